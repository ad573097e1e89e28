"""Small-device footprint: a LiteRT-only install against the full one.

    .venv/bin/python bench/footprint.py [--idle-seconds 60] [--requests 10000] [--out bench/RESULTS.md]

Builds a fresh venv with only the ``tflite`` extra (cached per pyproject hash), then for it
and for the full .venv: size on disk, number of packages, cold start to /readyz 200 for
the bench MLP as TFLite (median of 5, the backend decision cached from the first start),
RSS idle with the model loaded and after N requests, and CPU used while idle.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402
from bench.run_bench import bench_models, body, stop  # noqa: E402


def lite_venv() -> Path:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    venv = Path(f"/tmp/edge-appliance-lite-venv-{digest}")
    if not (venv / ".complete").exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-e", f"{ROOT}[tflite]"],
                       check=True)
        (venv / ".complete").write_text("ok")
    return venv


def du_mb(path: Path) -> float:
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout
    return round(int(out.split()[0]) / 1024, 1)


def packages(venv: Path) -> int:
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                         capture_output=True, text=True, check=True).stdout
    return len([line for line in out.splitlines() if line and not line.startswith(("pip==", "setuptools=="))])


def start(venv: Path, models: Path, state: Path, port: int) -> tuple[subprocess.Popen, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(venv / "bin" / "python"), "-m", "appliance.cli", "serve", "--models", str(models),
                             "--host", "127.0.0.1", "--port", str(port), "--state", str(state),
                             "--poll-interval", "30"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return proc, time.perf_counter() - t0
        except OSError:
            if proc.poll() is not None or time.perf_counter() - t0 > 120:
                raise RuntimeError("service did not become ready")
            time.sleep(0.02)


def measure(venv: Path, models: Path, idle_seconds: float, requests: int, port: int) -> dict:
    state = Path(tempfile.mkdtemp(prefix="edge-footprint-"))
    starts = []
    for _ in range(6):  # the first start measures and caches the backend decision; the next 5 are counted
        proc, seconds = start(venv, models, state, port)
        starts.append(seconds)
        stop(proc)
    proc, _ = start(venv, models, state, port)
    try:
        p = psutil.Process(proc.pid)
        time.sleep(2)
        rss_idle = p.memory_info().rss
        cpu0 = sum(p.cpu_times()[:2])
        time.sleep(idle_seconds)
        idle_cpu = 100 * (sum(p.cpu_times()[:2]) - cpu0) / idle_seconds
        asyncio.run(loadgen.run(f"http://127.0.0.1:{port}/v1/models/mlp:predict", body("mlp"), 4, 3600, 0,
                                None, max_requests=requests))
        rss_after = p.memory_info().rss
    finally:
        stop(proc)
        shutil.rmtree(state, ignore_errors=True)
    return {"disk_mb": du_mb(venv), "packages": packages(venv), "cold_start_s": round(statistics.median(starts[1:]), 2),
            "rss_idle_mb": round(rss_idle / 2**20, 1), "rss_after_mb": round(rss_after / 2**20, 1),
            "idle_cpu_pct": round(idle_cpu, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle-seconds", type=float, default=60)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    args = ap.parse_args()
    models = Path(tempfile.mkdtemp(prefix="edge-footprint-models-"))
    (models / "mlp" / "1").mkdir(parents=True)
    shutil.copy(bench_models() / "mlp" / "1" / "model.tflite", models / "mlp" / "1" / "model.tflite")
    rows = {"LiteRT-only venv ([tflite])": measure(lite_venv(), models, args.idle_seconds, args.requests, 18950),
            "full venv ([tf,tflite,s3,test])": measure(ROOT / ".venv", models, args.idle_seconds, args.requests, 18951)}
    lines = [f"\n## Small-device footprint, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs. Command: `{' '.join(sys.argv)}`. "
             f"Model: bench MLP as TFLite; idle CPU over {args.idle_seconds:.0f} s; RSS after {args.requests} requests.\n",
             "| install | disk MB | packages | cold start to ready s (median of 5) | RSS idle MB | RSS after MB | idle CPU % of a core |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['disk_mb']} | {r['packages']} | {r['cold_start_s']} | {r['rss_idle_mb']} | "
                     f"{r['rss_after_mb']} | {r['idle_cpu_pct']} |")
    text = "\n".join(lines) + "\n"
    with open(args.out, "a") as f:
        f.write(text)
    print(text)
    shutil.rmtree(models, ignore_errors=True)


if __name__ == "__main__":
    main()
