"""Issue 47's attack 5, rerun: legal big calls. ``--connections`` clients (each its own gRPC
connection) send KServe v2 ModelInfer calls of ``--mib`` MiB (the MLP's [N, 64] float32
input, in ``raw_input_contents``) back to back for ``--seconds``, at a service with two front
workers. Prints the calls answered and refused, each front worker's RSS idle / at its peak /
``--settle`` s after the burst, the tree's peak, and the largest ``held_bytes`` the service
reported (``/api/status`` ``grpc``) while the calls ran.

    PYTHONPATH=. .venv/bin/python -m bench.big_calls [--connections 8] [--mib 16] [--seconds 20]

Compare a tree before the change by running this with ``PYTHONPATH`` and the working
directory at a ``git archive`` of it. Targets are loopback only; every process it starts is
stopped by PID.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

INFER = "/inference.GRPCInferenceService/ModelInfer"


def infer_request(mib: float) -> bytes:
    """A ModelInfer of ``mib`` MiB for the MLP: [rows, 64] float32 in raw_input_contents."""
    import numpy as np

    from appliance.protos.kserve import pb

    rows = max(1, int(mib * (1 << 20)) // (64 * 4))
    request = pb.ModelInferRequest(model_name="mlp")
    tensor = request.inputs.add(name="x", datatype="FP32")
    tensor.shape.extend([rows, 64])
    request.raw_input_contents.append(np.full((rows, 64), 0.25, np.float32).tobytes())
    return bytes(request.SerializeToString())


class Callers(threading.Thread):
    """``connections`` threads, each with its own channel, sending ``message`` until stopped."""

    def __init__(self, port: int, message: bytes, connections: int):
        super().__init__(name="callers", daemon=True)
        self.port, self.message, self.connections = port, message, connections
        self.answered = self.refused = self.failed = 0
        self.halt = threading.Event()
        self.codes: dict[str, int] = {}

    def run(self) -> None:
        threads = [threading.Thread(target=self.caller, daemon=True) for _ in range(self.connections)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def caller(self) -> None:
        import grpc

        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                   ("grpc.use_local_subchannel_pool", 1)]  # a connection each, not one shared by all
        with grpc.insecure_channel(f"127.0.0.1:{self.port}", options=options) as channel:
            call = channel.unary_unary(INFER)
            while not self.halt.is_set():
                try:
                    call(self.message, timeout=120)
                    self.answered += 1
                except grpc.RpcError as exc:
                    code = exc.code().name
                    self.codes[code] = self.codes.get(code, 0) + 1
                    if code == "RESOURCE_EXHAUSTED":
                        self.refused += 1
                    else:
                        self.failed += 1

    def stop(self) -> None:
        self.halt.set()
        self.join(300)


def worker_pids(status: dict[str, Any]) -> list[int]:
    """The front workers' pids (``/api/status`` ``workers``: one entry each)."""
    workers = status.get("workers", [])
    return [int(w["pid"]) for w in workers if isinstance(w, dict) and w.get("pid")] if isinstance(workers, list) else []


def rss(pid: int) -> int:
    import psutil

    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--mib", type=float, default=16.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=30.0, help="seconds after the burst to read idle RSS")
    args = parser.parse_args()

    import psutil
    import requests

    from tests.conftest import every_model
    from tests.support.servers import free_port, launch

    models = every_model()
    with tempfile.TemporaryDirectory(prefix="big-calls-") as tmp:
        work, grpc_port = Path(tmp), free_port()
        config = work / "a.toml"
        config.write_text(f"[discovery]\nenabled = false\n[server]\nworkers = 2\n[batching]\nenable_batching = false\n"
                          f"[grpc]\nport = {grpc_port}\n"
                          f"[[models]]\nname = \"mlp\"\nbase_path = \"{models / 'keras_mlp_tflite'}\"\n"
                          f"backend = \"tflite\"\n")
        srv = launch(["--config", str(config), "--grpc-port", str(grpc_port)], work)
        try:
            status = lambda: requests.get(f"{srv.url}/api/status", timeout=30).json()  # noqa: E731
            pids = srv.wait_for(lambda: found if len(found := worker_pids(status())) == 2 else None, 60,
                                "two front workers")
            tree = lambda: sum(p.memory_info().rss for p in  # noqa: E731
                               (psutil.Process(srv.proc.pid), *psutil.Process(srv.proc.pid).children(recursive=True)))
            message = infer_request(args.mib)
            idle = {pid: rss(pid) for pid in pids}
            peak = dict(idle)
            tree_peak, held_peak = 0, 0
            callers = Callers(grpc_port, message, args.connections)
            callers.start()
            stop = time.monotonic() + args.seconds
            while time.monotonic() < stop:
                for pid in pids:
                    peak[pid] = max(peak[pid], rss(pid))
                tree_peak = max(tree_peak, tree())
                held_peak = max(held_peak, int(status().get("grpc", {}).get("held_bytes", 0)))
                time.sleep(0.2)
            callers.stop()
            time.sleep(args.settle)
            after = {pid: rss(pid) for pid in pids}
            alive = [pid for pid in pids if psutil.pid_exists(pid)]
            mib = lambda d: ", ".join(f"{v >> 20}" for v in d.values())  # noqa: E731
            print(f"{args.connections} connections of {args.mib:g} MiB ModelInfer for {args.seconds:g} s: "
                  f"{callers.answered} answered, {callers.refused} refused, {callers.failed} failed {callers.codes}; "
                  f"worker RSS MiB idle [{mib(idle)}], peak [{mib(peak)}], {args.settle:g} s after [{mib(after)}]; "
                  f"tree peak {tree_peak >> 20} MiB; held_bytes peak {held_peak >> 20} MiB; "
                  f"workers still the same: {len(alive)}/2", flush=True)
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
