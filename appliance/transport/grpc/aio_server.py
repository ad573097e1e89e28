"""grpcio's ``grpc.aio`` server behind the calls of ``grpc.Server``: the fallback gRPC
transport (``[grpc] transport = "grpcio"``). It knows nothing of models: the service adds
the generic handlers of the API layer.
"""

from __future__ import annotations

from typing import Sequence

import grpc

from appliance.transport.loop_thread import LoopThread


class AioServer(LoopThread):
    """A ``grpc.aio`` server on an event loop of its own thread, driven from plain threads
    with the calls of ``grpc.Server`` (add handlers and ports, start, stop)."""

    def __init__(self, threads: int, options: Sequence[tuple[str, int | str]] = (),
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = ()):
        super().__init__(threads)

        async def make() -> grpc.aio.Server:  # the server binds to the loop it is created on
            return grpc.aio.server(migration_thread_pool=self.pool, options=list(options),
                                   interceptors=list(interceptors))
        self.server = self.run(make())

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.server.add_generic_rpc_handlers(handlers)

    def add_insecure_port(self, address: str) -> int:
        async def add() -> int:
            port: int = self.server.add_insecure_port(address)  # (grpc is untyped)
            return port
        return self.run(add())

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        async def add() -> int:
            port: int = self.server.add_secure_port(address, credentials)
            return port
        return self.run(add())

    def start(self) -> None:
        self.run(self.server.start())

    def stop(self, grace: float | None) -> None:
        """Stop taking calls, let in-flight ones finish for up to ``grace`` seconds, then
        close the loop and its threads."""
        if self.loop.is_closed():
            return
        try:
            self.run(self.server.stop(grace), (grace or 0) + 5)
        finally:
            self.close_loop()
