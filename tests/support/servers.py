"""What the tests and the benchmarks share to run the real service: free loopback ports,
waiting for a condition (never for time), and ``appliance serve`` as a child process.

``launch(args, tmp_path)`` runs ``appliance serve`` (the real service, the real HTTP server) on a
free loopback port, waits for ``/readyz`` and returns a ``Server``; ``stop_process`` signals a
child we started, by PID. ``poll_until`` is the suite's one wait. ``bench/`` imports these too.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import requests

from tests.support import load

ROOT = Path(__file__).resolve().parents[2]
# Screenshots and other outputs for a person to look at: where $EDGE_TEST_ARTIFACTS says
# (scripts/test.sh: the checkout's test-artifacts/), else a folder under /tmp, never the checkout.
ARTIFACTS = Path(os.environ.get("EDGE_TEST_ARTIFACTS") or Path(tempfile.gettempdir()) / "edge-appliance-test-artifacts")


# What a predicate may raise while the thing it looks at is still coming up: a status key a
# part has not written yet, a list still empty, a server not listening yet or restarting.
NOT_YET = (KeyError, IndexError, requests.ConnectionError, requests.Timeout, ConnectionError)
POLL_S = (0.02, 0.2)  # poll_until's first and longest interval between tries


def poll_until(predicate: Any, timeout: float = 60, what: str = "condition", context: Any = lambda: "",
               alive: Any = lambda: None) -> Any:
    """The first truthy value of ``predicate()``, polled 20 ms after the first try, then at
    twice the last interval up to every 0.2 s (``POLL_S``): most conditions hold within a
    tenth of a second of the action they follow, and a flat 0.2 s poll lost 0.1 s on each of
    the suite's thousands of waits; a long wait still polls five times a second.

    A predicate that raises one of ``NOT_YET`` counts as "not yet" and is polled again; any
    other exception fails at once. ``alive()`` returns a message when waiting is pointless
    (the server exited). ``timeout`` is what a quiet machine needs: it is stretched by the
    machine's load (tests/support/load.py). On timeout the message names ``what``, the last
    value or "not yet" exception, the load, and ``context()`` (log tails, say)."""
    stretched = load.scaled(timeout)
    deadline = time.monotonic() + stretched
    last: Any = "never polled"
    interval = POLL_S[0]
    while True:
        try:
            value = predicate()
        except NOT_YET as exc:
            value, last = None, f"{type(exc).__name__}: {exc}"
        else:
            if value:
                return value
            last = f"value {value!r}"[:500]
        dead = alive()
        if dead:
            raise AssertionError(f"gave up waiting for {what}: {dead}\nlast: {last}\n{context()}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {stretched:.0f} s ({timeout} s at a quiet machine; {load.describe()}) "
                                 f"waiting for {what}\nlast: {last}\n{context()}")
        time.sleep(interval)
        interval = min(POLL_S[1], interval * 2)


_HANDED_OUT: set[int] = set()  # every port free_port gave in this process


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range (32768-60999 on Linux) so
    that no outgoing connection takes it between our choosing it and a server binding it, and
    low enough that SeaweedFS's port+10000 gRPC twin stays below that range too.

    Under pytest-xdist each worker takes only ports of its own residue (port % workers == its
    index), so two workers never pick the same port. Not ``bind(0)``: Linux hands those out
    with one parity, which would starve every other residue."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    for _ in range(1000):
        port = random.randrange(10000, 22000)
        port -= (port - worker) % count
        if port in _HANDED_OUT:  # free now, but a test may hold it for a server not started yet
            continue            # (a REST and a gRPC port picked one after the other, say)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free loopback port in 10000-22000 for test worker {worker} of {count}")


def modelgen_digest() -> str:
    import hashlib

    return hashlib.sha256((ROOT / "tests" / "support" / "modelgen.py").read_bytes()).hexdigest()[:12]


def model_copy(models_dir: Path, tmp_path: Path, *names: str) -> Path:
    """A fresh base directory holding copies of the named models (tests may change it)."""
    base = tmp_path / "models"
    for name in names:
        shutil.copytree(models_dir / name, base / name)
    return base


class Server:
    """A running ``appliance serve`` child process."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, state: Path, log: Path):
        self.proc, self.port, self.state, self.log = proc, port, state, log
        self.url = f"http://127.0.0.1:{port}"

    def get(self, path: str, **kw: Any) -> requests.Response:
        return requests.get(self.url + path, timeout=kw.pop("timeout", 30), **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> requests.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return requests.post(self.url + path, data=data, timeout=kw.pop("timeout", 30), **kw)

    def status(self) -> dict[str, Any]:
        return self.get("/api/status").json()

    def wait_for(self, predicate: Any, timeout: float = 60, what: str = "condition") -> Any:
        """``poll_until`` against this server: gives up at once if the process exits."""
        return poll_until(predicate, timeout, what, lambda: "--- server log (tail)\n" + self.log_text()[-3000:],
                          lambda: f"server exited with {self.proc.returncode}" if self.proc.poll() is not None else None)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        return stop_process(self.proc, sig, timeout)


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    """Signal a child we started (by PID), wait, kill it if it does not stop in time."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def launch(args: list[str], tmp_path: Path, env: dict[str, str] | None = None, ready: bool = True,
           port: int | None = None, timeout: float = 120, python: str = sys.executable,
           discovery: bool = False) -> Server:
    """Start ``appliance serve``; mDNS is off unless asked for (tests announce nothing on a LAN)."""
    port = port or free_port()
    if not discovery and "--no-discovery" not in args:
        args = [*args, "--no-discovery"]
    if "--grpc-port" not in args:  # gRPC only where a test asks for it: parallel servers never fight for 8500
        args = [*args, "--grpc-port", "0"]
    state = tmp_path / f"state-{port}"
    cmd = [python, "-m", "appliance.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--state", str(state), *args]
    return spawn(cmd, port, state, tmp_path / f"server-{port}.log", env, ready, timeout)


def spawn(cmd: list[str], port: int, state: Path, log: Path, env: dict[str, str] | None = None,
          ready: bool = True, timeout: float = 120) -> Server:
    """Run ``cmd`` (a service listening on ``port``) with its output in ``log``; wait for /readyz."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT)
    server = Server(proc, port, state, log)
    if ready:
        try:
            server.wait_for(lambda: _ready(server), timeout, "the server to be ready")
        except BaseException:  # a server that never got ready is stopped here: no test can leak it
            server.stop()
            raise
    return server


def _ready(server: Server) -> bool:
    try:
        return server.get("/readyz", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def echo_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    """A WSGI app answering ``ok N`` (N: the request body's length): the transport tests' app."""
    body = environ["wsgi.input"].read()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok %d" % len(body)]
