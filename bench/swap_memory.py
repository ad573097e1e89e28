"""Memory across swaps: 1,000 load/unload cycles of a small model under light load.

    .venv/bin/python -m bench.swap_memory [--cycles 1000] [--threshold-mib 24]

Runs two builds, each in a fresh process, through the real model manager (the LiteRT
backend, the real batcher, a state database on disk) with one client thread predicting
every 5 ms: at each cycle a new version directory appears, the manager loads it, swaps,
drains and unloads the old one, and the old directory is deleted. RSS is sampled after a
warm-up (the first 10 % of cycles) and at the end; the check is ``growth < threshold``.

The negative control (``EDGE_BENCH_LEAK=N``, set for the second build with N = 25) wraps
the backend so that every N-th servable it loads is kept and its ``close()`` does nothing,
as a backend that now and then forgets to free its interpreters would (about 30 KiB per
cycle on average with this model). The same check must trip on it; if it does not, the
check measures nothing and the run fails. Exit status: 0 when the real build passes
and the control trips, 1 otherwise. As Triton's memory-growth QA does.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LEAK_ENV = "EDGE_BENCH_LEAK"
MLP = {"in_dim": 64, "hidden": 256, "out": 10}
MiB = 1 << 20
THRESHOLD_MIB = 8.0  # recorded: the real build grew 2.3 MiB over cycles 100..1000 on x86-64 (2026-12-02)
CONTROL_EVERY = 25


def model_file() -> Path:
    from tests.support import modelgen  # builds with TensorFlow once; the runs themselves use LiteRT only

    digest = hashlib.sha256((ROOT / "tests" / "support" / "modelgen.py").read_bytes() + repr(MLP).encode()).hexdigest()[:12]
    cache = Path(os.environ.get("EDGE_TEST_MODEL_CACHE", "/tmp/edge-appliance-test-models")) / f"swapmlp-{digest}"
    if not (cache / ".complete").exists():
        build = cache.with_name(cache.name + f".build-{os.getpid()}")
        shutil.rmtree(build, ignore_errors=True)
        modelgen.build_keras_mlp_tflite(str(build / "1"), seed=1, **MLP)
        (build / ".complete").write_text("ok")
        shutil.rmtree(cache, ignore_errors=True)
        build.rename(cache)
    return cache / "1" / "model.tflite"


class LeakyServable:
    """The negative control: a servable whose close() forgets to free anything."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def close(self) -> None:
        pass


class BenchBackend:
    """The real backend, optionally turned into the leaking test build."""

    def __init__(self, inner: Any, leak_every: int):
        self._inner, self.leak_every = inner, leak_every
        self.loads = 0
        self.kept: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load(self, path: str, options: Any) -> Any:
        servable = self._inner.load(path, options)
        self.loads += 1
        if not self.leak_every or self.loads % self.leak_every:
            return servable
        self.kept.append(servable)
        return LeakyServable(servable)


def rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def run_cycles(cycles: int, leak_every: int) -> dict[str, Any]:
    """One build, in this process: returns the RSS figures."""
    import numpy as np

    from appliance.core import device as device_mod
    from appliance.core.config import Config
    from appliance.core.manager import Manager
    from appliance.core.sources import DirectorySource
    from appliance.core.state import StateDB
    from runtimes.tflite import TFLiteBackend

    work = Path(tempfile.mkdtemp(prefix="swap-memory-"))
    template = model_file()
    base = work / "models" / "mlp"
    (base / "1").mkdir(parents=True)
    os.link(template, base / "1" / "model.tflite")
    config = Config()
    config.state_dir, config.models_dir, config.poll_interval_s = str(work / "state"), str(work / "models"), 0.0
    config.runtime.backend = "tflite"
    db = StateDB(str(work / "state" / "state.db")).open()
    device = device_mod.profile({})
    backend = BenchBackend(TFLiteBackend(), leak_every)
    manager = Manager(config, db, device, {"tflite": backend})
    manager.start()
    source = DirectorySource("bench", manager, [], str(work / "models"))  # pushes what the folder holds
    source.scan()
    stop, answered, failed = threading.Event(), [0], [0]

    def serving() -> int | None:
        return manager.snapshot().get("mlp", {}).get("serving_version")

    def settled(version: int) -> bool:
        versions = manager.snapshot().get("mlp", {}).get("versions", [])
        return serving() == version and all(v["state"] == "END" for v in versions if v["version"] != version)

    def client() -> None:
        x = {"x": np.full((1, MLP["in_dim"]), 0.1, np.float32)}
        loop = asyncio.new_event_loop()  # a handle's run is awaited, as every API awaits it
        while not stop.wait(0.005):
            try:
                with manager.handle("mlp") as held:
                    loop.run_until_complete(held.run(next(iter(held.signatures)), x))
                answered[0] += 1
            except Exception:  # noqa: BLE001 - counted; a swap must not fail requests
                failed[0] += 1
        loop.close()

    wait_for(lambda: settled(1), 60)
    worker = threading.Thread(target=client, name="light-load", daemon=True)
    worker.start()
    warmup = max(50, cycles // 10)
    samples: dict[int, int] = {}
    started = time.perf_counter()
    try:
        for version in range(2, cycles + 2):
            (base / str(version)).mkdir()
            os.link(template, base / str(version) / "model.tflite")
            source.scan()
            wait_for(lambda: settled(version), 60)
            shutil.rmtree(base / str(version - 1))
            done = version - 1
            if done == warmup or done % 100 == 0 or done == cycles:
                samples[done] = rss()
    finally:
        stop.set()
        worker.join(10)
        manager.close(5)
        db.close()
        shutil.rmtree(work, ignore_errors=True)
    return {"leak_every": leak_every, "cycles": cycles, "warmup": warmup, "seconds": round(time.perf_counter() - started, 1),
            "rss_mib": {k: round(v / MiB, 1) for k, v in sorted(samples.items())},
            "growth_mib": round((samples[cycles] - samples[warmup]) / MiB, 1),
            "answered": answered[0], "failed": failed[0], "kept_by_leak": len(backend.kept)}


def wait_for(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the manager did not settle on the new version")
        time.sleep(0.002)


def child(cycles: int, leak_every: int) -> dict[str, Any]:
    env = {**os.environ, LEAK_ENV: str(leak_every)}
    done = subprocess.run([sys.executable, "-m", "bench.swap_memory", "--child", "--cycles", str(cycles)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"build ({LEAK_ENV}={leak_every}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--threshold-mib", type=float, default=THRESHOLD_MIB)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_cycles(args.cycles, int(os.environ.get(LEAK_ENV) or 0))))
        return 0
    model_file()  # build (TensorFlow) here, not inside the measured processes
    real, control = child(args.cycles, 0), child(args.cycles, CONTROL_EVERY)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}; threshold {args.threshold_mib} MiB over cycles "
          f"{real['warmup']}..{args.cycles}")
    for name, r in (("real build", real), (f"leak 1 in {CONTROL_EVERY}", control)):
        verdict = "PASS" if r["growth_mib"] < args.threshold_mib else "TRIPPED"
        print(f"{name:16} growth {r['growth_mib']:7.1f} MiB  {verdict:7}  {r['cycles']} cycles in {r['seconds']} s, "
              f"{r['answered']} requests answered, {r['failed']} failed, {r['kept_by_leak']} servables leaked; "
              f"RSS MiB by cycle: {r['rss_mib']}")
    ok = real["growth_mib"] < args.threshold_mib <= control["growth_mib"] and real["failed"] == 0
    print("check works and the real build passes" if ok else "FAILED: see the figures above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
