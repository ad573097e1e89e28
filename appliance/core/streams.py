"""A token stream: what a request asks (``Params``), the stream's own state and the events
its reader takes (``Stream``), and the metrics every stream reports into
(``GenerationMetrics``). The step scheduler (appliance/core/generation.py) and the text
streams of LiteRT-LM bundles (appliance/core/text_streams.py) both drive streams; neither
needs the other for it.

A request answered on an event loop reads its events from a ``LoopQueue``: the decode loop's
``put`` wakes the reader's loop, so a stream costs the reader no thread and no poll.

Thread-safety: a ``Stream`` is written by the one thread that drives it; ``cancel`` and
reading ``events`` may happen on any thread (a ``LoopQueue``'s only on its loop).
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from appliance.core.constraints import Constraint
from appliance.core.errors import ApplianceError

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the ``top`` most likely (id, logprob), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Params:
    """What a request asks for; validated by the API layer."""

    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    seed: int | None = None
    stop: frozenset[int] = frozenset()
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and the k best
    # OpenAI's and vLLM's logit processors (appliance/core/sampling.py), all off by default
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def processed(self) -> bool:
        """Whether any logit processor is on (sampling skips them all otherwise)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


class Stream:
    """One generation request. The HTTP side reads ``events``: ("token", id), then one
    ("done", summary) or ("error", message)."""

    def __init__(self, prompt: list[int], params: Params, handle: Any, model: str):
        self.prompt, self.params, self.model = prompt, params, model
        self._handle = handle
        self.slot = handle.slot
        self.version = self.slot.version
        self.events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.cancel_reason = "cancelled"
        self.tokens: list[int] = []
        self.pieces: list[str] = []  # a text-level servable's output (its ids are not known)
        self.text_level = False
        self.rng = np.random.default_rng(params.seed)
        self.started = time.monotonic()
        self.first_at: float | None = None
        self.position = len(prompt) - 1  # where the next decode input (prompt[-1] first) goes
        self.offset = 0  # where its sequence starts in its cache row (aligned lanes, lanes.py)
        self.next_input = prompt[-1]
        self.constraint: Constraint | None = None
        self.vocab_limit: int | None = None  # the tokenizer's size: logits past it are never chosen
        self.logprobs: list[TokenLogprob] = []  # one per token, when params.logprobs is set
        self.leader: Stream | None = None  # another choice of the same prompt whose prefill it copies
        self.index = 0  # which choice it is (OpenAI's index)
        self.choice_events: Any = None  # the request's one queue of tagged events (start_choices)

    @property
    def physical(self) -> int:
        """The cache position of its next decode input."""
        return self.offset + self.position

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the loop to drop this stream at its next step: a client went away
        ("cancelled"), or the API layer found a stop string ("stop")."""
        self.cancel_reason = reason
        self.cancelled.set()

    @property
    def generated(self) -> int:
        """Tokens generated so far (pieces, for a text-level servable)."""
        return len(self.tokens) + len(self.pieces)

    def release(self, failure: ApplianceError | None = None) -> None:
        """Give the version back, reporting the stream's outcome (the rollout judge's, when routed)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.report(failure, time.monotonic() - self.started)
            handle.release()

    def summary(self, reason: str) -> dict[str, Any]:
        elapsed = time.monotonic() - self.started
        ttft = (self.first_at - self.started) if self.first_at else None
        decode_s = time.monotonic() - self.first_at if self.first_at else 0.0
        return {"finish_reason": reason, "model_name": self.model, "model_version": str(self.version),
                "prompt_tokens": len(self.prompt), "completion_tokens": self.generated,
                "time_to_first_token_ms": round(ttft * 1000, 3) if ttft is not None else None,
                "tokens_per_s": round((self.generated - 1) / decode_s, 2) if self.generated > 1 and decode_s > 0
                else None, "elapsed_ms": round(elapsed * 1000, 3)}


Event = tuple[int, str, Any]  # (choice index, kind, value): "token" id, "text" piece, "done" summary, "error" text


