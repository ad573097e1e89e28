"""1,000 token streams opened at once against ``appliance serve`` (issue 45's bar): the tree's
memory stays bounded and ``/healthz`` keeps answering in < 100 ms throughout.

    PYTHONPATH=. .venv/bin/python -m bench.stream_flood [--streams 1000] [--workers N]
        [--cache-memory-mb MB] [--max-streams N] [--max-queued N] [--max-tokens 64] [--json OUT] [--tree DIR]

The model is the prebuilt tiny chat model (scripts/tiny_chat: a LiteRT LLM with a real
tokenizer.json), served from a temporary state directory. After a warm-up answer, ``--streams``
clients each open a connection and send a streamed ``/v1/completions`` request, all at once, and
read their answers to ``data: [DONE]``. Meanwhile a client in a process of its own asks
``/healthz`` on a keep-alive connection back to back (10 ms apart), and the service tree's RSS and PSS (every process: serving, zygote,
front workers; /proc/PID/smaps_rollup) and ``/api/status`` ``generation`` are sampled every
100 ms. Reported: the answers by status (a stream whose KV cache row does not fit in
``generation.cache_memory_mb`` waits in its model's queue, past ``generation.max_queued_per_model``
it is refused 503 + Retry-After), the most streams running and waiting at once, the most cache
bytes the running streams held against the total (``/api/status`` ``generation.cache_bytes_*``;
the tiny chat model's row is 64 KiB), ``/healthz`` latency (max, p99, count; the slowest
probes with when they were sent, to match against the server's logs), and the
tree's memory before, at its peak and after. Defaults are the service's own; ``--max-streams``
and ``--max-queued`` raise the bounds so that every stream runs or waits at once;
``--cache-memory-mb`` sets the cache total (e.g. 6.25: 100 rows of the tiny model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

from bench.footprint import smaps as footprint_smaps

ROOT = Path(__file__).resolve().parent.parent
TINY_CHAT = ROOT / "scripts" / "tiny_chat"
WHY: set[tuple[int, str]] = set()  # the refusals' bodies, each kind once
SLOWEST = 8  # the slowest /healthz probes reported with when they were sent (to match against the server's logs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def smaps(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of ``pid`` in MiB."""
    figures = footprint_smaps(pid)
    return figures["rss"], figures["pss"]


def tree_memory(pid: int) -> tuple[float, float, int]:
    """(RSS, PSS, processes) of the service tree."""
    import psutil

    root = psutil.Process(pid)
    rss = pss = 0.0
    procs = [root, *root.children(recursive=True)]
    for proc in procs:
        try:
            r, p = smaps(proc.pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        rss, pss = rss + r, pss + p
    return rss, pss, len(procs)


def start(tmp: Path, port: int, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    models = tmp / "models"
    shutil.copytree(TINY_CHAT, models / "chat" / "1")
    config = tmp / "appliance.toml"
    lines = [f'models_dir = "{models}"', "[generation]"]
    if args.cache_memory_mb:
        lines.append(f"cache_memory_mb = {args.cache_memory_mb}")
    if args.max_streams:
        lines.append(f"max_streams = {args.max_streams}")
    if args.max_queued:
        lines.append(f"max_queued_per_model = {args.max_queued}")
    config.write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "appliance.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--state", str(tmp / "state"), "--config", str(config), "--no-discovery", "--grpc-port", "0"]
    if args.workers is not None:
        cmd += ["--workers", str(args.workers)]
    log = open(tmp / "server.log", "wb")
    tree = args.tree.resolve()  # the service's source tree: this one, or another commit's for a before/after pair
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tree, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/readyz", timeout=2).status_code == 200:
                return proc
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"the service did not get ready; see {tmp / 'server.log'}")


async def one_stream(port: int, body: bytes) -> tuple[int, int]:
    """(status, data events read) of one streamed completion on its own connection."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return -1, 0
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:  # why, in the service's words
            WHY.add((status, (await reader.read(400)).decode(errors="replace")[:160]))
            return status, 0
        events = 0
        while True:
            line = await reader.readline()
            if not line:
                break
            events += line.startswith(b"data: ")
            if line.startswith(b"data: [DONE]"):
                break
        return status, events
    except (OSError, asyncio.IncompleteReadError, ValueError):
        return -2, 0
    finally:
        writer.close()


def probe_health(url: str, stop: Any, out: Any) -> None:
    """(a process of its own, so the flood's clients never slow the probe) ``/healthz`` back to
    back on a keep-alive connection, 10 ms apart; (when it was sent, wall clock; its latency,
    None: failed) of each to ``out``."""
    session = requests.Session()
    latencies: list[tuple[float, float | None]] = []
    while not stop.is_set():
        sent, t = time.time(), time.perf_counter()
        try:
            ok = session.get(url + "/healthz", timeout=10).status_code == 200
        except requests.RequestException:
            ok = False
        latencies.append((sent, time.perf_counter() - t if ok else None))
        time.sleep(0.01)
    out.put(latencies)


class Sampler(threading.Thread):
    """The tree's memory and the generation status every 100 ms; ``/healthz`` in a child process."""

    def __init__(self, url: str, pid: int):
        super().__init__(daemon=True)
        self.url, self.pid = url, pid
        self.stop = threading.Event()
        self.health: list[float] = []
        self.slowest: list[tuple[float, float]] = []  # (when sent, wall clock; seconds) of the slowest probes
        self.failed = 0
        self.memory: list[tuple[float, float]] = []
        self.running = self.waiting = 0
        self.cache_peak, self.cache_total = 0, None
        ctx = multiprocessing.get_context("spawn")
        self.probe_stop, self.probe_out = ctx.Event(), ctx.Queue()
        self.probe = ctx.Process(target=probe_health, args=(url, self.probe_stop, self.probe_out), daemon=True)

    def start(self) -> None:
        self.probe.start()
        super().start()

    def finish(self) -> None:
        self.stop.set()
        self.probe_stop.set()
        latencies = self.probe_out.get(timeout=60)
        self.probe.join(30)
        self.join()
        self.health = [x for _, x in latencies if x is not None]
        self.failed = sum(x is None for _, x in latencies)
        self.slowest = sorted(((sent, x) for sent, x in latencies if x is not None), key=lambda p: -p[1])[:SLOWEST]

    def run(self) -> None:
        session = requests.Session()
        while not self.stop.is_set():
            rss, pss, _ = tree_memory(self.pid)
            self.memory.append((rss, pss))
            try:
                gen = session.get(self.url + "/api/status", timeout=10).json().get("generation", {})
                self.running = max(self.running, int(gen.get("active_streams", 0)) - int(gen.get("requests_waiting", 0)))
                self.waiting = max(self.waiting, int(gen.get("requests_waiting", 0)))
                self.cache_peak = max(self.cache_peak, int(gen.get("cache_bytes_used", 0)))
                self.cache_total = gen.get("cache_bytes_total", self.cache_total)
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.1)


