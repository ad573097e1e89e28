"""How many token streams each model may run, and the queue of those that wait for room.

**Streams are bounded by the cache memory they hold**, not by a count: a stream of a version
holds that version's KV cache row while it runs (``stream_bytes``: what the version's cache
tensors declare for one sequence, appliance/core/generation.py), and streams are admitted while
their rows fit in ``generation.cache_memory_mb`` (all models together; default: a quarter of the
memory, the cgroup's limit when smaller). A request for ``n`` streams of a version whose rows
take ``b`` bytes each needs ``n * b`` free. ``generation.max_streams`` (default 4096) is only
a ceiling on the count (a stream without a cache, e.g. a generate_step that feeds its history,
holds a few bytes). Within both:

* ``generation.max_streams_per_model`` (0: none) caps any one model;
* ``generation.reserved_streams_per_model`` (default 0, off): a model may not take the
  pool's last streams that every *other* generative model still needs to reach that many.

**A burst waits, as vLLM, llama.cpp and Ollama make it wait**: a request that finds no room
joins its model's queue (at most ``generation.max_queued_per_model`` waiting) and is admitted
when a stream ends; it is refused (``Unavailable``: 503 + Retry-After, naming why) only when
that queue is full or it waited ``generation.queue_timeout_s``. **Fair shares without
reservations**: when room frees, the waiting request of the model that holds the least of the
cache goes first (``held``: its running streams' cache bytes, each stream counted at least
``STREAM_FLOOR_BYTES``, so a stream without a cache costs a small fixed amount; oldest first
among equals). Bytes, not a count: a stream of one model may hold 64 KiB and one of another
4 MiB, and counting streams would let the large rows take most of the memory. An idle model's
first request overtakes a busy model's queue, and a model alone may use the whole pool, whatever
the number of models. A request that has waited ``HOLD_AFTER_S`` (1 s) at the head of the queue
short of cache bytes holds the bytes that free until its streams fit, and goes first: large rows
are never starved by small ones.

**Waiting without a thread**: ``reserve`` is ``admit`` for a request answered on an event loop
(appliance/api/openai.py, generate.py): the same queue, order, deadline and refusals, awaited,
so a queued request holds no thread. It counts the streams in and returns a ``Ticket``; set in
``ADMITTED`` while the streams start, the ticket makes ``admit`` take them without counting
them twice; ``give_back`` counts them out if they never start.

Thread-safety: ``admit``/``leave`` run under the caller's lock (the generation's own), which
``admit`` releases while it waits (a ``threading.Condition`` on it); ``reserve`` and
``give_back`` take the lock themselves (call them outside it), briefly, on the loop.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from appliance.core.errors import ApplianceError, QueueFull, Unavailable

if TYPE_CHECKING:
    from appliance.core.handle import Handle

MODELS_TTL_S = 2.0  # how long the set of generative models is reused before it is read again
HOLD_AFTER_S = 1.0  # a waiter short of cache bytes this long holds the room that frees (``_next``)
# What a stream counts in the fair order at least (``_next``): one without a cache (a
# generate_step that feeds its history) still holds its tokens and buffers, and a model of many
# such streams must not look as if it held nothing.
STREAM_FLOOR_BYTES = 4 << 10


class LimitsConfig(Protocol):
    """What the limits read of ``[generation]`` (appliance/core/config_apis.py ``GenerationConfig``)."""

    max_streams: int
    max_streams_per_model: int
    reserved_streams_per_model: int
    max_queued_per_model: int
    queue_timeout_s: float


class QueueObserver(Protocol):
    """Where the queue reports (appliance/core/streams.py ``GenerationMetrics``); called under the lock."""

    def queued(self, model: str, delta: int) -> None: ...

    def waited(self, model: str, seconds: float) -> None: ...


@dataclass
class Waiter:
    model: str
    count: int
    seq: int
    each: int = 0  # cache bytes of each of its streams
    since: float = field(default_factory=time.monotonic)
    holding: bool = False  # it holds the cache bytes that free (``StreamLimits._next``)
    wake: Callable[[], None] | None = None  # an awaiting waiter's (``reserve``): called when room may have freed


@dataclass
class Ticket:
    """Streams ``reserve`` counted in (module docstring); ``used`` once ``admit`` took them."""

    model: str
    count: int
    each: int = 0  # cache bytes of each stream
    used: bool = False


ADMITTED: "contextvars.ContextVar[Ticket | None]" = contextvars.ContextVar("admitted", default=None)


class StreamLimits:
    """Counts per model, the admission rule and its queue (module docstring). ``admit`` and
    ``leave`` under ``lock``; ``refresh`` outside it."""

    def __init__(self, config: Callable[[], LimitsConfig], generative_models: Callable[[], Iterable[str]],
                 lock: threading.Lock | None = None, observer: "QueueObserver | None" = None,
                 cache_total: Callable[[], int] | None = None):
        self._config, self._models_of = config, generative_models
        self.cache_total = cache_total or (lambda: 0)  # bytes the streams' caches may hold; 0: no bound
        self.running: dict[str, int] = {}
        self.cache_used: dict[str, int] = {}  # cache bytes held by each model's running streams
        self.held: dict[str, int] = {}  # what each model holds in the fair order (module docstring)
        self.waiting: list[Waiter] = []
        self._ready = threading.Condition(lock or threading.Lock())
        self._seq = itertools.count()
        self._observer = observer
        self._models: tuple[float, frozenset[str]] = (-MODELS_TTL_S, frozenset())

    @property
    def total(self) -> int:
        return sum(self.running.values())

    @property
    def cache_bytes(self) -> int:
        """Cache bytes the running streams of all models hold."""
        return sum(self.cache_used.values())

    def queued(self) -> dict[str, int]:
        """Requests waiting per model (under the lock)."""
        out: dict[str, int] = {}
        for w in self.waiting:
            out[w.model] = out.get(w.model, 0) + 1
        return out

    def admit(self, model: str, count: int = 1, each: int = 0) -> None:
        """Count ``count`` new streams of ``model`` (``each`` cache bytes apiece) in, waiting for
        room in the model's queue; ``Unavailable`` naming why when the queue is full or the wait
        ran out."""
        ticket = ADMITTED.get()
        if ticket is not None and not ticket.used and (ticket.model, ticket.count, ticket.each) == (model, count, each):
            ticket.used = True  # counted in by ``reserve`` already
            return
        config = self._config()
        me = self._enter(model, count, each, config)
        if me is None:
            return
        deadline = me.since + config.queue_timeout_s
        try:
            while not self._my_turn(me, config):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._timed_out(model, count, each, config)
                self._ready.wait(left)
        finally:
            self._leave_queue(me)
        self._count_in(model, count, each)

    async def reserve(self, model: str, count: int = 1, changed: Callable[[], None] = lambda: None,
                      each: int = 0) -> Ticket:
        """(an event loop, outside the lock) ``admit`` awaited: no thread waits (module docstring).
        ``changed()`` (outside the lock) when the request joins the queue and when it leaves it:
        the status shows the queue as it is."""
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake() -> None:  # (any thread, under the lock)
            try:
                loop.call_soon_threadsafe(woken.set)
            except RuntimeError:  # the loop closed: its request is gone
                pass
        config = self._config()
        with self._ready:
            me = self._enter(model, count, each, config, wake)
        if me is None:
            return Ticket(model, count, each)
        changed()
        try:
            while True:
                woken.clear()
                with self._ready:
                    if self._my_turn(me, config):
                        self._count_in(model, count, each)
                        return Ticket(model, count, each)
                    left = me.since + config.queue_timeout_s - time.monotonic()
                    if left <= 0:
                        raise self._timed_out(model, count, each, config)
                try:
                    await asyncio.wait_for(woken.wait(), left)
                except TimeoutError:
                    pass
        finally:
            with self._ready:
                self._leave_queue(me)
            changed()

    def give_back(self, ticket: Ticket) -> None:
        """(outside the lock) Count out a ticket's streams that never started."""
        with self._ready:
            if not ticket.used:
                ticket.used = True
                for _ in range(ticket.count):
                    self.leave(ticket.model, ticket.each)

    def _enter(self, model: str, count: int, each: int, config: LimitsConfig,
               wake: Callable[[], None] | None = None) -> Waiter | None:
        """(lock) Count the streams in now (None), or queue them (their ``Waiter``); the refusals."""
        self._check_size(model, count, each, config)
        if not self.waiting and self._refusal(model, count, each, config) is None:
            self._count_in(model, count, each)
            return None
        if sum(w.model == model for w in self.waiting) >= config.max_queued_per_model:
            raise QueueFull(f"{config.max_queued_per_model} requests of model '{model}' are waiting for a stream, "
                            "the limit is generation.max_queued_per_model; retry later")
        me = Waiter(model, count, next(self._seq), each, wake=wake)
        self.waiting.append(me)
        if self._observer is not None:
            self._observer.queued(model, 1)
        return me

    def _leave_queue(self, me: Waiter) -> None:
        """(lock) ``me`` is admitted or gave up: the next in line may fit now."""
        self.waiting.remove(me)
        self._notify()
        if self._observer is not None:
            self._observer.queued(me.model, -1)
            self._observer.waited(me.model, time.monotonic() - me.since)

    def _notify(self) -> None:
        """(lock) Room may have freed: threads look again; of the awaiting waiters only the next
        in line is woken (it wakes the one after when it goes), not every one of a long queue."""
        self._ready.notify_all()
        if not self.waiting:
            return
        first = self._next(self._config())
        if first is not None and first.wake is not None:
            first.wake()

    def _timed_out(self, model: str, count: int, each: int, config: LimitsConfig) -> Unavailable:
        return Unavailable(f"waited {config.queue_timeout_s:g} s (generation.queue_timeout_s) for a stream of model "
                           f"'{model}': {self._refusal(model, count, each, config)} retry later")

    def _check_size(self, model: str, count: int, each: int, config: LimitsConfig) -> None:
        """A request no amount of waiting can admit is refused at once."""
        cap, budget = config.max_streams_per_model, self.cache_total()
        if count > config.max_streams or (cap and count > cap):
            raise Unavailable(f"{count} streams at once is more than model '{model}' may ever run "
                              f"(generation.max_streams = {config.max_streams}, max_streams_per_model = {cap})")
        if budget and count * each > budget:
            raise Unavailable(f"{count} streams of model '{model}' need {_mib(count * each)} of KV cache, more than "
                              f"all streams may ever hold (generation.cache_memory_mb: {_mib(budget)})")

    def _my_turn(self, me: Waiter, config: LimitsConfig) -> bool:
        """Whether ``me`` goes now (``_next``)."""
        return self._next(config) is me

    def _next(self, config: LimitsConfig) -> Waiter | None:
        """(lock) The waiter that goes next, if any fits: of those that fit, the one whose model
        holds the least of the cache (``held``: bytes, not streams; then the oldest). But the
        oldest waiter, once it has waited ``HOLD_AFTER_S`` short of cache bytes, holds those that
        free until it fits, and then goes first (a wait for a count keeps the fair order): a model
        with large rows is not overtaken forever by a stream of small ones (vLLM's queue is first
        come first served for the same reason)."""
        if not self.waiting:
            return None
        oldest = self.waiting[0]  # appended in arrival order
        if time.monotonic() - oldest.since >= HOLD_AFTER_S and self._short_of_cache(oldest):
            oldest.holding = True
            return None
        if oldest.holding and self._refusal(oldest.model, oldest.count, oldest.each, config) is None:
            return oldest
        fitting = [w for w in self.waiting if self._refusal(w.model, w.count, w.each, config) is None]
        return min(fitting, key=lambda w: (self.held.get(w.model, 0), w.seq)) if fitting else None

    def _short_of_cache(self, waiter: Waiter) -> bool:
        budget = self.cache_total()
        return bool(budget and self.cache_bytes + waiter.count * waiter.each > budget)

    def _count_in(self, model: str, count: int, each: int) -> None:
        self.running[model] = self.running.get(model, 0) + count
        if each:
            self.cache_used[model] = self.cache_used.get(model, 0) + count * each
        self.held[model] = self.held.get(model, 0) + count * max(each, STREAM_FLOOR_BYTES)

    def _refusal(self, model: str, count: int, each: int, config: LimitsConfig) -> str | None:
        """Why ``count`` more streams of ``model`` (``each`` cache bytes apiece) cannot start now;
        None when they can."""
        mine, total = self.running.get(model, 0), self.total
        budget, held = self.cache_total(), self.cache_bytes
        if budget and held + count * each > budget:
            return (f"running streams hold {_mib(held)} of KV cache and this request needs {_mib(count * each)} more, "
                    f"the limit is generation.cache_memory_mb: {_mib(budget)};")
        if total + count > config.max_streams:
            return f"{total} streams are running, the limit is generation.max_streams = {config.max_streams};"
        cap = config.max_streams_per_model
        if cap and mine + count > cap:
            return (f"{mine} streams of model '{model}' are running, the limit is "
                    f"generation.max_streams_per_model = {cap};")
        kept = self._kept_for_others(model, config.reserved_streams_per_model)
        if total + count > config.max_streams - kept:
            return (f"{total} of generation.max_streams = {config.max_streams} streams are running; the last {kept} "
                    f"are kept for other models (generation.reserved_streams_per_model = "
                    f"{config.reserved_streams_per_model});")
        return None

    def leave(self, model: str, each: int = 0) -> None:
        """(lock) One stream of ``model`` ended: its count and its ``each`` cache bytes free."""
        left = self.running.get(model, 0) - 1
        if left > 0:
            self.running[model] = left
        else:
            self.running.pop(model, None)
        held = self.cache_used.get(model, 0) - each
        if held > 0:
            self.cache_used[model] = held
        else:
            self.cache_used.pop(model, None)
        weight = self.held.get(model, 0) - max(each, STREAM_FLOOR_BYTES)
        if weight > 0:
            self.held[model] = weight
        else:
            self.held.pop(model, None)
        if self.waiting:
            self._notify()

    def _kept_for_others(self, model: str, reserve: int) -> int:
        if reserve <= 0:
            return 0
        return sum(max(0, reserve - self.running.get(other, 0)) for other in self._generative() if other != model)

    def _generative(self) -> frozenset[str]:
        return self._models[1]

    @property
    def stale(self) -> bool:
        """Whether ``refresh`` would read the models again now."""
        return time.monotonic() - self._models[0] >= MODELS_TTL_S

    def refresh(self) -> None:
        """Read which models can generate, at most every MODELS_TTL_S. Call *outside* the
        lock: reading them takes handles on the manager."""
        if self.stale:
            self._models = (time.monotonic(), frozenset(self._models_of()))


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


class SharedHandle:
    """One manager handle held by the ``n`` streams of one request (its choices): reported
    once (the first failure, else success when the last one ends) and released with the last."""

    def __init__(self, handle: "Handle", holders: int):
        self.handle, self.slot = handle, handle.slot
        self._left = holders
        self._failure: ApplianceError | None = None
        self._lock = threading.Lock()

    def report(self, failure: ApplianceError | None, seconds: float) -> None:
        with self._lock:
            self._failure = self._failure or failure
            self._seconds = seconds

    def release(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left:
                return
        self.handle.report(self._failure, self._seconds)
        self.handle.release()


__all__ = ["ADMITTED", "QueueObserver", "SharedHandle", "StreamLimits", "Ticket"]
