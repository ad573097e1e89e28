"""A lean gRPC server for unary calls: HTTP/2 framing by hand, on one asyncio event loop.

Why not grpcio's server: on a small device the per-call machinery of grpcio's Python server
(its Cython call objects, a polling thread, status sending) costs more CPU than the whole
REST path, so gRPC, the binary protocol, answered fewer requests per second than JSON over
HTTP/1.1. Every RPC this service offers (TF Serving's and KServe v2's) is unary, so the part
of gRPC it needs is small: one request message in, one response message or a status out.
This module speaks exactly that, over HTTP/2 as the gRPC wire spec describes
(PROTOCOL-HTTP2.md), and takes the same ``grpc.GenericRpcHandler`` objects and
``grpc.aio.ServerInterceptor`` as a grpc.aio server, so the services and the token check
do not know which server runs them (``[grpc] transport``: "lean", the default, or "grpcio").

What it implements: the connection preface and SETTINGS, HPACK request headers (the
``hpack`` library; responses use only literal fields that need no table, so they are
constant bytes), HEADERS + CONTINUATION, DATA, flow control both ways (receive
credit per stream by admission within a per-connection budget, and enforced; the peer's
windows respected when sending, the rest queued until its WINDOW_UPDATE; the connection
not read while the client does not read), PING, RST_STREAM, GOAWAY (sent on drain, honoured when received),
``grpc-timeout`` (DEADLINE_EXCEEDED), gzip-compressed requests, the maximum message size
both ways (RESOURCE_EXHAUSTED) and TCP or Unix socket listeners. What it does not: TLS
(the gRPC port is plaintext, as before), streaming RPCs (none are served), server push.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import re
import logging
import os
import struct
import time
import zlib
from typing import Any, Sequence

import grpc
import hpack

from appliance.transport.loop_thread import LoopThread

log = logging.getLogger("appliance.grpc")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, CANCEL, COMPRESSION_ERROR = 0, 1, 3, 6, 8, 9
MAX_WINDOW = 2**31 - 1
OUR_MAX_FRAME = 1 << 20  # advertised: large messages arrive in fewer frames
MAX_HEADER_BLOCK = 64 * 1024
MAX_STREAMS = 100  # calls in flight per connection; the batch queue bounds the work behind them
# Receive flow control. A new stream may send STREAM_WINDOW bytes; once its message's length
# prefix has arrived the stream is *admitted* (oldest first) while the messages admitted on
# the connection fit a budget (the largest message + CONNECTION_WINDOW), and is then given
# credit for its whole message at once. The oldest waiting stream is always admitted when
# none is, so requests that together exceed the budget take turns instead of deadlocking,
# and one client holds at most budget + MAX_STREAMS x STREAM_WINDOW bytes half-received.
# Bytes sent beyond the credit given are a FLOW_CONTROL_ERROR. The connection window itself
# is topped up as bytes arrive: the streams' credit is what bounds memory.
STREAM_WINDOW = 65535
CONNECTION_WINDOW = 16 << 20
GRANT_SLACK = 16384  # over a message's own size: room for padding
# Our SETTINGS: no push, MAX_STREAMS, STREAM_WINDOW, frames up to OUR_MAX_FRAME, header
# lists up to MAX_HEADER_BLOCK.
OUR_SETTINGS = struct.pack(">HIHIHIHIHI", 0x2, 0, 0x3, MAX_STREAMS, 0x4, STREAM_WINDOW, 0x5, OUR_MAX_FRAME,
                           0x6, MAX_HEADER_BLOCK)
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_TIMEOUT = re.compile(rb"(\d{1,8})([HMSmun])")  # the spec's TimeoutValue: at most 8 digits


def _unpad(payload: bytes) -> bytes:
    """A PADDED frame's content: the pad length byte and the padding removed."""
    if not payload or payload[0] >= len(payload):
        raise _ConnectionError(PROTOCOL_ERROR, "padding as long as the frame or longer")
    return payload[1:len(payload) - payload[0]]