async def flood(port: int, streams: int, max_tokens: int) -> list[tuple[int, int]]:
    body = json.dumps({"model": "chat", "prompt": "<user>hi\n<assistant>", "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    return await asyncio.gather(*[one_stream(port, body) for _ in range(streams)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=None, help="server.workers (default: the service's own)")
    ap.add_argument("--cache-memory-mb", type=float, default=0,
                    help="generation.cache_memory_mb (0: the default, a quarter of the memory)")
    ap.add_argument("--max-streams", type=int, default=0, help="generation.max_streams (0: the default)")
    ap.add_argument("--max-queued", type=int, default=0, help="generation.max_queued_per_model (0: the default)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tree", type=Path, default=ROOT,
                    help="the service's source tree (default: this one; e.g. `git archive` of an older commit)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="edge-flood-"))
    port = free_port()
    proc = start(tmp, port, args)
    url = f"http://127.0.0.1:{port}"
    try:
        warm = requests.post(url + "/v1/completions", timeout=120,
                             json={"model": "chat", "prompt": "<user>hi\n<assistant>", "max_tokens": 4})
        assert warm.status_code == 200, warm.text
        before = tree_memory(proc.pid)
        sampler = Sampler(url, proc.pid)
        sampler.start()
        started, started_wall = time.monotonic(), time.time()
        answers = asyncio.run(flood(port, args.streams, args.max_tokens))
        seconds = time.monotonic() - started
        sampler.finish()
        after = tree_memory(proc.pid)
        status = requests.get(url + "/api/status", timeout=10).json()
    finally:
        proc.terminate()
        proc.wait(30)
    result = report(args, answers, seconds, sampler, before, after, status, started_wall)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    shutil.rmtree(tmp, ignore_errors=True)


def report(args: argparse.Namespace, answers: list[tuple[int, int]], seconds: float, sampler: Sampler,
           before: tuple[float, float, int], after: tuple[float, float, int], status: dict[str, Any],
           started_wall: float) -> dict[str, Any]:
    by_status: dict[str, int] = {}
    for code, _ in answers:
        by_status[str(code)] = by_status.get(str(code), 0) + 1
    health = sorted(sampler.health)
    peak_rss = max((m[0] for m in sampler.memory), default=0.0)
    peak_pss = max((m[1] for m in sampler.memory), default=0.0)
    return {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "tree": str(args.tree),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "streams": args.streams, "workers": len(status.get("workers", [])) or 1,
        "max_tokens": args.max_tokens, "seconds": round(seconds, 2), "answers_by_status": by_status,
        "events_per_200": round(sum(e for c, e in answers if c == 200) / max(1, by_status.get("200", 0)), 1),
        "peak_running": sampler.running, "peak_waiting": sampler.waiting,
        "cache_bytes": {"peak_used": sampler.cache_peak, "total": sampler.cache_total},
        "healthz": {"count": len(health), "failed": sampler.failed,
                    "p50_ms": round(health[len(health) // 2] * 1000, 1) if health else None, "max_ms": round(health[-1] * 1000, 1) if health else None,
                    "p99_ms": round(health[int(len(health) * 0.99) - 1] * 1000, 1) if health else None,
                    # [s after the flood began (negative: before), ms, sent at (epoch s)] of the slowest probes
                    "slowest": [[round(sent - started_wall, 2), round(x * 1000, 1), round(sent, 3)]
                                for sent, x in sampler.slowest]},
        "tree_mib": {"before_rss": round(before[0], 1), "before_pss": round(before[1], 1),
                     "peak_rss": round(peak_rss, 1), "peak_pss": round(peak_pss, 1),
                     "after_rss": round(after[0], 1), "after_pss": round(after[1], 1), "processes": after[2]},
        "refusals": sorted({f"{code}: {text.split(':', 2)[-1][:90]}" for code, text in WHY})[:6],
        "generation": {k: status.get("generation", {}).get(k) for k in ("streams_started", "streams_cancelled",
                                                                      "requests_waiting", "active_streams")},
    }


if __name__ == "__main__":
    main()
