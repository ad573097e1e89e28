"""The manager's records: one ``VersionSlot`` per model version, one ``ModelEntry`` per model.

Plain data; the manager (appliance/core/manager.py) owns them and changes them under its
lock. ``describe()`` is what ``/api/status``, the page and the device report show of a version.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from runtimes import Servable

from appliance.core.batcher import Batcher
from appliance.core.config import ModelConfig, RolloutConfig
from appliance.core.policy import State


@dataclass
class VersionSlot:
    """One model version and everything loaded for it."""

    model: str
    version: int
    path: str
    state: State = State.START
    error: str = ""
    # The canonical code of ``error`` (TF Serving's model status carries it): DATA_LOSS for an
    # artifact that does not parse, FAILED_PRECONDITION for an API break or a refused directory...
    error_code: str = ""
    servable: Servable | None = None
    batcher: Batcher | None = None
    decision: dict[str, Any] | None = None
    api: dict[str, Any] | None = None  # its signatures as JSON (appliance/core/loader_api.py)
    load_ms: float = 0.0
    warmup_ms: float = 0.0
    trial_ms: float = 0.0
    available_since: float = 0.0
    degraded: str = ""  # a partial version serving (allow_partial_versions): what it lacks
    api_change: str = ""  # the declared API change it was let through with
    # Signatures whose synthetic warm-up call failed: {signature: why}. Served all the same
    # (TF Serving does no synthetic warm-up; the failure is shown, not held against the version).
    warnings: dict[str, str] = field(default_factory=dict)
    # Requests holding this version: one entry each. deque.append/pop are atomic under the
    # GIL, so a request counts itself in and out without the manager's lock (Manager.handle).
    inflight: collections.deque[None] = field(default_factory=collections.deque, repr=False)

    @property
    def refs(self) -> int:
        return len(self.inflight)

    def describe(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "state": self.state.value,
            "error": self.error,
            "error_code": self.error_code or ("OK" if not self.error else "UNKNOWN"),
            "degraded": self.degraded,
            "api_change": self.api_change,
            "backend": getattr(self.servable, "backend", None) or (self.decision or {}).get("chosen"),
            "load_ms": round(self.load_ms, 1),
            "warmup_ms": round(self.warmup_ms, 1),
            "trial_ms": round(self.trial_ms, 1),
            "available_since": self.available_since or None,
            "in_flight": self.refs,
            "decision": self.decision,
            "batching": self.batcher.snapshot() if self.batcher else None,
            "warmup_warnings": dict(self.warnings),
        }


@dataclass(frozen=True)
class Quarantine:
    """Why a version is not loaded again until its directory is replaced."""

    mtime: float  # of the version directory when it failed
    reason: str
    code: str


@dataclass
class ModelEntry:
    config: ModelConfig
    versions: dict[int, VersionSlot] = field(default_factory=dict)
    quarantined: dict[int, Quarantine] = field(default_factory=dict)
    # Rollouts (config rollout.mode shadow|canary): the version answering unversioned
    # requests, and a newer one loaded next to it until appliance/core/rollout.py judges it.
    serving: int | None = None
    candidate: int | None = None
    # The channel's rollout policy when a synced channel carries one (it replaces the
    # model's own [models.rollout] in ``config``; ``own_rollout`` keeps the latter).
    own_rollout: RolloutConfig | None = None
    channel_policy: dict[str, Any] | None = None
    channel_candidate: int | None = None  # judged only: never served as the newest version
    source: str = ""  # the version source that named this model (appliance/core/sources.py)
    on_disk: dict[int, str] = field(default_factory=dict)  # {version: directory}, as its source pushed


__all__ = ["ModelEntry", "Quarantine", "VersionSlot"]
