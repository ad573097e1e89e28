"""One C load generator for REST and gRPC alike: nghttp2's ``h2load``.

    python bench/nghttp2_load.py --url http://127.0.0.1:P/v1/models/mlp:predict --body F [--h1] [-c 8]
    python bench/nghttp2_load.py --url http://127.0.0.1:P/tensorflow.serving.PredictionService/Predict \
        --grpc-message F [-c 8]

``h2load`` (Debian's ``nghttp2-client``, installed by scripts/test.sh) speaks HTTP/1.1 with
``--h1`` and HTTP/2 otherwise, so the REST and the gRPC figures come from one program in C,
whose own CPU per request is a few microseconds: nothing is lost to a Python client on a
2-core machine, and neither API is favoured by its client. Each of ``c`` clients holds one
connection with one request in flight (``-m 1``): a closed loop, like bench/loadgen.py.

gRPC: the body is the length-prefixed message (the 5-byte gRPC prefix, then the serialized
request) with ``content-type: application/grpc`` and ``te: trailers``. h2load counts an
HTTP 200 as success and a gRPC error also comes with 200, so the answer is checked apart
(the caller makes one real call first) and h2load's received bytes per request are
reported: a call answered with an error carries no message. Targets must be loopback.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import check_loopback  # noqa: E402

H2LOAD = shutil.which("h2load") or "/usr/bin/h2load"
_RPS = re.compile(r"finished in [\d.]+\w*, ([\d.]+) req/s")
_COUNTS = re.compile(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored")
_TRAFFIC = re.compile(r"traffic: .*?\((\d+)\) total, .*?\((\d+)\) headers .*?, .*?\((\d+)\) data")
_MEAN = re.compile(r"time for request:\s+([\d.]+)(us|ms|s)\s+([\d.]+)(us|ms|s)\s+([\d.]+)(us|ms|s)")
_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def grpc_body(message: bytes) -> bytes:
    """A unary call's request body: uncompressed flag, 4-byte length, the message."""
    return b"\x00" + struct.pack(">I", len(message)) + message


def run(url: str, body: bytes, concurrency: int, duration: float, warmup: float, *, h1: bool = False,
        grpc: bool = False, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """One closed-loop h2load run of ``duration`` s after ``warmup`` s; its figures."""
    check_loopback(urlsplit(url).hostname or "")
    head = {"content-type": "application/grpc", "te": "trailers"} if grpc else {"content-type": "application/json"}
    head.update(headers or {})
    with tempfile.NamedTemporaryFile(prefix="h2load-", suffix=".body") as f:
        f.write(body)
        f.flush()
        cmd = [H2LOAD, "-c", str(concurrency), "-m", "1", "-t", "1", "-D", f"{round(duration * 1000)}ms",
               "--warm-up-time", f"{round(warmup * 1000)}ms", "-d", f.name, *(["--h1"] if h1 else [])]
        for k, v in head.items():
            cmd += ["-H", f"{k}: {v}"]
        out = subprocess.run([*cmd, url], capture_output=True, text=True, timeout=duration + warmup + 60)
    return parse(out.stdout, concurrency, duration) | ({"stderr": out.stderr[-500:]} if out.returncode else {})


def parse(text: str, concurrency: int, duration: float) -> dict[str, Any]:
    """h2load's summary as figures: req/s, successes and failures, mean latency, data bytes per request."""
    rps = _RPS.search(text)
    counts = _COUNTS.search(text)
    traffic = _TRAFFIC.search(text)
    mean = _MEAN.search(text)
    done = int(counts[3]) if counts else 0
    result: dict[str, Any] = {"concurrency": concurrency, "rps": float(rps[1]) if rps else 0.0,
                              "ok": int(counts[4]) if counts else 0,
                              "errors": (int(counts[5]) + int(counts[6])) if counts else None}
    if mean:
        result["mean_ms"] = round(float(mean[5]) * _UNIT[mean[6]], 3)
        result["max_ms"] = round(float(mean[3]) * _UNIT[mean[4]], 3)
    if traffic and done:
        result["data_bytes_per_request"] = round(int(traffic[3]) / done, 1)
    if not rps:
        result["raw"] = text[-800:]
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--body", help="a request body (REST)")
    ap.add_argument("--grpc-message", help="a serialized protobuf request (gRPC)")
    ap.add_argument("--h1", action="store_true", help="HTTP/1.1 (REST as most clients speak it)")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    a = ap.parse_args(argv)
    if a.grpc_message:
        body, grpc = grpc_body(Path(a.grpc_message).read_bytes()), True
    else:
        body, grpc = Path(a.body).read_bytes(), False
    print(json.dumps(run(a.url, body, a.concurrency, a.duration, a.warmup, h1=a.h1, grpc=grpc)))


if __name__ == "__main__":
    main()
