"""Which device reports count: only one signed by the device's registered key, and newer
than the last such report seen from that device.

A report's ``sequence`` (monotonic on the device, across restarts: appliance/parts/
device_report.py) and ``written_at`` are inside its signature. The view keeps, per device,
the last report that was signed by the registered key (``ReportCache.trusted``, saved with
the operator's cache) and marks as ``replayed`` a correctly signed report that is older than
it on both counts: a device's own earlier report copied over its current one.

Every other mark (``unregistered``, ``key-changed``, ``mis-signed``, ``unsigned``,
``replayed``) is shown apart: such a report is never counted in a rollout, and the view shows
the device as its last trusted report has it (status ``untrusted`` when there is none), so a
forged, re-keyed, replayed or phantom report changes no count, no decision and no status.
Pure functions over a ``ReportCache``; call them from one thread at a time.
"""

from __future__ import annotations

from .json_types import ReadJSONObject
from .listing import Entry, ReportCache
from .report import SIGNED, trust_mark

REPLAYED = "replayed"
UNTRUSTED = "untrusted"  # the device status when no report of it was ever trusted


def judge(entry: Entry, registry: dict[str, str], cache: ReportCache) -> tuple[str, Entry | None]:
    """(the report's mark, the entry to show the device by: its own when trusted, else its
    last trusted report's, else None)."""
    report = entry.report
    mark = trust_mark(report, registry.get(entry.device_id), entry.signature_holds) if report is not None else "unsigned"
    last = cache.trusted.get(entry.device_id)
    if mark == SIGNED and report is not None:
        if last is not None and older(report, last[1]):
            mark = REPLAYED
        else:
            cache.trusted[entry.device_id] = [entry.modified, report, entry.etag]
            return mark, entry
    if last is None:
        return mark, None
    return mark, Entry(entry.device_id, "", float(last[0]), 0, last[1], "", True)


def older(report: ReadJSONObject, last: ReadJSONObject) -> bool:
    """``report`` was written before ``last``: both its ``written_at`` and its ``sequence`` are
    lower (either alone may go back legitimately: a device's clock reset, or an older device
    whose sequence restarts with the service)."""
    return _number(report.get("written_at")) < _number(last.get("written_at")) and \
        _number(report.get("sequence")) <= _number(last.get("sequence"))


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def forget_gone(cache: ReportCache, device_ids: set[str]) -> None:
    """Drop the trusted reports of devices whose report left the bucket (a retired device)."""
    cache.trusted = {d: v for d, v in cache.trusted.items() if d in device_ids}
