"""The device's report to the fleet, ``<bucket>/_devices/<device-id>.json``: what it serves,
what it refused and why, following the device's state.

``Reporter`` runs one thread. A report is written

* at start, once the first poll is done and no version is still loading (or one poll
  interval after start at the latest);
* after a change an operator acts on: any state event (a version AVAILABLE, failed,
  quarantined, unloaded, a refusal, a pin or rollback, a wave wait, a rollout decision; the
  events in ``QUIET_EVENTS`` announce work in progress and wait for its outcome), a flip of
  the device's health, or a change of its problems;
* coalesced: at most one write per poll interval (jittered like the polls), so a burst of
  changes is one write and a fleet does not write in lockstep; a change is written once no
  poll is running and no version is loading or unloading (a poll's retention, a swap's
  "loaded" and the old version's "unloaded" are one write, not three a window apart), or a
  poll interval after it at the latest;
* and as a heartbeat every ``sync.report_interval_s`` (jittered), so a report older than
  three heartbeats means the device is gone: the fleet view shows it as stale.

The report is signed with the device's key (sync/report.py). A write that fails is retried
at the next window; a report never matters more than serving, so nothing here raises.

Thread-safety: ``notify`` (the state database's listener) may be called from any thread;
``start``/``close`` from the service's.
"""

from __future__ import annotations

import os
import json
import logging
import random
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

from sync.manifest import dumps
from sync.report import SCHEMA, device_key, sign_report
from sync.store import read_json, write_json_atomic

from appliance.core.json_types import JSONObject, JSONValue
from appliance.version import __version__

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from sync.follower import Follower
    from sync.source import Source
    from sync.store import Store

    from appliance.core.appliance import Appliance
    from appliance.core.config import SyncConfig

Health = tuple[bool, tuple[str, ...]]  # (ready, the problems' lines): a change of it is reported

log = logging.getLogger("appliance.report")
# Events that announce work in progress: the report waits for its outcome (a version
# loaded or failed) instead of spending its one write per interval on "LOADING". A parked or
# restored version (a channel move back) ends in "loaded"/"unloaded"; the bucket coming back
# ("sync_recovered") changes nothing on the device by itself. Measured (bench/RESULTS.md): a
# write spent on such a step delayed the one that mattered by a whole window.
QUIET_EVENTS = frozenset({"load_start", "unload_start", "sync_fetch", "sync_committed", "sync_config", "sync_error",
                          "sync_parked", "sync_restored", "sync_recovered", "report_failed", "service_start",
                          "service_stop", "warmup_warning"})
MAX_PROBLEMS = 50
SETTLE_S = 2.0  # a change waits for the versions in motion to settle: this long, or a poll interval if longer
SEQUENCE_BLOCK = 1000  # report sequence numbers reserved per write of sync/report-sequence.json
TRANSIENT_STATES = ("NEW", "LOADING", "UNLOADING")


class ReportedLoop(Protocol):
    """What the report reads of the sync loop (``parts.sync_loop.SyncLoop``, which starts the
    reporter): named here, not imported, so the two modules do not import each other."""

    core: Appliance
    cfg: SyncConfig
    source: Source
    store: Store
    follower: Follower
    polls_done: int
    polling: bool
    status: dict[str, Any]

    def event(self, kind: str, message: str, model: str = "", version: int | None = None, **detail: object) -> None: ...


