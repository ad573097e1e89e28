"""How many token streams each model may run: one pool, a cap per model, a share kept for the others.

``generation.max_streams`` bounds the streams of all models together (each holds an HTTP
thread and a cache row). Within it:

* ``generation.max_streams_per_model`` (0: none) caps any one model;
* ``generation.reserved_streams_per_model``: a model may not take the pool's last streams
  that every *other* generative model still needs to reach that many. With the defaults
  (24, 2) and three generative models, one busy model gets at most 20 while the other two
  are idle, and each of them can always start 2 at once; as they run more, the busy model
  gets fewer. That is a work-conserving fair share without a queue: the pool is never left
  idle for a model that may come, and no model can shut another out (with one pool, 24
  streams on one model made every other generative model answer 503 for 53 s, issue 35).

A refusal is ``Unavailable`` (503 + Retry-After) naming the limit that refused. Thread-safe:
``admit``/``leave`` run under the caller's lock (the generation's own).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

from appliance.core.errors import ApplianceError, Unavailable

MODELS_TTL_S = 2.0  # how long the set of generative models is reused before it is read again


class StreamLimits:
    """Counts per model and the admission rule (module docstring). ``admit`` and ``leave``
    under the caller's lock; ``refresh`` outside it."""

    def __init__(self, config: Callable[[], Any], generative_models: Callable[[], Iterable[str]]):
        self._config, self._models_of = config, generative_models
        self.running: dict[str, int] = {}
        self._models: tuple[float, frozenset[str]] = (-MODELS_TTL_S, frozenset())

    @property
    def total(self) -> int:
        return sum(self.running.values())

    def admit(self, model: str, count: int = 1) -> None:
        """Count ``count`` new streams of ``model`` in, or raise ``Unavailable`` naming why."""
        config = self._config()
        mine, total = self.running.get(model, 0), self.total
        if total + count > config.max_streams:
            raise Unavailable(f"{total} streams are running, the limit is generation.max_streams = "
                              f"{config.max_streams}; retry later")
        cap = config.max_streams_per_model
        if cap and mine + count > cap:
            raise Unavailable(f"{mine} streams of model '{model}' are running, the limit is "
                              f"generation.max_streams_per_model = {cap}; retry later")
        kept = self._kept_for_others(model, config.reserved_streams_per_model)
        if total + count > config.max_streams - kept:
            raise Unavailable(f"{total} of generation.max_streams = {config.max_streams} streams are running; the "
                              f"last {kept} are kept for other models (generation.reserved_streams_per_model = "
                              f"{config.reserved_streams_per_model}); retry later")
        self.running[model] = mine + count

    def leave(self, model: str) -> None:
        left = self.running.get(model, 0) - 1
        if left > 0:
            self.running[model] = left
        else:
            self.running.pop(model, None)

    def _kept_for_others(self, model: str, reserve: int) -> int:
        if reserve <= 0:
            return 0
        return sum(max(0, reserve - self.running.get(other, 0)) for other in self._generative() if other != model)

    def _generative(self) -> frozenset[str]:
        return self._models[1]

    def refresh(self) -> None:
        """Read which models can generate, at most every MODELS_TTL_S. Call *outside* the
        lock: reading them takes handles on the manager."""
        if time.monotonic() - self._models[0] >= MODELS_TTL_S:
            self._models = (time.monotonic(), frozenset(self._models_of()))


class SharedHandle:
    """One manager handle held by the ``n`` streams of one request (its choices): reported
    once (the first failure, else success when the last one ends) and released with the last."""

    def __init__(self, handle: Any, holders: int):
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


__all__ = ["SharedHandle", "StreamLimits"]
