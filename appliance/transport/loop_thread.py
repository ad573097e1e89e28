"""An asyncio event loop on a thread of its own, with a thread pool as its default executor,
driven from plain threads: what both gRPC servers run on (appliance/transport/grpc/h2_server.py's lean one,
grpcio's grpc.aio in appliance/service/grpc_port.py). Methods written as plain functions run on
the pool; coroutines, Predict among them, run on the loop. The lean server's loop is uvloop's
where it is installed (``new_event_loop``); grpc.aio keeps asyncio's own."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Coroutine, TypeVar

T = TypeVar("T")



def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop (libuv: its transports read and write in C, a tenth of the loop's time per
    gRPC call measured in bench/RESULTS.md), asyncio's own where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """``loop``: run on that loop (its owner runs it, in its own thread) instead of a loop
    and thread of this object's: a guest, as a front worker's gRPC server is on the worker's
    HTTP loop. ``run`` then needs that loop running, and ``close_loop`` leaves it alone."""

    def __init__(self, threads: int, name: str = "grpc",
                 loop_factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop,
                 loop: asyncio.AbstractEventLoop | None = None):
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self.guest = loop is not None
        self.loop = loop or loop_factory()
        self._thread: threading.Thread | None = None
        if not self.guest:
            self.loop.set_default_executor(self.pool)  # requests that run alone (not batched) run here too
            self._thread = threading.Thread(target=self.loop.run_forever, name=f"{name}-loop", daemon=True)
            self._thread.start()

    def run(self, coro: Coroutine[object, object, T], timeout: float | None = 30) -> T:
        """Run ``coro`` on the loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close_loop(self) -> None:
        """Stop the loop, join its thread (bounded), close the loop (not a guest's: its owner
        does); the pool stops taking work."""
        if self._thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
            if not self._thread.is_alive():
                self.loop.close()
        self.pool.shutdown(wait=False)
