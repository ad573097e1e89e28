"""TF Serving's gRPC Predict against its REST :predict, same service, same model, one run.

    .venv/bin/python bench/grpc_bench.py [--model mlp] [--concurrency 1 8 32] [--duration 8]
        [--rounds N] [--transport lean|grpcio] [--baseline-root DIR]

One service (the bench MLP, LiteRT, batching on) on loopback, with gRPC on. For each
concurrency, alternately: REST and gRPC, both from nghttp2's ``h2load`` by default
(bench/nghttp2_load.py: HTTP/1.1 for REST, h2 for gRPC, the request built once, c connections
with one call in flight each), so one C client does the same work for both and takes little
of the CPUs the server shares. ``--client h2`` uses the Python generators instead
(bench/loadgen.py for REST, bench/h2load.py for gRPC); ``--client grpcio`` calls gRPC with grpc.aio
(one channel, bytes in and out; REST as with h2): a real client, at about three times the
CPU per call.
Prints requests/s and p50/p99 per API, the gRPC/REST ratio (issue 37's bar: >= 1 at 8 and
32 clients through the default workers) and the server's CPU per request (the whole tree).

``--baseline-root DIR``: a second service from another checkout (a ``git archive`` of the
commit before, say) runs beside this tree's, and every round measures REST (this tree),
then gRPC on both, their order swapped each round: before and after in one run, on one box.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import h2load, loadgen, nghttp2_load  # noqa: E402
from bench.run_bench import SHAPES, tree_cpu, bench_models, body, stop, wait_ready  # noqa: E402
from tests.support.servers import free_port  # noqa: E402

PREDICT = "/tensorflow.serving.PredictionService/Predict"


def predict_bytes(model: str) -> bytes:
    """The PredictRequest TF Serving's own client sends for the REST body's numbers:
    tensorflow-serving-api's users build tensors with ``tf.make_tensor_proto``, which packs a
    numeric array into ``tensor_content`` (raw little-endian bytes), not the typed fields."""
    from appliance.protos.tfserving import pb

    request = pb.PredictRequest()
    request.model_spec.name = model
    x = np.asarray(json.loads(body(model))["instances"], dtype=np.float32)
    tensor = request.inputs["input"]  # the bench models' input (bench/run_bench.py builds them)
    tensor.dtype = 1  # DT_FLOAT
    for size in x.shape:
        tensor.tensor_shape.dim.add(size=size)
    tensor.tensor_content = x.astype("<f4").tobytes()
    return bytes(request.SerializeToString())


async def grpc_run(port: int, request: bytes, concurrency: int, duration: float, warmup: float) -> dict[str, Any]:
    import grpc

    record: list[float] = []
    errors: dict[str, int] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(PREDICT)  # bytes in, bytes out: no client-side protobuf work
        start = time.perf_counter()
        measure_from, stop_at = start + warmup, start + warmup + duration

        async def client() -> None:
            while time.perf_counter() < stop_at:
                began = time.perf_counter()
                try:
                    await call(request, timeout=30)
                except grpc.aio.AioRpcError as exc:
                    errors[exc.code().name] = errors.get(exc.code().name, 0) + 1
                    continue
                if began >= measure_from:
                    record.append(time.perf_counter() - began)

        await asyncio.gather(*(client() for _ in range(concurrency)))
    lat = sorted(record)
    return {"concurrency": concurrency, "ok": len(lat), "errors": sum(errors.values()), "error_kinds": errors,
            "rps": round(len(lat) / duration, 1), "p50_ms": round(loadgen.percentile(lat, 0.5) * 1000, 3),
            "p99_ms": round(loadgen.percentile(lat, 0.99) * 1000, 3)}


def _split(result: dict[str, Any]) -> str:
    split = result.get("cpu_us_per_request")
    return "(us/req: " + ", ".join(f"{k} {v}" for k, v in split.items() if v is not None) + ") " if split else ""


def _cpu(pid: int) -> tuple[float, float, float]:
    """CPU seconds so far of the service's whole tree, of its serving process alone, and of
    this process's waited-for children (each h2load run is one; the services are not waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return tree_cpu(pid), tree_cpu(pid, alone=True), usage.ru_utime + usage.ru_stime


def _latency(result: dict[str, Any]) -> str:
    if "p50_ms" in result:
        return f"p50 {result['p50_ms']:7.2f} p99 {result['p99_ms']:7.2f} ms"
    return f"mean {result.get('mean_ms', 0):7.2f} max {result.get('max_ms', 0):7.2f} ms"


async def _sync(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """A blocking load generator (h2load, a subprocess) where ``measured`` awaits one."""
    return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))


