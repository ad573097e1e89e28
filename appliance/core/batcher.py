"""Dynamic batching: concurrent requests to one servable and signature share a backend call.

Parameters keep TF Serving's names and units (``max_batch_size``, ``batch_timeout_micros``,
``num_batch_threads``, ``max_enqueued_batches``, ``allowed_batch_sizes``,
``pad_variable_length_inputs``). One difference from TF Serving's scheduler, on purpose:
**an idle worker never waits for a timeout.** A free worker takes whatever is queued (up to
``max_batch_size`` rows) and runs it at once, so a lone request costs its batch-1 time;
batches grow by themselves while all workers are busy, because requests queue up then.
``batch_timeout_micros`` is therefore only an upper bound that is never reached: a partial
batch waits exactly as long as every worker stays busy, never longer.

Requests are grouped by signature and by the dtypes and non-batch dimensions of their
inputs (with ``pad_variable_length_inputs`` differing trailing dimensions are padded with
zeros instead). A request with more rows than ``max_batch_size`` is split into several
tasks (TF Serving's ``enable_large_batch_splitting``). The queue is bounded at
``max_enqueued_batches * max_batch_size`` rows: beyond that ``submit`` raises ``QueueFull``
at once (HTTP 503 + Retry-After) instead of letting memory grow. A request that could never
be queued -- more rows than the whole queue holds, or than ``max_batch_size`` when
``split_large_requests`` is off -- is a permanent ``InvalidArgument`` (400 /
INVALID_ARGUMENT, TF Serving's "Task size N is larger than maximum input batch size M"),
never a "retry later". If a batch fails on bad
input and holds several requests, each is retried alone so one bad member fails alone.

Execution: ``submit`` is awaited on the caller's event loop (the HTTP server's, a gRPC
server's, the front service's); the batches run on this batcher's own threads (at most
``num_batch_threads``, started on demand), and each finished batch wakes its awaiting requests
with one call into their loop, not one per request. A request that is due to lead while a
thread is free starts that thread at once, so a lone request pays one hand-off each way; and
a lone call of a quick model runs right there (``_claim_idle``): the caller says so with the
request's context, passed to ``submit`` as data (appliance/core/request_context.py). A lone
call of a slow model (measured over INLINE_RUN_S) runs on a batcher thread through the servable's ``run_wide`` when it has one (runtimes/base.py), provided no
other batch runs and nothing is queued behind it: the cores that batch slots share under load
are all its own then. Only a call whose context says it is alone: under load a batch that happens
to run by itself shares the cores with the servers' decoding, and more threads there cost
the CNN 9-12 % of its requests/s at 32 clients (bench/RESULTS.md).

Thread-safety: ``submit`` may be awaited from any event loop; ``close`` is idempotent. There
is nothing to start: the threads start with the first batch.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

import numpy as np

from runtimes import InputFailure, RuntimeFailure

from appliance.core.errors import ApplianceError, InvalidArgument, QueueFull, Unavailable, from_runtime
from appliance.core.json_types import JSONObject
from appliance.core.request_context import NO_CONTEXT, RequestContext

if TYPE_CHECKING:  # only for the annotation: the config module is not needed at run time here
    from appliance.core.config import BatchingConfig

RunFn = Callable[[str, Mapping[str, np.ndarray]], dict[str, np.ndarray]]
INLINE_RUN_S = 0.0005  # a model whose batches average under this may run a lone call on its loop
RUNNER_IDLE_S = 1.0  # how long an idle batch thread waits for the next batch before it ends
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class _Runners:
    """Up to ``size`` threads, each running ``work()`` once per ``submit``. An idle thread waits
    ``RUNNER_IDLE_S`` for more, then ends: an idle model holds no threads, a busy one pays no
    thread start per batch."""

    def __init__(self, work: Callable[[], None], size: int, name: str):
        self.work, self.size, self.name = work, size, name
        self._cond = threading.Condition()
        self._jobs = self._idle = self._threads = 0
        self._closed = False

    def submit(self) -> None:
        with self._cond:
            self._jobs += 1
            if self._idle:
                self._cond.notify()
            elif self._threads < self.size:
                self._threads += 1
                threading.Thread(target=self._loop, name=f"{self.name}_{self._threads}", daemon=True).start()

    def close(self) -> None:
        """Idle threads end now; busy ones after their job."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    if self._closed:
                        self._threads -= 1
                        return
                    self._idle += 1
                    woken = self._cond.wait(RUNNER_IDLE_S)
                    self._idle -= 1
                    if not woken and not self._jobs:
                        self._threads -= 1
                        return
                self._jobs -= 1
            self.work()


