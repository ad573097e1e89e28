"""Bidirectional-streaming calls (``stream_stream`` handlers, e.g. Triton's ModelStreamInfer) on
the lean transport: many length-prefixed request messages on one stream, answers sent as the
method yields them, then the status in trailers (PROTOCOL-HTTP2.md).

connection.py owns the stream and calls in here at five points, each marked ``streams.``
(seeing the connection and the stream through faces.py, so this module never imports connection.py):
a new stream whose method is a streaming one (``wanted``), its DATA (``StreamCall.feed``), the
client's half-close (``end_input``), the answer's bytes nghttp2 asks for (``read``) and the
stream's end (``close``). Everything else (admission of new streams, deadlines, resets, the
connection's byte bounds) is the connection's, unchanged.

Bounds, so that a stream's messages stay bounded as a unary call's one message is:

* receiving: the stream's credit is ours (nghttp2 gives none back on its own). The client may
  have at most ``STREAM_WINDOW`` bytes sent and not yet taken by the method, or, once every
  earlier message is taken, the one larger message arriving (if the connection can hold it,
  else RESOURCE_EXHAUSTED): credit is given back as the method takes a message, never before.
  A message larger than the receive limit is RESOURCE_EXHAUSTED.
* bytes held: request messages waiting for the method and answers not yet written count in
  the connection's held bytes (``Limits.max_connection_buffer_bytes``, ``max_buffer_bytes``);
  a message or answer that would pass them ends the call with RESOURCE_EXHAUSTED.
* sending: while more than ``OUTBOX_BYTES`` of answers wait for the client to read (its
  window closed, or the socket full), the method is not resumed: it waits for the bytes to
  leave, so a client that sends but never reads holds a bounded amount.

Thread-safety: everything here runs on the server's event loop thread.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator, Callable, Sequence

import grpc

from appliance.transport.grpc import nghttp2 as ng
from appliance.transport.grpc.calls import (OK_TRAILERS, RESPONSE_HEADERS, Abort, CallDetails, Context, Request,
                                            declared_size, status_trailers)

if TYPE_CHECKING:
    from appliance.transport.grpc.faces import S, ConnectionFace

log = logging.getLogger("appliance.grpc")

STREAM_WINDOW = 65535  # the initial stream window: what a client may have in flight between messages
GRANT_SLACK = 16384  # over a large message's own size: room for padding
OUTBOX_BYTES = 1 << 20  # answers waiting for the client past this: the method waits


def method_of(headers: Sequence[tuple[bytes, bytes]]) -> str:
    return next((v.decode("latin-1") for k, v in headers if k == b":path"), "")


def wanted(find: Callable[[str], object], headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether a new stream's method is served by a ``stream_stream`` handler (``find``: the
    server's handler for a method name, interceptors not run, or None)."""
    handler = find(method_of(headers))
    return handler is not None and getattr(handler, "stream_stream", None) is not None


