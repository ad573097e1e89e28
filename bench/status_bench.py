"""What ``/api/status`` costs the device: the page asks for it every 2 s, and it now finds the
problems and samples the memory and CPU of the whole service tree.

    .venv/bin/python bench/status_bench.py [--compare OTHER_CHECKOUT] [--requests 300] [--out bench/RESULTS.md]

Starts the service of this tree (and, with ``--compare``, of another checkout, run with this
tree's Python and packages) on the embedded default with two front workers, waits for
ready, then asks each for ``/api/status`` in turn, ``--requests`` times, one at a time:
median and p90 latency, and the serving process's CPU time per request. The trees take
turns, so machine load falls on both alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(tree: Path, state: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "appliance.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--state", str(state), "--grpc-port", "0", "--no-discovery", "--workers", "2"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{tree}: not ready in 300 s")


def one(url: str) -> float:
    t0 = time.perf_counter()
    with urllib.request.urlopen(url + "/api/status", timeout=30) as r:
        r.read()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compare", default="", help="another checkout, run beside this one")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--out", default="", help="append the table to this file (bench/RESULTS.md)")
    args = ap.parse_args()
    trees = {"this": ROOT, **({"other": Path(args.compare).resolve()} if args.compare else {})}
    running = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name, tree in trees.items():
                running[name] = start(tree, Path(tmp) / name)
            times: dict[str, list[float]] = {name: [] for name in trees}
            cpu0 = {name: psutil.Process(p.pid).cpu_times() for name, (p, _) in running.items()}
            for _ in range(args.requests):
                for name, (_, url) in running.items():
                    times[name].append(one(url))
            rows = []
            for name, (proc, _) in running.items():
                c0, c1 = cpu0[name], psutil.Process(proc.pid).cpu_times()
                cpu_ms = 1000 * (c1.user + c1.system - c0.user - c0.system) / args.requests
                t = sorted(times[name])
                rows.append(f"| {name} ({trees[name]}) | {1000 * statistics.median(t):.1f} | "
                            f"{1000 * t[int(0.9 * len(t))]:.1f} | {cpu_ms:.1f} |")
        finally:
            for proc, _ in running.values():
                proc.terminate()
                proc.wait(60)
    table = "\n".join(["| tree | median ms | p90 ms | serving CPU ms per request |", "|---|---|---|---|", *rows])
    head = (f"`/api/status`, {args.requests} requests each, in turn; {platform.node()}, {os.cpu_count()} cores, "
            f"load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(head + "\n\n" + table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(f"\n{head}\n\n{table}\n")


if __name__ == "__main__":
    main()
