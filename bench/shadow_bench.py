"""Shadow rollouts: what a shadow candidate costs the answers, and that it is shed first.

    .venv/bin/python bench/shadow_bench.py [--duration 8] [--conc 8] [--overload 64] [--backend auto]

One service serves the batching benchmark's MLP (bench/run_bench.py) with
``rollout.mode = "shadow"`` and gates that never decide. Phase 1: version 1 alone (no
candidate: the layer passes requests through). Phase 2: a copy of it lands as version 2,
the shadow candidate; every answered request is copied to it. Same load both times: p50
at ``--conc`` clients, the p50 overhead in percent (issue target: <= 5 %). Phase 3:
``--overload`` clients: client errors (must be 0) and shadow copies dropped vs run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402
from bench.run_bench import bench_models, body, stop, wait_ready  # noqa: E402
from tests.support.servers import free_port  # noqa: E402

CONFIG = """
state_dir = "{state}"
poll_interval_s = 0.5
[runtime]
backend = "{backend}"
[[models]]
name = "mlp"
base_path = "{base}"
[models.rollout]
mode = "shadow"
min_requests = 1000000000
max_duration_s = 1000000000.0
shadow_queue = {queue}
shadow_percent = {percent}
shadow_busy_share = {share}
"""


def status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=10) as r:
        return json.loads(r.read())


def figures(port: int) -> dict:
    return (status(port).get("rollouts", {}).get("mlp") or {}).get("active") or {}


def load(port: int, conc: int, duration: float) -> dict:
    return asyncio.run(loadgen.run(f"http://127.0.0.1:{port}/v1/models/mlp:predict", body("mlp"), conc,
                                   duration, 1.0, b"predictions"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=8)
    ap.add_argument("--conc", type=int, default=8)
    ap.add_argument("--overload", type=int, default=64)
    ap.add_argument("--queue", type=int, default=64, help="rollout.shadow_queue")
    ap.add_argument("--percent", type=float, default=100.0, help="rollout.shadow_percent")
    ap.add_argument("--share", type=float, default=0.05, help="rollout.shadow_busy_share")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shadow-bench-"))
    base = work / "mlp"
    shutil.copytree(bench_models() / "mlp" / "1", base / "1")
    port = free_port()
    (work / "state").mkdir()
    config = work / "bench.toml"
    config.write_text(CONFIG.format(state=work / "state", backend=args.backend, base=base, queue=args.queue,
                                     percent=args.percent, share=args.share))
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve", "--config", str(config), "--host",
                             "127.0.0.1", "--port", str(port), "--no-discovery", "--grpc-port", "0"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(work / "server.log", "wb"))
    try:
        wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
        alone = load(port, args.conc, args.duration)
        print(json.dumps({"phase": "serving alone", **alone}), flush=True)
        shutil.copytree(base / "1", work / "stage")
        (work / "stage").rename(base / "2")
        deadline = time.monotonic() + 180
        while status(port)["models"]["mlp"].get("candidate_version") != 2 or not any(
                v["state"] == "AVAILABLE" and v["version"] == 2 for v in status(port)["models"]["mlp"]["versions"]):
            if time.monotonic() > deadline:
                raise SystemExit("the candidate did not load within 180 s")
            time.sleep(0.5)
        load(port, 1, 1.0)  # the layer starts the rollout on first sight
        before = figures(port)
        shadow = load(port, args.conc, args.duration)
        after = figures(port)
        overhead = 100 * (shadow["p50_ms"] - alone["p50_ms"]) / alone["p50_ms"]
        print(json.dumps({"phase": "with shadow candidate", **shadow, "p50_overhead_pct": round(overhead, 1),
                          "shadow_run": after["candidate_requests"] - before["candidate_requests"],
                          "shadow_dropped": after["shadow_dropped"] - before["shadow_dropped"]}), flush=True)
        before = figures(port)
        over = load(port, args.overload, args.duration)
        after = figures(port)
        print(json.dumps({"phase": f"overload ({args.overload} clients)", **over,
                          "shadow_run": after["candidate_requests"] - before["candidate_requests"],
                          "shadow_dropped": after["shadow_dropped"] - before["shadow_dropped"]}), flush=True)
    finally:
        stop(proc)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
