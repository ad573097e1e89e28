"""Small-device footprint: a LiteRT-only install against the full one, the whole process tree.

    PYTHONPATH=. .venv/bin/python -m bench.footprint [--workers 1,2,3] [--requests 100000]
        [--idle-seconds 30] [--installs lite,full] [--out bench/RESULTS.md]

Builds a fresh venv with only the ``tflite`` extra (cached per pyproject hash; it must not hold
TensorFlow), then for it and for the full .venv: size on disk without pip and setuptools (what
a device installs to run, as issue 34 measures it), and for each ``[server] workers`` value,
serving the bench MLP as TFLite: cold start to ``/readyz`` 200 (median of 5 after a first
start that caches the backend decision), every process of the tree (the serving process, the
workers' zygote, each worker) with its RSS, PSS and USS from ``/proc/PID/smaps_rollup`` (PSS
splits each shared page among the processes sharing it, so the tree's PSS is what the service
costs the device), idle, then after ``--requests`` MLP requests (concurrency 8), and the
tree's CPU while idle.
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
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402
from bench.run_bench import bench_models, body, stop  # noqa: E402

NOT_INSTALLED = ("pip", "setuptools", "pkg_resources", "_distutils_hack", "distutils-precedence.pth")


def lite_venv() -> Path:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    venv = Path(f"/tmp/edge-appliance-lite-venv-{digest}")
    if not (venv / ".complete").exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-e", f"{ROOT}[tflite]"],
                       check=True)
        (venv / ".complete").write_text("ok")
    check = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util as u; "
                            "print(u.find_spec('tensorflow') is None)"], capture_output=True, text=True, check=True)
    assert check.stdout.strip() == "True", "the LiteRT-only venv holds TensorFlow"
    return venv


def du_kb(path: Path) -> int:
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def installed_kb(venv: Path) -> int:
    """The venv's size on disk less pip and setuptools (and their dist-info)."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    left_out = [p for p in site.iterdir() if p.name.split("-")[0] in NOT_INSTALLED or p.name in NOT_INSTALLED]
    return du_kb(venv) - sum(du_kb(p) for p in left_out)


def packages(venv: Path) -> int:
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                         capture_output=True, text=True, check=True).stdout
    return len([line for line in out.splitlines() if line and not line.startswith(("pip==", "setuptools=="))])


def start(venv: Path, models: Path, state: Path, port: int, workers: int) -> tuple[subprocess.Popen, float, float]:
    """The service started and ready: (process, wall seconds to ready, the tree's CPU seconds by then:
    the part of a cold start that a loaded machine does not inflate)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(venv / "bin" / "python"), "-m", "appliance.cli", "serve", "--models", str(models),
                             "--host", "127.0.0.1", "--port", str(port), "--state", str(state), "--workers",
                             str(workers), "--grpc-port", "0", "--no-discovery", "--poll-interval", "30"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return proc, time.perf_counter() - t0, cpu_seconds(proc.pid)
        except OSError:
            if proc.poll() is not None or time.perf_counter() - t0 > 120:
                raise RuntimeError("service did not become ready")
            time.sleep(0.01)


def smaps(pid: int) -> dict[str, float]:
    """RSS, PSS and USS of ``pid`` in MB (MiB), from /proc/PID/smaps_rollup."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            value = rest.split()
            if len(value) == 2 and value[1] == "kB":
                fields[name] = int(value[0])
    return {"rss": fields["Rss"] / 1024, "pss": fields["Pss"] / 1024,
            "uss": (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024}


def tree(pid: int) -> list[dict[str, Any]]:
    """Every process of the service: the serving process first, then the zygote, then workers."""
    root = psutil.Process(pid)
    out = []
    for proc in [root, *root.children(recursive=True)]:
        role = "serving" if proc.pid == pid else ("zygote" if proc.ppid() == pid and proc.children() else "worker")
        out.append({"pid": proc.pid, "role": role, **smaps(proc.pid)})
    return out


def cpu_seconds(pid: int) -> float:
    root = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])


