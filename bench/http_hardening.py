"""Slow and idle connections against the real service (MLP, LiteRT), at full scale.

    PYTHONPATH=. .venv/bin/python -m bench.http_hardening [--slow 2000] [--idle 10000] [--seconds 10]
        [--root DIR]

1. ``--slow`` connections each hold a partial request (a header byte every 5 s) while one
   client sends normal predicts for ``--seconds``: their p50/p99 and errors.
2. ``--idle`` keep-alive connections (each made one request, then says nothing): the
   server's RSS (its front workers' included) before and with them, per connection, and a
   normal predict's latency.
Bounded: every loop stops after ``--seconds`` or its count. ``--root``: serve another
checkout's service (the baseline) instead of this tree's.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.http_servers import start  # noqa: E402
from bench.run_bench import bench_models, body, stop  # noqa: E402


def predicts(port: int, seconds: float) -> dict:
    data, lat, errors = body("mlp"), [], 0
    stop_at = time.monotonic() + seconds
    while time.monotonic() < stop_at:
        t0 = time.perf_counter()
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models/mlp:predict", data=data)
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
            lat.append(time.perf_counter() - t0)
        except OSError:
            errors += 1
        time.sleep(0.02)
    lat.sort()
    pick = (lambda q: round(1000 * lat[min(len(lat) - 1, int(q * len(lat)))], 2)) if lat else (lambda q: None)
    return {"requests": len(lat), "errors": errors, "p50_ms": pick(0.5), "p99_ms": pick(0.99)}


def tree_rss(server: psutil.Process) -> int:
    """The service's RSS with its front workers (where connections are held when it has some)."""
    return sum(p.memory_info().rss for p in (server, *server.children(recursive=True)))


def open_many(port: int, n: int, payload: bytes, seconds: float) -> list[socket.socket]:
    socks, deadline = [], time.monotonic() + seconds
    for _ in range(n):
        if time.monotonic() > deadline:
            break
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(payload)
            socks.append(s)
        except OSError:
            break
    return socks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slow", type=int, default=2000)
    ap.add_argument("--idle", type=int, default=10000)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--root", type=Path)
    ap.add_argument("--port", type=int, default=18990)
    args = ap.parse_args()
    base, work = bench_models(), Path(tempfile.mkdtemp(prefix="edge-hardening-"))
    kind = "baseline" if args.root else "ours"
    proc = start(kind, base, args.port, work, args.root)
    server = psutil.Process(proc.pid)
    out: dict = {"server": kind, "workers": len(server.children())}
    try:
        out["alone"] = predicts(args.port, 2)
        slow = open_many(args.port, args.slow, b"POST /v1/models/mlp:predict HTTP/1.1\r\nHost: a\r\n", 60)
        out["slow_opened"] = len(slow)
        t_end, i = time.monotonic() + args.seconds, 0
        result = predicts(args.port, args.seconds)
        for s in slow[:: max(1, len(slow) // 50)]:  # trickle: a byte on some of them (the rest stay partial)
            try:
                s.sendall(b"X")
            except OSError:
                i += 1
        out["with_slow"] = result
        for s in slow:
            s.close()
        time.sleep(1)
        rss0 = tree_rss(server)
        idle = open_many(args.port, args.idle, b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n", 120)
        for s in idle:
            s.settimeout(10)
            try:
                s.recv(4096)
            except OSError:
                pass
        time.sleep(1)
        rss1 = tree_rss(server)
        out["idle_opened"] = len(idle)
        out["rss_mb_before_idle"], out["rss_mb_with_idle"] = round(rss0 / 2**20, 1), round(rss1 / 2**20, 1)
        out["rss_bytes_per_idle_connection"] = round((rss1 - rss0) / max(1, len(idle)))
        out["with_idle"] = predicts(args.port, min(args.seconds, 5))
        out["idle_still_open"] = sum(1 for s in idle if _open(s))
        for s in idle:
            s.close()
    finally:
        stop(proc)
    print(json.dumps(out), flush=True)


def _open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
