"""Convergence of real devices: N LiteRT-only services (one process each, ``--workers 1``)
following one SeaweedFS bucket through a TCP proxy (so the bucket can go away), a short poll
interval. Run by bench/fleet_bench.py --mode devices.

Phases, each timed from the operator's action, in poll intervals, by the devices (their
``:predict`` answers: each version answers y = version + 2 for x = 2) and by the fleet view
(sync/listing.py over the reports, read every second as ``appliance fleet`` would):

1. idle: bucket requests per device per idle poll, per-service memory (RSS, PSS);
2. a new version on the channel; 3. the channel moved back (rollback);
4. kill -9 mid-download: a few devices stop dead inside the download (EDGE_SYNC_FAULT), are
   killed and restarted; the rest converge meanwhile;
5. the bucket unreachable for 30 s, a version published as it comes back;
6. a corrupted object: the refusal in the view, then the object fixed in place
   (``publish --repair``) and the fleet taking it;
7. a wave rollout of a version that fails to load, halted at its failure threshold by the
   watcher (sync/rollout_guard.py), the devices outside the open wave never touching it.

Every answer is checked against the versions published: "failed" counts answers that were
an error or a value no version gives (a partial version served would be one).
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before the heavy imports
    print(__doc__)
    raise SystemExit(0)


import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil
import requests

from sync.fleet_view import device_row
from sync.listing import ReportCache, list_reports
from sync.publisher import publish, repair, set_channel
from sync.rollout_guard import watch_round
from sync.open_source import open_source
from tests.support.servers import free_port
from tests.support.fleet_support import write_half_plus
from tests.support.sync_support import TCPProxy

ROOT = Path(__file__).resolve().parent.parent


def answer_of(version: int) -> float:
    return 0.5 * 2.0 + version + 1.0  # b = version + 1


def build_version(root: Path, version: int, padding_bytes: int = 0) -> Path:
    d = root / "versions" / str(version)
    if not (d / "model.tflite").exists():
        write_half_plus(d / "model.tflite", version + 1.0, padding_bytes)
    return d


@dataclass
class Device:
    index: int
    port: int
    state: Path
    config: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    seen: dict[int, float] = field(default_factory=dict)  # version -> when it last began answering with it
    answering: int | None = None
    down: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, python: str, env: dict[str, str]) -> None:
        cmd = [python, "-m", "appliance.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--state", str(self.state), "--config", str(self.config), "--backend", "tflite", "--workers", "1",
               "--no-discovery", "--grpc-port", "0"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def status(self) -> dict[str, Any]:
        return requests.get(self.url + "/api/status", timeout=10).json()

    def device_id(self) -> str:
        return (self.state / "device-id").read_text().strip()


class Fleet:
    def __init__(self, tmp: Path, python: str, weed: Any, count: int, interval: float, report_interval: float):
        self.tmp, self.python, self.weed, self.interval = tmp, python, weed, interval
        self.proxy = TCPProxy(int(weed.endpoint.rsplit(":", 1)[1])).up()
        self.url = "s3://fleet/bench"
        self.admin = open_source(self.url)  # the operator, straight to the bucket
        self.env = {**os.environ, **weed.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.proxy.port}",
                    "PYTHONUNBUFFERED": "1"}
        self.env.pop("EDGE_SYNC_FAULT", None)
        self.devices = [self._device(i, report_interval) for i in range(count)]
        self.failures: list[str] = []
        self.answers = 0
        self.shed = 0
        self.view_seen: dict[str, dict[int, float]] = {}  # device id -> version -> when its report began saying so
        self.view_serving: dict[str, int] = {}
        self.view_refused: dict[str, dict[int, float]] = {}
        self.published: set[int] = set()
        self.phase = "start"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _device(self, i: int, report_interval: float) -> Device:
        port = free_port()
        state = self.tmp / f"dev-{i}"
        config = self.tmp / f"dev-{i}.toml"
        config.write_text("\n".join([f'models_dir = "{state}/models"', "[sync]", f'bucket = "{self.url}"',
                                     'channel = "stable"', f"poll_interval_s = {self.interval}", "jitter = 0.2",
                                     f"report_interval_s = {report_interval}", "max_backoff_s = 600"]) + "\n")
        return Device(i, port, state, config, self.tmp / f"dev-{i}.log")

    # -- lifecycle -------------------------------------------------------------------------
    def start_all(self, batch: int = 5) -> float:
        started = time.monotonic()
        for i in range(0, len(self.devices), batch):
            for d in self.devices[i:i + batch]:
                d.start(self.python, self.env)
            self.wait(lambda: all(self._ready(d) for d in self.devices[i:i + batch]), 300, "a batch ready")
        return time.monotonic() - started

    @staticmethod
    def _ready(d: Device) -> bool:
        try:
            return requests.get(d.url + "/readyz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda d: d.stop(), self.devices))
        self.proxy.down()

    @staticmethod
    def wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")

    # -- observers -------------------------------------------------------------------------
    def observe(self) -> None:
        for target in (self._probe_loop, self._view_loop):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)

    def _probe_loop(self) -> None:
        session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=len(self.devices), pool_maxsize=4)
        session.mount("http://", adapter)
        with ThreadPoolExecutor(8) as pool:
            while not self._stop.is_set():
                list(pool.map(lambda d: self._probe(session, d), [d for d in self.devices if not d.down]))
                self._stop.wait(0.1)

    def _probe(self, session: requests.Session, d: Device) -> None:
        try:
            r = session.post(d.url + "/v1/models/hpt:predict", json={"instances": [[2.0]]}, timeout=10)
            if d.down:
                return
            if r.status_code == 503 and r.headers.get("Retry-After"):
                self.shed += 1  # the device shedding load (the machine overloaded), not a wrong answer
                return
            if r.status_code != 200:
                raise ValueError(f"HTTP {r.status_code}: {r.text[:300]}")
            prediction = r.json()["predictions"][0]
            y = float(prediction["y"][0] if isinstance(prediction, dict) else prediction[0])
            version = round(y - 2.0)
            if r.status_code != 200 or abs(answer_of(version) - y) > 1e-5 or version not in self.published:
                raise ValueError(f"HTTP {r.status_code}, y={y}")
            self.answers += 1
            if d.answering != version:
                d.answering = version
                d.seen[version] = time.time()
        except Exception as exc:  # every failure is a finding, unless we killed the device
            if not d.down:
                self.failures.append(f"{time.strftime('%H:%M:%S')} {self.phase}: device {d.index}: {str(exc)[:200]}")

    def _view_loop(self) -> None:
        cache = ReportCache()
        while not self._stop.is_set():
            try:
                listing = list_reports(open_source(self.url), cache)
            except Exception:  # the view reads the bucket straight: a hiccup is a late view, not a failure
                self._stop.wait(1.0)
                continue
            now = time.time()
            for entry in listing.entries:
                model = ((entry.report or {}).get("models") or {}).get("hpt") or {}
                serving = model.get("serving_version")
                if serving is not None and self.view_serving.get(entry.device_id) != serving:
                    self.view_serving[entry.device_id] = serving
                    self.view_seen.setdefault(entry.device_id, {})[serving] = now
                refused = model.get("refused") or {}
                if refused.get("version") is not None and refused.get("reason"):
                    self.view_refused.setdefault(entry.device_id, {}).setdefault(refused["version"], now)
            self._stop.wait(1.0)

    # -- measuring -------------------------------------------------------------------------
    def publish(self, version: int, padding_bytes: int = 0, channel: bool = True, **channel_kw: Any) -> float:
        publish(self.admin, "hpt", str(build_version(self.tmp, version, padding_bytes)), version)
        self.published.add(version)
        return self.move(version, **channel_kw) if channel else time.time()

    def move(self, version: int, **channel_kw: Any) -> float:
        set_channel(self.admin, "hpt", "stable", version, expires_days=1, **channel_kw)
        return time.time()

    def converge(self, version: int, since: float, devices: list[Device] | None = None, timeout_intervals: float = 20,
                 by_view: bool = True) -> dict[str, Any]:
        """Wait until every device answers ``version`` (and its report says so); the
        50/95/100 % times in poll intervals, by the devices and by the view."""
        devices = devices or self.devices
        ids = {d.index: d.device_id() for d in devices}
        deadline = self.interval * timeout_intervals
        try:
            self.wait(lambda: all(version in d.seen and d.seen[version] >= since for d in devices)
                      and (not by_view or all(self.view_seen.get(ids[d.index], {}).get(version, 0) >= since
                                              for d in devices)), deadline, f"version {version} everywhere")
        except TimeoutError:
            pass
        by_device = [d.seen[version] - since for d in devices if d.seen.get(version, 0) >= since]
        by_report = [self.view_seen[i][version] - since for i in ids.values()
                     if self.view_seen.get(i, {}).get(version, 0) >= since]
        return {"devices": len(devices), "by_devices": self.percentiles(by_device, len(devices)),
                "by_view": self.percentiles(by_report, len(devices))}

    def percentiles(self, times: list[float], n: int) -> dict[str, str]:
        times = sorted(times)
        out = {}
        for p in (50, 95, 100):
            k = -(-n * p // 100)  # devices needed for p %
            out[f"p{p}"] = f"{times[k - 1] / self.interval:.2f}" if len(times) >= k else f"not reached ({len(times)}/{n})"
        return out

    def idle(self, intervals: float = 3) -> dict[str, float]:
        """Bucket requests per device per idle poll, and memory per service."""
        before = [d.status()["sync"] for d in self.devices]
        time.sleep(self.interval * intervals)
        after = [d.status()["sync"] for d in self.devices]
        polls = sum(a["polls"] - b["polls"] for a, b in zip(after, before))
        requests_ = sum(a["requests"]["polls"] - b["requests"]["polls"] for a, b in zip(after, before))
        reports = sum(a["requests"]["reports"] - b["requests"]["reports"] for a, b in zip(after, before))
        rss, pss = [], []
        for d in self.devices:
            info = psutil.Process(d.proc.pid).memory_full_info()
            rss.append(info.rss)
            pss.append(info.pss)
        return {"requests_per_idle_poll": requests_ / max(1, polls), "polls": polls, "report_writes": reports,
                "rss_median_mb": sorted(rss)[len(rss) // 2] / 2**20, "pss_median_mb": sorted(pss)[len(pss) // 2] / 2**20,
                "rss_max_mb": max(rss) / 2**20}

    # -- the harder phases -----------------------------------------------------------------
    def kill_mid_download(self, version: int, victims: list[Device], padding_bytes: int) -> dict[str, Any]:
        """Restart ``victims`` so they stop dead inside their next download, publish, kill -9
        them there, restart them clean; convergence of the rest, and of each victim after restart."""
        for d in victims:
            d.down = True
            d.stop()
            d.start(self.python, {**self.env, "EDGE_SYNC_FAULT": "mid_download"})
        self.wait(lambda: all(self._ready(d) for d in victims), 120, "victims ready")
        for d in victims:
            d.down = False
        since = self.publish(version, padding_bytes)
        markers = [d.state / "sync" / "fault-mid_download" for d in victims]
        self.wait(lambda: all(m.exists() for m in markers), self.interval * 10, "victims inside their download")
        killed = time.time()
        for d in victims:
            d.down = True
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait(10)
            for m in markers:
                m.unlink(missing_ok=True)
        partials = sum(1 for d in victims for p in (d.state / "models").rglob("*.part"))
        restarted = time.time()
        for d in victims:
            d.start(self.python, self.env)
        self.wait(lambda: all(self._ready(d) for d in victims), 120, "victims restarted")
        ready_s = time.time() - restarted
        for d in victims:
            d.down = False
        rest = [d for d in self.devices if d not in victims]
        return {"rest": self.converge(version, since, rest), "victims_after_restart": self.converge(version, restarted, victims),
                "killed_after_s": round(killed - since, 2), "partial_files_in_store": partials,
                "restart_ready_s": round(ready_s, 1)}

    def outage(self, version: int, seconds: float) -> dict[str, Any]:
        self.proxy.down()
        went = time.time()
        time.sleep(seconds)
        publish(self.admin, "hpt", str(build_version(self.tmp, version)), version)
        self.published.add(version)
        self.proxy.up()
        back = self.move(version)
        return {"outage_s": round(back - went, 1), **self.converge(version, back)}

    def corrupt_then_repair(self, version: int) -> dict[str, Any]:
        good = build_version(self.tmp, version)
        publish(self.admin, "hpt", str(good), version)
        self.published.add(version)
        self.admin.put(f"hpt/{version}/model.tflite", b"\0" * (good / "model.tflite").stat().st_size)
        since = self.move(version)
        ids = [d.device_id() for d in self.devices]
        try:
            self.wait(lambda: all(version in self.view_refused.get(i, {}) for i in ids), self.interval * 10,
                      "the refusal in every report")
        except TimeoutError:
            pass
        refused = [self.view_refused[i][version] - since for i in ids if version in self.view_refused.get(i, {})]
        fixed = time.time()
        repair(self.admin, "hpt", version, str(good))
        return {"refusal_in_view": self.percentiles(refused, len(ids)), **self.converge(version, fixed)}

    def halted_wave(self, version: int, good: int, percent: float, threshold: float) -> dict[str, Any]:
        broken = self.tmp / "versions" / f"broken-{version}"
        broken.mkdir(parents=True, exist_ok=True)
        (broken / "model.tflite").write_bytes(b"not a flatbuffer " * 64)
        publish(self.admin, "hpt", str(broken), version)
        since = self.move(version, waves=[{"percent": percent, "hold_minutes": 60}, {"percent": 100}],
                          failure_threshold={"percent": threshold, "min_devices": 2})
        cache = ReportCache()
        halted_at = None
        round_ = None
        deadline = time.time() + self.interval * 20
        while time.time() < deadline:
            round_ = watch_round(self.admin, "hpt", "stable", cache, by="bench/fleet_bench.py")
            if round_.progress["halted"]:
                halted_at = time.time()
                break
            time.sleep(1.0)
        time.sleep(self.interval * 2)  # let every device poll the halted pointer at least once more
        statuses = [d.status() for d in self.devices]
        touched = sum(any(v["version"] == version for v in s["models"]["hpt"]["versions"]) for s in statuses)
        serving_good = sum(s["models"]["hpt"]["serving_version"] == good for s in statuses)
        progress = round_.progress if round_ else {}
        return {"halted_after_intervals": round((halted_at - since) / self.interval, 2) if halted_at else None,
                "reason": progress.get("halted_reason"), "devices_that_tried_it": touched,
                "serving_the_good_version": serving_good, "wave_1": progress.get("waves", {}).get("per_wave", {}).get("1")}

    def view_of(self) -> list[dict[str, Any]]:
        listing = list_reports(open_source(self.url))
        return [device_row(e, {}) for e in listing.entries]


def run(tmp: Path, python: str, weed: Any, count: int, interval: float, report_interval: float,
        log: Callable[[str], None]) -> dict[str, Any]:
    fleet = Fleet(tmp, python, weed, count, interval, report_interval)
    results: dict[str, Any] = {}
    try:
        for v in range(1, 8):  # build every model first: TensorFlow converts them in this process
            build_version(tmp, v, 16 << 20 if v == 3 else 0)
        fleet.publish(1)
        results["start_s"] = round(fleet.start_all(), 1)
        log(f"{count} devices up in {results['start_s']} s")
        fleet.observe()
        fleet.wait(lambda: all(1 in d.seen for d in fleet.devices), 120, "every device answering version 1")
        results["idle"] = fleet.idle()
        log(f"idle: {results['idle']}")
        fleet.phase = "rollout"
        results["rollout"] = fleet.converge(2, fleet.publish(2))
        log(f"rollout: {results['rollout']}")
        fleet.phase = "rollback"
        results["rollback"] = fleet.converge(1, fleet.move(1))
        log(f"rollback: {results['rollback']}")
        fleet.phase = "kill -9"
        results["kill_9"] = fleet.kill_mid_download(3, fleet.devices[:5], 16 << 20)
        log(f"kill -9: {results['kill_9']}")
        fleet.phase = "outage"
        results["outage"] = fleet.outage(4, 30.0)
        log(f"outage: {results['outage']}")
        fleet.phase = "corrupt"
        results["corrupt"] = fleet.corrupt_then_repair(5)
        log(f"corrupt: {results['corrupt']}")
        fleet.phase = "wave halt"
        results["wave_halt"] = fleet.halted_wave(6, 5, 20.0, 10.0)
        log(f"wave halt: {results['wave_halt']}")
        fleet.phase = "end"
    finally:
        results["answers"] = fleet.answers
        results["shed"] = fleet.shed
        results["failed_answers"] = len(fleet.failures)
        results["failure_examples"] = fleet.failures[:5]
        fleet.close()
    return results


SWAPS = [("rollout to 2", 2, True), ("rollback to 1", 1, False), ("rollout to 3", 3, True),
         ("forward move to the lower number 2", 2, False), ("rollout to 4", 4, True),
         ("rollback to 2 (on disk)", 2, False), ("rollback to 1, three steps back", 1, False)]


def swaps(tmp: Path, python: str, weed: Any, count: int, interval: float, report_interval: float,
          log: Callable[[str], None]) -> dict[str, Any]:
    """Channel moves in both directions under the probes' traffic: per move, the failed
    predictions, the convergence, and the versions the devices fetched (committed) for it."""
    fleet = Fleet(tmp, python, weed, count, interval, report_interval)
    results: dict[str, Any] = {"moves": []}
    try:
        for v in range(1, 5):
            build_version(tmp, v)
        fleet.publish(1)
        results["start_s"] = round(fleet.start_all(), 1)
        fleet.observe()
        fleet.wait(lambda: all(1 in d.seen for d in fleet.devices), 120, "every device answering version 1")
        for name, version, new in SWAPS:
            fleet.phase = name
            before, commits = len(fleet.failures), _commits(fleet)
            since = fleet.publish(version) if new else fleet.move(version)
            converged = fleet.converge(version, since, by_view=False)
            results["moves"].append({"move": name, "failed": len(fleet.failures) - before,
                                     "fetched": _commits(fleet) - commits, **converged})
            log(f"{name}: {results['moves'][-1]}")
    finally:
        results["answers"], results["failed_answers"] = fleet.answers, len(fleet.failures)
        results["failure_examples"] = fleet.failures[:5]
        fleet.close()
    return results


def _commits(fleet: "Fleet") -> int:
    """Versions committed (downloaded) by every device so far, from their status events."""
    return sum(sum(1 for e in d.status().get("events", []) if e["kind"] == "sync_committed") for d in fleet.devices)


def swaps_markdown(results: dict[str, Any], count: int, interval: float) -> list[str]:
    lines = [f"{count} real LiteRT devices, poll interval {interval:g} s, each probed continuously "
             f"({results['answers']} predictions answered in all).", "",
             "| move | failed predictions | versions fetched (all devices) | 95 % / 100 % of devices (intervals) |",
             "|---|---|---|---|"]
    for m in results["moves"]:
        lines.append(f"| {m['move']} | {m['failed']} | {m['fetched']} | {m['by_devices']['p95']} / "
                     f"{m['by_devices']['p100']} |")
    return lines


def markdown(results: dict[str, Any], count: int, interval: float) -> list[str]:
    def row(name: str, r: dict[str, Any]) -> str:
        d, v = r["by_devices"], r["by_view"]
        return f"| {name} | {d['p50']} / {d['p95']} / {d['p100']} | {v['p50']} / {v['p95']} / {v['p100']} |"

    idle = results.get("idle", {})
    lines = ["| phase | 50 / 95 / 100 % by the devices (poll intervals) | 50 / 95 / 100 % by the fleet view |",
             "|---|---|---|"]
    for name, key in (("new version on the channel", "rollout"), ("channel moved back (rollback)", "rollback")):
        if key in results:
            lines.append(row(name, results[key]))
    if "kill_9" in results:
        k = results["kill_9"]
        lines.append(row(f"kill -9 mid-download ({k['killed_after_s']} s after the move): the other devices", k["rest"]))
        lines.append(row(f"... the 5 killed devices, from their restart (all ready again after {k['restart_ready_s']} s)",
                         k["victims_after_restart"]))
    if "outage" in results:
        lines.append(row(f"bucket unreachable {results['outage']['outage_s']} s, a version published as it came back",
                         results["outage"]))
    if "corrupt" in results:
        c = results["corrupt"]
        r = c["refusal_in_view"]
        lines.append(f"| corrupted object: the refusal, with its reason, in the reports | | {r['p50']} / {r['p95']} / {r['p100']} |")
        lines.append(row("... the object fixed in place (publish --repair)", c))
    lines += ["", "| figure | result |", "|---|---|",
              f"| devices | {count} LiteRT-only services, one process each (`--workers 1`), poll {interval} s +-20 % |",
              f"| start of all devices (5 at a time) | {results.get('start_s')} s |",
              f"| bucket requests per device per idle poll | {idle.get('requests_per_idle_poll', 0):.2f} "
              f"({idle.get('polls')} polls; {idle.get('report_writes')} report writes in the same window) |",
              f"| memory per service (median RSS / PSS, max RSS) | {idle.get('rss_median_mb', 0):.0f} / "
              f"{idle.get('pss_median_mb', 0):.0f} / {idle.get('rss_max_mb', 0):.0f} MB |",
              f"| predictions answered / failed (an error, or a value no version gives) / shed (503 + Retry-After: "
              f"the machine overloaded) | {results['answers']} / {results['failed_answers']} / {results.get('shed', 0)} |"]
    if "kill_9" in results:
        lines.append(f"| partial files left in the killed devices' model stores | {results['kill_9']['partial_files_in_store']} |")
    if "wave_halt" in results:
        w = results["wave_halt"]
        lines.append(f"| wave of 20 %, threshold 10 %, a version that fails to load: halted after | "
                     f"{w['halted_after_intervals']} intervals; {w['devices_that_tried_it']} devices tried it (wave 1: "
                     f"{json.dumps(w['wave_1'])}), {w['serving_the_good_version']}/{count} serve the last good version |")
        lines.append(f"| the halt's reason in the pointer (first 300 characters) | {str(w['reason'])[:300]}... |")
    return lines