def _frame_header(kind: int, flags: int, stream: int, length: int) -> bytes:
    return (length << 8 | kind).to_bytes(4, "big") + bytes((flags,)) + stream.to_bytes(4, "big")


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return _frame_header(kind, flags, stream, len(payload)) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header field as "literal without indexing, new name": no table state, so any
    decoder reads it the same whatever came before."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


# ":status: 200" is static-table entry 8; content-type is entry 31, its value a literal.
RESPONSE_HEADERS = b"\x88" + b"\x0f\x10" + _hpack_int(len(b"application/grpc"), 7) + b"application/grpc"
OK_TRAILERS = _literal(b"grpc-status", b"0")


def _percent_encode(message: str) -> bytes:
    """grpc-message as the spec wants it: printable ASCII except '%' as is, the rest %XX."""
    out = bytearray()
    for byte in message.encode("utf-8"):
        out += bytes((byte,)) if 0x20 <= byte <= 0x7E and byte != 0x25 else b"%%%02X" % byte
    return bytes(out)


def status_trailers(code: grpc.StatusCode, message: str, metadata: Sequence[tuple[str, Any]] = ()) -> bytes:
    block = _literal(b"grpc-status", str(code.value[0]).encode())
    if message:
        block += _literal(b"grpc-message", _percent_encode(message))
    for key, value in metadata:
        raw = value if isinstance(value, bytes) else str(value).encode()
        if key.endswith("-bin"):
            raw = base64.b64encode(raw).rstrip(b"=")
        block += _literal(key.lower().encode(), raw)
    return block


