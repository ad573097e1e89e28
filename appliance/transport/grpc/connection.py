"""One gRPC connection: bytes in, python-hyper's ``h2`` state machine (frames, HPACK, stream
states, flow-control windows, SETTINGS and PING answers), unary calls out, answers back
through h2's API. What is ours sits above h2: which calls run, when a stream gets credit,
the bytes held for calls, and the bounds on what a hostile client can make us do.

Flow control, receiving: a new stream may send h2's initial window (64 KiB); once its
message's length prefix is in, the stream is *admitted* (oldest first) while the messages
admitted on the connection fit a budget (the largest message + ``CONNECTION_WINDOW``), and
h2 grants it credit for its whole message at once. The oldest waiting stream is always
admitted when none is, so requests that together exceed the budget take turns. The
connection window is topped up as bytes arrive: the streams' credit is what bounds memory.
Sending: an answer goes out as far as h2's windows allow and the socket takes it; the rest
waits for WINDOW_UPDATE or for the socket to drain (``pause_writing``), counted as held.

Held bytes (``Limits.max_connection_buffer_bytes``, ``max_buffer_bytes``): request messages
handed to methods plus answers not yet written. A call that would pass either bound is
answered RESOURCE_EXHAUSTED instead (gzip requests count as the largest message until
inflated, so inflation itself stays within the bound). A request or answer that moves no
byte for ``stall_timeout_s`` is reset, and what it held is freed.

GOAWAY on drain: h2 moves to CLOSED as soon as it sends or receives GOAWAY and then refuses to
send anything (python-hyper/h2 issue 1181), so a graceful drain writes hyperframe's GOAWAY
frame itself and keeps h2 open until the calls in flight are answered; new streams are
refused meanwhile. A GOAWAY from the client ends the connection: h2 cannot answer after it.

Thread-safety: everything here runs on the server's event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any, Sequence

import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from h2.errors import ErrorCodes
from hyperframe.frame import GoAwayFrame

from appliance.transport.grpc.calls import (OK_TRAILERS, RESPONSE_HEADERS, Abort, CallDetails, Context, Refused,
                                            Request, declared_size, message_of, status_trailers)
from appliance.transport.grpc.limits import CONTROL_BURST, CONTROL_RATE, RESET_BURST, RESET_RATE, FrameGuard, TokenBucket

if TYPE_CHECKING:
    from appliance.transport.grpc.h2_server import LeanServer

log = logging.getLogger("appliance.grpc")

MAX_FRAME = 1 << 20  # advertised SETTINGS_MAX_FRAME_SIZE: large messages arrive in fewer frames
STREAM_WINDOW = 65535  # h2's initial stream window, which we leave as it is
CONNECTION_WINDOW = 16 << 20
GRANT_SLACK = 16384  # over a message's own size: room for padding
WRITE_CHUNK = 256 * 1024  # answer bytes handed to the socket at a time, so pause_writing can stop us
# h2's configuration, shared by every connection (h2 only reads it). Headers stay bytes (no
# decoding per field). Outbound headers are neither validated nor normalized: they are our own
# constants and the services' trailing metadata, lower-cased in calls.py. Inbound ones are not
# normalized (that only joins cookies, which gRPC does not use) and not validated by h2 either:
# its checks (pseudo-header order and presence, connection-specific fields, te, upper case,
# host against :authority) guard proxies and caches, and cost 10-15 % of h2's time per call
# (bench/h2_cost.py); this server reads only :method, :path, content-type and grpc-* itself,
# answers anything that is not a gRPC POST with an HTTP error, refuses metadata carrying NUL,
# CR or LF (calls.py), and leaves the rest to the services as strings. HPACK, the header list
# size and every frame-level rule of RFC 9113 stay h2's.
H2_CONFIG = h2.config.H2Configuration(client_side=False, header_encoding=None, validate_inbound_headers=False,
                                      normalize_inbound_headers=False, validate_outbound_headers=False,
                                      normalize_outbound_headers=False)


class Stream:
    __slots__ = ("id", "headers", "body", "granted", "need", "admitted", "dispatched", "message_bytes",
                 "pending", "trailers", "headers_sent", "task", "timer", "last")

    def __init__(self, stream_id: int, headers: Sequence[tuple[bytes, bytes]]):
        self.id, self.headers = stream_id, headers
        self.body = bytearray()
        self.granted = STREAM_WINDOW  # the credit it has had in all
        self.need: int | None = None  # its message's size with the prefix, once the prefix is in
        self.admitted = self.dispatched = self.headers_sent = False
        self.message_bytes = 0  # its request message, held while the method runs
        self.pending: memoryview | None = None  # the answer's bytes not yet handed to h2
        self.trailers: Sequence[tuple[bytes, bytes]] = OK_TRAILERS
        self.task: asyncio.Task[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.last = time.monotonic()  # when a byte of it last moved


class Connection(asyncio.Protocol):
    """One HTTP/2 connection: h2's events in, calls out, answers back in order of completion."""

    def __init__(self, server: "LeanServer"):
        self.server, self.limits = server, server.limits
        self.h2 = h2.connection.H2Connection(H2_CONFIG)
        self.h2.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self.limits.max_concurrent_streams,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: self.limits.max_metadata_size})
        # values given as initial ones are in force at once; h2 copied two of them at construction
        self.h2.max_inbound_frame_size = MAX_FRAME
        self.h2.decoder.max_header_list_size = self.limits.max_metadata_size
        self.guard = FrameGuard(MAX_FRAME, self.limits.max_metadata_size)
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, Stream] = {}
        self.opened = self.last_active = time.monotonic()
        self.handshaken = self.going_away = self.paused = self.write_soon = False
        self.held = 0  # request messages in methods + answers not yet written
        self.calls = 0  # calls dispatched on this connection and not finished
        self.received = 0  # DATA bytes since the connection window was last topped up
        self.committed = 0  # the sizes of the admitted requests still arriving
        self.waiting = 0  # streams whose size is known, not admitted yet
        self.resets = TokenBucket(RESET_BURST, RESET_RATE)
        self.control = TokenBucket(CONTROL_BURST, CONTROL_RATE)
        self.peer = "unknown"
        self.on_event = {h2.events.RequestReceived: self.on_request, h2.events.DataReceived: self.on_data,
                         h2.events.StreamEnded: self.on_end, h2.events.StreamReset: self.on_reset,
                         h2.events.WindowUpdated: self.on_window, h2.events.RemoteSettingsChanged: self.on_settings,
                         h2.events.PingReceived: self.on_ping, h2.events.ConnectionTerminated: self.on_goaway}

    @property
    def buffered(self) -> int:
        """Bytes of requests not yet complete, held in their streams."""
        return sum(len(stream.body) for stream in self.streams.values())

    @property
    def idle(self) -> bool:
        return not self.streams and not self.calls

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else f"unix:{peer or ''}"
        self.server.connection_made(self)
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self.write_out()

    def connection_lost(self, exc: Exception | None) -> None:
        for stream in list(self.streams.values()):
            self.done(stream)
        self.server.connection_lost(self)

    def pause_writing(self) -> None:
        """The client is not reading: stop reading it too (no new calls, no PING answers
        piling up) and hold answers, until the socket's buffer drains."""
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.resume_reading()
        self.flush_all()

    def data_received(self, data: bytes) -> None:
        refused = self.guard.feed(data)
        if refused is not None:
            self.fail(*refused)
            return
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:  # h2 has queued its GOAWAY
            log.info("gRPC connection from %s closed: %s", self.peer, exc)
            self.close_now()
            return
        self.last_active = time.monotonic()
        try:
            for event in events:
                handler = self.on_event.get(type(event))
                if handler is not None:
                    handler(event)
                if self.transport is None or self.transport.is_closing():
                    return
        except Exception as exc:  # a bug here must cost one connection, never the loop
            log.exception("gRPC connection from %s: unexpected error", self.peer)
            self.fail(ErrorCodes.INTERNAL_ERROR, f"internal error: {type(exc).__name__}")
            return
        self.write_out()

    # -- h2's events -----------------------------------------------------------------------
    def on_request(self, event: h2.events.RequestReceived) -> None:
        sid = event.stream_id
        if self.going_away or self.server.closing:  # a client that has not seen our GOAWAY yet
            self.h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            return
        self.streams[sid] = Stream(sid, event.headers)

    def on_data(self, event: h2.events.DataReceived) -> None:
        self.received += event.flow_controlled_length
        if self.received >= CONNECTION_WINDOW // 2:  # top the connection window up
            self.h2.increment_flow_control_window(self.received)
            self.received = 0
        stream = self.streams.get(event.stream_id)
        if stream is None or stream.dispatched:
            return
        body = stream.body
        body += event.data
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

    def on_end(self, event: h2.events.StreamEnded) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is not None and not stream.dispatched:
            self.dispatch(stream)

    def on_reset(self, event: h2.events.StreamReset) -> None:
        stream = self.streams.get(event.stream_id)
        if stream is None:
            return
        self.done(stream)  # its call is cancelled; a drain waiting on it is told
        if event.remote_reset and not self.resets.take():
            self.fail(ErrorCodes.ENHANCE_YOUR_CALM, "too many streams reset by the client (rapid reset)")

    def on_window(self, event: h2.events.WindowUpdated) -> None:
        if event.stream_id == 0:
            self.flush_all()
            return
        stream = self.streams.get(event.stream_id)
        if stream is not None and stream.pending is not None:
            self.flush(stream)

    def on_settings(self, event: h2.events.RemoteSettingsChanged) -> None:
        self.handshaken = True
        if not self.control.take():
            self.fail(ErrorCodes.ENHANCE_YOUR_CALM, "too many SETTINGS frames")
            return
        self.flush_all()  # the initial window or the frame size may have grown

    def on_ping(self, event: h2.events.PingReceived) -> None:
        self.server.count("pings")
        if not self.control.take():  # h2 has queued its answer; this one is the last
            self.fail(ErrorCodes.ENHANCE_YOUR_CALM, "too many PING frames")

    def on_goaway(self, event: h2.events.ConnectionTerminated) -> None:
        self.close_now()  # h2 sends nothing after a GOAWAY: what is in flight cannot be answered

    # -- receiving -------------------------------------------------------------------------
    def refuse_oversized(self, stream: Stream, size: int) -> None:
        self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Received message larger than max ({size} vs. {self.server.max_receive})")

    def admit(self) -> None:
        """Admit waiting streams, oldest first, while their messages fit the budget (always
        one when none is admitted), giving each credit for its whole message."""
        budget = self.server.max_receive + 5 + CONNECTION_WINDOW
        for stream in self.streams.values():
            if not self.waiting:
                return
            if stream.admitted or stream.need is None or stream.need < 0 or stream.dispatched:
                continue
            if self.committed and self.committed + stream.need > budget:
                continue
            stream.admitted = True
            self.waiting -= 1
            self.committed += stream.need
            if stream.need > stream.granted:
                increment = stream.need + GRANT_SLACK - stream.granted
                self.h2.increment_flow_control_window(increment, stream.id)
                stream.granted += increment

    def release(self, stream: Stream) -> None:
        """A stream's request leaves the connection's accounts (handed to its call, answered
        or reset): its bytes and its admission; waiting streams may be admitted now."""
        stream.body = bytearray()
        need, stream.need = stream.need, -1  # accounted for, before admit() looks at the streams again
        if stream.admitted:
            stream.admitted = False
            self.committed -= need or 0
            self.admit()
        elif need is not None and need >= 0:
            self.waiting -= 1

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
        body, server = stream.body, self.server
        reserve = server.max_receive if body[:1] == b"\x01" else len(body)  # inflation's worst case
        if not self.may_hold(reserve):
            self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED, self.full_message())
            return
        try:
            message = message_of(body, request.encoding, server.max_receive)
        except Refused as exc:
            self.finish(stream, exc.code, exc.details)
            return
        self.release(stream)
        stream.message_bytes = len(message)
        self.hold(len(message))
        context = Context(request.metadata, request.deadline, self.peer)
        self.calls += 1
        server.in_flight += 1  # counted from here, so a burst read at once is not "alone"
        stream.task = server.loop.create_task(self.call(stream, request.method, message, context))
        stream.task.add_done_callback(partial(self.call_done, stream))
        if request.deadline is not None:
            stream.timer = server.loop.call_at(server.loop.time() + max(0.0, request.deadline - time.monotonic()),
                                               self.expire, stream)

    async def call(self, stream: Stream, method: str, message: bytes, context: Context) -> None:
        server = self.server
        if server.alone_var is not None:  # this task's own context: the batcher may run a lone call here
            server.alone_var.set(server.alone)
        try:
            handler = await server.lookup(CallDetails(method, context.invocation_metadata()))
            if handler is None or handler.unary_unary is None:
                self.finish(stream, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
                return
            try:
                request = handler.request_deserializer(message) if handler.request_deserializer else message
            except Exception:
                self.finish(stream, grpc.StatusCode.INTERNAL, "Exception deserializing request!")
                return
            del message
            self.unhold_message(stream)
            fn = handler.unary_unary
            if asyncio.iscoroutinefunction(fn):
                response = await fn(request, context)
            else:
                response = await server.loop.run_in_executor(server.pool, fn, request, context)
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

    def call_done(self, stream: Stream, task: Any) -> None:
        self.calls -= 1
        self.server.in_flight -= 1
        self.unhold_message(stream)

    def expire(self, stream: Stream) -> None:
        stream.timer = None
        self.finish(stream, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")  # done() cancels the call

    # -- held bytes ------------------------------------------------------------------------
    def may_hold(self, size: int) -> bool:
        limits = self.limits
        return (self.held + size <= limits.max_connection_buffer_bytes
                and self.server.held + size <= limits.max_buffer_bytes)

    def full_message(self) -> str:
        return (f"this connection holds {self.held} bytes of calls and unread answers, all connections "
                f"{self.server.held} ([grpc] max_connection_buffer_bytes = {self.limits.max_connection_buffer_bytes}, "
                f"max_buffer_bytes = {self.limits.max_buffer_bytes}): read the answers, or retry later")

    def hold(self, size: int) -> None:
        self.held += size
        self.server.held += size

    def unhold_message(self, stream: Stream) -> None:
        if stream.message_bytes:
            self.hold(-stream.message_bytes)
            stream.message_bytes = 0

    # -- answers ---------------------------------------------------------------------------
    def respond(self, stream: Stream, payload: bytes, trailing: Sequence[tuple[str, Any]] = ()) -> None:
        """Headers, the length-prefixed message and the trailers, as far as the windows allow."""
        if self.streams.get(stream.id) is not stream:
            return  # reset or expired meanwhile
        self.control.give()  # a call answered earns a PING back (see limits.py)
        data = b"\x00" + len(payload).to_bytes(4, "big") + payload
        trailers = OK_TRAILERS if not trailing else status_trailers(grpc.StatusCode.OK, "", trailing)
        conn, sid = self.h2, stream.id
        room = 0 if self.paused else conn.local_flow_control_window(sid)
        if len(data) <= room and len(data) <= conn.max_outbound_frame_size:  # the common case: all at once
            conn.send_headers(sid, RESPONSE_HEADERS)
            conn.send_data(sid, data)
            conn.send_headers(sid, trailers, end_stream=True)
            self.done(stream)
            if self.calls > 1:  # others may finish in this turn of the loop: one write for all
                self.write_later()
            else:
                self.write_out()
            return
        if len(data) > room and not self.may_hold(len(data) - room):
            self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED, self.full_message())
            return
        conn.send_headers(sid, RESPONSE_HEADERS)
        stream.headers_sent = True
        stream.pending, stream.trailers = memoryview(data), trailers
        self.hold(len(data))
        self.flush(stream)

    def flush(self, stream: Stream) -> None:
        """Hand h2 what its windows allow of a waiting answer, a chunk at a time to the socket
        (which pauses us when the client does not read); the trailers once the data is out."""
        conn, sid, view = self.h2, stream.id, stream.pending
        assert view is not None
        sent = 0
        while sent < len(view) and not self.paused:
            n = min(len(view) - sent, conn.local_flow_control_window(sid), conn.max_outbound_frame_size,
                    WRITE_CHUNK)
            if n <= 0:
                break
            conn.send_data(sid, view[sent:sent + n])
            sent += n
            self.write_out()
        if sent:
            stream.pending = view[sent:]
            stream.last = time.monotonic()
            self.hold(-sent)
        if not stream.pending:
            stream.pending = None
            conn.send_headers(sid, stream.trailers, end_stream=True)
            self.done(stream)
        self.write_later()

    def flush_all(self) -> None:
        for stream in list(self.streams.values()):
            if stream.pending is not None and not self.paused:
                self.flush(stream)

    def finish(self, stream: Stream, code: grpc.StatusCode, message: str,
               trailing: Sequence[tuple[str, Any]] = ()) -> None:
        """End the stream with a status: trailers-only, or trailers after headers already sent."""
        if self.streams.get(stream.id) is not stream:
            return
        block = status_trailers(code, message, trailing)
        if not stream.headers_sent:  # a trailers-only response
            block = [*RESPONSE_HEADERS, *block]
        self.h2.send_headers(stream.id, block, end_stream=True)
        if not stream.dispatched:  # its request is still arriving: stop it
            self.h2.reset_stream(stream.id, ErrorCodes.NO_ERROR)
        self.done(stream)
        self.write_later()

    def http_error(self, stream: Stream, status: int, message: str) -> None:
        """A request that is not gRPC: an HTTP status."""
        block = [(b":status", str(status).encode()), (b"content-type", b"application/grpc"),
                 *status_trailers(grpc.StatusCode.INTERNAL, message)]
        self.h2.send_headers(stream.id, block, end_stream=True)
        self.done(stream)
        self.write_later()

    def reset(self, stream: Stream, code: ErrorCodes) -> None:
        """End one stream with RST_STREAM ``code`` (a stream error: the connection lives on)."""
        self.h2.reset_stream(stream.id, code)
        self.done(stream)
        self.write_later()

    def done(self, stream: Stream) -> None:
        """The stream is over (answered, reset by either side, expired, stalled): out of the
        accounts, its timer and its call cancelled, the connection closed if going away."""
        if self.streams.pop(stream.id, None) is None:
            return
        self.release(stream)
        if stream.pending is not None:
            self.hold(-len(stream.pending))
            stream.pending = None
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if stream.task is not None and stream.task is not asyncio.current_task():
            stream.task.cancel()  # over before its call finished: its result is not wanted
        if self.going_away and not self.streams:
            self.write_out()
            self.close_now()
        self.server.stream_done(self)

    # -- housekeeping (the server's sweep, once a second) -----------------------------------
    def sweep(self, now: float) -> None:
        limits = self.limits
        if not self.handshaken and now - self.opened > limits.handshake_timeout_s:
            log.info("gRPC connection from %s closed: no HTTP/2 preface and SETTINGS within %g s",
                     self.peer, limits.handshake_timeout_s)
            self.close_now()
            return
        for stream in list(self.streams.values()):
            moving = stream.pending is not None or not stream.dispatched
            if moving and now - stream.last > limits.stall_timeout_s:
                self.reset(stream, ErrorCodes.CANCEL)
                self.server.count("stalled_streams")

    # -- the connection --------------------------------------------------------------------
    def write_later(self) -> None:
        """Answers finished in one turn of the loop (a batch) leave in one write."""
        if not self.write_soon:
            self.write_soon = True
            self.server.loop.call_soon(self.write_out)

    def write_out(self) -> None:
        self.write_soon = False
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def go_away(self) -> None:
        """Graceful: no new streams; those in flight finish (module docstring: why this GOAWAY
        is written here and not through h2)."""
        if self.going_away:
            return
        self.going_away = True
        self.write_out()
        frame = GoAwayFrame(0, last_stream_id=self.h2.highest_inbound_stream_id, error_code=0)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame.serialize())
        if not self.streams:
            self.close_now()

    def fail(self, code: int, message: str) -> None:
        """Close the connection with GOAWAY ``code``. What h2 had queued for it (the answers to
        a flood, say) is dropped: the GOAWAY is all it gets."""
        log.info("gRPC connection from %s closed: %s", self.peer, message)
        self.server.count("refused_connections")
        self.h2.data_to_send()
        try:
            self.h2.close_connection(code, message.encode()[:256])
        except h2.exceptions.ProtocolError:
            pass  # h2 has closed it already
        self.write_out()
        self.close_now()

    def close_now(self) -> None:
        self.write_out()
        if self.transport is not None:
            self.transport.close()
