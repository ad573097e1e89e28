"""What the token-stream APIs (``:generate``, OpenAI) share on the front path's event loop.

``client_gone``: whether a whole answer's client went away (it writes nothing until its end, so
only the socket can say). ``off_loop``: work that may take milliseconds (parsing a body,
tokenizing a prompt, compiling a grammar) on the loop's executor, so the loop keeps answering
(``/healthz`` among others) while it runs. A streamed answer is an async generator of SSE
chunks (appliance/api/family.py ``Streamed``) whose ``finally`` cancels its token stream when
the HTTP server closes it early.
"""

from __future__ import annotations

import asyncio
from typing import Callable, TypeVar
from wsgiref.types import WSGIEnvironment

GONE_KEY = "appliance.client_gone"  # environ: a callable, True once the client went away (the transport sets it)
T = TypeVar("T")


def client_gone(environ: WSGIEnvironment) -> Callable[[], bool]:
    """Whether the request's client is gone, for an answer that writes nothing until it is
    whole (a non-streamed completion): the HTTP server, or the front worker's link, puts the
    callable in the environ; without one the answer runs to its end."""
    gone = environ.get(GONE_KEY)
    return gone if callable(gone) else (lambda: False)


def waiting_gone(environ: WSGIEnvironment) -> Callable[[], bool] | None:
    """What a request waiting for a stream looks at to leave the queue when its client went
    away: the socket, where this process holds it; None for a request a front worker forwarded
    (the worker looks and cancels it)."""
    gone = environ.get(GONE_KEY)
    return gone if callable(gone) else None


async def off_loop(fn: Callable[[], T], undo: Callable[[T], None] | None = None) -> T:
    """``fn()`` on the running loop's executor (module docstring). When the awaiting request is
    cancelled meanwhile (its client went away), ``undo(result)`` runs once ``fn`` returns: a
    handle it took is released."""
    future = asyncio.get_running_loop().run_in_executor(None, fn)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if undo is not None:
            future.add_done_callback(lambda done: _undo(done, undo))
        raise


def _undo(done: "asyncio.Future[T]", undo: Callable[[T], None]) -> None:
    if not done.cancelled() and done.exception() is None:
        undo(done.result())


__all__ = ["GONE_KEY", "client_gone", "off_loop", "waiting_gone"]
