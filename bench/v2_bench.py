"""Open Inference Protocol benchmark: TF Serving JSON, v2 JSON, v2 binary, and MLServer's v2 JSON.

    .venv/bin/python bench/v2_bench.py [--duration 8] [--warmup 2] [--conc 32] [--model cnn]
                                       [--backend tflite] [--rounds 1] [--no-mlserver]

One run, one machine, side by side at the same concurrency, on the CNN of the batching
benchmark (MobileNetV2 at 96x96x3, bench/run_bench.py's models, byte-identical to
../shared/peer-bench's): the service (batching on, default config) answers

* ``/v1/models/cnn:predict`` with a TF Serving row-format JSON body (about 190 KB),
* ``/v2/models/cnn/infer`` with the KServe v2 JSON body MLServer gets (flat ``data``),
* ``/v2/models/cnn/infer`` with Triton's binary tensor extension: a 180-byte JSON header,
  then the image as 110,592 raw float32 bytes; the output comes back binary too;

and MLServer 1.7.1 with adaptive batching (../shared/peer-bench/peers/mlserver, started
with PEERS_ROOT, default /tmp/peers-v2) answers the same v2 JSON body right after them in
each round (both servers stay up; each ratio compares points of one round, so a shared
machine whose load moves between rounds moves both sides). Every body holds
the same numbers; the first answer of each is checked before the load starts.

The load generator is bench/loadgen.py's closed loop (one keep-alive connection per client,
nothing parsed but the status line and Content-Length), fed prebuilt request bytes so the
binary requests carry their ``Inference-Header-Content-Length`` header. Server CPU is the
server's process tree over the run. Ratios within one run are what to compare: the
machine is shared and the absolute figures move with its load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import socket
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

from bench import loadgen  # noqa: E402
from bench.run_bench import SHAPES, tree_cpu, bench_models, raw_limit, stop, wait_ready  # noqa: E402

# ../shared/peer-bench beside the checkout; from a worktree one level deeper (wt/NAME), the one above
# it; PEER_BENCH names another.
PEER_BENCH = Path(os.environ.get("PEER_BENCH") or next(
    (p / "shared" / "peer-bench" for p in (ROOT.parent, ROOT.parent.parent) if (p / "shared" / "peer-bench").is_dir()),
    ROOT.parent / "shared" / "peer-bench"))
MLSERVER_PORT = 9201  # fixed by peer-bench's MLServer settings
MLSERVER_LABEL = "MLServer 1.7.1 adaptive batching, v2 JSON"


# --- bodies --------------------------------------------------------------------------------------
def sample(model: str, seed: int = 0) -> list[float]:
    """The numbers of bench/run_bench.py's and peer-bench's bodies (same generator, same seed)."""
    rnd = random.Random(seed)
    return [round(rnd.gauss(0.0, 1.0), 3) for _ in range(int(np.prod(SHAPES[model])))]


def http_request(path: str, port: int, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    head = {"Host": f"127.0.0.1:{port}", "Content-Type": "application/json", "Content-Length": str(len(body)),
            **(headers or {})}
    return (f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in head.items()) + "\r\n").encode() + body


def tfs_json(model: str, values: list[float]) -> bytes:
    from bench.run_bench import body

    out = body(model)
    assert json.loads(out)["instances"][0] == np.array(values).reshape(SHAPES[model]).tolist()
    return out


def v2_json(model: str, values: list[float]) -> bytes:
    doc = {"inputs": [{"name": "input", "shape": [1, *SHAPES[model]], "datatype": "FP32", "data": values}]}
    return json.dumps(doc, separators=(",", ":")).encode()


def v2_binary(model: str, values: list[float]) -> tuple[bytes, dict[str, str]]:
    raw = np.asarray(values, dtype="<f4").tobytes()
    header = {"inputs": [{"name": "input", "shape": [1, *SHAPES[model]], "datatype": "FP32",
                          "parameters": {"binary_data_size": len(raw)}}],
              "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}
    head = json.dumps(header, separators=(",", ":")).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}


# --- checks and load ---------------------------------------------------------------------------------
def once(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one prebuilt request; (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(rest) < length:
            rest += s.recv(65536)
        return int(lines[0].split()[1]), headers, rest


def answer(kind: str, port: int, request: bytes) -> np.ndarray:
    """The output of one request of ``kind``, decoded as its protocol says."""
    status, headers, body = once(port, request)
    if status != 200:
        raise RuntimeError(f"{kind}: HTTP {status}: {body[:300]!r}")
    if kind == "tfs-json":
        return np.asarray(json.loads(body)["predictions"], dtype=np.float32)
    if "inference-header-content-length" in headers:
        length = int(headers["inference-header-content-length"])
        out = json.loads(body[:length])["outputs"][0]
        return np.frombuffer(body[length:], dtype="<f4").reshape(out["shape"])
    out = json.loads(body)["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


async def load(port: int, request: bytes, concurrency: int, duration: float, warmup: float,
               expect: bytes | None) -> dict[str, Any]:
    """bench/loadgen.py's closed loop on a prebuilt request (its ``run`` builds JSON requests only)."""
    start = time.perf_counter()
    measure_from, stop_at = start + warmup, start + warmup + duration
    record: list[float] = []
    errors: dict[str, int] = {}
    tasks = [asyncio.create_task(loadgen._client("127.0.0.1", port, request, stop_at, record, errors, measure_from,
                                                 expect)) for _ in range(concurrency)]
    await asyncio.sleep(max(0.0, measure_from - time.perf_counter()))
    cpu0 = loadgen._cpu()
    await asyncio.gather(*tasks)
    cpu = loadgen._cpu() - cpu0
    elapsed = min(duration, time.perf_counter() - measure_from)
    lat = sorted(record)
    return {"concurrency": concurrency, "ok": len(lat), "errors": sum(errors.values()), "error_kinds": errors,
            "rps": round(len(lat) / elapsed, 1), "p50_ms": round(loadgen.percentile(lat, 0.50) * 1000, 1),
            "p99_ms": round(loadgen.percentile(lat, 0.99) * 1000, 1),
            "client_cpu_pct": round(100 * cpu / elapsed, 1)}


