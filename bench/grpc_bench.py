"""TF Serving's gRPC Predict against its REST :predict, same service, same model, one run.

    .venv/bin/python bench/grpc_bench.py [--model mlp] [--concurrency 1 8 32] [--duration 8]
        [--rounds N] [--transport lean|grpcio]

One service (the bench MLP, LiteRT, batching on) on loopback, with gRPC on. For each
concurrency, alternately: REST (bench/loadgen.py: keep-alive HTTP/1.1 connections, the JSON
request built once) and gRPC (bench/h2load.py: HTTP/2 connections, the protobuf request
serialized once). The two generators do the same work per call (send prebuilt bytes, frame
the reply, parse nothing), so on a 2-core machine, where the generator's CPU is taken from
the server, neither API is favoured by its client. ``--client grpcio`` uses grpc.aio instead
(one channel, bytes in and out): a real client, at about three times the CPU per call.
Prints requests/s and p50/p99 per API, the gRPC/REST ratio (the issue's target: >= 1.3) and
the server's CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import h2load, loadgen  # noqa: E402
from bench.run_bench import SHAPES, bench_models, body, start_service, stop  # noqa: E402
from tests.conftest import free_port  # noqa: E402

PREDICT = "/tensorflow.serving.PredictionService/Predict"


def predict_bytes(model: str) -> bytes:
    from appliance.api.tfserving.grpc_service import to_tensor
    from appliance.protos.tfserving import pb

    request = pb.PredictRequest()
    request.model_spec.name = model
    x = np.asarray(json.loads(body(model))["instances"], dtype=np.float32)
    to_tensor(x, request.inputs["input"])  # the bench models' input (bench/run_bench.py builds them)
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp", choices=sorted(SHAPES))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--client", choices=["h2", "grpcio"], default="h2", help="the gRPC load generator")
    ap.add_argument("--transport", choices=["lean", "grpcio"], default="lean",
                    help="the service's gRPC server ([grpc] transport)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="REST and gRPC alternated this many times per concurrency (this box is noisy)")
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()
    base = bench_models()
    port, grpc_port = free_port(), free_port()
    state = Path(tempfile.mkdtemp(prefix="grpc-bench-"))
    server = start_service(base, "tflite", True, port, state, f"[grpc]\nport = {grpc_port}\ntransport = \"{a.transport}\"\n")
    rows = []
    try:
        payload, request = body(a.model), predict_bytes(a.model)
        url = f"http://127.0.0.1:{port}/v1/models/{a.model}:predict"
        proc = psutil.Process(server.pid)

        def measured(run: Any) -> dict[str, Any]:
            """The run's figures plus the server's CPU per request: what the API costs the
            device, whatever the load generator (Python on the same CPUs) costs itself."""
            before = sum(proc.cpu_times()[:2])
            result = asyncio.run(run)
            spent = sum(proc.cpu_times()[:2]) - before
            total = result["ok"] * (a.duration + a.warmup) / a.duration  # warm-up requests cost CPU too
            result["server_cpu_ms_per_request"] = round(1000 * spent / total, 3) if total else None
            return result

        for c in [c for c in a.concurrency for _ in range(a.rounds)]:
            rest = measured(loadgen.run(url, payload, c, a.duration, a.warmup, b"predictions"))
            if a.client == "h2":
                grpc_ = measured(h2load.run("127.0.0.1", grpc_port, PREDICT, request, c, a.duration, a.warmup))
            else:
                grpc_ = measured(grpc_run(grpc_port, request, c, a.duration, a.warmup))
            rows.append({"concurrency": c, "rest": rest, "grpc": grpc_,
                         "ratio": round(grpc_["rps"] / rest["rps"], 2) if rest["rps"] else None})
            print(f"c={c:3d}  REST {rest['rps']:8.1f} req/s p50 {rest['p50_ms']:7.2f} p99 {rest['p99_ms']:7.2f} ms | "
                  f"gRPC {grpc_['rps']:8.1f} req/s p50 {grpc_['p50_ms']:7.2f} p99 {grpc_['p99_ms']:7.2f} ms | "
                  f"gRPC/REST {rows[-1]['ratio']}x | server CPU per request REST "
                  f"{rest['server_cpu_ms_per_request']} ms, gRPC {grpc_['server_cpu_ms_per_request']} ms "
                  f"(errors {rest['errors']}/{grpc_['errors']})", flush=True)
    finally:
        stop(server)
        shutil.rmtree(state, ignore_errors=True)
    result = {"machine": f"{platform.node()} {platform.machine()} {psutil.cpu_count()} cpus",
              "date": time.strftime("%Y-%m-%d %H:%M"), "model": a.model, "client": a.client,
              "transport": a.transport, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