class Reporter:
    """Writes this device's report; ``build`` is what it writes (also served for tests)."""

    def __init__(self, loop: ReportedLoop, clock: Callable[[], float] = time.monotonic):
        self.loop, self.core, self.cfg = loop, loop.core, loop.cfg
        self.source = loop.source.sibling()  # its own request count: idle polls stay countable
        self.clock = clock
        self._cond = threading.Condition()
        self._stop = False
        self._dirty: set[str] = {"start"}
        self._dirty_since: float | None = None  # when the first change not yet written came
        self._tried_at: float | None = None  # monotonic time of the last attempt: the coalescing window
        self._written_at: float | None = None  # ... of the last write that reached the bucket: the heartbeat
        self._gap = self._jittered(self.cfg.poll_interval_s)
        self._heartbeat = self._jittered(self.cfg.report_interval_s)
        self._started = clock()
        self._health: Health | None = None
        self._sequence = self._reserved = 0  # the sequence, and how far sync/report-sequence.json reserved it
        self._key: Ed25519PrivateKey | None = None
        self._thread: threading.Thread | None = None
        self.last_error = ""
        self.writes = 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        try:
            self._key = device_key(self.core.config.state_dir)
        except (OSError, ValueError) as exc:  # a read-only state folder: reports go unsigned, and say so
            log.warning("no device key, reports are unsigned: %s", exc)
        self.core.db.subscribe(self.notify)
        self._thread = threading.Thread(target=self._run, name="device-report", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.source.close()

    def notify(self, event: Mapping[str, object]) -> None:
        """A state event (the state database's listener): a change to report."""
        kind = str(event.get("kind", ""))
        if kind in QUIET_EVENTS:
            return
        with self._cond:
            self._dirty.add(kind)
            if self._dirty_since is None:
                self._dirty_since = self.clock()
            self._cond.notify_all()

    def poll_done(self) -> None:
        """The sync loop finished a poll: the start report may go, and health is looked at."""
        with self._cond:
            self._cond.notify_all()

    # -- when to write ---------------------------------------------------------------------
    def _jittered(self, seconds: float) -> float:
        jitter = max(0.0, min(self.cfg.jitter, 0.9))
        return max(0.05, seconds) * random.uniform(1 - jitter, 1 + jitter)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
                self._cond.wait(self._wait_s())
                if self._stop:
                    return
            self._note_health()
            trigger = self._due()
            if trigger:
                self._write(trigger)

    def _wait_s(self) -> float:
        """Until the next thing to look at: health (every poll interval), the heartbeat, or
        the end of the coalescing window while a change waits."""
        now = self.clock()
        wait = max(0.2, min(self.cfg.poll_interval_s, 5.0))
        if self._tried_at is not None:
            window = self._tried_at + self._gap - now
            beat = (self._written_at if self._written_at is not None else self._tried_at) + self._heartbeat - now
            wait = min(wait, max(window, 0.1) if self._dirty else max(window, beat))  # 0.1: settling
        return max(0.01, wait)

    def _due(self) -> str:
        """Why a report is due now ("" when none is): never twice within one window."""
        now = self.clock()
        with self._cond:
            dirty = sorted(self._dirty)
        if self._tried_at is None:
            settled = self.loop.polls_done > 0 and not self._in_motion(("NEW", "LOADING"))
            return "start" if settled or now - self._started >= self.cfg.poll_interval_s else ""
        if now - self._tried_at < self._gap:
            return ""
        if dirty:
            since = self._dirty_since if self._dirty_since is not None else now
            settle = max(SETTLE_S, self.cfg.poll_interval_s)
            return "change: " + ", ".join(dirty) if now - since >= settle or not self._in_motion() else ""
        last = self._written_at if self._written_at is not None else self._tried_at
        return "heartbeat" if now - last >= self._heartbeat else ""

    def _in_motion(self, states: tuple[str, ...] = TRANSIENT_STATES) -> bool:
        """A poll is running (what it commits is loaded right after it), or some version is
        in one of ``states`` (being loaded or unloaded)."""
        if self.loop.polling:
            return True
        manager = self.core.manager
        snapshot = manager.snapshot() if manager is not None else {}
        return any(v.get("state") in states for m in snapshot.values() for v in m.get("versions", []))

    def _health_now(self) -> Health | None:
        try:
            return bool(self.core.ready()), tuple(map(str, self.core.problems()))
        except Exception:  # the core closing under us
            return None

    def _note_health(self) -> None:
        """Health or problems other than the last report said: a change to report."""
        health = self._health_now()
        if health is not None and self._health is not None and health != self._health:
            with self._cond:
                self._dirty.add("health")

    # -- writing ---------------------------------------------------------------------------
    def _write(self, trigger: str) -> None:
        with self._cond:
            taken, self._dirty, self._dirty_since = self._dirty, set(), None
        health = self._health_now()
        try:
            doc = self.build(trigger)
            if self._key is not None:
                doc = sign_report(doc, self._key)
            self.source.put(f"_devices/{self.core.device_id}.json", dumps(doc))
        except Exception as exc:  # the bucket down, the core closing: retried at the next window
            with self._cond:
                self._dirty |= taken or {"retry"}
                self._dirty_since = self._dirty_since or self.clock()
            if str(exc) != self.last_error:
                self.loop.event("report_failed", f"could not write the device report: {exc}")
            self.last_error = str(exc)
        else:
            self.last_error = ""
            self.writes += 1
            self._health = health
            self._written_at = self.clock()
            self._heartbeat = self._jittered(self.cfg.report_interval_s)
        self._tried_at = self.clock()
        self._gap = self._jittered(self.cfg.poll_interval_s)

    def build(self, trigger: str = "requested") -> JSONObject:
        """The report (unsigned): see docs/fleet.md for every field. One snapshot of the
        manager makes the models and ``healthy`` alike (a load finishing while the report is
        built cannot give "healthy" beside "serving nothing")."""
        self._sequence = self._next_sequence()
        manager = self.core.manager
        snapshot = manager.snapshot() if manager is not None else {}
        served = bool(snapshot) and all(m.get("serving_version") is not None for m in snapshot.values())
        status = self.loop.status
        now = time.time()
        return {
            "schema": SCHEMA, "device_id": self.core.device_id, "hostname": self.core.device.get("hostname"),
            "software_version": __version__, "written_at": now, "updated": now, "sequence": self._sequence,
            "started_at": self.core.started_at, "trigger": trigger,
            "report_interval_s": self.cfg.report_interval_s, "poll_interval_s": self.cfg.poll_interval_s,
            "healthy": served and bool(self.core.ready()), "channel": self.cfg.channel, "bucket": status.get("bucket"),
            "sync": {k: status.get(k) for k in ("last_poll", "last_success", "last_change", "failures", "last_error")},
            "last_sync": status.get("last_poll"), "last_change": status.get("last_change"),
            "last_error": status.get("last_error"),
            "models": self._models(snapshot), "problems": self._problems(snapshot),
            "rollouts": _jsonable(self.core.status_of("rollouts") or {}),
            "backend_decisions": {name: next((v.get("decision") for v in m["versions"] if v.get("decision")), None)
                                  for name, m in snapshot.items()},
        }

    def _next_sequence(self) -> int:
        """The report's ``sequence``: increasing across restarts too, so the view can tell a
        replayed report (sync/report_trust.py). Reserved a block at a time on disk (one write
        per 1000 reports; numbers lost to a restart are skipped, never reused)."""
        path = os.path.join(self.loop.store.sync_dir, "report-sequence.json")
        if self._reserved == 0:
            stored = read_json(path).get("reserved")
            self._sequence = self._reserved = stored if isinstance(stored, int) and stored > 0 else 0
        if self._sequence + 1 > self._reserved:
            self._reserved = self._sequence + SEQUENCE_BLOCK
            write_json_atomic(path, {"reserved": self._reserved})
        return self._sequence + 1

    def _models(self, snapshot: dict[str, Any]) -> dict[str, Any]:
        follower = self.loop.follower
        targets, refused, waves = follower.targets, follower.refused, follower.waves
        pins = self.loop.store.pins()
        names = sorted(set(snapshot) | set(targets) | {name for name in refused if name})
        return {name: model_view(snapshot.get(name, {}), targets.get(name), refused.get(name), waves.get(name),
                                 pins.get(name)) for name in names}

    def _problems(self, snapshot: dict[str, Any]) -> list[JSONValue]:
        """The problems ``/api/status`` lists (appliance/core/problems.py), from the report's
        own snapshot; a status provider failing must not cost the report."""
        try:
            problems: Sequence[object] = self.core.problem_list(snapshot)
        except Exception:
            problems = list(self.core.problems())
        return [_jsonable(p) for p in problems[:MAX_PROBLEMS]]


def model_view(model: dict[str, Any], target: int | None, refused: dict[str, Any] | None,
               wave: dict[str, Any] | None, pinned: int | None) -> dict[str, Any]:
    """One model as the device sees it: what serves, what it aims at, and every version it
    knows with its state and the reason (a failed load, a quarantine, a refusal)."""
    quarantined = {str(k): v for k, v in (model.get("quarantined") or {}).items()}
    versions = [{"version": v.get("version"), "state": v.get("state"),
                 "reason": v.get("error") or quarantined.get(str(v.get("version"))) or "",
                 "backend": v.get("backend"), **({"error_code": v["error_code"]} if v.get("error_code") else {}),
                 **({"degraded": v["degraded"]} if v.get("degraded") else {})}  # what it lacks here
                for v in model.get("versions", [])]
    known = {v["version"] for v in versions}
    versions += [{"version": int(v), "state": "QUARANTINED", "reason": why, "backend": None}
                 for v, why in quarantined.items() if v.isdigit() and int(v) not in known]
    if refused is not None and refused.get("version") is not None and refused["version"] not in known:
        versions.append({"version": refused["version"], "state": "REFUSED", "reason": refused["reason"], "backend": None})
    return {"serving_version": model.get("serving_version"), "target_version": target,
            "candidate_version": model.get("candidate_version"), "pinned": pinned,
            "versions": sorted(versions, key=lambda v: -(v["version"] or 0)), "quarantined": quarantined,
            "refused": refused, "wave": wave}


def _jsonable(value: object) -> JSONValue:
    """``value`` as JSON would carry it (anything else as its text)."""
    carried: JSONValue = json.loads(json.dumps(value, default=str))
    return carried
