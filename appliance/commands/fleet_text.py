"""The text face of ``appliance fleet``: one line per device, a rollout's progress block,
and the counts. Plain functions over the snapshot of sync/fleet.py (what ``--json`` prints)."""

from __future__ import annotations

import time
from typing import Any, Callable

Print = Callable[[str], None]


def ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 172800 else f"{seconds / 86400:.0f} d"


COLUMNS = f"{'DEVICE':24} {'STATUS':10} {'CHANNEL':10} {'REPORTED':>12}  MODELS (what serves, what it aims at)  PROBLEM"


def header_line() -> str:
    """The table's header: what each column of ``device_line`` is."""
    return COLUMNS


def version(v: Any) -> str:
    return "nothing" if v is None else f"v{v}"


def model_words(name: str, m: dict[str, Any]) -> str:
    """One model on one device in words: "hpt: target v2 failed; serving v1", never a code."""
    serving, target, state = version(m["serving"]), version(m.get("target")), m["state"]
    if state == "on-target":
        return f"{name}: serving {serving}"
    if state == "moving":
        return f"{name}: serving {serving}, moving to {target}"
    if state == "waiting":
        return f"{name}: serving {serving}; target {target} waits for its wave"
    return f"{name}: target {target} {state}; serving {serving}"  # failed, refused


def device_line(row: dict[str, Any]) -> str:
    models = "; ".join(model_words(name, m) for name, m in row["models"].items()) or "no models"
    trouble = row["error"] or next((m["reason"] for m in row["models"].values() if m["reason"]
                                    and m["state"] in ("refused", "failed")), "") or "; ".join(row["problems"][:2])
    trust = "" if row["trust"] == "signed" else f" [report {row['trust']}]"
    return (f"{row['device_id']:24} {row['status'].upper():10} {str(row.get('channel') or '-'):10} "
            f"{ago(row['age_s']) + ' ago':>12}  {models}{trust}{'  ' + trouble if trouble else ''}")


def progress_lines(p: dict[str, Any], now: float | None = None) -> list[str]:
    """A rollout as an operator reads it before opening the next wave or aborting."""
    now = time.time() if now is None else now
    lines = [f"{p['model']}: channel {p['channel']} -> version {p['target_version']}"
             f"{'  HALTED: ' + str(p['halted_reason'] or '') if p['halted'] else ''}",
             f"  on version {p['target_version']}: {p['on_target']} of {p['devices']} devices ({p['on_target_percent']:g}%)"
             f"; moving {p['moving']}, waiting for their wave {p['waiting']}, stale {p['stale']}"]
    back = p.get("rolled_back")
    if isinstance(back, dict):
        lines.insert(1, f"  ROLLED BACK from version {back.get('from')} to {back.get('to')} by {back.get('by')}: "
                        f"{back.get('reason')}")
    others = {v: n for v, n in p["on_other_versions"].items()}
    if others:
        lines.append("  still serving: " + ", ".join(f"version {v}: {n}" for v, n in sorted(others.items())))
    waves = p["waves"]
    if waves["declared"]:
        nxt = f", next opens in {ago(max(0.0, waves['next_opens_at'] - now))}" if waves["next_opens_at"] else ""
        lines.append(f"  waves: {waves['open']} of {waves['total']} open ({waves['open_percent']:g}% of the fleet){nxt}")
        for wave, w in waves["per_wave"].items():
            lines.append(f"    wave {wave}: {w['devices']} devices, {w['on_target']} on target, {w['failing']} failing")
    threshold = p.get("threshold")
    if threshold:
        lines.append(f"  failure threshold {threshold['percent']:g}% (after {threshold['min_devices']} devices): "
                     f"{threshold['failing_in_open_waves']} of {threshold['devices_in_open_waves']} in the open waves "
                     f"failing ({threshold['failing_percent']:g}%){'  BREACHED' if threshold['breached'] else ''}")
    for f in p["failing"]:
        lines.append(f"  FAILING {f['device_id']}: {f['state']} version {f['version']}: {f['reason']}")
    lines.append(f"  promotions: {len(p['promotions'])}")
    for row in p["aborts"]:
        lines.append(f"  ABORTED on {row['device_id']}: version {row.get('candidate_version')}: {row.get('reason')}")
    return lines


def counts_line(counts: dict[str, int]) -> str:
    trust = ", ".join(f"{n} {k[6:]}" for k, n in counts.items() if k.startswith("trust_"))
    return (f"{counts['devices']} devices: {counts['ok']} ok, {counts['degraded']} degraded, "
            f"{counts['unhealthy']} unhealthy, {counts['stale']} stale, {counts['unreadable']} unreadable, "
            f"{counts['untrusted']} untrusted"
            f"{'; reports ' + trust if trust else ''}")
