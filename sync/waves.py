"""Staged fleet waves, decided on each device with no central server (docs/rollouts.md).

A channel pointer may carry ``"waves": [{"percent": 5, "hold_minutes": 30},
{"percent": 25, "hold_minutes": 60}, {"percent": 100}]`` (cumulative shares of the fleet)
and ``"waves_start"`` (epoch seconds; default the pointer's ``created``). Wave *i* opens
once the holds of the waves before it have passed. A device belongs to the first wave
whose percent exceeds its *share*: a stable hash of its device id and the version, so the
answer is the same after every restart and differs from one version to the next (the
same devices are not always first). ``"halt": true`` stops every further move.

``"failure_threshold": {"percent": 10, "min_devices": 1}`` is the share of the devices in the
open waves that may report a refusal or a failed load of the version before the rollout is
halted (by ``appliance rollout watch``, which reads the reports: devices cannot read each
other's). ``min_devices``: how many devices must have reported on the version before the
share is judged (AWS IoT Jobs' ``minNumberOfExecutedThings``), so one early failure of a
tiny first wave does not halt a fleet by itself unless asked.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from collections.abc import Mapping

from .errors import Refused
from .json_types import JSONObject, ReadJSONObject, ReadJSONValue


@dataclass(frozen=True)
class Admission:
    admitted: bool
    wave: int  # index of the device's wave (0-based)
    opens_at: float  # when that wave opens (epoch seconds)
    reason: str


def share(device_id: str, version: int) -> float:
    """The device's place in [0, 1) for this version: uniform over device ids, stable."""
    digest = hashlib.sha256(f"{device_id}\0{int(version)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def parse_waves(pointer: ReadJSONObject, what: str) -> list[tuple[float, float]]:
    """[(cumulative percent, hold seconds)], checked; [] when the pointer declares none."""
    waves = pointer.get("waves")
    if waves is None:
        return []
    if not isinstance(waves, (list, tuple)) or not waves:
        raise Refused(f"{what}: waves must be a non-empty list")
    parsed, last = [], 0.0
    for i, wave in enumerate(waves):
        percent = wave.get("percent") if isinstance(wave, Mapping) else None
        hold = wave.get("hold_minutes", 0) if isinstance(wave, Mapping) else None
        if not isinstance(percent, (int, float)) or not last < percent <= 100:
            raise Refused(f"{what}: waves[{i}].percent must increase and lie in (0, 100], got {percent!r}")
        if not isinstance(hold, (int, float)) or hold < 0:
            raise Refused(f"{what}: waves[{i}].hold_minutes must be a non-negative number, got {hold!r}")
        parsed.append((float(percent), float(hold) * 60))
        last = percent
    if last != 100:
        raise Refused(f"{what}: the last wave must reach percent 100, got {last}")
    return parsed


def admission(device_id: str, pointer: ReadJSONObject, what: str = "channel", now: float | None = None) -> Admission:
    """Whether this device may move to the pointer's version now."""
    version = int(_number(pointer["version"]))
    if pointer.get("halt"):
        return Admission(False, -1, 0.0, f"{what} is halted: no device moves")
    waves = parse_waves(pointer, what)
    if not waves:
        return Admission(True, 0, 0.0, "no waves declared")
    start = float(_number(pointer.get("waves_start") or pointer.get("created") or 0))
    mine = share(device_id, version) * 100
    opens = start
    for index, (percent, hold) in enumerate(waves):
        if mine < percent:
            now = time.time() if now is None else now
            if now >= opens:
                return Admission(True, index, opens, f"in wave {index + 1} ({percent:g}%), open")
            return Admission(False, index, opens, f"in wave {index + 1} ({percent:g}%), which opens in "
                                                  f"{(opens - now) / 60:.1f} min")
        opens += hold
    raise AssertionError("unreachable: the last wave covers 100%")


@dataclass(frozen=True)
class WaveState:
    """Where a rollout stands in time: waves open now, the share of the fleet they cover,
    and when the next one opens (None: all open, or none declared)."""

    open_waves: int
    total_waves: int
    open_percent: float
    next_opens_at: float | None


def wave_state(pointer: ReadJSONObject, now: float | None = None) -> WaveState:
    """The channel's waves at ``now`` (a pointer without waves: one wave, all open)."""
    waves = parse_waves(pointer, "channel")
    if not waves:
        return WaveState(1, 1, 100.0, None)
    now = time.time() if now is None else now
    opens = float(_number(pointer.get("waves_start") or pointer.get("created") or 0))
    for index, (percent, hold) in enumerate(waves):
        if now < opens:
            return WaveState(index, len(waves), waves[index - 1][0] if index else 0.0, opens)
        opens += hold
    return WaveState(len(waves), len(waves), 100.0, None)


def check_failure_threshold(threshold: object, where: str) -> JSONObject:
    """``{"percent": (0, 100], "min_devices": >= 1}``, checked (``Refused`` with the reason)."""
    if not isinstance(threshold, dict) or set(threshold) - {"percent", "min_devices"}:
        raise Refused(f"{where}: failure_threshold must be {{\"percent\": P, \"min_devices\": N}}, got {threshold!r}")
    percent, minimum = threshold.get("percent"), threshold.get("min_devices", 1)
    if isinstance(percent, bool) or not isinstance(percent, (int, float)) or not 0 < percent <= 100:
        raise Refused(f"{where}: failure_threshold.percent must lie in (0, 100], got {percent!r}")
    if type(minimum) is not int or minimum < 1:
        raise Refused(f"{where}: failure_threshold.min_devices must be a whole number >= 1, got {minimum!r}")
    return {"percent": float(percent), "min_devices": minimum}


def check_rollout_policy(policy: object, where: str) -> JSONObject:
    """The shape of a channel's rollout policy: a JSON object of scalars (the device checks
    names and values against its RolloutConfig, and refuses what it does not know)."""
    if not isinstance(policy, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float, bool))
                                               for k, v in policy.items()):
        raise Refused(f"{where}: rollout must be an object of names and plain values, got {policy!r}")
    return dict(policy)


def _number(value: ReadJSONValue) -> int | float | str:
    """A pointer's number as ``int()``/``float()`` take it (a numeric string too); TypeError else."""
    if isinstance(value, (int, float, str)):
        return value
    raise TypeError(f"not a number: {value!r}")
