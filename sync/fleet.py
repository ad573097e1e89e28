"""One look at the fleet: every report listed (sync/listing.py), checked against the key
registry (sync/report.py), turned into rows and rollout progress (sync/fleet_view.py).

``snapshot(source, cache)`` is what ``appliance fleet --json`` prints and what the fleet page
serves: ``{"schema", "generated_at", "bucket", "listing", "counts", "devices", "rollouts"}``
(docs/fleet.md). ``rollouts`` has one entry per (model, channel) that some device reports,
each read against that channel's pointer in the bucket (one GET per pair).
"""

from __future__ import annotations

import json
import time
from typing import Any, Mapping

from .errors import Refused
from .json_types import JSONObject
from .fleet_view import counts, device_rows, rollout_progress
from .listing import ReportCache, list_reports
from .manifest import parse_json
from .report import load_registry
from .source import MISSING, Source

SCHEMA = 1


def snapshot(source: Source, cache: ReportCache | None = None, workers: int = 16, now: float | None = None,
             also: tuple[str, str] | None = None) -> dict[str, Any]:
    """The fleet now; ``also``: a (model, channel) rollout to show even if no device reports it yet."""
    cache = cache or ReportCache()
    listing = list_reports(source, cache, workers)
    registry = _registry(source)
    now = time.time() if now is None else now
    rows, shown = device_rows(listing.entries, registry, cache, now)
    pairs = sorted({(m, r.get("channel") or "") for r in rows for m in r["models"]} | ({also} if also else set()))
    rollouts = [rollout_progress(listing.entries, rows, model, channel, read_pointer(source, model, channel), now, shown)
                for model, channel in pairs if channel]
    return {"schema": SCHEMA, "generated_at": now, "bucket": getattr(source, "url", ""),
            "listing": {"reports": len(listing.entries), "fetched": listing.fetched, "cached": listing.cached,
                        "seconds": round(listing.seconds, 3), "requests": listing.requests},
            "counts": counts(rows), "devices": rows, "rollouts": rollouts,
            "reports": {e.device_id: e.report for e in listing.entries}}


def _registry(source: Source) -> dict[str, str]:
    try:
        return load_registry(source)
    except Refused:  # a damaged registry trusts nobody: every report shows as unregistered
        return {}


def read_pointer(source: Source, model: str, channel: str) -> JSONObject | None:
    """The channel pointer as the bucket holds it (unverified: the view shows what is there),
    None when the channel does not exist or does not parse."""
    fetched = source.read(f"{model}/channels/{channel}.json")
    if fetched.status == MISSING:
        return None
    try:
        return parse_json(fetched.data, f"{model} channel {channel}")
    except Refused:
        return None


def without_reports(view: dict[str, Any]) -> dict[str, Any]:
    """The snapshot without the full reports (what a listing prints)."""
    return {k: v for k, v in view.items() if k != "reports"}


def dumps(view: Mapping[str, object]) -> bytes:  # anything not JSON is written as its text
    return json.dumps(view, separators=(",", ":"), default=str).encode()
