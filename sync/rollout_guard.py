"""Acting on a rollout's failure threshold: what ``appliance rollout watch`` does each round
(halt), and what ``appliance rollout controller`` does (the pointer's ``on_failure``: roll the
channel back to the last good version, or halt it).

Devices cannot read each other's reports (each writes only its own), so the judge of a
fleet-wide threshold is whoever can read them all: the shipped controller (a systemd unit or
a Kubernetes Deployment per channel, systemd/ and deploy/), or ``appliance rollout watch`` on
the operator's machine, a CI job or a timer. Each round lists the reports (only those written
since the last round are read: sync/listing.py), measures the rollout against the channel's
``failure_threshold`` (sync/fleet_view.py), and when the share of failing devices in the open
waves reaches it, writes ``halt`` into the channel pointer with the reason (signed with the
publisher's key when devices require signatures): no further device moves, the ones that
failed keep serving their last good version, and the page and ``appliance fleet`` show why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .fleet_view import device_rows, rollout_progress
from .fleet import read_pointer
from .listing import ReportCache, list_reports
from .publisher import halt_channel, roll_back_channel
from .report import load_registry
from .errors import Refused
from .source import Source

if TYPE_CHECKING:  # cryptography is imported where keys are used
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey


@dataclass
class Round:
    progress: dict[str, Any]
    halted_now: bool = False
    done: bool = False  # every device of the channel is on the target


def halt_reason(progress: dict[str, Any]) -> str:
    """Why the rollout must stop now ("" while it may go on)."""
    threshold = progress.get("threshold")
    if not threshold or not threshold["breached"] or progress["halted"]:
        return ""
    examples = "; ".join(f"{f['device_id']}: {f['reason']}" for f in progress["failing"][:3])
    return (f"{threshold['failing_in_open_waves']} of {threshold['devices_in_open_waves']} devices in the open waves "
            f"({threshold['failing_percent']:g}%) failed version {progress['target_version']}, at or over the "
            f"failure threshold of {threshold['percent']:g}%: {examples}")


def look(source: Source, model: str, channel: str, cache: ReportCache) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the rollout's progress now, the channel pointer it was measured against)."""
    listing = list_reports(source, cache)
    registry = load_registry(source)
    rows, shown = device_rows(listing.entries, registry, cache)
    pointer = read_pointer(source, model, channel)
    return rollout_progress(listing.entries, rows, model, channel, pointer, shown=shown), pointer


def watch_round(source: Source, model: str, channel: str, cache: ReportCache, sign_key: Ed25519PrivateKey | None = None,
                by: str = "appliance rollout watch") -> Round:
    """One look at the rollout; halts the channel when its threshold is reached."""
    progress, _ = look(source, model, channel, cache)
    reason = halt_reason(progress)
    if reason:
        halt_channel(source, model, channel, sign_key, reason=reason, by=by)
        progress = {**progress, "halted": True, "halted_reason": reason}
    return Round(progress, halted_now=bool(reason), done=_done(progress))


def control_round(source: Source, model: str, channel: str, cache: ReportCache,
                  sign_key: Ed25519PrivateKey | None = None,
                  by: str = "appliance rollout controller") -> Round:
    """The controller's round: the same judge as ``watch_round``; at the threshold, what the
    pointer's ``on_failure`` says: ``rollback`` points the channel back at its
    ``previous_version`` (every device that took the failed version returns to the last good
    one), ``halt`` (the default, or when no previous version is known) halts it. Idempotent:
    a halted or rolled-back channel has nothing left to judge, so a second controller, or a
    second round, writes nothing."""
    progress, pointer = look(source, model, channel, cache)
    reason = halt_reason(progress)
    if not reason or pointer is None:
        return Round(progress, done=_done(progress))
    previous = pointer.get("previous_version")
    if pointer.get("on_failure") == "rollback" and type(previous) is int and previous != pointer.get("version"):
        try:
            doc = roll_back_channel(source, model, channel, previous, sign_key, reason=reason, by=by,
                                    judged=pointer.get("version"))
        except Refused:  # the pointer moved since it was read: the next round judges what it says now
            return Round(progress, done=_done(progress))
        return Round({**progress, "rolled_back": doc["rolled_back"]}, halted_now=True)
    halt_channel(source, model, channel, sign_key, reason=reason, by=by)
    return Round({**progress, "halted": True, "halted_reason": reason}, halted_now=True)


def _done(progress: dict[str, Any]) -> bool:
    """Every device of the channel is on the target."""
    return bool(progress["devices"]) and progress["on_target"] == progress["devices"]