def point(label: str, port: int, pid: int, request: bytes, args: argparse.Namespace, expect: bytes | None) -> dict:
    cpu0, t0 = tree_cpu(pid), time.perf_counter()
    result = asyncio.run(load(port, request, args.conc, args.duration, args.warmup, expect))
    result["server_cpu_pct"] = round(100 * (tree_cpu(pid) - cpu0) / (time.perf_counter() - t0), 1)
    result.update(server=label, body_bytes=len(request.partition(b"\r\n\r\n")[2]))
    print(json.dumps(result), flush=True)
    return result


# --- servers -------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(models: Path, backend: str, port: int, state: Path) -> subprocess.Popen:
    """``appliance serve`` as run_bench starts it (batching on, default config), mDNS off."""
    state.mkdir(parents=True, exist_ok=True)
    config = state / "bench.toml"
    config.write_text(f'models_dir = "{models}"\nstate_dir = "{state}"\npoll_interval_s = 60\n'
                      f'[runtime]\nbackend = "{backend}"\n[discovery]\nenabled = false\n')
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve", "--config", str(config),
                             "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(state / "server.log", "wb"))
    wait_ready(f"http://127.0.0.1:{port}/readyz", proc)
    return proc


def start_mlserver(models: Path, peers_root: str) -> int:
    """peer-bench's MLServer start script (adaptive batching on); returns the root PID."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", MLSERVER_PORT)) == 0:
            raise RuntimeError(f"port {MLSERVER_PORT} is taken (another MLServer?); not starting a second one")
    env = {**os.environ, "PEERS_ROOT": peers_root, "BENCH_MODELS": str(models)}
    log = Path(peers_root) / "mlserver-start.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        rc = subprocess.call([str(PEER_BENCH / "peers" / "mlserver" / "start.sh"), "on"], env=env, stdout=out,
                             stderr=subprocess.STDOUT, timeout=1200)
    if rc != 0:
        raise RuntimeError(f"MLServer did not start (see {log})")
    return int((Path(peers_root) / "run" / "mlserver.pid").read_text())


def mlserver_checked(models: Path, args: argparse.Namespace, request: bytes, reference: np.ndarray) -> int | None:
    """MLServer started (both servers stay up: idle, one costs the other little) and its first
    answer checked; None, said on stderr, where it cannot start."""
    try:
        pid = start_mlserver(models, args.peers_root)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"MLServer skipped: {exc}", file=sys.stderr)
        return None
    try:
        got = answer("v2-json", MLSERVER_PORT, request)
        np.testing.assert_allclose(got, reference, rtol=1e-3, atol=1e-4)  # TF vs LiteRT kernels
    except BaseException:
        stop_mlserver(args.peers_root)
        raise
    return pid


def stop_mlserver(peers_root: str) -> None:
    env = {**os.environ, "PEERS_ROOT": peers_root}
    subprocess.call([str(PEER_BENCH / "peers" / "mlserver" / "stop.sh"), "on"], env=env,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)


def per_cpu(row: dict) -> float:
    """Requests per second of the server tree's CPU: on a machine loaded by others the servers get
    unequal shares of the cores, which req/s alone does not see."""
    return float(row["rps"]) / max(float(row["server_cpu_pct"]) / 100, 1e-9)


def ratios(rows: list[dict]) -> list[str]:
    """Per round, each of our protocols against MLServer's point of the same round."""
    out: list[str] = []
    ml_rows = [i for i, r in enumerate(rows) if r["server"] == MLSERVER_LABEL]
    for n, i in enumerate(ml_rows, 1):
        ml = rows[i]
        ours = [r for r in rows[(ml_rows[n - 2] + 1 if n > 1 else 0):i]]
        if not ml["rps"]:
            continue
        parts = [f"{r['server'].split(', ', 1)[1]} **{r['rps'] / ml['rps']:.2f}x** (p99 {r['p99_ms']} ms; "
                 f"{per_cpu(r) / per_cpu(ml):.2f}x per server CPU-second)" for r in ours]
        out += ["", f"Round {n}, against MLServer's v2 JSON ({ml['rps']} req/s, p99 {ml['p99_ms']} ms): "
                    + ", ".join(parts) + " (target 3x)."]
    return out


