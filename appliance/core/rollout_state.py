"""Rollout state of the models, next to the rollout judge (appliance/core/rollout.py).

``ChannelRollouts`` keeps what a synced channel says about each model's rollout (pushed by
sync: ``{"candidate": N | None, "policy": {...} | None}``) and applies it: the channel's policy
replaces the model's own ``[models.rollout]`` (the central team sets it for the whole fleet; a
policy this device cannot take is refused once, with the reason, and the own one stays), and
its candidate is only ever judged, never served as the newest version.

``rollout_aspired`` turns the aspired versions into the rollout's: with a rollout mode, a newer
version becomes the candidate beside the serving one instead of replacing it.

Thread-safety: ``set`` may be called from any thread; ``apply`` and the functions run on the
manager's thread, changing entries under the lock the manager passes.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Mapping, Protocol

from appliance.core.config import RolloutConfig
from appliance.core.errors import ApplianceError
from appliance.core.policy import State
from appliance.core.slots import ModelEntry


class _Event(Protocol):
    """``StateDB.event``."""

    def __call__(self, kind: str, message: str, model: str = "", version: int | None = None,
                 **detail: object) -> None: ...


class ChannelRollouts:
    def __init__(self, event: _Event):
        """``event(kind, message, model=...)``: the state database's."""
        self._records: dict[str, dict[str, Any]] = {}  # model -> the channel's rollout record
        self.event = event

    def set(self, name: str, record: dict[str, Any] | None) -> None:
        """(sync) The channel of ``name`` names a candidate and/or a rollout policy; None: neither."""
        if record:
            self._records[name] = dict(record)
        else:
            self._records.pop(name, None)

    def apply(self, entries: list[tuple[str, ModelEntry]], lock: threading.RLock) -> None:
        """Each model's channel candidate and policy into its entry (see the module docstring)."""
        for name, entry in entries:
            record = self._records.get(name) or {}
            candidate, policy = record.get("candidate"), record.get("policy")
            entry.channel_candidate = candidate if isinstance(candidate, int) else None
            if policy == entry.channel_policy:
                continue
            entry.channel_policy = policy
            own = entry.own_rollout if entry.own_rollout is not None else entry.config.rollout
            rollout = self._policy(name, policy, own)
            with lock:
                entry.own_rollout = own
                entry.config = dataclasses.replace(entry.config, rollout=rollout)

    def _policy(self, name: str, policy: dict[str, Any] | None, own: RolloutConfig) -> RolloutConfig:
        if policy is None:
            return own
        try:
            rollout = RolloutConfig(**policy)
            rollout.validate("rollout")
            return rollout
        except (TypeError, ApplianceError) as exc:
            self.event("rollout_policy_refused", f"{name}: the channel's rollout policy is refused, "
                       f"the device's own applies: {exc}", model=name)
            return own


def servable_versions(entry: ModelEntry, on_disk: Mapping[int, str]) -> Mapping[int, str]:
    """The versions on disk that may serve: a channel's candidate is there to be judged, so
    without a rollout mode it is never served."""
    if entry.channel_candidate is not None and entry.config.rollout.mode == "off" and len(on_disk) > 1:
        return {v: p for v, p in on_disk.items() if v != entry.channel_candidate}
    return on_disk


def rollout_aspired(entry: ModelEntry, aspired: list[int]) -> list[int]:
    """The versions to hold loaded: with a rollout mode, the serving one and a newer candidate
    beside it; without one, ``aspired`` as the version policy chose them. Call under the
    manager's lock (it moves the serving pin)."""
    live = {v for v, s in entry.versions.items() if s.state == State.AVAILABLE}
    if entry.serving not in live:
        entry.serving = max(live, default=None)
    if entry.config.rollout.mode == "off" or entry.config.version_policy != "latest":
        entry.serving = entry.candidate = None  # no pin: the newest available version answers
        return aspired
    if entry.serving is None:
        return aspired
    newest = max(aspired, default=None)
    entry.candidate = newest if newest is not None and newest > entry.serving else None
    return sorted({entry.serving, *([entry.candidate] if entry.candidate is not None else [])})


__all__ = ["ChannelRollouts", "rollout_aspired", "servable_versions"]
