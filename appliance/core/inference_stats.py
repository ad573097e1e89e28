"""Per model version inference statistics, as Triton's statistics extension reports them.

Triton's ``/v2/models/{m}/stats`` (and gRPC ``ModelStatistics``) give, per model and version,
the count and total nanoseconds of successful and failed requests, of the time requests
waited in the queue and of the three compute phases, a per batch-size breakdown, the last
inference time, and how many inferences (rows) and executions (batches) ran. The figures
here come from the same two events as the Prometheus series (appliance/core/metrics.py):

* ``request``: one request a version answered or failed, with its duration, recorded by the
  handle (appliance/core/handle.py) for every API, so TF Serving, v2 and OpenAI requests all
  count, as every request Triton runs counts whatever its frontend;
* ``execution``: one batch the version's batcher ran (rows, requests in it, mean queue time,
  run time), through the metrics' ``batch_observer``; a request that bypasses the batcher (a
  shape the batch queue cannot join, batching off) is one execution of its own.

``compute_input`` and ``compute_output`` (Triton: copying tensors to and from the backend)
are counted per request with zero nanoseconds: here the merge and split of a batch are part
of the run and are timed within ``compute_infer``. Thread-safety: every method may be called
from any thread. Each version has its own lock, held for a few additions, so requests to
different versions never wait on each other (one process-wide lock was taken on every request
of every API); the table's lock is taken only when a version first counts or is forgotten.
A version's figures are forgotten when it is unloaded (``forget``): Triton reports the
versions it serves, and a device that rolls through versions for months keeps no row for each.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Duration:
    """Triton's StatisticDuration: how many, and their total time in nanoseconds."""

    count: int = 0
    ns: int = 0

    def add(self, count: int, seconds: float) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass
class BatchSize:
    """Triton's InferBatchStatistics for one batch size."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class VersionStats:
    """One version's figures (Triton's ModelStatistics less name and version)."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, BatchSize] = field(default_factory=lambda: defaultdict(BatchSize))
    last_inference_ms: int = 0
    inference_count: int = 0
    execution_count: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def as_dict(self) -> dict[str, object]:
        """The JSON shape of Triton's ``model_stats`` entry (less name and version)."""
        phases = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
        return {
            "last_inference": self.last_inference_ms, "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {k: getattr(self, k).as_dict() for k in phases},
            "batch_stats": [{"batch_size": size, "compute_input": b.compute_input.as_dict(),
                             "compute_infer": b.compute_infer.as_dict(), "compute_output": b.compute_output.as_dict()}
                            for size, b in sorted(self.batches.items())],
        }


class InferenceStats:
    """Every version's ``VersionStats``, keyed (model, version); see the module docstring."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards the table's shape only; figures under each version's lock
        self._versions: dict[tuple[str, int], VersionStats] = {}

    def _stats(self, model: str, version: int) -> VersionStats:
        stats = self._versions.get((model, version))  # a dict read is atomic: no lock on the hot path
        if stats is None:
            with self._lock:
                stats = self._versions.setdefault((model, version), VersionStats())
        return stats

    def request(self, model: str, version: int, ok: bool, seconds: float) -> None:
        """A request ``version`` answered (``ok``) or failed, after ``seconds``."""
        stats = self._stats(model, version)
        with stats.lock:
            (stats.success if ok else stats.fail).add(1, seconds)
            if ok:
                stats.compute_input.add(1, 0.0)
                stats.compute_output.add(1, 0.0)
                stats.last_inference_ms = int(time.time() * 1000)

    def execution(self, model: str, version: int, rows: int, requests: int, queued: float, ran: float) -> None:
        """One run of the model on ``rows`` rows from ``requests`` requests, which waited
        ``queued`` seconds on average, and took ``ran`` seconds."""
        stats = self._stats(model, version)
        with stats.lock:
            stats.execution_count += 1
            stats.inference_count += rows
            stats.queue.add(requests, queued * requests)
            stats.compute_infer.add(requests, ran * requests)
            batch = stats.batches[rows]
            batch.compute_input.add(1, 0.0)
            batch.compute_infer.add(1, ran)
            batch.compute_output.add(1, 0.0)

    def of(self, model: str, version: int) -> dict[str, object]:
        """A copy of one version's figures (zeros for a version that has run nothing)."""
        stats = self._versions.get((model, version))
        if stats is None:
            return VersionStats().as_dict()
        with stats.lock:
            return stats.as_dict()

    def forget(self, model: str, version: int) -> None:
        """Drop an unloaded version's figures (a later load of it starts from zero, as in Triton)."""
        with self._lock:
            self._versions.pop((model, version), None)


__all__ = ["Duration", "InferenceStats", "VersionStats"]
