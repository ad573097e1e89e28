"""Shared memory against v2 JSON and v2 binary tensors: tritonclient, one client, sequential requests.

    .venv/bin/python bench/shm_bench.py [--model cnn] [--duration 8] [--rounds 2] [--api http grpc]

One service (the bench CNN or MLP of bench/run_bench.py, LiteRT, batching on, the default
front workers) and one tritonclient client calling it back to back, as an app on the device
does frame after frame, three ways per API, alternated each round:

* ``json``: v2 JSON tensors (``binary_data=False`` both ways; gRPC: typed ``contents``),
* ``binary``: Triton's binary tensor extension (REST) / ``raw_input_contents`` (gRPC),
* ``shm``: Triton's system shared memory: the app writes the frame into its region with
  ``tritonclient.utils.shared_memory.set_shared_memory_region``, the request names the
  regions, and the app reads the answer with ``get_contents_as_numpy``: all inside the timing.

Every mode's first answer is compared with JSON's. Prints requests/s per mode and the ratios
shm/JSON and shm/binary (issue 37's bars: at least 2x and 1.3x), with the server's process
tree CPU per request. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run_bench import SHAPES, tree_cpu, bench_models, start_service, stop  # noqa: E402
from tests.support.servers import free_port  # noqa: E402


def modes(api: str, address: str, model: str) -> tuple[Any, dict[str, Callable[[], np.ndarray]], Callable[[], None]]:
    """(client, {mode: one request returning the output}, cleanup) for ``api``."""
    import tritonclient.utils.shared_memory as shm

    mod: Any
    if api == "http":
        import tritonclient.http as mod
    else:
        import tritonclient.grpc as mod
    client = mod.InferenceServerClient(address)
    api = "grpc" if api.startswith("grpc") else api
    x = np.random.default_rng(0).standard_normal((1, *SHAPES[model])).astype(np.float32)
    meta = client.get_model_metadata(model)
    inputs = meta["inputs"] if api == "http" else [{"name": i.name} for i in meta.inputs]
    outputs = meta["outputs"] if api == "http" else [{"name": o.name, "shape": list(o.shape)} for o in meta.outputs]
    in_name, out_name = inputs[0]["name"], outputs[0]["name"]
    out_bytes = 4 * int(np.prod([d if d > 0 else 1 for d in outputs[0]["shape"]]))
    tag = f"shm-bench-{api}-{time.monotonic_ns()}"
    in_region = shm.create_shared_memory_region(f"{tag}-in", f"/{tag}-in", x.nbytes)
    out_region = shm.create_shared_memory_region(f"{tag}-out", f"/{tag}-out", out_bytes)
    client.unregister_system_shared_memory()
    client.register_system_shared_memory("bench-in", f"/{tag}-in", x.nbytes)
    client.register_system_shared_memory("bench-out", f"/{tag}-out", out_bytes)

    def tensor(binary: bool) -> Any:
        inp = mod.InferInput(in_name, list(x.shape), "FP32")
        if api == "http":
            inp.set_data_from_numpy(x, binary_data=binary)
        else:
            inp.set_data_from_numpy(x)
        return inp

    def plain(binary: bool) -> np.ndarray:
        out = mod.InferRequestedOutput(out_name, binary_data=binary) if api == "http" else mod.InferRequestedOutput(out_name)
        if api == "grpc" and not binary:  # typed contents, gRPC's JSON-like way
            request_input = tensor(False)
            request_input._raw_content = None
            request_input._input.contents.fp32_contents.extend(x.reshape(-1).tolist())
            return client.infer(model, [request_input], outputs=[out]).as_numpy(out_name)
        return client.infer(model, [tensor(binary)], outputs=[out]).as_numpy(out_name)

    def shared() -> np.ndarray:
        shm.set_shared_memory_region(in_region, [x])
        inp = mod.InferInput(in_name, list(x.shape), "FP32")
        inp.set_shared_memory("bench-in", x.nbytes)
        out = mod.InferRequestedOutput(out_name)
        out.set_shared_memory("bench-out", out_bytes)
        result = client.infer(model, [inp], outputs=[out])
        described = result.get_output(out_name)
        shape = described["shape"] if api == "http" else list(described.shape)
        return np.array(shm.get_contents_as_numpy(out_region, np.float32, shape))

    def cleanup() -> None:
        client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(in_region)
        shm.destroy_shared_memory_region(out_region)
        client.close()
    return client, {"json": lambda: plain(False), "binary": lambda: plain(True), "shm": shared}, cleanup


def timed(call: Callable[[], Any], seconds: float, pid: int) -> dict[str, Any]:
    for _ in range(20):
        call()
    cpu0, n, started = tree_cpu(pid), 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        call()
        n += 1
    elapsed = time.perf_counter() - started
    return {"rps": round(n / elapsed, 1), "ms": round(1000 * elapsed / n, 3),
            "server_cpu_ms_per_request": round(1000 * (tree_cpu(pid) - cpu0) / n, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cnn", choices=sorted(SHAPES))
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--api", nargs="+", default=["http", "grpc", "grpc-unix"], choices=["http", "grpc", "grpc-unix"],
                    help="grpc-unix: tritonclient's gRPC over [grpc] socket_path, the main process's own socket")
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()
    state = Path(tempfile.mkdtemp(prefix="shm-bench-"))
    port, grpc_port = free_port(), free_port()
    sock = state / "grpc.sock"
    proc = start_service(bench_models(), "tflite", True, port, state, f"[grpc]\nport = {grpc_port}\n"
                         f'socket_path = "{sock}"\n[discovery]\nenabled = false\n')
    address = {"http": f"127.0.0.1:{port}", "grpc": f"127.0.0.1:{grpc_port}", "grpc-unix": f"unix:{sock}"}
    rows: list[dict[str, Any]] = []
    try:
        for api in a.api:
            client, calls, cleanup = modes(api, address[api], a.model)
            try:
                want = calls["json"]()
                for name, call in calls.items():
                    np.testing.assert_allclose(call(), want, rtol=1e-6, atol=1e-7)  # the same numbers every way
                for r in range(a.rounds):
                    order = list(calls) if r % 2 == 0 else list(reversed(calls))
                    row: dict[str, Any] = {"api": api, "round": r + 1}  # grpc-unix: no front worker in between
                    for name in order:
                        row[name] = timed(calls[name], a.duration, proc.pid)
                    row["shm/json"] = round(row["shm"]["rps"] / row["json"]["rps"], 2)
                    row["shm/binary"] = round(row["shm"]["rps"] / row["binary"]["rps"], 2)
                    rows.append(row)
                    print(f"{api:9s} round {r + 1}: " + "  ".join(
                        f"{m} {row[m]['rps']:7.1f} req/s ({row[m]['ms']:.2f} ms, server {row[m]['server_cpu_ms_per_request']} ms)"
                        for m in calls) + f" | shm/json {row['shm/json']}x shm/binary {row['shm/binary']}x", flush=True)
            finally:
                cleanup()
    finally:
        stop(proc)
        shutil.rmtree(state, ignore_errors=True)
    result = {"machine": f"{platform.node()} {platform.machine()} {psutil.cpu_count()} cpus",
              "load": psutil.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M"), "model": a.model, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    print(f"load average at the end: {psutil.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
