"""Which decode signature runs a step: the batch-1 one or the batched one, by measured cost.

A LiteRT LLM whose decode batch is B > 1 computes (and copies the KV cache of) all B rows every
call, whatever runs in them: on litert-torch's conversions a batch-4 call costs 2-4x a batch-1
call of the same weights (bench/RESULTS.md, issues 35 and 45). A version that carries both (a
batch-1 ``decode`` beside ``decode_<B>``, runtimes/generative.py) runs each step's group of
rows at one position on whichever is cheaper for that many rows: ``m`` batch-1 calls cost
``m * single_ms``, one batched call ``batched_ms``. The two costs are measured per version when
it loads (its warm-up, as backends are timed at load: runtimes/select.py), on the version's own
signatures and cache, in alternating rounds so a drift of the machine's load falls on both, each
side's fastest round kept (a busy machine only ever adds time). Not refined from the calls
served: only the chosen side is timed there, under whatever load the machine has then, and set
against the other side's quiet figure it made a lone stream flip onto the batched call under
load (measured: 0.63x of batch 1 in bench/RESULTS.md's first issue-45 run).

``batched_from``: the smallest group that runs on the batched signature (``batch + 1``: never,
a full batch costing more than its rows one by one). This module imports numpy only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

ROUNDS = 10  # alternating timed calls of each signature, after one untimed call each


@dataclass
class DecodePlan:
    batch: int  # rows of the batched signature
    single_ms: float | None = None  # one batch-1 call, the fastest of the rounds
    batched_ms: float | None = None  # one batched call, likewise
    batched_from: int = 1  # before a measurement: every group on the batched signature

    @property
    def measured(self) -> bool:
        return self.single_ms is not None

    def use_batched(self, rows: int) -> bool:
        return rows >= self.batched_from

    def decide(self, single_ms: float, batched_ms: float) -> None:
        """Set both costs and the smallest group the batched call is cheaper for (module docstring)."""
        self.single_ms, self.batched_ms = single_ms, batched_ms
        self.batched_from = next((m for m in range(1, self.batch + 1) if batched_ms < m * single_ms), self.batch + 1)

    def describe(self) -> dict[str, Any]:
        if not self.measured:
            return {"decode_ms": None, "batched_from": None}
        return {"decode_ms": {"1": round(self.single_ms or 0.0, 4), str(self.batch): round(self.batched_ms or 0.0, 4)},
                "batched_from": self.batched_from if self.batched_from <= self.batch else "never"}


def measure(single: Callable[[], object], batched: Callable[[], object], rounds: int = ROUNDS) -> tuple[float, float]:
    """The fastest of ``rounds`` alternating timed calls of ``single()`` and ``batched()``, in ms."""
    single(), batched()  # the first call of a signature allocates: not counted
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for call, into in ((single, times[0]), (batched, times[1])):
            start = time.perf_counter()
            call()
            into.append((time.perf_counter() - start) * 1000)
    return float(np.min(times[0])), float(np.min(times[1]))


__all__ = ["DecodePlan", "measure"]