class StreamCall:
    """One streaming call's messages both ways, between its stream and its method."""

    __slots__ = ("inbox", "inbox_bytes", "window", "input_ended", "outbox", "finished", "trailers", "drained")

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: the client half-closed
        self.inbox_bytes = 0  # framed sizes of the messages in the inbox
        self.window = STREAM_WINDOW  # what the client may still send on the stream
        self.input_ended = False
        self.outbox = bytearray()  # framed answers not yet handed to nghttp2
        self.finished = False  # the method is over: the trailers follow the outbox
        self.trailers: Sequence[tuple[bytes, bytes]] = OK_TRAILERS
        self.drained = asyncio.Event()
        self.drained.set()

    # -- receiving -------------------------------------------------------------------------
    def feed(self, conn: ConnectionFace[S], stream: S, data: bytes) -> None:
        """DATA of the stream: complete messages go to the inbox; credit for a message larger
        than the window is given once its prefix is in (the connection's bounds allowing)."""
        self.window -= len(data)
        stream.last = conn.last_active
        if self.finished:  # its status is out or on its way: the rest is not read
            return
        body = stream.body
        body += data
        while len(body) >= 5:
            size = declared_size(body)
            if size > conn.server.max_receive:
                conn.refuse_oversized(stream, size)
                return
            if len(body) < size + 5:
                self._grant(conn, stream)
                return
            if body[0] != 0:  # a compressed message: none of our streaming clients sends one
                self.end(conn, stream, grpc.StatusCode.UNIMPLEMENTED, "compressed messages on a stream are not "
                         "supported by this gRPC transport; send them uncompressed")
                return
            if not conn.may_hold(size):
                self.end(conn, stream, grpc.StatusCode.RESOURCE_EXHAUSTED, conn.full_message())
                return
            message = bytes(memoryview(body)[5:size + 5])
            del body[:size + 5]
            conn.hold(size)
            self.inbox_bytes += size + 5
            self.inbox.put_nowait(message)

    def _grant(self, conn: ConnectionFace[S], stream: S) -> None:
        """Credit up to what the stream may have sent and not had taken: STREAM_WINDOW, or,
        while nothing waits in the inbox, the whole of the message arriving (if it can be held)."""
        if self.input_ended or self.finished or conn.session is None or conn.streams.get(stream.id) is not stream:
            return
        body, target = stream.body, STREAM_WINDOW
        if not self.inbox_bytes and len(body) >= 5:
            need = declared_size(body) + 5
            if need + GRANT_SLACK > target and not conn.may_hold(need):
                self.end(conn, stream, grpc.StatusCode.RESOURCE_EXHAUSTED, conn.full_message())
                return
            target = max(target, need + GRANT_SLACK)
        want = target - len(body) - self.inbox_bytes
        if want > self.window:
            conn.session.grant(stream.id, want - self.window)
            self.window = want
            conn.write_later()

    def end_input(self, conn: ConnectionFace[S], stream: S) -> None:
        """The client half-closed: the method's requests end (a message cut short is an error)."""
        self.input_ended = True
        if stream.body:
            self.end(conn, stream, grpc.StatusCode.INTERNAL, "the stream ended inside a message")
        self.inbox.put_nowait(None)

    async def requests(self, conn: ConnectionFace[S], stream: S,
                       deserialize: Callable[[bytes], object] | None) -> AsyncIterator[object]:
        """The request iterator the method reads; each message taken gives its credit back."""
        while True:
            message = await self.inbox.get()
            if message is None:
                return
            self._taken(conn, stream, len(message))
            try:
                request = deserialize(message) if deserialize is not None else message
            except Exception:
                raise Abort(grpc.StatusCode.INTERNAL, "Exception deserializing request!") from None
            yield request

    def _taken(self, conn: ConnectionFace[S], stream: S, size: int) -> None:
        conn.hold(-size)
        self.inbox_bytes -= size + 5
        self._grant(conn, stream)

    # -- sending ---------------------------------------------------------------------------
    async def send(self, conn: ConnectionFace[S], stream: S, payload: bytes) -> None:
        """One answer message out (headers first, with the first); waits while the client
        leaves more than OUTBOX_BYTES unread."""
        if len(payload) > conn.server.max_send:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"Sent message larger than max ({len(payload)} vs. {conn.server.max_send})")
        data = b"\x00" + len(payload).to_bytes(4, "big") + payload
        if not conn.may_hold(len(data)):
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, conn.full_message())
        if self.finished or conn.streams.get(stream.id) is not stream or conn.session is None:
            raise asyncio.CancelledError()  # the stream is over: the method's work is not wanted
        self.outbox += data
        conn.hold(len(data))
        self._kick(conn, stream)
        if len(self.outbox) > OUTBOX_BYTES:
            self.drained.clear()
            await self.drained.wait()

    def _kick(self, conn: ConnectionFace[S], stream: S) -> None:
        """Headers with the first bytes; later, nghttp2 asks for the new bytes again."""
        assert conn.session is not None
        if not stream.answered:
            stream.answered = True
            conn.session.respond(stream.id, RESPONSE_HEADERS, with_body=True)
        else:
            conn.session.resume(stream.id)
        conn.control.give()  # an answer earns a PING back, as a unary call's does (limits.py)
        conn.write_later()

    def read(self, conn: ConnectionFace[S], stream: S, buf: object, length: int) -> tuple[int, bool]:
        """(Connection.read_answer) Up to ``length`` bytes of the answers; deferred while
        there are none and the method runs; True with the last, once the trailers are set."""
        outbox, session = self.outbox, conn.session
        assert session is not None
        n = min(length, len(outbox))
        if n:
            session.ffi.memmove(buf, bytes(outbox[:n]), n)
            del outbox[:n]
            conn.hold(-n)
            stream.last = time.monotonic()
            if len(outbox) <= OUTBOX_BYTES:
                self.drained.set()
        if outbox or not self.finished:
            return (n, False) if n else (ng.ERR_DEFERRED, False)
        session.trailers(stream.id, self.trailers)
        if not self.input_ended:  # the client may still send: stop it once the status is out
            conn.stop_after_send.append(stream.id)
        return n, True

    def end(self, conn: ConnectionFace[S], stream: S, code: grpc.StatusCode, message: str,
            trailing: Sequence[tuple[str, str | bytes]] = ()) -> None:
        """The call's status: trailers-only if nothing was answered yet, else after the answers."""
        if conn.streams.get(stream.id) is not stream or conn.session is None or self.finished:
            return
        if not stream.answered:
            self.finished = True
            conn.finish(stream, code, message, trailing)
            return
        self.finished = True
        self.trailers = (OK_TRAILERS if code == grpc.StatusCode.OK and not trailing
                         else status_trailers(code, message, trailing))
        conn.session.resume(stream.id)
        conn.write_later()

    # -- the stream's end ------------------------------------------------------------------
    def moving(self, stream: S) -> bool:
        """Whether bytes wait to move (a message half in, answers unread): a stall if they
        do not for the stall timeout. A stream idle between messages is not stalled."""
        return bool(stream.body) or bool(self.outbox)

    def close(self, conn: ConnectionFace[S]) -> None:
        """The stream is over: the bytes it held leave the accounts; a waiting send ends."""
        while not self.inbox.empty():
            message = self.inbox.get_nowait()
            if message is not None:
                conn.hold(-len(message))
        self.inbox_bytes = 0
        conn.hold(-len(self.outbox))
        self.outbox = bytearray()
        self.input_ended = self.finished = True
        self.drained.set()