class Abort(Exception):
    """Raised by ``Context.abort``: ends the call with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class CallDetails:
    """What a GenericRpcHandler and an interceptor are given (``grpc.HandlerCallDetails``)."""

    __slots__ = ("method", "invocation_metadata")

    def __init__(self, method: str, metadata: tuple[tuple[str, Any], ...]):
        self.method, self.invocation_metadata = method, metadata


class Context:
    """The part of ``grpc.ServicerContext`` the services use: abort, trailing metadata,
    the caller's metadata, the deadline. ``abort`` raises at once, so it works called
    plainly (in a method run on the thread pool) and awaited (in a coroutine method)."""

    __slots__ = ("_metadata", "trailing", "deadline", "peer_address", "code", "details")

    def __init__(self, metadata: tuple[tuple[str, Any], ...], deadline: float | None, peer: str):
        self._metadata, self.deadline, self.peer_address = metadata, deadline, peer
        self.trailing: tuple[tuple[str, Any], ...] = ()
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def abort(self, code: grpc.StatusCode, details: str = "") -> Any:
        raise Abort(code, details)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, Any]]) -> None:
        self.trailing = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def peer(self) -> str:
        return self.peer_address

    def is_active(self) -> bool:
        return True


class _Stream:
    __slots__ = ("id", "block", "end_after_headers", "headers", "body", "received", "granted", "need", "admitted",
                 "window", "pending", "headers_sent", "task", "timer")

    def __init__(self, stream_id: int, window: int):
        self.id = stream_id
        self.block = b""  # a header block still awaiting its CONTINUATION frames
        self.end_after_headers = False
        self.headers: list[tuple[bytes, bytes]] | None = None
        self.body = bytearray()
        self.received = 0  # DATA bytes (padding included) taken in on this stream
        self.granted = STREAM_WINDOW  # the credit we gave it in all
        self.need: int | None = None  # its message's size with the prefix, once the prefix is in
        self.admitted = False
        self.window = window  # what the peer lets us send on this stream
        self.pending: list[Any] = []  # response bytes (data payload, then trailers) waiting for window
        self.headers_sent = False  # response headers out: a late status goes as trailers only
        self.task: asyncio.Task[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class Connection(asyncio.Protocol):
    """One HTTP/2 connection: frames in, calls out, responses back in order of completion."""

    def __init__(self, server: "LeanServer"):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface_seen = False
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = MAX_HEADER_BLOCK
        self.streams: dict[int, _Stream] = {}
        self.last_stream = 0
        self.send_window = 65535  # the connection's, as the peer lets us send
        self.peer_initial_window = 65535
        self.peer_max_frame = 16384
        self.conn_received = 0  # DATA bytes taken in on the connection
        self.conn_granted = CONNECTION_WINDOW  # the connection credit we gave in all
        self.committed = 0  # the sizes of the admitted requests still arriving
        self.waiting = 0  # streams whose size is known, not admitted yet
        self.continuing: _Stream | None = None
        self.going_away = False
        self.peer = "unknown"

    @property
    def buffered(self) -> int:
        """Bytes of requests not yet complete, held in their streams."""
        return sum(len(stream.body) for stream in self.streams.values())

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"ipv4:{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else f"unix:{peer or ''}"
        self.server.connections.add(self)
        # our SETTINGS first (the server preface), then open the connection window wide
        transport.write(_frame(SETTINGS, 0, 0, OUR_SETTINGS)  # type: ignore[attr-defined]
                        + _frame(WINDOW_UPDATE, 0, 0, (CONNECTION_WINDOW - 65535).to_bytes(4, "big")))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for stream in self.streams.values():
            if stream.task is not None:
                stream.task.cancel()
            if stream.timer is not None:
                stream.timer.cancel()
        self.streams.clear()
        self.server.connection_closed()

    def pause_writing(self) -> None:
        """The client is not reading: stop reading it too (no new calls, no PING answers
        piling up) until the transport's buffer drains."""
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        try:
            pos = 0
            if not self.preface_seen:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                if buf[:len(PREFACE)] != PREFACE:
                    raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.preface_seen, pos = True, len(PREFACE)
            end = len(buf)
            while end - pos >= 9:
                length = int.from_bytes(buf[pos:pos + 3], "big")
                if length > OUR_MAX_FRAME:
                    raise _ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes over {OUR_MAX_FRAME}")
                if end - pos < 9 + length:
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                stream_id = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                payload = bytes(buf[pos + 9:pos + 9 + length])
                pos += 9 + length
                self.frame(kind, flags, stream_id, payload)
                if self.transport is None or self.transport.is_closing():
                    return
            del buf[:pos]
        except _ConnectionError as exc:
            self.fail(exc.code, str(exc))
        except Exception as exc:  # a bug here must cost one connection, never the loop
            log.exception("gRPC connection from %s: unexpected error", self.peer)
            self.fail(2, f"internal error: {type(exc).__name__}")  # INTERNAL_ERROR

    # -- frames ----------------------------------------------------------------------------
    def frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.continuing is not None and kind != CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "a header block was interrupted by another frame")
        if kind == DATA:
            self.on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self.on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            stream = self.continuing
            if stream is None or stream.id != stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, "CONTINUATION without a header block to continue")
            stream.block += payload
            if len(stream.block) > MAX_HEADER_BLOCK:
                raise _ConnectionError(PROTOCOL_ERROR, "header block too large")
            if flags & END_HEADERS:
                self.continuing = None
                self.headers_done(stream)
        elif kind == SETTINGS:
            if stream_id:
                raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
            if not flags & ACK:
                self.on_settings(payload)
        elif kind == WINDOW_UPDATE:
            if len(payload) != 4:
                raise _ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE payload is not 4 bytes")
            increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
            if stream_id == 0:
                if not increment:
                    raise _ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection")
                self.send_window += increment
                if self.send_window > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
                for stream in list(self.streams.values()):
                    if stream.pending:
                        self.flush(stream)
            elif stream_id in self.streams:
                stream = self.streams[stream_id]
                stream.window += increment
                if not increment or stream.window > MAX_WINDOW:
                    self.reset(stream, FLOW_CONTROL_ERROR if increment else PROTOCOL_ERROR)
                elif stream.pending:
                    self.flush(stream)
        elif kind == PING:
            if len(payload) != 8 or stream_id:
                raise _ConnectionError(FRAME_SIZE_ERROR if stream_id == 0 else PROTOCOL_ERROR, "malformed PING")
            if not flags & ACK:
                self.write(_frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if stream_id == 0:
                raise _ConnectionError(PROTOCOL_ERROR, "RST_STREAM on stream 0")
            stream = self.streams.get(stream_id)
            if stream is not None:
                self.done(stream)  # its call is cancelled; a drain waiting on it is told
        elif kind == GOAWAY:
            self.going_away = True
            self.close_if_idle()
        elif kind == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "a client cannot push")
        # PRIORITY and unknown frame types are ignored, as the spec asks

    def on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id % 2 == 0:
                raise _ConnectionError(PROTOCOL_ERROR, f"stream {stream_id} is not a client stream")
            stream = _Stream(stream_id, self.peer_initial_window)
            if stream_id <= self.last_stream:
                pass  # a stream we already answered or reset: decoded below, then ignored
            elif self.going_away or self.server.closing or len(self.streams) >= MAX_STREAMS:
                self.write(_frame(RST_STREAM, 0, stream_id, (7).to_bytes(4, "big")))  # REFUSED_STREAM
                # its header block is still decoded below (not kept): HPACK's table must stay in step
            else:
                self.streams[stream_id] = stream
            self.last_stream = max(self.last_stream, stream_id)
        elif stream.headers is not None and not flags & END_STREAM:
            raise _ConnectionError(PROTOCOL_ERROR, "request trailers must end the stream")
        stream.end_after_headers = bool(flags & END_STREAM)
        stream.block = payload
        if flags & END_HEADERS:
            self.headers_done(stream)
        else:
            self.continuing = stream

    def headers_done(self, stream: _Stream) -> None:
        try:
            fields = self.decoder.decode(stream.block, raw=True)
        except hpack.HPACKError as exc:
            raise _ConnectionError(COMPRESSION_ERROR, f"bad header block: {exc}") from exc
        stream.block = b""
        if self.streams.get(stream.id) is not stream:
            return  # refused or reset: decoded only to keep the header table in step
        if stream.headers is None:
            stream.headers = fields  # type: ignore[assignment]
        if stream.end_after_headers and stream.task is None:  # a second END_STREAM changes nothing
            self.dispatch(stream)

    def on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        size = len(payload)
        self.conn_received += size
        if self.conn_received > self.conn_granted:
            raise _ConnectionError(FLOW_CONTROL_ERROR, "DATA beyond the connection's window")
        if self.conn_granted - self.conn_received < CONNECTION_WINDOW // 2:  # top it up
            increment = CONNECTION_WINDOW - (self.conn_granted - self.conn_received)
            self.write(_frame(WINDOW_UPDATE, 0, 0, increment.to_bytes(4, "big")))
            self.conn_granted += increment
        stream = self.streams.get(stream_id)
        if stream is None or stream.task is not None:
            return  # a stream we reset or already answered: its data is counted and dropped
        stream.received += size
        if stream.received > stream.granted:
            raise _ConnectionError(FLOW_CONTROL_ERROR, f"DATA beyond stream {stream_id}'s window")
        if flags & PADDED:
            payload = _unpad(payload)
        stream.body += payload
        max_receive = self.server.max_receive
        if stream.need is None and len(stream.body) >= 5:
            declared = int.from_bytes(stream.body[1:5], "big")
            if declared > max_receive:
                self.refuse_oversized(stream, declared)
                return
            stream.need = declared + 5
            self.waiting += 1
            self.admit()
        if len(stream.body) > max_receive + 5:
            self.refuse_oversized(stream, len(stream.body) - 5)
            return
        if flags & END_STREAM:
            self.dispatch(stream)

    def refuse_oversized(self, stream: _Stream, size: int) -> None:
        self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Received message larger than max ({size} vs. {self.server.max_receive})")
        self.write(_frame(RST_STREAM, 0, stream.id, NO_ERROR.to_bytes(4, "big")))

    def admit(self) -> None:
        """Admit waiting streams, oldest first, while their messages fit the budget (always
        one when none is admitted), giving each credit for its whole message."""
        budget = self.server.max_receive + 5 + CONNECTION_WINDOW
        for stream in self.streams.values():
            if not self.waiting:
                return
            if stream.admitted or stream.need is None or stream.need < 0 or stream.task is not None:
                continue
            if self.committed and self.committed + stream.need > budget:
                continue
            stream.admitted = True
            self.waiting -= 1
            self.committed += stream.need
            if stream.need > stream.granted:
                increment = stream.need + GRANT_SLACK - stream.granted
                self.write(_frame(WINDOW_UPDATE, 0, stream.id, increment.to_bytes(4, "big")))
                stream.granted += increment

    def reset(self, stream: _Stream, code: int) -> None:
        """End one stream with RST_STREAM ``code`` (a stream error: the connection lives on)."""
        self.write(_frame(RST_STREAM, 0, stream.id, code.to_bytes(4, "big")))
        self.done(stream)

    def release(self, stream: _Stream) -> None:
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

    def on_settings(self, payload: bytes) -> None:
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == 0x4:  # INITIAL_WINDOW_SIZE: applies to open streams by the difference
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
                delta, self.peer_initial_window = value - self.peer_initial_window, value
                for stream in self.streams.values():
                    stream.window += delta
                    if stream.window > MAX_WINDOW:
                        raise _ConnectionError(FLOW_CONTROL_ERROR, "a stream window over 2^31-1")
            elif key == 0x5:
                if not 16384 <= value <= 16777215:
                    raise _ConnectionError(PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value} out of range")
                self.peer_max_frame = value
        self.write(_frame(SETTINGS, ACK, 0))
        for stream in list(self.streams.values()):
            if stream.pending:
                self.flush(stream)

    # -- calls -----------------------------------------------------------------------------
    def dispatch(self, stream: _Stream) -> None:
        """The request is complete: check its headers and framing, then run the call."""
        method, metadata, deadline, encoding, problem = "", [], None, b"identity", ""
        content_type, verb = b"", b""
        for name, value in stream.headers or ():
            if name == b":path":
                method = value.decode("latin-1")
            elif name == b":method":
                verb = value
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                match = _TIMEOUT.fullmatch(value)
                if match is None:
                    problem = f"malformed grpc-timeout {value.decode('latin-1')!r}"
                else:
                    deadline = time.monotonic() + int(match[1]) * _TIMEOUT_UNITS[match[2]]
            elif name == b"grpc-encoding":
                encoding = value
            elif name[:1] != b":" and name not in (b"te", b"grpc-accept-encoding"):
                key = name.decode("latin-1")
                try:
                    metadata.append((key, base64.b64decode(value + b"==") if key.endswith("-bin")
                                     else value.decode("latin-1")))
                except ValueError:
                    problem = f"metadata {key!r} is not base64"
        if verb != b"POST":  # not a gRPC request at all: answered in HTTP, as grpcio does
            self.http_error(stream, 405, f"method {verb.decode('latin-1')} is not POST")
            return
        if content_type != b"application/grpc" and not content_type.startswith((b"application/grpc+",
                                                                                b"application/grpc;")):
            self.http_error(stream, 415, f"content-type {content_type.decode('latin-1')!r} is not application/grpc")
            return
        body = stream.body
        if not problem:
            if len(body) < 5 or body[0] > 1 or int.from_bytes(body[1:5], "big") != len(body) - 5:
                problem = "the request is not one length-prefixed gRPC message"
            elif body[0] == 1 and encoding not in (b"gzip", b"deflate"):
                self.finish(stream, grpc.StatusCode.UNIMPLEMENTED,
                            f"grpc-encoding {encoding.decode('latin-1')!r} is not supported (gzip, deflate)")
                return
        if problem:
            self.finish(stream, grpc.StatusCode.INTERNAL if "gRPC message" in problem else
                        grpc.StatusCode.INVALID_ARGUMENT, problem)
            return
        message = bytes(body[5:])
        if body[0] == 1:
            try:
                inflate = zlib.decompressobj(31 if encoding == b"gzip" else 15)
                message = inflate.decompress(message, self.server.max_receive + 1)
                if len(message) <= self.server.max_receive and (not inflate.eof or inflate.unused_data):
                    raise zlib.error("truncated, or followed by other bytes")
            except zlib.error as exc:
                self.finish(stream, grpc.StatusCode.INTERNAL, f"cannot decompress the request: {exc}")
                return
            if len(message) > self.server.max_receive:
                self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"Received message larger than max (more than {self.server.max_receive} bytes "
                            "once decompressed)")
                return
        self.release(stream)
        context = Context(tuple(metadata), deadline, self.peer)
        server = self.server
        server.in_flight += 1  # counted from here, so a burst read at once is not "alone"
        stream.task = server.loop.create_task(self.call(stream, method, message, context))
        stream.task.add_done_callback(server.call_done)
        if deadline is not None:
            stream.timer = self.server.loop.call_at(
                self.server.loop.time() + max(0.0, deadline - time.monotonic()), self.expire, stream)

    async def call(self, stream: _Stream, method: str, message: bytes, context: Context) -> None:
        if self.server.alone_var is not None:  # this task's own context: the batcher may run a lone call here
            self.server.alone_var.set(self.server.alone)
        try:
            handler = await self.server.lookup(CallDetails(method, context.invocation_metadata()))
            if handler is None or handler.unary_unary is None:
                self.finish(stream, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
                return
            try:
                request = handler.request_deserializer(message) if handler.request_deserializer else message
            except Exception:
                self.finish(stream, grpc.StatusCode.INTERNAL, "Exception deserializing request!")
                return
            fn = handler.unary_unary
            if asyncio.iscoroutinefunction(fn):
                response = await fn(request, context)
            else:
                response = await self.server.loop.run_in_executor(self.server.pool, fn, request, context)
            if context.code not in (None, grpc.StatusCode.OK):
                self.finish(stream, context.code, context.details, context.trailing)
                return
            payload = handler.response_serializer(response) if handler.response_serializer else response
            if len(payload) > self.server.max_send:
                self.finish(stream, grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"Sent message larger than max ({len(payload)} vs. {self.server.max_send})")
                return
            self.respond(stream, payload, context.trailing)
        except Abort as exc:
            self.finish(stream, exc.code, exc.details, context.trailing)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unhandled error in %s", method)
            self.finish(stream, grpc.StatusCode.UNKNOWN, "Unexpected error in the method handler")

    def expire(self, stream: _Stream) -> None:
        stream.timer = None
        self.finish(stream, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")  # done() cancels the call

    # -- responses -------------------------------------------------------------------------
    def respond(self, stream: _Stream, payload: bytes, trailing: Sequence[tuple[str, Any]] = ()) -> None:
        """Headers, the length-prefixed message and the trailers, as far as the windows allow."""
        if self.streams.get(stream.id) is not stream:
            return  # reset or expired meanwhile
        size = len(payload)
        trailers = OK_TRAILERS if not trailing else status_trailers(grpc.StatusCode.OK, "", trailing)
        data = b"\x00" + size.to_bytes(4, "big") + payload
        head = _frame(HEADERS, END_HEADERS, stream.id, RESPONSE_HEADERS)
        sendable = min(self.send_window, stream.window, self.peer_max_frame)
        if len(data) <= sendable and len(trailers) <= self.peer_max_frame:  # the common case: one write
            self.send_window -= len(data)
            stream.window -= len(data)
            self.write(head + _frame(DATA, 0, stream.id, data)
                       + _frame(HEADERS, END_HEADERS | END_STREAM, stream.id, trailers))
            self.done(stream)
            return
        self.write(head)
        stream.headers_sent = True
        stream.pending = [data, trailers]
        self.flush(stream)

    def flush(self, stream: _Stream) -> None:
        """Send what the windows allow of a queued response; the trailers once the data is out.
        The data is a memoryview cut into frames without copying, written in one go."""
        data, trailers = stream.pending
        view = memoryview(data)
        pieces: list[Any] = []
        sent = 0
        while sent < len(view):
            n = min(len(view) - sent, self.send_window, stream.window, self.peer_max_frame)
            if n <= 0:
                break
            pieces += (_frame_header(DATA, 0, stream.id, n), view[sent:sent + n])
            sent += n
            self.send_window -= n
            stream.window -= n
        if sent < len(view):
            stream.pending = [view[sent:], trailers]
        else:
            stream.pending = []
            pieces.append(self._headers_frames(stream.id, trailers, END_STREAM))
        if pieces and self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(pieces)
        if not stream.pending:
            self.done(stream)

    def finish(self, stream: _Stream, code: grpc.StatusCode, message: str,
               trailing: Sequence[tuple[str, Any]] = ()) -> None:
        """End the stream with a status: trailers-only, or trailers after headers already sent."""
        if self.streams.get(stream.id) is not stream:
            return
        block = status_trailers(code, message, trailing)
        if not stream.headers_sent:  # a trailers-only response
            block = RESPONSE_HEADERS + block
        self.write(self._headers_frames(stream.id, block, END_STREAM))
        self.done(stream)

    def http_error(self, stream: _Stream, status: int, message: str) -> None:
        """A request that is not gRPC: an HTTP status (":status" by its static-table name)."""
        block = b"\x08" + _hpack_int(3, 7) + str(status).encode() + status_trailers(grpc.StatusCode.INTERNAL, message)
        self.write(self._headers_frames(stream.id, block, END_STREAM))
        self.done(stream)

    def _headers_frames(self, stream_id: int, block: bytes, flags: int) -> bytes:
        limit = self.peer_max_frame
        if len(block) <= limit:
            return _frame(HEADERS, flags | END_HEADERS, stream_id, block)
        out = _frame(HEADERS, flags, stream_id, block[:limit])
        for i in range(limit, len(block), limit):
            last = i + limit >= len(block)
            out += _frame(CONTINUATION, END_HEADERS if last else 0, stream_id, block[i:i + limit])
        return out

    def done(self, stream: _Stream) -> None:
        """The stream is over (answered, reset by either side, expired): out of the accounts,
        its timer and its call cancelled, the connection closed if it was going away."""
        self.streams.pop(stream.id, None)
        self.release(stream)
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None
        if stream.task is not None and stream.task is not asyncio.current_task():
            stream.task.cancel()  # over before its call finished: its result is not wanted
        self.close_if_idle()
        if self.server.closing and not self.streams:
            self.server.connection_closed()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def go_away(self) -> None:
        self.write(_frame(GOAWAY, 0, 0, self.last_stream.to_bytes(4, "big") + NO_ERROR.to_bytes(4, "big")))
        self.going_away = True
        self.close_if_idle()

    def close_if_idle(self) -> None:
        if self.going_away and not self.streams and self.transport is not None:
            self.transport.close()

    def fail(self, code: int, message: str) -> None:
        log.info("gRPC connection from %s closed: %s", self.peer, message)
        self.write(_frame(GOAWAY, 0, 0, self.last_stream.to_bytes(4, "big") + code.to_bytes(4, "big")
                          + message.encode()[:256]))
        if self.transport is not None:
            self.transport.close()


class LeanServer(LoopThread):
    """The calls of ``grpc.Server`` (add handlers and ports, start, stop) for this transport,
    its event loop on a thread of its own; methods written as plain functions run on a pool
    of ``threads``."""

    def __init__(self, threads: int, options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[Any] = (),
                 alone_var: "contextvars.ContextVar[Any] | None" = None):
        super().__init__(threads)
        # Set to ``self.alone`` in each call's context, so what the call runs (the batcher)
        # can ask whether it is the only call in flight; the server knows nothing of batching.
        self.alone_var = alone_var
        opts = dict(options)
        self.max_receive = int(opts.get("grpc.max_receive_message_length", 4 * 1024 * 1024))
        self.max_send = int(opts.get("grpc.max_send_message_length", 2**31 - 1))
        self.handlers: list[grpc.GenericRpcHandler] = []
        self.interceptors = list(interceptors)
        self.listeners: list[asyncio.AbstractServer] = []
        self.connections: set[Connection] = set()
        self.closing = False
        self._all_closed: asyncio.Event | None = None
        self._cache: dict[str, Any] = {}
        self.unix_paths: list[str] = []
        self.lookup = self._chain()
        self.in_flight = 0  # calls dispatched and not finished (their tasks), on every connection

    def alone(self) -> bool:
        return self.in_flight == 1

    def call_done(self, task: Any) -> None:
        self.in_flight -= 1

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.handlers.extend(handlers)
        self._cache.clear()

    def add_insecure_port(self, address: str) -> int:
        """``host:port`` or ``[v6]:port`` (port 0: any free one) or ``unix:PATH``; the port bound."""
        async def listen() -> int:
            if address.startswith("unix:"):
                server = await self.loop.create_unix_server(lambda: Connection(self), address[5:],
                                                            start_serving=False)
                self.listeners.append(server)
                self.unix_paths.append(address[5:])
                return 1
            host, _, port = address.rpartition(":")
            host = host.strip("[]")
            server = await self.loop.create_server(lambda: Connection(self), host or None, int(port),
                                                   reuse_address=True, start_serving=False)
            self.listeners.append(server)
            return int(server.sockets[0].getsockname()[1])
        try:
            return int(self.run(listen()))
        except OSError as exc:
            raise RuntimeError(f"cannot bind {address}: {exc}") from exc

    def start(self) -> None:
        async def serve() -> None:
            for server in self.listeners:
                await server.start_serving()
        self.run(serve())

    async def _find(self, details: Any) -> Any:
        handler = self._cache.get(details.method)
        if handler is None:
            handler = next((h for h in (g.service(details) for g in self.handlers) if h is not None), None)
            if handler is not None:
                self._cache[details.method] = handler
        return handler

    def _chain(self) -> Any:
        """The handler lookup behind the interceptors (the token check), outermost first."""
        continuation = self._find
        for interceptor in reversed(self.interceptors):
            continuation = _intercepted(interceptor, continuation)
        return continuation

    def connection_closed(self) -> None:
        if self.closing and self._all_closed is not None and not any(c.streams for c in self.connections):
            self._all_closed.set()

    def stop(self, grace: float | None) -> None:
        """Stop taking connections and calls (GOAWAY), let in-flight calls finish for up to
        ``grace`` seconds, then close everything and the loop's thread."""
        if self.loop.is_closed():
            return

        async def drain() -> None:
            self.closing = True
            self._all_closed = asyncio.Event()
            for server in self.listeners:
                server.close()
            for connection in list(self.connections):
                connection.go_away()
            self.connection_closed()
            if grace:
                try:
                    await asyncio.wait_for(self._all_closed.wait(), grace)
                except asyncio.TimeoutError:
                    log.warning("gRPC calls still running after %.1f s of drain: cancelled", grace)
            for connection in list(self.connections):
                if connection.transport is not None:
                    connection.transport.close()
        try:
            self.run(drain(), (grace or 0) + 5)
        finally:
            self.close_loop()
            for path in self.unix_paths:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def _intercepted(interceptor: Any, continuation: Any) -> Any:
    async def call(details: Any) -> Any:
        return await interceptor.intercept_service(continuation, details)
    return call
