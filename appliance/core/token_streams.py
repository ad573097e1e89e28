"""Token streams on an event loop: the shape of vLLM's ``EngineClient.generate``.

``generate(generation, handle, request)`` is awaited on the caller's loop: the request waits
for room (its streams' KV cache bytes within ``generation.cache_memory_mb``) in its model's queue without a thread (``StreamLimits.reserve``:
appliance/core/stream_limits.py), its streams start on the handle's version
(``Generation.start_choices``), and it returns a ``TokenStream``: an async iterator of the
request's events, ``(choice index, kind, value)`` as appliance/core/streams.py names them,
woken by the decode loop (``LoopQueue``), never polled. ``abort()`` (a client that went away)
cancels every choice: the decode loop drops them at its next step and releases the version.
The reader pays no thread for the stream's whole life; the decode loop (one thread per
version, shared by all its streams) is the generation's own.

Thread-safety: one reader per ``TokenStream``, on the loop that called ``generate``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from appliance.core.constraints import Grammar
from appliance.core.stream_limits import ADMITTED, Ticket
from appliance.core.streams import Event, LoopQueue, Params, Stream

if TYPE_CHECKING:
    from appliance.core.generation import Generation
    from appliance.core.handle import Handle

ENDS = ("done", "error")  # the kinds that end a choice
GONE_POLL_S = 0.25  # how often a waiting request looks whether its client went away (one process)


@dataclass(frozen=True)
class TokenRequest:
    """What to generate: the prompt's ids (``text``: as text, for a text-level servable), its
    parameters, ``n`` choices, an optional grammar; ``model``: the name its queue is kept by."""

    prompt: list[int]
    params: Params
    model: str
    text: str | None = None
    n: int = 1
    grammar: Grammar | None = None


class TokenStream:
    """A request's streams, as an async iterator of their events (module docstring)."""

    def __init__(self, streams: list[Stream], events: LoopQueue):
        self.streams, self._events = streams, events
        self.open = len(streams)

    def __aiter__(self) -> "TokenStream":
        return self

    async def __anext__(self) -> Event:
        if not self.open:
            raise StopAsyncIteration
        event = await self._events.get()
        if event[1] in ENDS:
            self.open -= 1
        return event

    def abort(self, reason: str = "cancelled") -> None:
        """Cancel every choice still running (their "done" events follow)."""
        for stream in self.streams:
            stream.cancel(reason)


async def generate(generation: "Generation", handle: "Handle", request: TokenRequest,
                   gone: Callable[[], bool] | None = None) -> TokenStream:
    """Queue, admit and start ``request`` on ``handle``'s version (module docstring). The handle
    is the generation's once this returns; on an error (a full queue, a wait past its deadline,
    a cancelled request) the caller still holds it and releases it. ``gone``: whether the
    client went away, looked at every ``GONE_POLL_S`` while the request waits in the queue
    (it is then cancelled: ``CancelledError``)."""
    limits = generation.limits
    if limits.stale:  # which models generate (it may load a tokenizer): read off the loop, not in start_choices
        await asyncio.get_running_loop().run_in_executor(None, limits.refresh)
    # the cache bytes each stream will hold (read once per version: off the loop the first time)
    each = await asyncio.get_running_loop().run_in_executor(None, generation.stream_bytes, handle)
    ticket = await _reserve(generation, request, each, gone)
    events = LoopQueue(asyncio.get_running_loop())
    token = ADMITTED.set(ticket)
    try:
        streams = generation.start_choices(request.prompt, request.params, handle, request.model, text=request.text,
                                           n=request.n, grammar=request.grammar, events=events)
    finally:
        ADMITTED.reset(token)
        limits.give_back(ticket)  # nothing when the streams took it
    return TokenStream(streams, events)


async def _reserve(generation: "Generation", request: TokenRequest, each: int,
                   gone: Callable[[], bool] | None) -> Ticket:
    reserving = asyncio.ensure_future(generation.limits.reserve(request.model, request.n, generation.publish, each))
    if gone is None:
        return await reserving
    try:
        while True:
            done, _ = await asyncio.wait({reserving}, timeout=GONE_POLL_S)
            if done:
                return reserving.result()
            if gone():  # no one will read the answer: leave the queue
                raise asyncio.CancelledError()
    except BaseException:
        reserving.cancel()
        await asyncio.gather(reserving, return_exceptions=True)  # it left the queue (or gave its streams back)
        if reserving.done() and not reserving.cancelled() and reserving.exception() is None:
            generation.limits.give_back(reserving.result())
        raise


class LocalTokenStreams:
    """``TokenStreams`` (appliance/core/seams.py) of the process that generates."""

    def __init__(self, generation: "Generation"):
        self.generation = generation

    async def generate(self, handle: "Handle", request: TokenRequest,
                       gone: Callable[[], bool] | None = None) -> TokenStream:
        return await generate(self.generation, handle, request, gone)


__all__ = ["LocalTokenStreams", "TokenRequest", "TokenStream", "generate"]