def measure(venv: Path, models: Path, workers: int, idle_seconds: float, requests: int, port: int) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="edge-footprint-"))
    starts, cpus = [], []
    for _ in range(6):  # the first start measures and caches the backend decision; the next 5 are counted
        proc, seconds, cpu = start(venv, models, state, port, workers)
        starts.append(seconds)
        cpus.append(cpu)
        stop(proc)
    proc, _, _ = start(venv, models, state, port, workers)
    try:
        time.sleep(3)  # the workers' first figures, the first status reads
        idle = tree(proc.pid)
        cpu0 = cpu_seconds(proc.pid)
        time.sleep(idle_seconds)
        idle_cpu = 100 * (cpu_seconds(proc.pid) - cpu0) / idle_seconds
        if requests:
            asyncio.run(loadgen.run(f"http://127.0.0.1:{port}/v1/models/mlp:predict", body("mlp"), 8, 3600, 0,
                                    None, max_requests=requests))
            time.sleep(2)
        after = tree(proc.pid)
    finally:
        stop(proc)
        shutil.rmtree(state, ignore_errors=True)
    return {"workers": workers, "cold_start_s": round(statistics.median(starts[1:]), 2),
            "cold_cpu_s": round(statistics.median(cpus[1:]), 2), "idle": idle,
            "after": after, "idle_cpu_pct": round(idle_cpu, 2)}


def total(procs: list[dict[str, Any]], key: str) -> float:
    return round(sum(p[key] for p in procs), 1)


def rows(install: str, disk: int, npkg: int, results: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in results:
        workers = [p for p in r["idle"] if p["role"] == "worker"]
        zygote = "".join(f"{p['pss']:.1f}" for p in r["idle"] if p["role"] == "zygote") or "-"
        each = ", ".join(f"{p['pss']:.1f} / {p['uss']:.1f}" for p in workers) or "-"
        out.append(f"| {install} | {r['workers']} | {len(r['idle'])} | {disk / 1024:.1f} ({disk} kB) | {npkg} | "
                   f"{r['cold_start_s']} ({r['cold_cpu_s']} CPU) | {total(r['idle'], 'rss')} | {total(r['idle'], 'pss')} | "
                   f"{total(r['after'], 'pss')} | {r['idle'][0]['pss']:.1f} | {zygote} | {each} | "
                   f"{r['idle_cpu_pct']} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", default="1,2,3")
    ap.add_argument("--idle-seconds", type=float, default=30)
    ap.add_argument("--requests", type=int, default=100000)
    ap.add_argument("--installs", default="lite,full")
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    args = ap.parse_args()
    models = Path(tempfile.mkdtemp(prefix="edge-footprint-models-"))
    (models / "mlp" / "1").mkdir(parents=True)
    shutil.copy(bench_models() / "mlp" / "1" / "model.tflite", models / "mlp" / "1" / "model.tflite")
    venvs = {"lite": ("LiteRT-only venv ([tflite])", lite_venv), "full": ("full venv (.venv)", lambda: ROOT / ".venv")}
    table = []
    for key in args.installs.split(","):
        name, make = venvs[key]
        venv = make()
        results = [measure(venv, models, int(w), args.idle_seconds, args.requests, 18950)
                   for w in args.workers.split(",")]
        table += rows(name, installed_kb(venv), packages(venv), results)
    load = os.getloadavg()[0]
    lines = [f"\n## Small-device footprint, the whole process tree, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {load:.1f} at the end. Command: "
             f"`{' '.join(sys.argv)}`. Model: bench MLP as TFLite. MB are MiB (kB / 1024); disk without pip and "
             f"setuptools. PSS after {args.requests} requests at concurrency 8; idle CPU over {args.idle_seconds:.0f} s "
             "(the whole tree).\n",
             "| install | workers | processes | disk MB | packages | cold start to ready s, wall (tree CPU s), median of 5 | idle RSS MB | "
             "idle PSS MB | PSS after MB | serving PSS | zygote PSS | each worker PSS / USS | idle CPU % of a core |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|", *table]
    text = "\n".join(lines) + "\n"
    with open(args.out, "a") as f:
        f.write(text)
    print(text)
    shutil.rmtree(models, ignore_errors=True)


if __name__ == "__main__":
    main()