# --- report ---------------------------------------------------------------------------------------------
def markdown(args: argparse.Namespace, rows: list[dict], raw: list[dict]) -> str:
    lines = [f"v2 benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {platform.machine()}, "
             f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total // 2**30} GiB, Python "
             f"{platform.python_version()}, load average {os.getloadavg()[0]:.2f} at the end. "
             f"Command: `{' '.join(sys.argv)}`", "",
             "| server, protocol | body bytes | req/s | p50 ms | p99 ms | errors | server CPU % | client CPU % |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['server']} | {r['body_bytes']:,} | {r['rps']} | {r['p50_ms']} | {r['p99_ms']} | {r['errors']} | "
              f"{r['server_cpu_pct']} | {r['client_cpu_pct']} |" for r in rows]
    if raw:
        lines += ["", "In-process limit of the same model, no HTTP (bench/run_bench.py's raw_limit): " + ", ".join(
            f"batch {r['batch']}: {r['samples_per_s']} samples/s" for r in raw) + f" ({raw[0]['backend']})."]
    lines += ratios(rows)
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=8)
    ap.add_argument("--warmup", type=float, default=2)
    ap.add_argument("--conc", type=int, default=32)
    ap.add_argument("--model", default="cnn", choices=sorted(SHAPES))
    ap.add_argument("--backend", default="tflite", help="the service's runtime.backend (run_bench's best: tflite)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the service's three points this many times")
    ap.add_argument("--mlserver", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--peers-root", default=os.environ.get("PEERS_ROOT", "/tmp/peers-v2"))
    ap.add_argument("--raw-seconds", type=float, default=2, help="per batch size of the in-process limit (0: skip)")
    ap.add_argument("--out", help="also append the markdown table to this file")
    args = ap.parse_args()
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    models, model = bench_models(), args.model
    values = sample(model)
    bin_body, bin_headers = v2_binary(model, values)
    rows: list[dict] = []
    port = free_port()
    state = Path(tempfile.mkdtemp(prefix="edge-v2-bench-"))
    proc = start_service(models, args.backend, port, state)
    ml_pid = None
    try:
        requests = {
            "tfs-json": http_request(f"/v1/models/{model}:predict", port, tfs_json(model, values)),
            "v2-json": http_request(f"/v2/models/{model}/infer", port, v2_json(model, values)),
            "v2-binary": http_request(f"/v2/models/{model}/infer", port, bin_body, bin_headers),
        }
        reference = answer("tfs-json", port, requests["tfs-json"])
        for kind, request in requests.items():  # every protocol answers the same numbers
            np.testing.assert_allclose(answer(kind, port, request), reference, rtol=1e-5, atol=1e-6)
        ml_request = http_request(f"/v2/models/{model}/infer", MLSERVER_PORT, v2_json(model, values))
        ml_pid = mlserver_checked(models, args, ml_request, reference) if args.mlserver else None
        labels = {"tfs-json": f"edge-appliance ({args.backend}), TF Serving JSON",
                  "v2-json": f"edge-appliance ({args.backend}), v2 JSON",
                  "v2-binary": f"edge-appliance ({args.backend}), v2 binary"}
        expects = {"tfs-json": b"predictions", "v2-json": b"outputs", "v2-binary": b"outputs"}
        for _ in range(args.rounds):  # MLServer in every round, right after ours: one window per ratio
            for kind, request in requests.items():
                rows.append(point(labels[kind], port, proc.pid, request, args, expects[kind]))
            if ml_pid is not None:
                rows.append(point(MLSERVER_LABEL, MLSERVER_PORT, ml_pid, ml_request, args, b"outputs"))
    finally:
        stop(proc)
        shutil.rmtree(state, ignore_errors=True)
        if ml_pid is not None:
            stop_mlserver(args.peers_root)
    raw = raw_limit(models, [model], [args.backend], args.raw_seconds) if args.raw_seconds else []
    text = markdown(args, rows, raw)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