class _Task:
    __slots__ = ("signature", "inputs", "rows", "done", "lead", "result", "error", "enqueued", "future", "lone")

    def __init__(self, signature: str, inputs: Mapping[str, np.ndarray], rows: int):
        self.signature, self.inputs, self.rows = signature, inputs, rows
        self.done = False
        self.lead = False  # a thread of the batcher was started for it
        self.result: dict[str, np.ndarray] | None = None
        self.error: BaseException | None = None
        self.enqueued = time.perf_counter()
        self.future: asyncio.Future[None] | None = None  # resolved in its caller's loop
        self.lone = False  # its context said it was the only call in flight (RequestContext.alone)


@dataclass
class BatchStats:
    """Cheap in-memory counters read by /api/status and the metrics endpoint."""

    batches: int = 0
    rows: int = 0
    padded_rows: int = 0
    rejected_full: int = 0
    size_counts: dict[int, int] = field(default_factory=lambda: collections.defaultdict(int))
    queue_seconds: float = 0.0
    run_seconds: float = 0.0
    last_progress: float = field(default_factory=time.monotonic)

    def snapshot(self, queued_rows: int) -> JSONObject:
        return {
            "batches": self.batches,
            "rows": self.rows,
            "padded_rows": self.padded_rows,
            "rejected_full": self.rejected_full,
            "queue_depth_rows": queued_rows,
            "mean_batch_size": round(self.rows / self.batches, 2) if self.batches else 0.0,
            "batch_size_histogram": {str(k): v for k, v in sorted(self.size_counts.items())},  # size: batches
            "mean_queue_ms": round(1000 * self.queue_seconds / self.batches, 3) if self.batches else 0.0,
            "mean_run_ms": round(1000 * self.run_seconds / self.batches, 3) if self.batches else 0.0,
        }


def _rows(inputs: Mapping[str, np.ndarray]) -> int | None:
    """Rows of a request, or None when it cannot be batched (a scalar, or unequal dim 0)."""
    counts = {a.shape[0] if a.ndim else None for a in inputs.values()}
    if len(counts) != 1:
        return None
    return counts.pop()


