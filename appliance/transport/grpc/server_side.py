"""What one gRPC connection (connection.py) needs of the server that accepted it (h2_server.py).

The server owns what every connection shares: the bounds (``limits``), the counts a hostile
client is measured against over the whole server (open streams, resets, bytes held, calls in
flight), the method table and the loop. A connection reads and updates them through this face
and never names the server's class, so the two modules do not import each other.

Thread-safety: every member is used on the server's event loop thread only.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Protocol

from appliance.transport.grpc.limits import Limits, TokenBucket
from appliance.transport.grpc.peers import Peers

if TYPE_CHECKING:
    import concurrent.futures

    import grpc

    from appliance.transport.grpc.calls import CallDetails


class ServerSide(Protocol):
    limits: Limits
    loop: asyncio.AbstractEventLoop
    pool: "concurrent.futures.ThreadPoolExecutor"  # runs the methods not written as coroutines
    closing: bool
    max_receive: int  # the largest request message, bytes
    max_send: int  # the largest answer message, bytes
    open_streams: int  # on every connection together (Limits.max_open_streams)
    churn: int  # connections accepted and ended, streams opened, in all: what a front worker trims its heap after
    in_flight: int  # calls dispatched and not finished, every connection
    held: int  # bytes held for calls, every connection (requests arriving and in methods, answers unsent)
    held_back: bool  # a stream waits for the worker's held bytes to fall (admission.py ``admit``)
    resets: TokenBucket  # client resets, over the whole server
    peers: Peers  # control frames and abandoned streams per peer address, every connection (peers.py)
    tells_alone: bool  # each call's context carries ``alone`` (calls.py Context)
    lookup: "Callable[[CallDetails], Awaitable[grpc.RpcMethodHandler | None]]"  # the method handler for a call, or None

    def handler_of(self, method: str) -> grpc.RpcMethodHandler | None:
        """The method's handler, interceptors not run (None if none): whether a new stream
        is a streaming call (streams.py)."""

    def alone(self) -> bool:
        """Whether the calling call is the only one in flight."""

    def is_coroutine(self, fn: Callable[..., object]) -> bool:
        """Whether a method is written as a coroutine (else it runs on the server's threads)."""

    def count(self, what: str) -> None:
        """Adds one to the server's counter ``what`` (shown in status)."""

    def readmit_soon(self) -> None:
        """Held bytes fell: streams held back on any connection are looked at again, soon."""

    # Any: connection.py's Connection, which imports this module (naming it here makes a circle);
    # the server's own methods take Connection.
    def connection_made(self, connection: Any) -> None: ...

    def connection_lost(self, connection: Any) -> None: ...

    def stream_done(self, connection: Any) -> None:
        """A stream of ``connection`` ended: a stream may open again under the server's bound."""


__all__ = ["ServerSide"]
