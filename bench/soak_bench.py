"""Soak: mixed traffic for a long time with a version swap every minute; memory, file
descriptors and threads must not grow.

    .venv/bin/python bench/soak_bench.py [--duration 660] [--swap-every 60] [--clients 8] [--json OUT]

Serves the bench MLP (model.tflite, LiteRT) from a fresh model base directory and drives,
all at once for ``--duration`` seconds:

* ``--clients`` closed-loop keep-alive predict clients (bench/loadgen.py, TF Serving REST);
* one client cycling through the other endpoints: model status and metadata, KServe v2
  infer, /api/status, Prometheus metrics, and refused requests (malformed JSON, unknown
  model, wrong shape) that must answer 400/404, never 5xx;
* every ``--swap-every`` seconds a new version directory (version N+1) appears; once it
  serves, version N-1 is deleted, so the device keeps two versions as a synced one does.

The service's RSS, open fds and threads are sampled every 5 s and 5 s after each swap.
RSS swings with the swap cycle, so like is compared with like. Pass: RSS 5 s after the
last swap is within 10 % of RSS 5 s after the first; fds and threads at the end are
no higher than then (plus the few a connection churn may hold, see ``FD_SLACK``). Exit
status 0 on pass, 1 on fail; the figures go to stdout (and ``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402
from bench.run_bench import bench_models, body, stop  # noqa: E402
from tests.support.servers import free_port  # noqa: E402

FD_SLACK = 4  # sockets of clients reconnecting at the moment of the sample
RSS_LIMIT = 0.10


def start(base: Path, state: Path, port: int) -> subprocess.Popen[bytes]:
    config = state / "soak.toml"
    state.mkdir(parents=True, exist_ok=True)
    config.write_text(f'models_dir = "{base}"\nstate_dir = "{state}"\npoll_interval_s = 1.0\n'
                      '[runtime]\nbackend = "tflite"\n[discovery]\nenabled = false\n')
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve", "--config", str(config), "--host",
                             "127.0.0.1", "--port", str(port), "--grpc-port", "0"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(state / "server.log", "wb"))
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return proc
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}; see {state / 'server.log'}")
        time.sleep(0.3)
    stop(proc)
    raise RuntimeError("server not ready in 180 s")


def sample(proc: psutil.Process) -> dict[str, float]:
    return {"t": time.time(), "rss_mb": proc.memory_info().rss / 2**20, "fds": proc.num_fds(),
            "threads": proc.num_threads()}


class Mixed(threading.Thread):
    """The other endpoints, round robin; counts statuses, flags any 5xx."""

    def __init__(self, url: str, stop_at: float):
        super().__init__(name="mixed", daemon=True)
        self.url, self.stop_at = url, stop_at
        self.statuses: dict[str, int] = {}
        self.server_errors: list[str] = []

    def run(self) -> None:
        good = body("mlp").decode()
        v2 = json.dumps({"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": [0.1] * 64}]})
        calls: list[tuple[str, str, Any]] = [
            ("GET", "/v1/models/mlp", None), ("GET", "/v1/models/mlp/metadata", None),
            ("POST", "/v2/models/mlp/infer", v2), ("GET", "/api/status", None),
            ("GET", "/monitoring/prometheus/metrics", None), ("POST", "/v1/models/mlp:predict", "{not json"),
            ("POST", "/v1/models/nope:predict", good), ("POST", "/v1/models/mlp:predict", '{"instances": [[1, 2]]}'),
        ]
        with requests.Session() as session:
            i = 0
            while time.time() < self.stop_at:
                method, path, data = calls[i % len(calls)]
                i += 1
                try:
                    r = session.request(method, self.url + path, data=data, timeout=30)
                    self.statuses[str(r.status_code)] = self.statuses.get(str(r.status_code), 0) + 1
                    if r.status_code >= 500 and r.status_code != 503:
                        self.server_errors.append(f"{method} {path}: {r.status_code} {r.text[:200]}")
                except requests.RequestException as exc:
                    self.server_errors.append(f"{method} {path}: {exc}")
                time.sleep(0.02)


def serving_version(url: str) -> int | None:
    try:
        return requests.get(url + "/api/status", timeout=10).json()["models"]["mlp"]["serving_version"]
    except (requests.RequestException, KeyError, ValueError):
        return None


def run(duration: float, swap_every: float, clients: int) -> dict[str, Any]:
    tflite = bench_models() / "mlp" / "1" / "model.tflite"
    work = Path(tempfile.mkdtemp(prefix="soak-"))
    base = work / "models"
    (base / "mlp" / "1").mkdir(parents=True)
    shutil.copy(tflite, base / "mlp" / "1" / "model.tflite")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start(base, work / "state", port)
    proc = psutil.Process(server.pid)
    started = time.time()
    stop_at = started + duration
    load: dict[str, Any] = {}
    loader = threading.Thread(target=lambda: load.update(asyncio.run(loadgen.run(
        f"{url}/v1/models/mlp:predict", body("mlp"), clients, duration, 0.0, b"predictions"))), daemon=True)
    mixed = Mixed(url, stop_at)
    loader.start()
    mixed.start()
    samples: list[dict[str, float]] = []
    swaps: list[dict[str, Any]] = []
    baseline: dict[str, float] | None = None
    version, next_swap, next_sample = 1, started + swap_every, started
    try:
        while time.time() < stop_at:
            now = time.time()
            if now >= next_sample:
                samples.append(sample(proc))
                next_sample = now + 5
            if now >= next_swap and now + 20 < stop_at:
                version += 1
                swaps.append(swap(url, base, version))
                next_swap = now + swap_every
                time.sleep(5)  # the old version unloaded and its memory returned
                swaps[-1]["after"] = sample(proc)  # the same point of every swap cycle
                if baseline is None:
                    baseline = swaps[-1]["after"]
            time.sleep(0.2)
        loader.join(60)
        mixed.join(60)
        time.sleep(2)  # the last requests' buffers released
        final = sample(proc)
    finally:
        stop(server)
        shutil.rmtree(work, ignore_errors=True)
    assert baseline is not None, "no swap happened: --duration must exceed --swap-every + 20"
    # RSS swings with each swap cycle (two versions loaded, then one): compare like with like,
    # 5 s after the first swap against 5 s after the last one
    end = swaps[-1]["after"]
    growth = (end["rss_mb"] - baseline["rss_mb"]) / baseline["rss_mb"]
    verdict = {"rss_ok": growth <= RSS_LIMIT, "fds_ok": end["fds"] <= baseline["fds"] + FD_SLACK,
               "threads_ok": end["threads"] <= baseline["threads"], "no_5xx": not mixed.server_errors,
               "predict_errors": load.get("errors", -1), "swaps_ok": all(s["served"] for s in swaps)}
    return {"duration_s": duration, "swap_every_s": swap_every, "clients": clients, "swaps": swaps,
            "after_first_swap": baseline, "end": end, "final_sample": final, "rss_growth_pct": round(100 * growth, 2),
            "peak_rss_mb": round(max(s["rss_mb"] for s in samples), 1), "predict": load,
            "mixed_statuses": mixed.statuses, "mixed_server_errors": mixed.server_errors[:10],
            "samples": samples, "verdict": verdict,
            "pass": all(v for k, v in verdict.items() if k.endswith("_ok") or k == "no_5xx")
            and load.get("errors") == 0}


def swap(url: str, base: Path, version: int) -> dict[str, Any]:
    """Publish version ``version`` into the base directory, wait until it serves, drop ``version - 2``."""
    t0 = time.time()
    staged = base / "mlp" / f".{version}"
    staged.mkdir()
    shutil.copy(base / "mlp" / str(version - 1) / "model.tflite", staged / "model.tflite")
    staged.rename(base / "mlp" / str(version))  # appears whole, as the sync store commits
    served = False
    while time.time() - t0 < 40:
        if serving_version(url) == version:
            served = True
            break
        time.sleep(0.2)
    old = base / "mlp" / str(version - 2)
    if version - 2 >= 1 and old.exists():
        shutil.rmtree(old)
    return {"version": version, "served": served, "seconds": round(time.time() - t0, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=660.0)
    ap.add_argument("--swap-every", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()
    result = run(a.duration, a.swap_every, a.clients)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    first, end = result["after_first_swap"], result["end"]
    print(f"soak {a.duration:.0f} s, {len(result['swaps'])} swaps, {a.clients} predict clients + mixed: "
          f"{result['predict'].get('ok')} predictions ({result['predict'].get('rps')} req/s, "
          f"errors {result['predict'].get('errors')}), mixed {result['mixed_statuses']}")
    print(f"RSS after first swap {first['rss_mb']:.1f} MiB -> end {end['rss_mb']:.1f} MiB "
          f"({result['rss_growth_pct']:+.2f} %, peak {result['peak_rss_mb']} MiB); fds {first['fds']} -> {end['fds']}; "
          f"threads {first['threads']} -> {end['threads']}; verdict {result['verdict']}: "
          f"{'PASS' if result['pass'] else 'FAIL'}")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
