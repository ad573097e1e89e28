"""Every core for HTTP and JSON (issue 23): the service with one process and with front
workers, both bench models, in one run.

    PYTHONPATH=. .venv/bin/python -m bench.cores_bench [--workers 1,2] [--conc 1,32]
        [--models mlp,cnn] [--duration 8] [--rounds 2] [--load-procs 1] [--soak 100000]
        [--compare OTHER_CHECKOUT] [--out bench/RESULTS.md]

``--workers``: ``[server] workers`` values to compare (1 is the single-process path). Each
round starts the service once per value (LiteRT, batching on, the bench models of
bench/run_bench.py) and loads each model at each concurrency with single-sample TF Serving
JSON (closed loop, keep-alive, loopback; ``--load-procs`` generators in processes of their
own, for machines with more cores than one generator can load). Rounds alternate the
values, so every ratio is from one run. Per point: req/s, p50/p99, errors, the generator's
CPU, and the server's CPU per request, process by process.

Also: the bare batch-1 call of each model in this process (c=1 p50 minus it is what HTTP,
JSON and the hand-off cost a lone request); the CNN request's JSON decode rate on one core
(``json_format.loads`` + ``decode_predict`` of the bench body), times the CPU count, the
ceiling a server that decodes on every core can reach, beside the c=32 CNN figure; and
memory: every process's RSS and PSS (shared pages split among the processes that share
them, so the sum is what the service costs the device), idle and after ``--soak`` MLP
requests, for each workers value.

``--compare``: another checkout of the project (with its own .venv), run at every point beside
this one, alternating within each round: a before/after comparison measured in one window.

Appends a dated section (machine, command, tables) to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402
from bench.run_bench import SHAPES, bench_models, body, start_service, stop  # noqa: E402

PORT = 18950


def processes(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def cpu_by_process(pid: int) -> dict[int, float]:
    out = {}
    for p in processes(pid):
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def memory_by_process(pid: int) -> list[dict[str, Any]]:
    rows = []
    for p in processes(pid):
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        rows.append({"pid": p.pid, "role": "serving" if p.pid == pid else "worker",
                     "rss_mb": round(info.rss / 2**20, 1), "pss_mb": round(getattr(info, "pss", info.rss) / 2**20, 1)})
    return rows


def load(url: str, data: bytes, concurrency: int, duration: float, procs: int, max_requests: int = 0) -> dict:
    """One closed-loop point; with ``procs`` > 1, that many generator processes, summed."""
    if procs <= 1:
        return asyncio.run(loadgen.run(url, data, concurrency, duration, 1.0, b"predictions", max_requests))
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        f.write(data)
    share = [concurrency // procs + (i < concurrency % procs) for i in range(procs)]
    runs = [subprocess.Popen([sys.executable, "-m", "bench.loadgen", url, "--body-file", f.name, "-c", str(c),
                              "--duration", str(duration), "--warmup", "1", "--expect", "predictions", "--json"],
                             cwd=ROOT, stdout=subprocess.PIPE) for c in share if c]
    results = [json.loads(r.communicate()[0]) for r in runs]
    os.unlink(f.name)
    total = sum(r["ok"] for r in results)
    return {"concurrency": concurrency, "ok": total, "errors": sum(r["errors"] for r in results),
            "rps": round(sum(r["rps"] for r in results), 1),
            "p50_ms": round(max(r["p50_ms"] for r in results), 3), "p99_ms": round(max(r["p99_ms"] for r in results), 3),
            "client_cpu_pct": round(sum(r["client_cpu_pct"] for r in results), 1)}


def point(port: int, proc: subprocess.Popen, model: str, concurrency: int, duration: float, procs: int) -> dict:
    url = f"http://127.0.0.1:{port}/v1/models/{model}:predict"
    cpu0 = cpu_by_process(proc.pid)
    r = load(url, body(model), concurrency, duration, procs)
    cpu1 = cpu_by_process(proc.pid)
    requests = max(1, r["ok"])
    per = {("serving" if pid == proc.pid else "worker"): 0.0 for pid in cpu1}
    for pid, seconds in cpu1.items():
        role = "serving" if pid == proc.pid else "worker"
        per[role] += 1000 * (seconds - cpu0.get(pid, 0.0)) / requests  # warm-up included: an upper bound
    r.update(model=model, cpu_ms_per_request={k: round(v, 3) for k, v in per.items()})
    return r


def in_process(base: Path) -> dict[str, float]:
    """ms of one bare batch-1 call of each model (LiteRT), median of 200."""
    import numpy as np

    import runtimes

    out = {}
    backend = runtimes.default_backends()["tflite"]
    for model, shape in SHAPES.items():
        servable = backend.load(str(base / model / "1"), {"num_threads": os.cpu_count(), "pool_size": 1})
        sig = servable.signatures["serving_default"]
        x = {next(iter(sig.inputs)): np.random.default_rng(0).standard_normal((1, *shape)).astype(np.float32)}
        times = []
        for _ in range(200):
            t = time.perf_counter()
            servable.run(sig.name, x)
            times.append(time.perf_counter() - t)
        servable.close()
        out[model] = round(1000 * sorted(times)[len(times) // 2], 3)
    return out


def decode_rate(base: Path) -> float:
    """CNN requests/s one core decodes (TF Serving JSON -> numpy), as the service does it."""
    from appliance.api.tfserving import json_format
    from runtimes import SignatureInfo, TensorSpec

    import numpy as np

    spec = TensorSpec("input", np.dtype(np.float32), (-1, *SHAPES["cnn"]))
    sig = SignatureInfo("serving_default", {"input": spec}, {})
    data = body("cnn")
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < 3:
        json_format.decode_predict(json_format.loads(data), sig, data)
        n += 1
    return round(n / (time.perf_counter() - start), 1)


def soak(port: int, proc: subprocess.Popen, requests: int) -> dict:
    idle = memory_by_process(proc.pid)
    r = asyncio.run(loadgen.run(f"http://127.0.0.1:{port}/v1/models/mlp:predict", body("mlp"), 32, 3600, 0.0,
                                b"predictions", max_requests=requests)) if requests else {"ok": 0, "errors": 0}
    time.sleep(1.5)  # the workers' memory settles, their figures reach the status
    return {"idle": idle, "after": memory_by_process(proc.pid), "requests": r["ok"], "errors": r["errors"]}


def markdown(args: argparse.Namespace, points: list[dict], bare: dict[str, float], rate: float,
             memory: dict[str, dict]) -> str:
    cpus = os.cpu_count() or 1
    lines = [f"\n## Every core: front workers against one process, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
             f"Machine: {platform.machine()}, {cpus} CPUs ({platform.processor() or 'cpu'}), "
             f"{psutil.virtual_memory().total // 2**30} GiB, Python {platform.python_version()}, load average "
             f"{os.getloadavg()[0]:.1f} at the end. Command: `{' '.join(sys.argv)}`\n",
             "| tree | workers | round | model | conc | req/s | p50 ms | p99 ms | errors | client CPU % | server CPU ms/req (serving + workers) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        cpu = p["cpu_ms_per_request"]
        lines.append(f"| {p['tree']} | {p['workers']} | {p['round']} | {p['model']} | {p['concurrency']} | {p['rps']} | {p['p50_ms']} | "
                     f"{p['p99_ms']} | {p['errors']} | {p['client_cpu_pct']} | "
                     f"{cpu.get('serving', 0)} + {cpu.get('worker', 0)} |")
    lines += ["", f"Bare batch-1 call in-process (LiteRT): mlp {bare.get('mlp')} ms, cnn {bare.get('cnn')} ms; "
              f"c=1 p50 minus it is what a lone request pays for HTTP, JSON and the hand-off.",
              f"CNN JSON decode on one core: {rate} req/s; x {cpus} CPUs = {round(rate * cpus, 1)} req/s, the "
              "decode ceiling of a server that decodes on every core.", "",
              "Memory (RSS / PSS MB: PSS splits shared pages among the processes sharing them):", "",
              "| tree, workers | state | serving | workers | total RSS | total PSS |", "|---|---|---|---|---|---|"]
    for workers, m in memory.items():
        for state in ("idle", "after"):
            rows = m[state]
            label = "idle" if state == "idle" else f"after {m['requests']} requests"
            serving = " / ".join(f"{r['rss_mb']} / {r['pss_mb']}" for r in rows if r["role"] == "serving")
            fronts = ", ".join(f"{r['rss_mb']} / {r['pss_mb']}" for r in rows if r["role"] == "worker") or "-"
            total_rss = round(sum(r["rss_mb"] for r in rows), 1)
            total_pss = round(sum(r["pss_mb"] for r in rows), 1)
            lines.append(f"| {workers} | {label} | {serving} | {fronts} | {total_rss} | {total_pss} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--conc", default="1,32")
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--duration", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--load-procs", type=int, default=1)
    ap.add_argument("--soak", type=int, default=100000, help="MLP requests before the second memory reading (0: none)")
    ap.add_argument("--compare", default="", help="another checkout (with its .venv), run beside this one")
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    args = ap.parse_args()
    trees = {"this": ROOT, **({"other": Path(args.compare).resolve()} if args.compare else {})}
    base = bench_models()
    workers = [int(w) for w in args.workers.split(",")]
    conc = [int(c) for c in args.conc.split(",")]
    models = args.models.split(",")
    bare, rate = in_process(base), decode_rate(base)
    print(json.dumps({"bare_ms": bare, "cnn_decode_per_s": rate}), flush=True)
    work = Path(tempfile.mkdtemp(prefix="edge-cores-"))
    points: list[dict] = []
    memory: dict[str, dict] = {}
    try:
        for round_ in range(1, args.rounds + 1):
            for w in workers:
                for tree, checkout in trees.items():
                    config = f"[server]\nworkers = {w}\n[grpc]\nport = 0\n[discovery]\nenabled = false\n"
                    proc = start_service(base, "tflite", True, PORT, work / f"{tree}-w{w}-r{round_}",
                                         extra_config=config, checkout=checkout)
                    try:
                        for model in models:
                            for c in conc:
                                p = point(PORT, proc, model, c, args.duration, args.load_procs)
                                p.update(tree=tree, workers=w, round=round_)
                                print(json.dumps(p), flush=True)
                                points.append(p)
                        if round_ == args.rounds:
                            key = f"{tree}, {w}" if args.compare else str(w)
                            memory[key] = soak(PORT, proc, args.soak)
                            print(json.dumps({"tree": tree, "workers": w, **memory[key]}), flush=True)
                    finally:
                        stop(proc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = markdown(args, points, bare, rate, memory)
    with open(args.out, "a") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
