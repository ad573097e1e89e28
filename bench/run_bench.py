"""Batching benchmark: in-process limit, the service over HTTP, the naive baseline, memory.

    .venv/bin/python bench/run_bench.py [--duration 8] [--conc 1,8,32] [--models mlp,cnn]
                                        [--backends tflite,tf-cpu] [--out bench/RESULTS.md]

Builds the bench models (same architectures and shapes as ../shared/peer-bench) once,
measures the bare backend call at batch 1/8/32, then serves them and loads them with
bench/loadgen.py (closed loop, one keep-alive connection per client, loopback) at each
concurrency with batching on and off, then the naive Flask + TensorFlow server the same
way, then the service's RSS with both models loaded and after --soak requests. Appends a
dated section with the machine, the command and every figure to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402

SHAPES = {"mlp": (64,), "cnn": (96, 96, 3)}
MODELS_CACHE = Path(os.environ.get("EDGE_BENCH_MODELS", "/tmp/edge-appliance-bench-models"))


def bench_models() -> Path:
    if not (MODELS_CACHE / ".complete").exists():
        from tests.support import modelgen

        shutil.rmtree(MODELS_CACHE, ignore_errors=True)
        modelgen.build_bench_models(str(MODELS_CACHE))
        (MODELS_CACHE / ".complete").write_text("ok")
    return MODELS_CACHE


def body(model: str, seed: int = 0) -> bytes:
    rnd = random.Random(seed)
    shape = SHAPES[model]
    flat = [round(rnd.gauss(0.0, 1.0), 3) for _ in range(int(__import__("math").prod(shape)))]

    def nest(values: list[float], dims: tuple[int, ...]) -> list:
        if len(dims) == 1:
            return values
        step = len(values) // dims[0]
        return [nest(values[i * step:(i + 1) * step], dims[1:]) for i in range(dims[0])]

    return json.dumps({"instances": [nest(flat, shape)]}, separators=(",", ":")).encode()


def raw_limit(base: Path, models: list[str], backends: list[str], seconds: float) -> list[dict]:
    """Samples/s of the bare backend call, the ceiling any server on this device can reach."""
    import numpy as np

    import runtimes

    rows = []
    for backend_name in backends:
        backend = runtimes.default_backends()[backend_name]
        for model in models:
            servable = backend.load(str(base / model / "1"), {"num_threads": os.cpu_count(), "pool_size": 1})
            sig = servable.signatures["serving_default"]
            name = next(iter(sig.inputs))
            for batch in (1, 8, 32):
                x = np.random.default_rng(0).standard_normal((batch, *SHAPES[model])).astype(np.float32)
                servable.run(sig.name, {name: x})
                n, start = 0, time.perf_counter()
                while time.perf_counter() - start < seconds:
                    servable.run(sig.name, {name: x})
                    n += 1
                elapsed = time.perf_counter() - start
                rows.append({"backend": backend_name, "model": model, "batch": batch,
                             "samples_per_s": round(n * batch / elapsed, 1),
                             "ms_per_call": round(1000 * elapsed / n, 3)})
            servable.close()
    return rows


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def start_service(base: Path, backend: str, batching: bool, port: int, state: Path,
                  extra_config: str = "", checkout: Path = ROOT) -> subprocess.Popen:
    """The service on ``base``; ``extra_config``: more TOML tables appended to its config;
    ``checkout``: the tree (and its .venv) whose service runs: another one for a before/after
    comparison in one run."""
    config = state / "bench.toml"
    state.mkdir(parents=True, exist_ok=True)
    config.write_text(f'models_dir = "{base}"\nstate_dir = "{state}"\npoll_interval_s = 60\n'
                      f'[runtime]\nbackend = "{backend}"\n[batching]\nenable_batching = {str(batching).lower()}\n'
                      + extra_config)
    python = sys.executable if checkout == ROOT else str(checkout / ".venv" / "bin" / "python")
    proc = subprocess.Popen([python, "-m", "appliance.cli", "serve", "--config", str(config),
                             "--host", "127.0.0.1", "--port", str(port)], cwd=checkout,
                            stdout=subprocess.DEVNULL, stderr=open(state / "server.log", "wb"))
    wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
    return proc


def start_naive(base: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "naive_server.py"), str(base), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import urllib.request

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/models/mlp:predict", data=body("mlp"))
            urllib.request.urlopen(req, timeout=5)
            return proc
        except OSError:
            time.sleep(0.5)
    stop(proc)  # never leave it behind holding the port
    raise RuntimeError("naive server did not start")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def load_points(label: str, port: int, models: list[str], conc: list[int], duration: float, proc) -> list[dict]:
    rows = []
    for model in models:
        for c in conc:
            cpu0 = tree_cpu(proc.pid)
            t0 = time.perf_counter()
            r = asyncio.run(loadgen.run(f"http://127.0.0.1:{port}/v1/models/{model}:predict", body(model), c,
                                        duration, 1.0, b"predictions"))
            r["server_cpu_pct"] = round(100 * (tree_cpu(proc.pid) - cpu0) / (time.perf_counter() - t0), 1)
            r.update(server=label, model=model)
            print(json.dumps(r), flush=True)
            rows.append(r)
    return rows


def tree_cpu(pid: int, alone: bool = False) -> float:
    """CPU seconds (user + system) of the process and its descendants, or of it ``alone``."""
    try:
        p = psutil.Process(pid)
        procs = [p] if alone else [p, *p.children(recursive=True)]
        return sum(sum(x.cpu_times()[:2]) for x in procs)
    except psutil.Error:
        return 0.0


def memory(base: Path, port: int, state: Path, soak: int) -> dict:
    """RSS with both models loaded, after a 10k-request warm-up (interpreter pools, buffers and
    the metrics window fill up), and after ``soak`` more: growth is measured from the warm level."""
    proc = start_service(base, "tflite", True, port, state)
    url = f"http://127.0.0.1:{port}/v1/models/mlp:predict"
    try:
        rss_loaded = psutil.Process(proc.pid).memory_info().rss
        asyncio.run(loadgen.run(url, body("mlp"), 32, 3600, 0.0, None, max_requests=10000))
        rss0 = psutil.Process(proc.pid).memory_info().rss
        r = asyncio.run(loadgen.run(url, body("mlp"), 32, 3600, 0.0, None, max_requests=soak))
        time.sleep(1)
        rss1 = psutil.Process(proc.pid).memory_info().rss
        return {"rss_loaded_mb": round(rss_loaded / 2**20, 1), "rss_warm_mb": round(rss0 / 2**20, 1),
                "rss_after_mb": round(rss1 / 2**20, 1), "requests": r["ok"], "errors": r["errors"],
                "growth_pct": round(100 * (rss1 - rss0) / rss0, 2)}
    finally:
        stop(proc)


def markdown(args: argparse.Namespace, raw: list[dict], points: list[dict], mem: dict | None) -> str:
    lines = [f"\n## Batching benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, {psutil.virtual_memory().total // 2**30} GiB, "
             f"Python {platform.python_version()}. Command: `{' '.join(sys.argv)}`\n",
             "In-process limit (bare backend call, no HTTP):\n",
             "| backend | model | batch | samples/s | ms/call |", "|---|---|---|---|---|"]
    lines += [f"| {r['backend']} | {r['model']} | {r['batch']} | {r['samples_per_s']} | {r['ms_per_call']} |" for r in raw]
    lines += ["", "Over HTTP on loopback (closed loop, single-sample JSON requests; client CPU is the load "
              "generator's own share of one core):\n",
              "| server | model | conc | req/s | p50 ms | p99 ms | errors | server CPU % | client CPU % |",
              "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {p['server']} | {p['model']} | {p['concurrency']} | {p['rps']} | {p['p50_ms']} | {p['p99_ms']} | "
              f"{p['errors']} | {p['server_cpu_pct']} | {p['client_cpu_pct']} |" for p in points]
    if mem:
        lines += ["", f"Memory (tflite, both models loaded): RSS {mem['rss_loaded_mb']} MB loaded, {mem['rss_warm_mb']} MB "
                  f"after a 10k-request warm-up, {mem['rss_after_mb']} MB after {mem['requests']} more requests "
                  f"({mem['errors']} errors): growth {mem['growth_pct']} % from the warm level."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=8)
    ap.add_argument("--conc", default="1,8,32")
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--backends", default="tflite,tf-cpu", help="'none': only the naive baseline and memory")
    ap.add_argument("--batching", default="on,off")
    ap.add_argument("--naive", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--soak", type=int, default=100000, help="requests for the memory-growth check (0: skip)")
    ap.add_argument("--raw-seconds", type=float, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    args = ap.parse_args()
    models, conc = args.models.split(","), [int(c) for c in args.conc.split(",")]
    base = bench_models()
    backends = [] if args.backends == "none" else args.backends.split(",")
    raw = raw_limit(base, models, backends, args.raw_seconds)
    for r in raw:
        print(json.dumps(r), flush=True)
    points: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="edge-bench-"))
    port = 18900
    for backend in backends:
        for mode in args.batching.split(","):
            proc = start_service(base, backend, mode == "on", port, work / f"{backend}-{mode}")
            try:
                points += load_points(f"edge-appliance {backend} batching {mode}", port, models, conc, args.duration, proc)
            finally:
                stop(proc)
    if args.naive:
        try:
            proc = start_naive(base, port + 1)
        except RuntimeError as exc:  # the baseline failing must not lose the service's figures
            print(f"naive baseline skipped: {exc}", file=sys.stderr)
        else:
            try:
                points += load_points("naive Flask+TF (waitress)", port + 1, models, conc, args.duration, proc)
            finally:
                stop(proc)
    mem = memory(base, port + 2, work / "mem", args.soak) if args.soak else None
    text = markdown(args, raw, points, mem)
    with open(args.out, "a") as f:
        f.write(text)
    print(text)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
