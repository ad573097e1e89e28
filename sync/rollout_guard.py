"""Halting a rollout at its failure threshold: what ``appliance rollout watch`` does each round.

Devices cannot read each other's reports (each writes only its own), so the judge of a
fleet-wide threshold is whoever can read them all: the operator's machine, a CI job or a
timer running ``appliance rollout watch``. Each round lists the reports (only those written
since the last round are read: sync/listing.py), measures the rollout against the channel's
``failure_threshold`` (sync/fleet_view.py), and when the share of failing devices in the open
waves reaches it, writes ``halt`` into the channel pointer with the reason (signed with the
publisher's key when devices require signatures): no further device moves, the ones that
failed keep serving their last good version, and the page and ``appliance fleet`` show why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fleet_view import device_rows, rollout_progress
from .fleet import read_pointer
from .listing import ReportCache, list_reports
from .publisher import halt_channel
from .report import load_registry


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


def watch_round(source: Any, model: str, channel: str, cache: ReportCache, sign_key: Any = None,
                by: str = "appliance rollout watch") -> Round:
    """One look at the rollout; halts the channel when its threshold is reached."""
    listing = list_reports(source, cache)
    registry = load_registry(source)
    rows, shown = device_rows(listing.entries, registry, cache)
    pointer = read_pointer(source, model, channel)
    progress = rollout_progress(listing.entries, rows, model, channel, pointer, shown=shown)
    reason = halt_reason(progress)
    if reason:
        halt_channel(source, model, channel, sign_key, reason=reason, by=by)
        progress = {**progress, "halted": True, "halted_reason": reason}
    done = bool(progress["devices"]) and progress["on_target"] == progress["devices"]
    return Round(progress, halted_now=bool(reason), done=done)
