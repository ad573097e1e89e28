"""One gRPC connection: bytes in, libnghttp2's session (appliance/transport/grpc/session.py:
frames, HPACK, stream states, flow-control accounting, SETTINGS and PING answers), unary calls
out, answers back through nghttp2. What is ours sits above it: which calls run, when a stream
gets credit, the bytes held for calls, and the bounds on what a hostile client can make us do.

Receiving flow control (which stream gets credit, and when) and the bytes held for calls are
admission.py's (``Admission``); the sweep's deadlines and the budgets of resets and control
frames are bounds.py's (``Bounds``): ``Connection`` inherits both. Sending: an answer goes
out as far as the peer's windows allow and the socket takes it; the rest waits for
WINDOW_UPDATE or for the socket to drain (``pause_writing``), counted as held.

Calls are dispatched once the bytes of a read are all processed: a stream opened and reset
in one read (rapid reset, CVE-2023-44487) never becomes a call.

Open streams are bounded per connection (SETTINGS_MAX_CONCURRENT_STREAMS) and on the whole
server (``Limits.max_open_streams``, refused with REFUSED_STREAM past it), so a client that
never opens its window (zero-window stalls) holds a bounded number of answers. One address
holds at most its share of the open streams (peers.py).

Lifetime: ``connection_lost`` frees the nghttp2 session and drops every reference the
connection holds (streams, transport, its handle), so nothing waits for the cyclic collector.
The server is seen through ``ServerSide`` (server_side.py). Thread-safety: everything here
runs on the server's event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import Sequence

import grpc

from appliance.transport.grpc import nghttp2 as ng
from appliance.transport.grpc import streams
# GRANT_SLACK, STREAM_WINDOW: read here by tests/transport/test_h2_grpc.py with the other figures
from appliance.transport.grpc.admission import CONNECTION_WINDOW, GRANT_SLACK, STREAM_WINDOW, Admission, Stream
from appliance.transport.grpc.bounds import Bounds
from appliance.transport.grpc.calls import (OK_TRAILERS, RESPONSE_HEADERS, Abort, CallDetails, Context, Refused,
                                            Request, declared_size, message_of, status_trailers)
from appliance.transport.grpc.limits import (ANSWER_EARNS, CONTROL_BURST, CONTROL_RATE, RESET_BURST, RESET_RATE,
                                             TokenBucket)
from appliance.transport.grpc.peers import Guard, stream_cap
from appliance.transport.grpc.server_side import ServerSide
from appliance.transport.grpc.session import Session, SessionError

log = logging.getLogger("appliance.grpc")

MAX_FRAME = 1 << 20  # advertised SETTINGS_MAX_FRAME_SIZE: large messages arrive in fewer frames
UPDATES_DUE_MAX = 4096  # WINDOW_UPDATEs owed for our DATA, at most (an idle connection's are not kept forever)
CONSUME_BATCH = 1 << 20  # connection-level credit is given back in steps this large (one C call each)


class Connection(Bounds, Admission, asyncio.Protocol):
    """One HTTP/2 connection: nghttp2's events in, calls out, answers back as they complete."""

    def __init__(self, server: ServerSide, accepted: float | None = None):
        """``accepted``: when the socket was accepted (a TLS handshake came first: the
        preface is due within ``handshake_timeout_s`` of the accept, not of its end)."""
        self.server, self.limits = server, server.limits
        self.session: Session | None = None
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self.ended: list[Stream] = []  # requests complete in the read under way: dispatched after it
        self.stop_after_send: list[int] = []  # answered while still arriving: RST_STREAM once the answer is out
        self.opened = self.last_active = time.monotonic()
        if accepted is not None:
            self.opened = accepted
        self.paused_since = 0.0
        self.handshaken = self.going_away = self.paused = self.write_soon = self.failed = False
        self.held = 0  # requests admitted until their methods return + answers not yet written
        self.calls = 0  # calls dispatched on this connection and not finished
        self.committed = 0  # the sizes of the admitted requests still arriving
        self.unconsumed = 0  # DATA bytes taken but not yet given back to the connection window
        self.waiting = 0  # streams whose size is known, not admitted yet
        self.resets = TokenBucket(RESET_BURST, RESET_RATE)
        self.control = TokenBucket(CONTROL_BURST, CONTROL_RATE)
        # WINDOW_UPDATE frames our own DATA has earned: a client acknowledges what it read (a
        # stream's and the connection's window, so two a DATA frame). Those are owed and never
        # charged; only credit beyond them is a control frame for nothing. Charging them all
        # (an answer already handed to the kernel had no ``pending``) sent grpcio's own client
        # GOAWAY "too many WINDOW_UPDATE frames" under load, with 250 calls on one connection.
        self.updates_due = 0
        self.guard: Guard | None = None  # its peer address's budgets, over all its connections (peers.py)
        self.stream_cap = stream_cap(self.limits.max_open_streams, self.limits.max_concurrent_streams)
        self.peer = "unknown"

    @property
    def buffered(self) -> int:
        """Bytes of requests not yet complete, held in their streams."""
        return sum(len(stream.body) for stream in self.streams.values())

    @property
    def idle(self) -> bool:
        return not self.streams and not self.calls

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream's transport: asyncio types the argument as its base
        peer = transport.get_extra_info("peername")
        self.peer = f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else f"unix:{peer or ''}"
        self.guard = self.server.peers.guard(peer)
        self.server.connection_made(self)
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None and ssl_object.selected_alpn_protocol() not in (None, "h2"):
            log.info("gRPC connection from %s closed: TLS negotiated %s, not h2", self.peer,
                     ssl_object.selected_alpn_protocol())
            self.close_now()
            return
        limits = self.limits
        self.session = Session(self, {ng.SETTINGS_ENABLE_PUSH: 0,
                                      ng.SETTINGS_MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
                                      ng.SETTINGS_MAX_FRAME_SIZE: MAX_FRAME,
                                      ng.SETTINGS_MAX_HEADER_LIST_SIZE: limits.max_metadata_size},
                               CONNECTION_WINDOW, RESET_BURST, RESET_RATE, limits.max_metadata_size)
        self.write_out()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.guard is not None:  # calls left running or unread by a client that went away count
            self.guard.abandoned(0 if self.failed or self.server.closing else len(self.streams))
            self.guard.closed()
        for stream in list(self.streams.values()):
            self.done(stream)
        self.ended.clear()
        if self.session is not None:
            self.session.close()
        self.session, self.transport = None, None
        self.server.connection_lost(self)

    def pause_writing(self) -> None:
        """The client is not reading: stop reading it too (no new calls, no PING answers
        piling up) and hold answers, until the socket's buffer drains."""
        self.paused, self.paused_since = True, time.monotonic()
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.resume_reading()
        self.write_out()

    def data_received(self, data: bytes) -> None:
        session = self.session
        if session is None or self.failed:
            return
        self.last_active = time.monotonic()
        try:
            session.feed(data)
        except SessionError as exc:  # nghttp2 has queued its GOAWAY, if any
            if not self.failed:
                log.info("gRPC connection from %s closed: %s", self.peer, exc)
                self.server.count("refused_connections")
                self.failed = True
                session.goaway(ng.ENHANCE_YOUR_CALM if "flood" in str(exc).lower() or "too many" in str(exc).lower()
                               else ng.PROTOCOL_ERROR, str(exc).encode()[:256])
        if self.failed:  # a bound was passed (fail) or nghttp2 refused the bytes
            self.close_now()
            return
        if self.ended:
            ended, self.ended = self.ended, []
            for stream in ended:
                if self.streams.get(stream.id) is stream and not self.failed:
                    self.dispatch(stream)
        if session.wants_write():  # SETTINGS and PING answers, credit, refusals
            self.write_out()

    # -- nghttp2's events (session.Events) ---------------------------------------------------
    def on_stream(self, stream_id: int) -> list[tuple[bytes, bytes]] | None:
        """A new stream (its header fields go into the list returned), or request trailers
        (None: gRPC clients send none, and nothing here reads them)."""
        if stream_id in self.streams:
            return None
        server = self.server
        server.churn += 1
        refused = ("refused_streams" if self.going_away or server.closing or server.open_streams >= self.limits.max_open_streams
                   else "peer_refused_streams" if self.guard is not None and not self.guard.stream_opened(self.stream_cap)
                   else "")  # past the server's streams, or its address's share of them (peers.py)
        if refused:
            assert self.session is not None
            self.session.reset(stream_id, ng.REFUSED_STREAM)  # the client may retry it elsewhere
            server.count(refused)
            return None
        stream = self.streams[stream_id] = Stream(stream_id)
        server.open_streams += 1
        return stream.headers

    def on_data(self, stream_id: int, data: object, length: int) -> None:
        assert self.session is not None
        self.unconsumed += length  # the connection window: streams' credit bounds memory
        if self.unconsumed >= CONSUME_BATCH:
            self.session.consumed(self.unconsumed)
            self.unconsumed = 0
        stream = self.streams.get(stream_id)
        if stream is not None and stream.streaming is not None:  # many messages: streams.py
            stream.streaming.feed(self, stream, self.session.ffi.buffer(data, length)[:])
            return
        if stream is None or stream.dispatched:
            return
        body = stream.body
        body += self.session.ffi.buffer(data, length)
        stream.last = self.last_active
        max_receive = self.server.max_receive
        if stream.need is None and len(body) >= 5:
            declared = declared_size(body)
            if declared > max_receive:
                self.refuse_oversized(stream, declared)
                return
            stream.need = declared + 5
            self.waiting += 1
            self.admit()
        if len(body) > max_receive + 5:
            self.refuse_oversized(stream, len(body) - 5)

    def on_headers(self, stream_id: int, end_stream: bool, size: int) -> None:
        """A header block is complete: one over the advertised SETTINGS_MAX_HEADER_LIST_SIZE
        is answered RESOURCE_EXHAUSTED at once (its fields were decoded by nghttp2, so the
        header table stays in step, but never kept)."""
        stream = self.streams.get(stream_id)
        if stream is None or stream.dispatched:
            return
        stream.header_bytes = size
        if size > self.limits.max_metadata_size:
            stream.dispatched = True  # nothing more of it is taken
            self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the request's metadata ({stream.header_bytes} bytes) is over the "
                        f"{self.limits.max_metadata_size} advertised (SETTINGS_MAX_HEADER_LIST_SIZE)")
            if not end_stream:
                self.stop_after_send.append(stream_id)
        elif streams.wanted(self.server.handler_of, stream.headers):  # started after the read, as a unary call
            stream.streaming = streams.StreamCall()
            if end_stream:
                stream.streaming.end_input(self, stream)
            self.ended.append(stream)
        elif end_stream:
            self.ended.append(stream)

    def on_request_end(self, stream_id: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None and stream.streaming is not None:
            stream.streaming.end_input(self, stream)
        elif stream is not None and not stream.dispatched:
            self.ended.append(stream)

    def on_stream_closed(self, stream_id: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            self.done(stream)  # its call is cancelled; a drain waiting on it is told

    def on_settings(self) -> None:
        first, self.handshaken = not self.handshaken, True
        self.control_frame("SETTINGS", peer=not first)  # the preface's SETTINGS is every connection's due

    def on_ping(self) -> None:
        self.server.count("pings")
        self.control_frame("PING")  # nghttp2 has queued its answer; past a budget, it is the last

    def on_goaway(self) -> None:
        """The client will open no more streams; those in flight are still answered."""
        self.going_away = True
        if not self.streams and not self.calls:
            self.server.loop.call_soon(self.close_now)

    # -- receiving -------------------------------------------------------------------------
    def refuse_oversized(self, stream: Stream, size: int) -> None:
        self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Received message larger than max ({size} vs. {self.server.max_receive})")

    # -- calls -----------------------------------------------------------------------------
    def dispatch(self, stream: Stream) -> None:
        """The request is complete: check its headers and framing, then run the call."""
        stream.dispatched = True
        request = Request(stream.headers)
        if request.http_status:  # not a gRPC request at all: answered in HTTP, as grpcio does
            self.http_error(stream, request.http_status, request.problem)
            return
        if request.problem:
            self.finish(stream, grpc.StatusCode.INVALID_ARGUMENT, request.problem)
            return
        if stream.streaming is not None:
            self.start_streaming(stream, stream.streaming, request)
            return
        body, server = stream.body, self.server
        # inflation's worst case; a plain message admitted was held as it arrived, and its copy replaces it
        reserve = server.max_receive if body[:1] == b"\x01" else 0 if stream.admitted else len(body)
        if reserve and not self.may_hold(reserve):
            self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED, self.full_message())
            return
        if body[:1] == b"\x00" and declared_size(body) == len(body) - 5:  # the common case: one plain message
            message = bytes(memoryview(body)[5:])
        else:
            try:
                message = message_of(body, request.encoding, server.max_receive)
            except Refused as exc:
                self.finish(stream, exc.code, exc.details)
                return
        self.release(stream)
        stream.message_bytes = len(message)
        self.hold(len(message))
        context = Context(request.metadata, request.deadline, self.peer,
                          server.alone if server.tells_alone else None)  # the call's lone-call predicate
        self.calls += 1
        server.in_flight += 1  # counted from here, so a burst read at once is not "alone"
        stream.task = server.loop.create_task(self.call(stream, request.method, message, context))
        stream.task.add_done_callback(partial(self.call_done, stream))
        if request.deadline is not None:
            stream.timer = server.loop.call_at(server.loop.time() + max(0.0, request.deadline - time.monotonic()),
                                               self.expire, stream)

    def start_streaming(self, stream: Stream, call: "streams.StreamCall", request: Request) -> None:
        """A bidirectional-streaming call (streams.py): its task runs while the stream is open;
        it is not counted in the server's calls in flight (it may idle between messages)."""
        self.calls += 1
        stream.task = self.server.loop.create_task(streams.run(self, stream, call, request))
        stream.task.add_done_callback(partial(self.stream_call_done, stream))
        if request.deadline is not None:
            stream.timer = self.server.loop.call_at(
                self.server.loop.time() + max(0.0, request.deadline - time.monotonic()), self.expire, stream)

    def stream_call_done(self, stream: Stream, task: asyncio.Task[None]) -> None:
        self.calls -= 1
        if self.going_away and not self.streams and not self.calls:
            self.server.loop.call_soon(self.close_now)

    async def call(self, stream: Stream, method: str, message: bytes, context: Context) -> None:
        server = self.server
        try:
            handler = await server.lookup(CallDetails(method, context.invocation_metadata()))
            if handler is None or handler.unary_unary is None:
                self.finish(stream, grpc.StatusCode.UNIMPLEMENTED, "Method not found!" if handler is None else
                            f"{method} is a client- or server-streaming method, which this gRPC transport (unary and "
                            "bidirectional-streaming calls) does not serve; the grpcio transport does "
                            "([grpc] transport = \"grpcio\")")
                return
            try:
                request = handler.request_deserializer(message) if handler.request_deserializer else message
            except Exception:
                self.finish(stream, grpc.StatusCode.INTERNAL, "Exception deserializing request!")
                return
            del message
            fn = handler.unary_unary
            if server.is_coroutine(fn):
                response = await fn(request, context)
            else:
                response = await server.loop.run_in_executor(server.pool, fn, request, context)
            del request
            self.unhold_message(stream)  # its decoded tensors lived as long as the method ran
            if context.code not in (None, grpc.StatusCode.OK):
                self.finish(stream, context.code, context.details, context.trailing)
                return
            payload = handler.response_serializer(response) if handler.response_serializer else response
            if len(payload) > server.max_send:
                self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"Sent message larger than max ({len(payload)} vs. {server.max_send})")
                return
            self.respond(stream, payload, context.trailing)
        except Abort as exc:
            self.finish(stream, exc.code, exc.details, context.trailing)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error in %s", method)
            self.finish(stream, grpc.StatusCode.UNKNOWN, "Unexpected error in the method handler")

    def call_done(self, stream: Stream, task: asyncio.Task[None]) -> None:
        self.calls -= 1
        self.server.in_flight -= 1
        self.unhold_message(stream)
        if self.going_away and not self.streams and not self.calls:
            self.server.loop.call_soon(self.close_now)

    def expire(self, stream: Stream) -> None:
        stream.timer = None
        self.finish(stream, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")  # done() cancels the call

    # -- answers ---------------------------------------------------------------------------
    def respond(self, stream: Stream, payload: bytes, trailing: Sequence[tuple[str, str | bytes]] = ()) -> None:
        """Headers, the length-prefixed message and the trailers, as far as the windows allow."""
        if self.streams.get(stream.id) is not stream or self.session is None:
            return  # reset or expired meanwhile
        self.control.give(ANSWER_EARNS)  # a call answered earns its pings and credit back (limits.py)
        if self.guard is not None:
            self.guard.answered()
        data = b"\x00" + len(payload).to_bytes(4, "big") + payload
        if not self.may_hold(len(data)):  # what the windows let out at once is never held
            room = 0 if self.paused else self.session.stream_window(stream.id)
            if len(data) > room and not self.may_hold(len(data) - room):
                self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED, self.full_message())
                return
        stream.pending, stream.answered = memoryview(data), True
        stream.last = time.monotonic()  # the send stall deadlines count from here (sweep)
        stream.trailers = OK_TRAILERS if not trailing else status_trailers(grpc.StatusCode.OK, "", trailing)
        self.hold(len(data))
        self.session.respond(stream.id, RESPONSE_HEADERS, with_body=True)
        if self.calls > 1:  # others may finish in this turn of the loop: one write for all
            self.write_later()
        else:
            self.write_out(check_end=False)

    def read_answer(self, stream_id: int, buf: object, length: int) -> tuple[int, bool]:
        """(session.Events) Up to ``length`` bytes of the stream's answer into ``buf``; True
        with the last of them, once its trailers are submitted to follow. A stream we reset
        meanwhile is deferred: its RST_STREAM, already queued, ends it."""
        n, last = self._read_answer(stream_id, buf, length)
        if n > 0:  # one DATA frame: the client may acknowledge it on the stream and the connection
            self.updates_due = min(self.updates_due + 2, UPDATES_DUE_MAX)
        return n, last

    def _read_answer(self, stream_id: int, buf: object, length: int) -> tuple[int, bool]:
        stream = self.streams.get(stream_id)
        if stream is not None and stream.streaming is not None and self.session is not None:
            return stream.streaming.read(self, stream, buf, length)
        view = stream.pending if stream is not None else None
        if stream is None or view is None or self.session is None:
            return ng.ERR_DEFERRED, False
        n = min(length, len(view))
        self.session.ffi.memmove(buf, view[:n], n)
        stream.pending = view[n:]
        stream.last = time.monotonic()
        self.hold(-n)
        if len(view) > n:
            return n, False
        stream.pending = None
        self.session.trailers(stream_id, stream.trailers)
        return n, True

    def finish(self, stream: Stream, code: grpc.StatusCode, message: str,
               trailing: Sequence[tuple[str, str | bytes]] = ()) -> None:
        """End the stream with a trailers-only status (RST_STREAM CANCEL once its answer's
        headers are out: a deadline that passes while the client does not read it)."""
        if self.streams.get(stream.id) is not stream or self.session is None:
            return
        if stream.answered:
            self.reset(stream, ng.CANCEL)
            return
        stream.answered = True
        self.session.respond(stream.id, [*RESPONSE_HEADERS, *status_trailers(code, message, trailing)],
                             with_body=False)
        if not stream.dispatched:  # its request is still arriving: stop it, after the answer (nghttp2
            self.stop_after_send.append(stream.id)  # drops a response submitted before an RST_STREAM)
            stream.dispatched = True
        self.done(stream)
        self.write_later()

    def http_error(self, stream: Stream, status: int, message: str) -> None:
        """A request that is not gRPC: an HTTP status."""
        assert self.session is not None
        stream.answered = True
        self.session.respond(stream.id, [(b":status", str(status).encode()), (b"content-type", b"application/grpc"),
                                         *status_trailers(grpc.StatusCode.INTERNAL, message)], with_body=False)
        self.done(stream)
        self.write_later()

    def reset(self, stream: Stream, code: int) -> None:
        """End one stream with RST_STREAM ``code`` (a stream error: the connection lives on)."""
        if self.session is not None:
            self.session.reset(stream.id, code)
        self.done(stream)
        self.write_later()

    def done(self, stream: Stream) -> None:
        """The stream is over for us (answered, reset by either side, expired, stalled): out
        of the accounts, its timer and its call cancelled, the connection closed if going away."""
        if self.streams.pop(stream.id, None) is None:
            return
        self.server.open_streams -= 1
        if self.guard is not None:
            self.guard.stream_closed()
        self.release(stream)
        if stream.pending is not None:
            self.hold(-len(stream.pending))
            stream.pending = None
        if stream.streaming is not None:
            stream.streaming.close(self)
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if stream.task is not None and stream.task is not asyncio.current_task():
            stream.task.cancel()  # over before its call finished: its result is not wanted
        if self.going_away and not self.streams and not self.calls:
            self.server.loop.call_soon(self.close_now)
        self.server.stream_done(self)

    # -- the connection --------------------------------------------------------------------
    def write_later(self) -> None:
        """Answers finished in one turn of the loop (a batch) leave in one write."""
        if not self.write_soon:
            self.write_soon = True
            self.server.loop.call_soon(self.write_out)

    def write_out(self, check_end: bool = True) -> None:
        """Everything nghttp2 has to send, in one write; ``check_end``: close the socket if
        the session is over (a GOAWAY nghttp2 sent on its own, after a protocol error)."""
        self.write_soon = False
        session, transport = self.session, self.transport
        if session is None or transport is None or transport.is_closing() or self.paused:
            return
        try:
            data = session.output()
            if self.stop_after_send:
                for stream_id in self.stop_after_send:
                    session.reset(stream_id, ng.NO_ERROR)
                self.stop_after_send.clear()
                data += session.output()
        except SessionError as exc:
            log.info("gRPC connection from %s closed: %s", self.peer, exc)
            self.abort()
            return
        if data:
            transport.write(data)
        if check_end and not session.wants_io():  # a GOAWAY sent (ours or nghttp2's own) or received, all sent
            transport.close()

    def go_away(self) -> None:
        """Graceful: no new streams (nghttp2 refuses them); those in flight finish."""
        if self.going_away or self.session is None:
            if self.session is None:
                self.close_now()
            return
        self.going_away = True
        self.session.goaway(ng.NO_ERROR, graceful=True)
        self.write_out()
        if not self.streams and not self.calls:
            self.close_now()

    def fail(self, code: int, message: str) -> None:
        """Close the connection with GOAWAY ``code``, at once: what it sent and we have not
        read yet is dropped, not processed. Called inside nghttp2's callbacks too: the rest of
        the read is skipped (session.py) and the close happens after it."""
        if self.failed:
            return
        self.failed = True
        log.info("gRPC connection from %s closed: %s", self.peer, message)
        self.server.count("refused_connections")
        if self.session is not None:
            self.session.goaway(code, message.encode()[:256])
        self.server.loop.call_soon(self.close_now)

    def close_now(self) -> None:
        self.write_out()
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Close without flushing: a client that reads nothing gets nothing more."""
        if self.transport is not None:
            self.transport.abort()