class EventSink(Protocol):
    """Where a request's tagged events go: a ``queue.SimpleQueue`` (a reader thread) or a ``LoopQueue``."""

    def put(self, item: Event) -> None: ...


class LoopWaker:
    """Wakes the readers of one event loop's ``LoopQueue``s: one ``call_soon_threadsafe`` (a
    write to the loop's self-pipe) per batch of puts, not one per token, so a decode step of 24
    streams wakes the loop once. ``for_loop`` gives each loop its one waker."""

    _of: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWaker]" = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.ready: collections.deque[LoopQueue] = collections.deque()
        self.scheduled = False

    @classmethod
    def for_loop(cls, loop: asyncio.AbstractEventLoop) -> "LoopWaker":
        """(the loop's thread) Its waker."""
        waker = cls._of.get(loop)
        if waker is None:
            waker = cls._of[loop] = cls(loop)
        return waker

    def notify(self, queue: "LoopQueue") -> None:
        """(any thread) ``queue`` has a new item."""
        self.ready.append(queue)
        if not self.scheduled:  # a wake already scheduled will see this queue: it drains ``ready`` after clearing the flag
            self.scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._run)
            except RuntimeError:  # the loop closed: no one reads any more
                pass

    def _run(self) -> None:
        self.scheduled = False
        while self.ready:
            self.ready.popleft().wake()


class LoopQueue:
    """A request's events for a reader on an event loop (module docstring): ``put`` from any
    thread, ``get`` awaited on ``loop`` (made on that loop's thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._waker = LoopWaker.for_loop(loop)
        self._items: collections.deque[Event] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: Event) -> None:
        self._items.append(item)
        self._waker.notify(self)

    def wake(self) -> None:
        """(the loop) Its reader, if it waits, looks again."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Event:
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class Tagged:
    """A stream's ``events`` put on its request's one queue with the choice's index."""

    def __init__(self, merged: EventSink, index: int):
        self.merged, self.index = merged, index

    def put(self, item: tuple[str, Any]) -> None:
        self.merged.put((self.index, *item))


class GenerationMetrics:
    """Time to first token, tokens/s per stream and in total, active streams, rows per step."""

    def __init__(self, registry: CollectorRegistry | None):
        self.ttft = Histogram("edge_appliance_generation_time_to_first_token_seconds",
                              "From request to first generated token", ["model_name"], buckets=TTFT_BUCKETS_S,
                              registry=registry)
        self.tokens = Counter("edge_appliance_generation_tokens", "Generated tokens (rate() = total tokens/s)",
                              ["model_name"], registry=registry)
        self.stream_rate = Histogram("edge_appliance_generation_stream_tokens_per_second",
                                     "Decode speed of each finished stream", ["model_name"], buckets=RATE_BUCKETS,
                                     registry=registry)
        self.active = Gauge("edge_appliance_generation_active_streams", "Streams admitted and not finished",
                            ["model_name"], registry=registry)
        self.streams = Counter("edge_appliance_generation_streams", "Finished streams by finish reason",
                               ["model_name", "finish_reason"], registry=registry)
        self.waiting = Gauge("edge_appliance_generation_requests_waiting",
                             "Requests waiting for a stream (vLLM's num_requests_waiting)", ["model_name"],
                             registry=registry)
        self.queue_wait = Histogram("edge_appliance_generation_queue_wait_seconds",
                                    "How long a request waited for a stream (refused ones included)",
                                    ["model_name"], buckets=TTFT_BUCKETS_S + (30, 60), registry=registry)
        self.step_rows = Histogram("edge_appliance_generation_step_rows",
                                   "Streams per model call of a decode step (a lane whose streams sit at "
                                   "different shared positions makes one call per position)",
                                   ["model_name"], buckets=ROW_BUCKETS, registry=registry)


    def queued(self, model: str, delta: int) -> None:
        self.waiting.labels(model).inc(delta)

    def waited(self, model: str, seconds: float) -> None:
        self.queue_wait.labels(model).observe(seconds)


__all__ = ["Event", "EventSink", "GenerationMetrics", "LoopQueue", "LoopWaker", "Params", "Stream", "Tagged", "TokenLogprob"]