class Batcher:
    """The queues and worker threads of one servable (see module docstring)."""

    def __init__(self, run: RunFn, params: BatchingConfig, name: str = "", threads: int = 1,
                 observe: Callable[[str, int, int, float, float, int], None] | None = None,
                 run_wide: RunFn | None = None):
        self._run = run
        self._run_wide = run_wide or run
        self.params = params
        self.name = name
        self._threads_wanted = max(1, threads)
        self._observe = observe
        self._cond = threading.Condition()
        self._queues: dict[tuple[object, ...], collections.deque[_Task]] = {}
        self._queued_rows = 0
        self._busy = 0  # execution slots in use (leaders running a batch)
        self._closed = False
        self._frozen = False
        self._runners = _Runners(self._run_queued, self._threads_wanted, f"batch-{name}")
        self.stats = BatchStats()

    # -- lifecycle ---------------------------------------------------------------------
    def close(self, timeout: float = 30.0) -> None:
        """Refuse new requests and wait (bounded) for the queued ones to finish. Idempotent."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closed = True
            while (self._queued_rows or self._busy) and time.monotonic() < deadline:
                self._cond.wait(0.05)
        self._runners.close()

    def freeze(self, frozen: bool) -> None:
        """Test hook: stop taking batches (simulates a wedged backend for the watchdog)."""
        with self._cond:
            self._frozen = frozen
            if not frozen:
                self._hand_over()

    def stalled(self, after_s: float) -> bool:
        """True when rows have waited and no batch finished for ``after_s`` seconds."""
        with self._cond:
            waiting = self._queued_rows > 0 or self._busy > 0
        return waiting and time.monotonic() - self.stats.last_progress > after_s

    def snapshot(self) -> JSONObject:
        return self.stats.snapshot(self._queued_rows)

    # -- request side ------------------------------------------------------------------
    async def submit(self, signature: str, inputs: Mapping[str, np.ndarray],
                     context: RequestContext = NO_CONTEXT) -> dict[str, np.ndarray]:
        """Run ``inputs`` as part of a batch; this request's rows of the outputs. Cancelled while
        still queued (the client went away), the request leaves the queue. ``context``: the
        request's scheduling hints (a lone call may run here, or wide: module docstring)."""
        loop = asyncio.get_running_loop()
        tasks = self._tasks(signature, inputs)
        if tasks is None:
            return await loop.run_in_executor(None, self._direct, signature, inputs)
        if len(tasks) == 1 and context.is_alone():  # asked once: it says so for both uses
            if self._claim_idle():
                return self._run_here(tasks[0])
            tasks[0].lone = True
        for task in tasks:
            task.future = loop.create_future()
        self._enqueue(tasks)
        try:
            for task in tasks:
                await task.future  # type: ignore[misc]  # set just above: a Future, never None here
        except asyncio.CancelledError:
            with self._cond:
                for task in tasks:
                    if not task.done:
                        self._unqueue(task)
            raise
        return _joined(tasks)

    def _claim_idle(self) -> bool:
        """(A call whose context says it is alone) Take the execution slot for it when
        nothing is queued or running and this model's batches are quick (INLINE_RUN_S):
        running it right there costs less than the two thread hand-offs of a batch, and there
        is nothing to batch it with. With other calls in flight it queues, so that they can
        share its batch (a first version that ran any call on an idle batcher there served
        up to a fifth fewer requests/s at 32 clients); a slow model never runs on the loop."""
        if not self._quick():
            return False
        with self._cond:
            if self._busy or self._queued_rows or self._frozen or self._closed:
                return False
            self._busy += 1
            return True

    def _quick(self) -> bool:
        """This model's batches are measured to average under INLINE_RUN_S."""
        s = self.stats
        return bool(s.batches) and s.run_seconds <= INLINE_RUN_S * s.batches

    def _slow(self) -> bool:
        """Measured, and not quick: more threads for a lone batch pay (a quick model's would
        cost more to wake and wait for than they save)."""
        return bool(self.stats.batches) and not self._quick()

    def _run_here(self, task: _Task) -> dict[str, np.ndarray]:
        try:
            self._execute([task])
        finally:
            with self._cond:
                self._busy -= 1
                self._hand_over()
        return _joined([task])

    def _capacity(self) -> int:
        """The most rows the queue holds (max_enqueued_batches batches of max_batch_size)."""
        return self.params.max_enqueued_batches * self.params.max_batch_size

    def _tasks(self, signature: str, inputs: Mapping[str, np.ndarray]) -> list[_Task] | None:
        """The request as tasks of at most max_batch_size rows; None: it cannot be batched.
        A request larger than any the queue can take is refused here, before it is queued."""
        rows = _rows(inputs)
        if rows is None or rows == 0:
            return None
        limit = self.params.max_batch_size
        if rows > limit:
            self._check_size(rows)
        return [_Task(signature, {k: v[i:i + limit] for k, v in inputs.items()}, min(limit, rows - i))
                for i in range(0, rows, limit)]

    def _check_size(self, rows: int) -> None:
        """A permanent 400, never QueueFull's "retry later", for a request that no wait could
        make fit: over max_batch_size without splitting, or over the whole queue with it.
        The text is TF Serving's (shared_batch_scheduler.h, INVALID_ARGUMENT), then ours."""
        p = self.params
        if not p.split_large_requests:
            largest, why = p.max_batch_size, "max_batch_size; split_large_requests is off"
        else:
            largest = self._capacity()
            why = (f"the most rows the batch queue holds: max_enqueued_batches {p.max_enqueued_batches} "
                   f"x max_batch_size {p.max_batch_size}")
        if rows > largest:
            raise InvalidArgument(f"Task size {rows} is larger than maximum input batch size {largest} ({why}); "
                                  f"send at most {largest} rows per request")

    def _direct(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            return self._run(signature, inputs)
        except RuntimeFailure as exc:
            raise from_runtime(exc) from exc

    def _group(self, task: _Task) -> tuple[object, ...]:
        pad = self.params.pad_variable_length_inputs
        return (task.signature,) + tuple(
            (k, v.dtype.str, v.ndim if pad else v.shape[1:]) for k, v in sorted(task.inputs.items()))

    def _enqueue(self, tasks: list[_Task]) -> None:
        """Queue ``tasks`` (or refuse them whole) and hand free slots out at once."""
        rows = sum(t.rows for t in tasks)
        capacity = self._capacity()
        with self._cond:
            if self._closed:
                raise Unavailable("the model version is unloading; retry")
            if self._queued_rows + rows > capacity:
                self.stats.rejected_full += 1
                raise QueueFull(f"the batch queue of {self.name} is full ({self._queued_rows} rows queued); retry later")
            for task in tasks:
                self._queues.setdefault(self._group(task), collections.deque()).append(task)
            self._queued_rows += rows
            self._hand_over()

    # -- execution ---------------------------------------------------------------------
    def _run_queued(self) -> None:
        """A thread of the batcher: batches (oldest group first) until none is queued."""
        while True:
            with self._cond:
                if self._frozen or not any(self._queues.values()):
                    self._busy -= 1
                    self._hand_over()
                    return
                batch = self._pop_batch()
                alone = (len(batch) == 1 and batch[0].lone and self._busy == 1 and not self._queued_rows
                         and self._slow())
            self._execute(batch, alone)

    def _hand_over(self) -> None:
        """Under the lock: a thread for each free slot while tasks wait that no thread serves."""
        while not self._frozen and self._busy < self._threads_wanted:
            waiting = [t for q in self._queues.values() for t in q if not t.lead]
            if not waiting:
                break
            task = min(waiting, key=lambda t: t.enqueued)
            task.lead = True
            self._busy += 1
            self._runners.submit()
        if self._closed and not self._queued_rows and not self._busy:
            self._cond.notify_all()

    def _pop_batch(self) -> list[_Task]:
        """Under the lock: the oldest group's tasks, up to max_batch_size rows."""
        ready = [q for q in self._queues.values() if q]
        queue = min(ready, key=lambda q: q[0].enqueued)
        batch, rows = [], 0
        while queue and rows + queue[0].rows <= self.params.max_batch_size:
            task = queue.popleft()
            batch.append(task)
            rows += task.rows
        self._queued_rows -= rows
        return batch

    def _unqueue(self, task: _Task) -> bool:
        for queue in self._queues.values():
            if task in queue:
                queue.remove(task)
                self._queued_rows -= task.rows
                return True
        return False

    def _padded_size(self, rows: int) -> int:
        for size in self.params.allowed_batch_sizes:
            if size >= rows:
                return size
        return rows

    def _merge(self, batch: list[_Task], padded: int) -> dict[str, np.ndarray]:
        merged = {}
        for name in batch[0].inputs:
            parts = [t.inputs[name] for t in batch]
            if self.params.pad_variable_length_inputs:
                parts = _pad_trailing(parts)
            rows = sum(p.shape[0] for p in parts)
            if padded > rows:  # pad with copies of the first row: always a valid input
                parts.append(np.repeat(parts[0][:1], padded - rows, axis=0))
            merged[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return merged

    def _execute(self, batch: list[_Task], alone: bool = False) -> None:
        """Run ``batch``; ``alone``: no other batch runs and none waits (``run_wide``)."""
        started = time.perf_counter()
        rows = sum(t.rows for t in batch)
        padded = self._padded_size(rows)
        try:
            outputs = (self._run_wide if alone else self._run)(batch[0].signature, self._merge(batch, padded))
            self._split(batch, outputs, padded)
        except InputFailure as exc:
            if len(batch) > 1:  # isolate the bad member: run each alone
                for task in batch:
                    self._execute([task])
                return
            self._fail(batch, from_runtime(exc))
        except RuntimeFailure as exc:
            self._fail(batch, from_runtime(exc))
        except ApplianceError as exc:
            self._fail(batch, exc)
        except Exception as exc:  # a backend bug must not kill the worker
            self._fail(batch, ApplianceError(f"backend error: {type(exc).__name__}: {exc}"))
        finished = time.perf_counter()
        queued = sum(started - t.enqueued for t in batch) / len(batch)
        self._record(batch[0].signature, rows, padded, queued, finished - started, len(batch))
        self.stats.last_progress = time.monotonic()  # a batch finished: the watchdog's sign of life
        self._finish(batch)  # counted before answered: a client that reads the figures next sees its batch

    def _record(self, signature: str, rows: int, padded: int, queued: float, ran: float, requests: int) -> None:
        with self._cond:
            self._count(signature, rows, padded, queued, ran, requests)

    def _count(self, signature: str, rows: int, padded: int, queued: float, ran: float, requests: int) -> None:
        s = self.stats
        s.batches += 1
        s.rows += rows
        s.padded_rows += padded - rows
        s.size_counts[rows] += 1
        s.queue_seconds += queued
        s.run_seconds += ran
        if self._observe is not None:
            self._observe(signature, rows, padded, queued, ran, requests)

    def _split(self, batch: list[_Task], outputs: dict[str, np.ndarray], padded: int) -> None:
        if len(batch) == 1 and padded == batch[0].rows:  # nothing to split: any output shape is fine
            batch[0].result = outputs
            return
        for name, value in outputs.items():
            if value.ndim == 0 or value.shape[0] != padded:
                raise ApplianceError(f"output {name!r} has shape {value.shape}, not one row per input row; "
                                     "this signature cannot be batched (set enable_batching = false for it)")
        offset = 0
        for task in batch:
            task.result = {k: v[offset:offset + task.rows] for k, v in outputs.items()}
            offset += task.rows

    def _fail(self, batch: list[_Task], error: BaseException) -> None:
        for task in batch:
            task.error = error

    def _finish(self, batch: list[_Task]) -> None:
        """Mark answered under the lock; then wake the batch's awaiting requests with one call
        into each of their loops (REST and gRPC requests of one batch wait on different ones)."""
        with self._cond:
            for task in batch:
                task.done = True
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
        for task in batch:
            if task.future is not None:
                by_loop.setdefault(task.future.get_loop(), []).append(task.future)
        for loop, futures in by_loop.items():
            try:
                loop.call_soon_threadsafe(_resolve, futures)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass


def _resolve(futures: list[asyncio.Future[None]]) -> None:
    for future in futures:
        if not future.done():  # a cancelled waiter is gone
            future.set_result(None)


def _joined(tasks: list[_Task]) -> dict[str, np.ndarray]:
    """The request's outputs from its answered tasks (the first error, if any, raised)."""
    for task in tasks:
        if task.error is not None:
            raise task.error
    if len(tasks) == 1:
        return tasks[0].result  # type: ignore[return-value]  # one task ran without error: its result is set
    results = [t.result for t in tasks]
    assert all(r is not None for r in results)  # each task ran (an error was raised above)
    return {k: np.concatenate([r[k] for r in results if r is not None]) for k in results[0] or {}}


def _pad_trailing(parts: list[np.ndarray]) -> list[np.ndarray]:
    """Zero-pad every part to the largest size of each non-batch dimension."""
    target = np.max([p.shape[1:] for p in parts], axis=0)
    out = []
    for p in parts:
        widths = [(0, 0)] + [(0, int(t - s)) for s, t in zip(p.shape[1:], target)]
        out.append(np.pad(p, widths) if any(w[1] for w in widths) else p)
    return out
