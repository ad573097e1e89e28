"""The operator's view of the fleet, from the device reports: one row per device, filters,
and the progress of a model's rollout on a channel. Pure functions (no I/O): the CLI
(``appliance fleet``), the fleet page and ``appliance rollout watch`` share them, and the
JSON they print is this module's output (docs/fleet.md documents every field).

A device's **status**, first match wins:

    untrusted   no report of it signed by its registered key was ever seen (what its report
                claims is shown, never counted: sync/report_trust.py)
    unreadable  its report could not be read or parsed (the error says why)
    stale       its last report is older than three of its heartbeats (``report_interval_s``,
                as the report states it; age by the bucket's clock): the device is gone or
                cannot reach the bucket, and what it said last is not shown as its health
    unhealthy   it reports itself not healthy (a model without a serving version)
    degraded    healthy, but it reports a problem, a refused or failed version, a version it serves
                only in part (``degraded``: what it lacks there, e.g. the signatures only
                TensorFlow serves on a LiteRT-only device), or failing polls
    ok

A device whose current report is not trusted (``trust`` other than ``signed``: unregistered,
key-changed, mis-signed, unsigned, replayed) is shown as its last trusted report has it, with
the untrusted one described in ``untrusted_report``; only trusted reports count in a rollout.

A model on a device is, against the version it aims at (the channel's, in a rollout):
``on-target``, ``stale`` (on it, by a report too old to count), ``moving`` (fetching or loading), ``waiting`` (its wave has not opened),
``refused`` (the version failed verification: the device's original reason) or ``failed``
(it failed to load or was quarantined: the reason). ``degraded`` says what the version it
serves lacks on that device ('' when nothing).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Iterable

from .errors import Refused
from .listing import Entry, ReportCache
from .report import SIGNED, UNSIGNED, trust_mark
from .report_trust import UNTRUSTED, forget_gone, judge
from .waves import admission, parse_waves, wave_state

STALE_HEARTBEATS = 3
DEFAULT_REPORT_INTERVAL_S = 300.0
STATUSES = ("untrusted", "unreadable", "stale", "unhealthy", "degraded", "ok")
FAILED_STATES = ("END", "QUARANTINED", "REFUSED", "FAILED")


def device_rows(entries: list[Entry], registry: dict[str, str], cache: ReportCache,
                now: float | None = None) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """(one row per device, the report each row shows: the device's last trusted one)."""
    rows, shown = [], {}
    forget_gone(cache, {e.device_id for e in entries})
    for entry in entries:
        mark, trusted = judge(entry, registry, cache)
        # An unreadable report is shown as such (its error, status "unreadable"), not hidden
        # behind the last trusted one: the device's own file is broken, and that is news.
        row = device_row(entry if entry.report is None else trusted or entry, registry, now)
        row.update(trust=mark, counted=trusted is not None)  # counted as its last trusted report has it
        if mark != SIGNED:
            report = entry.report or {}
            row["untrusted_report"] = {"trust": mark, "written_at": report.get("written_at"),
                                       "sequence": report.get("sequence"), "stored_at": entry.modified or None}
            if trusted is None and entry.report is not None:
                row["status"] = UNTRUSTED
        rows.append(row)
        shown[entry.device_id] = (trusted or entry).report or {}
    return rows, shown


def device_row(entry: Entry, registry: dict[str, str], now: float | None = None) -> dict[str, Any]:
    """One device as the view shows it (the report's own fields stay in the report)."""
    now = time.time() if now is None else now
    report = entry.report or {}
    written = entry.modified or float(report.get("written_at") or report.get("updated") or 0)
    interval = _positive(report.get("report_interval_s"), DEFAULT_REPORT_INTERVAL_S)
    models = {name: model_state(m) for name, m in (report.get("models") or {}).items() if isinstance(m, dict)}
    row = {"device_id": entry.device_id, "hostname": report.get("hostname"), "channel": report.get("channel"),
           "software_version": report.get("software_version"), "written_at": report.get("written_at") or
           report.get("updated"), "stored_at": entry.modified or None, "age_s": round(max(0.0, now - written), 1),
           "report_interval_s": interval, "healthy": report.get("healthy"), "models": models,
           "problems": [p if isinstance(p, str) else p.get("message", str(p)) if isinstance(p, dict) else str(p)
                        for p in (report.get("problems") or [])],
           "last_error": report.get("last_error") or "", "error": entry.error,
           "trust": trust_mark(report, registry.get(entry.device_id), entry.signature_holds)
           if entry.report is not None else UNSIGNED,
           "anomalies": _anomalies(entry, report)}
    row["status"] = _status(row, entry, now - written > STALE_HEARTBEATS * interval)
    return row


def _positive(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else default


def _anomalies(entry: Entry, report: dict[str, Any]) -> list[str]:
    named = report.get("device_id")
    return [f"the report names device {named!r}"] if entry.report is not None and named != entry.device_id else []


def _status(row: dict[str, Any], entry: Entry, stale: bool) -> str:
    if entry.report is None:
        return "unreadable"
    if stale:
        return "stale"
    if not row["healthy"]:
        return "unhealthy"
    troubled = any(m["state"] in ("refused", "failed") or m["degraded"] for m in row["models"].values())
    return "degraded" if troubled or row["problems"] or row["last_error"] or row["anomalies"] else "ok"


def model_state(model: dict[str, Any], target: int | None = None) -> dict[str, Any]:
    """One model on one device against ``target`` (default: the version the device aims at)."""
    target = model.get("target_version") if target is None else target
    serving = model.get("serving_version")
    out = {"serving": serving, "target": target, "state": "on-target", "reason": "",
           "degraded": next((str(v["degraded"]) for v in model.get("versions") or [] if isinstance(v, dict)
                             and v.get("version") == serving and v.get("degraded")), "")}
    refused = model.get("refused") or {}
    failed = next((v for v in model.get("versions") or [] if isinstance(v, dict) and v.get("version") == target
                   and v.get("state") in FAILED_STATES and v.get("reason")), None)
    wave = model.get("wave") or {}
    if target is None or serving == target:
        return out
    if refused and refused.get("version") in (None, target):
        out.update(state="refused", reason=str(refused.get("reason", "")))
    elif failed is not None:
        out.update(state="refused" if failed.get("state") == "REFUSED" else "failed", reason=str(failed["reason"]))
    elif wave.get("version") == target and wave.get("admitted") is False:
        out.update(state="waiting", reason=str(wave.get("reason", "")))
    else:
        out["state"] = "moving"
    return out


def matches(row: dict[str, Any], model: str = "", channel: str = "", version: int | None = None,
            stale: bool = False, unhealthy: bool = False) -> bool:
    """The CLI's and the page's filters: all given ones must hold. ``version``: the device
    serves it (for ``model`` when given, else for any model). ``unhealthy``: not ``ok`` and
    not ``stale`` (unhealthy, degraded, unreadable or untrusted)."""
    if model and model not in row["models"]:
        return False
    if channel and row.get("channel") != channel:
        return False
    if stale and row["status"] != "stale":
        return False
    if unhealthy and row["status"] not in ("unhealthy", "degraded", "unreadable", "untrusted"):
        return False
    if version is not None:
        served = [row["models"][model]["serving"]] if model else [m["serving"] for m in row["models"].values()]
        return version in served
    return True


def counts(rows: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Devices per status and per trust mark, and the total."""
    rows = list(rows)
    by_status, by_trust = Counter(r["status"] for r in rows), Counter(r["trust"] for r in rows)
    return {"devices": len(rows), **{s: by_status.get(s, 0) for s in STATUSES},
            **{f"trust_{t}": n for t, n in sorted(by_trust.items())}}


def rollout_progress(entries: list[Entry], rows: list[dict[str, Any]], model: str, channel: str,
                     pointer: dict[str, Any] | None, now: float | None = None,
                     shown: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Where ``model``'s rollout on ``channel`` stands: the target, devices on it (count, %),
    on other versions, failing (with each device's original reason), waiting for their wave,
    the wave plan and the failure threshold as measured now, halts, promotions and aborts.
    Only rows ``counted`` count (as their last trusted report has them); every device whose
    current report is not trusted is listed in ``untrusted``.
    ``shown``: the report to judge each device by (``device_rows``'s second value)."""
    now = time.time() if now is None else now
    target = (pointer or {}).get("version")
    reports = shown if shown is not None else {e.device_id: e.report or {} for e in entries}
    claim = [r for r in rows if model in r["models"] and r.get("channel") in (channel, None, "")]
    members = [r for r in claim if r.get("counted", True)]
    states = {r["device_id"]: _judged_state(r, (reports[r["device_id"]].get("models") or {}).get(model) or {}, target)
              for r in members}
    on_target = sorted(d for d, s in states.items() if s["state"] == "on-target")
    failing = [{"device_id": d, "state": s["state"], "version": target, "reason": s["reason"]}
               for d, s in sorted(states.items()) if s["state"] in ("refused", "failed")]
    others = Counter(_version_key(s["serving"]) for s in states.values() if s["state"] != "on-target")
    serving = Counter(_version_key(s["serving"]) for s in states.values())
    waves = _waves(members, states, pointer, target, now)
    return {"model": model, "channel": channel, "target_version": target,
            "candidate_version": (pointer or {}).get("candidate"), "pointer_created": (pointer or {}).get("created"),
            "halted": bool((pointer or {}).get("halt")), "halted_reason": ((pointer or {}).get("halted") or {}).get("reason"),
            "on_failure": (pointer or {}).get("on_failure") or "halt", "previous_version": (pointer or {}).get("previous_version"),
            "rolled_back": (pointer or {}).get("rolled_back"),
            "devices": len(members), "on_target": len(on_target),
            "on_target_percent": round(100.0 * len(on_target) / len(members), 1) if members else 0.0,
            "on_other_versions": dict(sorted(others.items())),
            "moving": sum(s["state"] == "moving" for s in states.values()),
            "waiting": sum(s["state"] == "waiting" for s in states.values()),
            "stale": sum(r["status"] == "stale" for r in members),
            "devices_per_version": dict(sorted(serving.items())),
            "failing": failing, "waves": waves, "threshold": _threshold(pointer, waves),
            "unreadable_reports": sorted(e.device_id for e in entries if e.report is None),
            "untrusted": [{"device_id": r["device_id"], "trust": r["trust"], "counted_as_last_trusted": r.get("counted")}
                          for r in claim if r.get("trust", SIGNED) != SIGNED],
            **_decisions(reports, members, model)}


def _judged_state(row: dict[str, Any], model: dict[str, Any], target: Any) -> dict[str, Any]:
    """``model_state``, but a device on the target by a stale report is ``stale``, not on target."""
    state = model_state(model, target)
    if row["status"] == "stale" and state["state"] == "on-target":
        state = {**state, "state": "stale", "reason": f"last report {row['age_s']:g} s old"}
    return state


def _version_key(version: Any) -> str:
    return "none" if version is None else str(version)


def _waves(members: list[dict[str, Any]], states: dict[str, dict[str, Any]], pointer: dict[str, Any] | None,
           target: Any, now: float) -> dict[str, Any]:
    """The wave plan at ``now`` and, per wave, its devices: on target, failing, in all."""
    if pointer is None or not isinstance(target, int):
        return {"declared": [], "open": 0, "total": 0, "open_percent": 0.0, "next_opens_at": None, "per_wave": {}}
    try:
        declared, state = parse_waves(pointer, "channel"), wave_state(pointer, now)
    except Refused:  # a malformed plan (devices refuse it too): shown as none
        declared, state = [], None
    per_wave: dict[str, dict[str, int]] = {}
    for row in members:
        wave = admission(row["device_id"], {**pointer, "halt": False}, now=now).wave + 1 if declared else 1
        bucket = per_wave.setdefault(str(wave), {"devices": 0, "on_target": 0, "failing": 0})
        s = states[row["device_id"]]["state"]
        bucket["devices"] += 1
        bucket["on_target"] += s == "on-target"
        bucket["failing"] += s in ("refused", "failed")
    return {"declared": pointer.get("waves") or [], "open": state.open_waves if state else 1,
            "total": state.total_waves if state else 1, "open_percent": state.open_percent if state else 100.0,
            "next_opens_at": state.next_opens_at if state else None, "per_wave": dict(sorted(per_wave.items()))}


def _threshold(pointer: dict[str, Any] | None, waves: dict[str, Any]) -> dict[str, Any] | None:
    """The failure threshold against the devices of the open waves now."""
    declared = (pointer or {}).get("failure_threshold")
    if not isinstance(declared, dict):
        return None
    open_waves = [w for k, w in waves["per_wave"].items() if int(k) <= waves["open"]]
    devices = sum(w["devices"] for w in open_waves)
    failing = sum(w["failing"] for w in open_waves)
    reported = sum(w["failing"] + w["on_target"] for w in open_waves)
    share = 100.0 * failing / devices if devices else 0.0
    percent, minimum = float(declared.get("percent", 100)), int(declared.get("min_devices", 1))
    return {"percent": percent, "min_devices": minimum, "devices_in_open_waves": devices,
            "reported_in_open_waves": reported, "failing_in_open_waves": failing, "failing_percent": round(share, 1),
            "breached": failing > 0 and reported >= minimum and share >= percent}


def _decisions(reports: dict[str, dict[str, Any]], members: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """The devices' own rollout decisions (candidate promoted or aborted, with figures)."""
    promotions: list[dict[str, Any]] = []
    aborts: list[dict[str, Any]] = []
    for row in members:
        rollouts = reports[row["device_id"]].get("rollouts") or {}
        for decision in (rollouts.get(model) or {}).get("decisions", []) if isinstance(rollouts, dict) else []:
            entry = {"device_id": row["device_id"], **decision}
            (promotions if decision.get("action") == "promote" else aborts).append(entry)
    return {"promotions": promotions, "aborts": aborts}