def start(root: Path, base: Path, port: int, grpc_port: int, state: Path, transport: str,
          workers: int = 0) -> subprocess.Popen:
    """The service of the checkout at ``root`` (the bench MLP on LiteRT, batching on, gRPC on;
    ``workers``: ``[server] workers``, 0 the default)."""
    state.mkdir(parents=True, exist_ok=True)
    config = state / "bench.toml"
    config.write_text(f'models_dir = "{base}"\nstate_dir = "{state}"\npoll_interval_s = 60\n[runtime]\n'
                      f'backend = "tflite"\n[batching]\nenable_batching = true\n[discovery]\nenabled = false\n'
                      f'[grpc]\nport = {grpc_port}\ntransport = "{transport}"\n'
                      + (f"[server]\nworkers = {workers}\n" if workers else ""))
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve", "--config", str(config), "--host",
                             "127.0.0.1", "--port", str(port)], cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                            stdout=subprocess.DEVNULL, stderr=open(state / "server.log", "wb"))
    wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
    return proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp", choices=sorted(SHAPES))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--client", choices=["nghttp2", "h2", "grpcio"], default="nghttp2",
                    help="the load generator: nghttp2's h2load for both APIs (C, HTTP/1.1 for REST), or "
                         "Python ones (bench/loadgen.py for REST with h2: bench/h2load.py; grpcio: grpc.aio)")
    ap.add_argument("--transport", choices=["lean", "grpcio"], default="lean",
                    help="the service's gRPC server ([grpc] transport)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="REST and gRPC alternated this many times per concurrency (this box is noisy)")
    ap.add_argument("--baseline-root", type=Path, help="also run gRPC on the service of this checkout")
    ap.add_argument("--workers", type=int, default=0, help="[server] workers of this tree's service (0: default)")
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()
    base = bench_models()
    state = Path(tempfile.mkdtemp(prefix="grpc-bench-"))
    servers: dict[str, tuple[subprocess.Popen, int, int]] = {}
    rows = []
    try:
        roots = {"after": ROOT, **({"before": a.baseline_root.resolve()} if a.baseline_root else {})}
        for label, root in roots.items():
            port, grpc_port = free_port(), free_port()
            servers[label] = (start(root, base, port, grpc_port, state / label, a.transport,
                                    a.workers if label == "after" else 0), port, grpc_port)
        payload, request = body(a.model), predict_bytes(a.model)
        url = f"http://127.0.0.1:{servers['after'][1]}/v1/models/{a.model}:predict"

        def measured(run: Any, label: str = "after") -> dict[str, Any]:
            """The run's figures plus the server's CPU per request: what the API costs the
            device, whatever the load generator (Python on the same CPUs) costs itself."""
            pid = servers[label][0].pid  # the whole tree: the zygote's front workers are grandchildren
            before = _cpu(pid)
            result = asyncio.run(run)
            spent, serving, client = (after - was for was, after in zip(before, _cpu(pid)))
            total = result["ok"] * (a.duration + a.warmup) / a.duration  # warm-up requests cost CPU too
            result["server_cpu_ms_per_request"] = round(1000 * spent / total, 3) if total else None
            if total:  # where it went: the serving process, the workers (and zygote), h2load itself
                result["cpu_us_per_request"] = {"serving": round(1e6 * serving / total, 1),
                                                "workers": round(1e6 * (spent - serving) / total, 1),
                                                "client": round(1e6 * client / total, 1) if a.client == "nghttp2" else None}
            return result

        for i, c in enumerate(c for c in a.concurrency for _ in range(a.rounds)):
            rest = measured(_sync(nghttp2_load.run, url, payload, c, a.duration, a.warmup, h1=True)
                            if a.client == "nghttp2" else loadgen.run(url, payload, c, a.duration, a.warmup,
                                                                       b"predictions"))
            print(f"c={c:3d}  REST          {rest['rps']:8.1f} req/s {_latency(rest)} | server CPU {rest['server_cpu_ms_per_request']} ms/req "
                  f"{_split(rest)}(errors {rest['errors']})", flush=True)
            row: dict[str, Any] = {"concurrency": c, "rest": rest}
            for label in sorted(servers, reverse=bool(i % 2)):  # "after" first in even rounds
                grpc_port = servers[label][2]
                if a.client == "nghttp2":
                    run = _sync(nghttp2_load.run, f"http://127.0.0.1:{grpc_port}{PREDICT}",
                                nghttp2_load.grpc_body(request), c, a.duration, a.warmup, grpc=True)
                elif a.client == "h2":
                    run = h2load.run("127.0.0.1", grpc_port, PREDICT, request, c, a.duration, a.warmup)
                else:
                    run = grpc_run(grpc_port, request, c, a.duration, a.warmup)
                grpc_ = row[f"grpc_{label}"] = measured(run, label)
                ratio = row[f"ratio_{label}"] = round(grpc_["rps"] / rest["rps"], 2) if rest["rps"] else None
                print(f"c={c:3d}  gRPC {label:>6s}  {grpc_['rps']:8.1f} req/s {_latency(grpc_)} | server CPU {grpc_['server_cpu_ms_per_request']} ms/req | "
                      f"gRPC/REST {ratio}x {_split(grpc_)}(errors {grpc_['errors']})", flush=True)
            rows.append(row)
    finally:
        for proc, _, _ in servers.values():
            stop(proc)
        shutil.rmtree(state, ignore_errors=True)
    result = {"machine": f"{platform.node()} {platform.machine()} {psutil.cpu_count()} cpus",
              "date": time.strftime("%Y-%m-%d %H:%M"), "model": a.model, "client": a.client,
              "transport": a.transport, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
