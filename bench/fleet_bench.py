"""Fleet benchmarks on a SeaweedFS bucket on loopback. Each mode appends a section to
bench/RESULTS.md (machine, date, command, load average before and after).

    # real devices: LiteRT-only services, one process each, converging (bench/fleet_devices.py);
    # PYTHON is a LiteRT-only install with the s3 extra:
    #   python3 -m venv /tmp/lite-s3 && /tmp/lite-s3/bin/pip install -e '.[tflite,s3]'
    .venv/bin/python -m bench.fleet_bench --mode devices --python /tmp/lite-s3/bin/python [--devices 50] [--interval 5]
    # channel moves both ways under traffic: failed predictions and fetches per move
    .venv/bin/python -m bench.fleet_bench --mode swaps [--devices 10] [--interval 5]
    # 10,000 reports listed (bench/fleet_listing.py)
    .venv/bin/python -m bench.fleet_bench --mode listing [--reports 10000]
    # many simulated followers in one process (the real sync.follower code, one S3 client each)
    .venv/bin/python -m bench.fleet_bench --mode followers [--devices 200] [--interval 2]

Followers' figures: bucket requests per device per idle poll; seconds from a channel move
until 95 % and 100 % of devices hold the new version (verified and committed); bytes fetched
per device when a new version changes one file of ten; CPU and RSS of the sync loops.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from sync.follower import Follower, Options
from sync.publisher import publish, set_channel
from sync.open_source import open_source
from sync.store import Store
from tests.support.seaweed import SeaweedS3

FILE_BYTES = 256 * 1024


class Device:
    def __init__(self, root: Path, url: str, i: int):
        self.committed: dict[int, float] = {}
        self.downloaded: dict[int, int] = {}
        self.source = open_source(url)
        self.store = Store(str(root / f"dev-{i}")).open()
        self.follower = Follower(self.source, self.store, Options(models=["m"], channel="stable"), self._event)

    def _event(self, kind: str, message: str, model: str = "", version: int | None = None, **d: Any) -> None:
        if kind == "sync_committed" and version is not None:
            self.committed[version] = time.time()
            self.downloaded[version] = int(d.get("downloaded_bytes", 0))


def make_version(root: Path, name: str, changed: int) -> Path:
    d = root / name
    d.mkdir(parents=True)
    for i in range(10):
        rng = random.Random(i if i else 1000 + changed)  # only file 0 differs between versions
        (d / f"part-{i}.bin").write_bytes(rng.randbytes(FILE_BYTES))
    return d


def poll_forever(devices: list[Device], interval: float, stop: threading.Event) -> None:
    while not stop.is_set():
        for d in devices:
            try:
                d.follower.sync_once()
            except Exception as exc:  # recorded by the figures as a slower convergence
                print("poll failed:", exc)
        stop.wait(interval * random.uniform(0.8, 1.2))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("devices", "listing", "followers", "swaps"), default="devices")
    ap.add_argument("--devices", type=int, default=None, help="devices: 50 real services; followers: 200")
    ap.add_argument("--interval", type=float, default=None, help="poll interval (devices: 5 s; followers: 2 s)")
    ap.add_argument("--report-interval", type=float, default=60.0, help="devices: the reports' heartbeat")
    ap.add_argument("--python", default=sys.executable, help="devices: the interpreter of a LiteRT-only install")
    ap.add_argument("--reports", type=int, default=10_000, help="listing: how many reports")
    ap.add_argument("--threads", type=int, default=20)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    load_before = os.getloadavg()
    weed = SeaweedS3.start(tmp)
    try:
        weed.make_bucket("fleet")
        os.environ.update(weed.env())
        if args.mode == "followers":
            args.devices, args.interval = args.devices or 200, args.interval or 2.0
            run(tmp, args)
        elif args.mode == "listing":
            from bench import fleet_listing

            lines = fleet_listing.run("s3://fleet/listing", args.reports, weed.proc.pid)
            append(f"Listing {args.reports} device reports from SeaweedFS", args, load_before, lines)
        elif args.mode == "swaps":
            swaps(tmp, weed, args, load_before)
        else:
            devices(tmp, weed, args, load_before)
    finally:
        weed.stop()


def devices(tmp: Path, weed: Any, args: argparse.Namespace, load_before: tuple[float, float, float]) -> None:
    from bench import fleet_devices

    count, interval = args.devices or 50, args.interval or 5.0
    results = fleet_devices.run(tmp, args.python, weed, count, interval, args.report_interval,
                                lambda line: print(time.strftime("%H:%M:%S"), line, flush=True))
    (tmp / "results.json").write_text(json.dumps(results, indent=1, default=str))
    append(f"Fleet convergence: {count} real devices on one SeaweedFS bucket (issue 36)", args, load_before,
           fleet_devices.markdown(results, count, interval) + (
               [f"", f"Failed answers (first 5): {results['failure_examples']}"] if results["failed_answers"] else []))


def swaps(tmp: Path, weed: Any, args: argparse.Namespace, load_before: tuple[float, float, float]) -> None:
    from bench import fleet_devices

    count, interval = args.devices or 10, args.interval or 5.0
    results = fleet_devices.swaps(tmp, args.python, weed, count, interval, args.report_interval,
                                  lambda line: print(time.strftime("%H:%M:%S"), line, flush=True))
    append(f"Channel moves in both directions under traffic: {count} real devices (issue 48)", args, load_before,
           fleet_devices.swaps_markdown(results, count, interval) + (
               ["", f"Failed answers (first 5): {results['failure_examples']}"] if results["failed_answers"] else []))


def append(title: str, args: argparse.Namespace, load_before: tuple[float, float, float], lines: list[str]) -> None:
    """A section of bench/RESULTS.md: what ran, where, how loaded, then the figures."""
    load_after = os.getloadavg()
    header = ["", f"## {title}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
              f"Command: `{' '.join(sys.argv)}`. Machine: {os.cpu_count()} CPUs, "
              f"{psutil.virtual_memory().total / 2**30:.0f} GiB, shared with other work: load average "
              f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (1 min). SeaweedFS (`weed server -s3`) and every "
              "client on the same machine.", ""]
    with open(Path(__file__).with_name("RESULTS.md"), "a") as out:
        out.write("\n".join(header + lines) + "\n")
    print("\n".join(header + lines))


def run(tmp: Path, args: argparse.Namespace) -> None:
    url = "s3://fleet/bench"
    pub = open_source(url)
    publish(pub, "m", str(make_version(tmp, "v1", 1)), 1, channel="stable", expires_days=1)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    devices = [Device(tmp, url, i) for i in range(args.devices)]
    for d in devices:
        d.follower.sync_once()  # everyone on version 1
    rss1 = proc.memory_info().rss
    # idle polls: requests per device per poll, CPU per poll
    before = sum(d.source.requests for d in devices)
    cpu0, t0 = proc.cpu_times(), time.perf_counter()
    for d in devices:
        d.follower.sync_once()
    cpu1, t1 = proc.cpu_times(), time.perf_counter()
    idle_requests = (sum(d.source.requests for d in devices) - before) / len(devices)
    cpu_per_poll_ms = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / len(devices) * 1000
    # a new version that changes one file of ten, devices polling on their own
    publish(pub, "m", str(make_version(tmp, "v2", 2)), 2, expires_days=1)
    stop = threading.Event()
    groups = [devices[i::args.threads] for i in range(args.threads)]
    workers = [threading.Thread(target=poll_forever, args=(g, args.interval, stop)) for g in groups]
    for w in workers:
        w.start()
    time.sleep(args.interval * 1.5)
    moved = time.time()
    set_channel(pub, "m", "stable", 2, expires_days=1)
    deadline = moved + 300
    while time.time() < deadline and not all(2 in d.committed for d in devices):
        time.sleep(0.2)
    stop.set()
    for w in workers:
        w.join()
    times = sorted(d.committed[2] - moved for d in devices if 2 in d.committed)
    manifest = len(pub.read("m/2/MANIFEST.json").data)
    downloaded = sum(d.downloaded.get(2, 0) for d in devices) / len(devices)
    write_results(args, idle_requests, cpu_per_poll_ms, (rss1 - rss0) / len(devices), times, downloaded, manifest,
                  len(devices), t1 - t0)


def write_results(args: Any, idle: float, cpu_ms: float, rss_per_device: float, times: list[float],
                  downloaded: float, manifest: int, n: int, idle_wall: float) -> None:
    def pct(p: float) -> str:
        k = max(0, int(len(times) * p) - 1)
        return f"{times[k]:.1f} s" if len(times) >= int(n * p) and times else "not reached"

    lines = [
        "",
        f"## Fleet sync benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"Command: `{' '.join(sys.argv)}`.",
        "",
        f"{n} simulated devices (real `sync.follower` code, one state directory and one boto3 client each, "
        f"{args.threads} polling threads in one process) on one SeaweedFS S3 bucket on loopback, channel `stable`, "
        f"poll interval {args.interval} s +-20 %. Machine: {os.cpu_count()} CPUs, weed and the clients share them.",
        "",
        "| figure | result |",
        "|---|---|",
        f"| bucket requests per device per idle poll | {idle:.2f} (one conditional GET of the channel pointer, "
        "answered 304) |",
        f"| time from the channel move until 95 % of devices hold v2 verified | {pct(0.95)} |",
        f"| ... until 100 % | {pct(1.0)} ({len(times)}/{n} devices) |",
        f"| bytes fetched per device, new version changing 1 file of 10 ({FILE_BYTES} B each) | "
        f"{downloaded:.0f} B of files + {manifest} B manifest + pointer (target: {FILE_BYTES} + manifest) |",
        f"| CPU per idle poll per device | {cpu_ms:.2f} ms ({idle_wall / n * 1000:.1f} ms wall, sequential) |",
        f"| RSS per simulated device (state + S3 client) | {rss_per_device / 1024:.0f} KiB |",
        "",
        f"Extrapolation: 10,000 devices polling every 60 s make {10000 * idle / 60:.0f} requests/s on the bucket "
        f"when idle (conditional GETs answered 304), plus one manifest and the changed files per device per release.",
        "",
        "Idle CPU of a device's loop = CPU per idle poll / poll interval (e.g. "
        f"{cpu_ms:.2f} ms every 30 s = {cpu_ms / 30000 * 100:.4f} % of one core).",
    ]
    with open(Path(__file__).with_name("RESULTS.md"), "a") as out:  # appended, like the other benches
        out.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
