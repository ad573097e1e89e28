"""Compare REST servers in the serving process, back to back, on the real app (MLP, LiteRT).

    PYTHONPATH=. .venv/bin/python -m bench.http_servers [--servers baseline,ours,uvicorn,granian]
        [--baseline-root DIR] [--conc 1,8,32] [--duration 5]

* ``ours``: this tree's service (appliance/transport/http/server.py);
* ``baseline``: the service of another checkout (``--baseline-root``: e.g. a worktree of the
  commit before, with waitress);
* ``uvicorn``/``granian``: this tree's app and core, served by uvicorn (httptools, uvloop) or
  granian's embedded server (``granian.server.embed``, ASGI: it takes no WSGI app) through
  the same thread-pool WSGI adapter below, with the limits they have of their own only.

Each server is loaded with bench/loadgen.py (closed loop, keep-alive, loopback) at each
concurrency; prints one JSON line per point.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import loadgen  # noqa: E402
from bench.run_bench import tree_cpu, bench_models, body, stop, wait_ready  # noqa: E402


def wsgi_to_asgi(app: Any, threads: int) -> Any:
    """The least an ASGI server needs to run our WSGI app: body read whole, app on a pool."""
    pool = ThreadPoolExecutor(threads)

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                await send({"type": msg["type"] + ".complete"})
                if msg["type"] == "lifespan.shutdown":
                    return
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        data = b"".join(chunks)
        env = {"REQUEST_METHOD": scope["method"], "PATH_INFO": scope["path"], "SCRIPT_NAME": "",
               "QUERY_STRING": scope["query_string"].decode(), "SERVER_NAME": "127.0.0.1", "SERVER_PORT": "0",
               "SERVER_PROTOCOL": "HTTP/1.1", "wsgi.input": io.BytesIO(data), "wsgi.url_scheme": "http",
               "wsgi.errors": sys.stderr, "wsgi.multithread": True, "wsgi.multiprocess": False,
               "wsgi.run_once": False, "wsgi.version": (1, 0), "CONTENT_LENGTH": str(len(data))}
        for k, v in scope["headers"]:
            key = k.decode().upper().replace("-", "_")
            env["CONTENT_TYPE" if key == "CONTENT_TYPE" else "HTTP_" + key] = v.decode("latin-1")
        out: dict[str, Any] = {}

        def run() -> bytes:
            def start_response(status: str, headers: list, exc_info: Any = None) -> None:
                out["status"], out["headers"] = int(status[:3]), headers
            return b"".join(app(env, start_response))

        payload = await asyncio.get_running_loop().run_in_executor(pool, run)
        await send({"type": "http.response.start", "status": out["status"],
                    "headers": [(k.encode(), v.encode()) for k, v in out["headers"]]})
        await send({"type": "http.response.body", "body": payload})

    return asgi


def serve_candidate(server: str, base: Path, port: int, state: Path) -> None:
    from appliance.core.config_file import load
    from appliance.service import Service

    config = load(overrides={"models_dir": str(base), "state_dir": str(state), "runtime.backend": "tflite",
                             "server.host": "127.0.0.1", "server.port": port, "discovery.enabled": False,
                             "grpc.port": 0})
    service = Service(config)
    service.core.start()
    asgi = wsgi_to_asgi(service.app, config.server.threads)
    if server == "uvicorn":
        import uvicorn

        uvicorn.run(asgi, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning",
                    lifespan="off", access_log=False)
    else:
        from granian.constants import Interfaces
        from granian.server.embed import Server

        asyncio.run(Server(asgi, address="127.0.0.1", port=port, interface=Interfaces.ASGINL,
                           log_enabled=False).serve())


def start(kind: str, base: Path, port: int, work: Path, baseline_root: Path | None) -> subprocess.Popen:
    state = work / kind
    state.mkdir(parents=True, exist_ok=True)
    log = open(state / "server.log", "wb")
    if kind in ("uvicorn", "granian"):
        cmd = [sys.executable, "-m", "bench.http_servers", "--serve", kind, "--port", str(port), "--state", str(state)]
        cwd, env = ROOT, dict(os.environ, PYTHONPATH=str(ROOT))
    else:
        root = baseline_root if kind == "baseline" else ROOT
        assert root is not None, "--baseline-root is needed for the baseline"
        config = state / "bench.toml"
        config.write_text(f'models_dir = "{base}"\nstate_dir = "{state}"\npoll_interval_s = 60\n'
                          '[runtime]\nbackend = "tflite"\n[discovery]\nenabled = false\n[grpc]\nport = 0\n')
        cmd = [sys.executable, "-m", "appliance.cli", "serve", "--config", str(config), "--host", "127.0.0.1",
               "--port", str(port)]
        cwd, env = root, dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    wait_ready(f"http://127.0.0.1:{port}/v1/models/mlp", proc)
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--servers", default="baseline,ours,uvicorn,granian")
    ap.add_argument("--baseline-root", type=Path)
    ap.add_argument("--conc", default="1,8,32")
    ap.add_argument("--duration", type=float, default=5)
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=18950)
    ap.add_argument("--state", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    base = bench_models()
    if args.serve:
        serve_candidate(args.serve, base, args.port, args.state)
        return
    work = Path(tempfile.mkdtemp(prefix="edge-http-bench-"))
    for i, kind in enumerate(args.servers.split(",")):
        port = args.port + i
        proc = start(kind, base, port, work, args.baseline_root)
        try:
            for c in (int(x) for x in args.conc.split(",")):
                cpu0, t0 = tree_cpu(proc.pid), time.perf_counter()
                r = asyncio.run(loadgen.run(f"http://127.0.0.1:{port}/v1/models/mlp:predict", body("mlp"), c,
                                            args.duration, 1.0, b"predictions"))
                r["server_cpu_pct"] = round(100 * (tree_cpu(proc.pid) - cpu0) / (time.perf_counter() - t0), 1)
                r.update(server=kind, concurrency=c)
                print(json.dumps(r), flush=True)
        finally:
            stop(proc)


if __name__ == "__main__":
    main()
