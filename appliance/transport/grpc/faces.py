"""What streams.py reads of a connection and of its streams (connection.py), as Protocols.

connection.py owns the streams and calls into streams.py; streams.py sees the connection and
the stream only through these faces, so it never names connection.py's classes and the two
modules do not import each other (``Connection`` and ``Stream`` satisfy them structurally).

The face is generic in the stream type: the connection's methods that take a stream take its
own ``Stream`` (a parameter cannot be widened to the face), and streams.py passes back the
stream it was given.

Thread-safety: everything is used on the server's event loop thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol, Sequence, TypeVar

if TYPE_CHECKING:
    import grpc

    from appliance.transport.grpc.limits import TokenBucket
    from appliance.transport.grpc.server_side import ServerSide
    from appliance.transport.grpc.session import Session


class StreamFace(Protocol):
    """One HTTP/2 stream as streams.py sees it (admission.py's ``Stream``)."""

    id: int
    body: bytearray  # the request bytes received and not yet taken as messages
    answered: bool  # its response headers are submitted
    last: float  # when a byte of it last moved (time.monotonic())


S = TypeVar("S", bound=StreamFace)


class ConnectionFace(Protocol[S]):
    """One gRPC connection as streams.py sees it (connection.py's ``Connection``)."""

    last_active: float  # when the peer last sent bytes (time.monotonic())
    peer: str  # "ipv4:host:port" or "unix:path", as grpcio's context.peer() says
    stop_after_send: list[int]  # streams to reset once their answers are out

    @property
    def control(self) -> TokenBucket: ...

    @property
    def server(self) -> ServerSide: ...

    @property
    def session(self) -> Session | None: ...

    @property
    def streams(self) -> Mapping[int, S]: ...

    def finish(self, stream: S, code: grpc.StatusCode, message: str,
               trailing: Sequence[tuple[str, str | bytes]] = ()) -> None: ...

    def full_message(self) -> str: ...

    def hold(self, size: int) -> None: ...

    def may_hold(self, size: int) -> bool: ...

    def refuse_oversized(self, stream: S, size: int) -> None: ...

    def write_later(self) -> None: ...


__all__ = ["ConnectionFace", "StreamFace"]
