"""gRPC's own layer above HTTP/2 for unary calls (PROTOCOL-HTTP2.md): what a request's headers
say (method, metadata, deadline, compression), the one length-prefixed message of its body,
the status and trailers of an answer, and the objects a method and an interceptor are given
(``grpc.HandlerCallDetails`` and the part of ``grpc.ServicerContext`` the services use).

No sockets and no HTTP/2 here: appliance/transport/grpc/connection.py feeds it h2's events.
"""

from __future__ import annotations

import base64
import re
import time
import zlib
from typing import Callable, NoReturn, Sequence

import grpc

Header = tuple[bytes, bytes]
RESPONSE_HEADERS: tuple[Header, ...] = ((b":status", b"200"), (b"content-type", b"application/grpc"))
OK_TRAILERS: tuple[Header, ...] = ((b"grpc-status", b"0"),)
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_TIMEOUT = re.compile(rb"(\d{1,8})([HMSmun])")  # the spec's TimeoutValue: at most 8 digits
_ILLEGAL = re.compile(rb"[\x00\r\n]")
_NOT_METADATA = frozenset((b"te", b"grpc-accept-encoding", b"grpc-encoding", b"grpc-timeout", b"content-type"))


class Abort(Exception):
    """Raised by ``Context.abort``: ends the call with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class CallDetails:
    """What a GenericRpcHandler and an interceptor are given (``grpc.HandlerCallDetails``)."""

    __slots__ = ("method", "invocation_metadata")

    def __init__(self, method: str, metadata: tuple[tuple[str, str | bytes], ...]):
        self.method, self.invocation_metadata = method, metadata


class Context:
    """The part of ``grpc.ServicerContext`` the services use: abort, trailing metadata,
    the caller's metadata, the deadline. ``abort`` raises at once, so it works called
    plainly (in a method run on the thread pool) and awaited (in a coroutine method).
    ``alone``: where the server counts its calls, a function telling whether this call is the
    only one in flight (the services make the call's request context of it:
    appliance/core/request_context.py ``of_grpc``); None: never alone."""

    __slots__ = ("_metadata", "trailing", "deadline", "peer_address", "code", "details", "alone")

    def __init__(self, metadata: tuple[tuple[str, str | bytes], ...], deadline: float | None, peer: str,
                 alone: Callable[[], bool] | None = None):
        self._metadata, self.deadline, self.peer_address, self.alone = metadata, deadline, peer, alone
        self.trailing: tuple[tuple[str, str | bytes], ...] = ()
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise Abort(code, details)

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self.trailing = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
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


class Request:
    """A request's headers, read once: ``http_status`` set when it is not gRPC at all (answered
    in HTTP, as grpcio does), ``problem`` when it is gRPC with a bad header."""

    __slots__ = ("method", "metadata", "deadline", "encoding", "problem", "http_status")

    def __init__(self, headers: Sequence[Header]):
        self.method, self.encoding, self.problem = "", b"identity", ""
        self.deadline: float | None = None
        self.http_status = 0
        metadata: list[tuple[str, str | bytes]] = []
        verb = content_type = b""
        for name, value in headers:
            if name[:1] == b":":
                if name == b":path":
                    self.method = value.decode("latin-1")
                elif name == b":method":
                    verb = value
            elif name not in _NOT_METADATA:
                self._metadata(metadata, name, value)
            elif name == b"content-type":
                content_type = value
            elif name == b"grpc-timeout":
                self._deadline(value)
            elif name == b"grpc-encoding":
                self.encoding = value
        self.metadata = tuple(metadata)
        if verb != b"POST":
            self.http_status, self.problem = 405, f"method {verb.decode('latin-1')} is not POST"
        elif content_type != b"application/grpc" and not content_type.startswith((b"application/grpc+",
                                                                                b"application/grpc;")):
            self.http_status = 415
            self.problem = f"content-type {content_type.decode('latin-1')!r} is not application/grpc"

    def _metadata(self, metadata: list[tuple[str, str | bytes]], name: bytes, value: bytes) -> None:
        if _ILLEGAL.search(name) or _ILLEGAL.search(value):  # never handed to a service (h2 does not check them here)
            self.problem = f"metadata {name[:64].decode('latin-1')!r} holds NUL, CR or LF"
            return
        key = name.decode("latin-1")
        if not key.endswith("-bin"):
            metadata.append((key, value.decode("latin-1")))
            return
        try:
            metadata.append((key, base64.b64decode(value + b"==")))
        except ValueError:
            self.problem = f"metadata {key!r} is not base64"

    def _deadline(self, value: bytes) -> None:
        match = _TIMEOUT.fullmatch(value)
        if match is None:
            self.problem = f"malformed grpc-timeout {value.decode('latin-1')!r}"
        else:
            self.deadline = time.monotonic() + int(match[1]) * _TIMEOUT_UNITS[match[2]]


class Refused(Exception):
    """A request body that cannot be a call: answered with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


def declared_size(body: bytes | bytearray) -> int:
    """The message length its 5-byte prefix declares (the body holds at least 5 bytes)."""
    return int.from_bytes(body[1:5], "big")


def message_of(body: bytearray, encoding: bytes, max_receive: int) -> bytes:
    """The one message of a unary request's body, inflated if compressed: never more than
    ``max_receive`` bytes are produced, whatever the compressed bytes would inflate to."""
    if len(body) < 5 or body[0] > 1 or declared_size(body) != len(body) - 5:
        raise Refused(grpc.StatusCode.INTERNAL, "the request is not one length-prefixed gRPC message")
    message = bytes(memoryview(body)[5:])
    if body[0] == 0:
        return message
    if encoding not in (b"gzip", b"deflate"):
        raise Refused(grpc.StatusCode.UNIMPLEMENTED,
                      f"grpc-encoding {encoding.decode('latin-1')!r} is not supported (gzip, deflate)")
    try:
        inflate = zlib.decompressobj(31 if encoding == b"gzip" else 15)
        message = inflate.decompress(message, max_receive + 1)
        if len(message) <= max_receive and (not inflate.eof or inflate.unused_data):
            raise zlib.error("truncated, or followed by other bytes")
    except zlib.error as exc:
        raise Refused(grpc.StatusCode.INTERNAL, f"cannot decompress the request: {exc}") from exc
    if len(message) > max_receive:
        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"Received message larger than max (more than {max_receive} bytes once decompressed)")
    return message


def percent_encode(message: str) -> bytes:
    """grpc-message as the spec wants it: printable ASCII except '%' as is, the rest %XX."""
    raw = message.encode("utf-8")
    if all(0x20 <= byte <= 0x7E and byte != 0x25 for byte in raw):
        return raw
    return b"".join(bytes((byte,)) if 0x20 <= byte <= 0x7E and byte != 0x25 else b"%%%02X" % byte for byte in raw)


def status_trailers(code: grpc.StatusCode, message: str,
                    metadata: Sequence[tuple[str, str | bytes]] = ()) -> list[Header]:
    block = [(b"grpc-status", str(code.value[0]).encode())]
    if message:
        block.append((b"grpc-message", percent_encode(message)))
    for key, value in metadata:
        raw = value if isinstance(value, bytes) else str(value).encode()
        if key.endswith("-bin"):
            raw = base64.b64encode(raw).rstrip(b"=")
        block.append((key.lower().encode(), raw))
    return block
