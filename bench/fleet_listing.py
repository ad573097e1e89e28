"""10,000 device reports listed from SeaweedFS: one GET after another with boto3 (what
``appliance fleet`` did), boto3 from a thread pool, the same signed GETs over urllib3's pool,
and sync/listing.py (GETs signed by botocore, sent over keep-alive http.client connections, 16
in flight), cold; then the repeated view (the ETag cache: only changed reports
read) and the whole CLI, ``appliance fleet --json``, cold and warm. Run by bench/fleet_bench.py
--mode listing."""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before the heavy imports
    print(__doc__)
    raise SystemExit(0)


import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from sync.listing import ReportCache, list_reports
from sync.open_source import open_source
from tests.support.fleet_support import device_ids, fleet_report, write_reports

ROOT = Path(__file__).resolve().parent.parent


def timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def cpu(fn: Any) -> tuple[float, float, Any]:
    """(wall seconds, this process's CPU seconds, value)."""
    started, cpu0 = time.perf_counter(), time.process_time()
    value = fn()
    return time.perf_counter() - started, time.process_time() - cpu0, value


def boto3_sequential(url: str) -> int:
    """What ``appliance fleet`` did before: list, then one get_object after another."""
    source = open_source(url)
    names = source.list_keys("_devices")
    return sum(len(source.read(f"_devices/{n}").data) > 0 for n in names)


def boto3_threads(url: str, workers: int = 16) -> int:
    source = open_source(url)
    names = source.list_keys("_devices")
    with ThreadPoolExecutor(workers) as pool:
        return sum(pool.map(lambda n: len(source.read(f"_devices/{n}").data) > 0, names))


def urllib3_signed(url: str, workers: int = 16) -> int:
    """The GETs sync/listing.py sends, signed the same way, over urllib3's pool instead."""
    import urllib3

    source = open_source(url)
    names = source.list_keys("_devices")
    sign = source.get_signer()
    pool = urllib3.PoolManager(maxsize=workers, block=True)

    def get(name: str) -> bool:
        address, headers = sign(f"_devices/{name}")
        return len(pool.request("GET", address, headers=headers).data) > 0

    with ThreadPoolExecutor(workers) as executor:
        return sum(executor.map(get, names))


def cli(url: str, env: dict[str, str], *args: str) -> float:
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "appliance.cli", "fleet", "--bucket", url, "--json", *args],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0 and json.loads(out.stdout)["counts"]["devices"] > 0, out.stderr[-2000:]
    return time.perf_counter() - started


def run(url: str, count: int, weed_pid: int | None = None) -> list[str]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    source = open_source(url)
    key = Ed25519PrivateKey.generate()
    ids = device_ids(count, seed=3)
    write_s, _ = timed(lambda: write_reports(source, [fleet_report(d, 2, key=key) for d in ids], workers=16))
    seq_s, seq_cpu, seq_n = cpu(lambda: boto3_sequential(url))
    thr_s, thr_cpu, thr_n = cpu(lambda: boto3_threads(url))
    u3_s, u3_cpu, u3_n = cpu(lambda: urllib3_signed(url))
    cache = ReportCache()
    weed = psutil.Process(weed_pid) if weed_pid else None
    weed0 = sum(weed.cpu_times()[:2]) if weed else 0.0
    cold_s, cold_cpu, cold = cpu(lambda: list_reports(open_source(url), cache))
    weed_cpu = sum(weed.cpu_times()[:2]) - weed0 if weed else 0.0
    write_reports(source, [fleet_report(d, 3, key=key) for d in ids[:100]])  # 1 % changed since
    warm_s, warm = timed(lambda: list_reports(open_source(url), cache))
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "XDG_CACHE_HOME": home}
        cli_cold = cli(url, env)
        cli_warm = cli(url, env)
    assert seq_n == thr_n == u3_n == len(cold.entries) == count and warm.fetched == 100
    return ["| figure | result |", "|---|---|", f"| reports | {count} (~{len(json.dumps(fleet_report(ids[0], 2, key=key)))} B each, signed) |",
            f"| writing them (16 threads, boto3) | {write_s:.1f} s |",
            f"| boto3, one GET after another (before) | {seq_s:.1f} s ({seq_cpu:.1f} s CPU) |",
            f"| boto3, 16 threads | {thr_s:.1f} s ({thr_cpu:.1f} s CPU) |",
            f"| GETs signed by botocore, sent by urllib3's pool, 16 in flight (parse and signature checks not included) | "
            f"{u3_s:.1f} s ({u3_cpu:.1f} s CPU) |",
            f"| sync/listing.py cold: GETs signed by botocore, sent over keep-alive http.client connections, 16 in flight | {cold_s:.1f} s ({cold_cpu:.1f} s CPU here, {weed_cpu:.1f} s in "
            f"SeaweedFS; signatures checked; {seq_s / cold_s:.1f}x faster than one after another; {cold.requests} requests) |",
            f"| the same view again with 100 reports changed (ETag cache) | {warm_s:.2f} s ({warm.fetched} read, "
            f"{warm.cached} unchanged, {warm.requests} requests) |",
            f"| `appliance fleet --json` cold (process start, listing, rows, rollouts, JSON out) | {cli_cold:.1f} s |",
            f"| `appliance fleet --json` again (cache in XDG_CACHE_HOME) | {cli_warm:.1f} s |"]