async def run(conn: ConnectionFace[S], stream: S, call: StreamCall, request: Request) -> None:
    """The call's task: find the handler (interceptors run), run the method over the stream's
    messages, send what it yields, then its status."""
    context = Context(request.metadata, request.deadline, conn.peer)
    try:
        handler = await conn.server.lookup(CallDetails(request.method, context.invocation_metadata()))
        if handler is None or handler.stream_stream is None:
            call.end(conn, stream, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return
        result = handler.stream_stream(call.requests(conn, stream, handler.request_deserializer), context)
        serialize = handler.response_serializer or (lambda message: message)
        if inspect.isawaitable(result):
            result = await result
        if hasattr(result, "__aiter__"):
            async for response in result:
                await call.send(conn, stream, serialize(response))
        elif result is not None:
            for response in result:
                await call.send(conn, stream, serialize(response))
        if context.code not in (None, grpc.StatusCode.OK):
            call.end(conn, stream, context.code, context.details, context.trailing)
        else:
            call.end(conn, stream, grpc.StatusCode.OK, "", context.trailing)
    except Abort as exc:
        call.end(conn, stream, exc.code, exc.details, context.trailing)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error in %s", request.method)
        call.end(conn, stream, grpc.StatusCode.UNKNOWN, "Unexpected error in the method handler")


__all__ = ["StreamCall", "run", "wanted"]
