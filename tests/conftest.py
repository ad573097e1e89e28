"""Shared fixtures: real models built once per session, real servers on free loopback ports.

``models_dir``: every model of ``tests.modelgen`` (TF1 half_plus_two with warm-up
requests, a Keras MLP with its TFLite conversion, a tiny CNN, a string model, a
multi-signature and a signature-less TFLite model) under ``<tmp>/<name>/1``.

``start_server(models, **opts)``: runs ``appliance serve`` as a child process (the real
service, the real HTTP server), waits for ``/readyz`` and stops it by PID at teardown.

An autouse fixture fails any test that leaves threads or child processes behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"


# What a predicate may raise while the thing it looks at is still coming up: a status key a
# part has not written yet, a list still empty, a server not listening yet or restarting.
NOT_YET = (KeyError, IndexError, requests.ConnectionError, requests.Timeout, ConnectionError)


def poll_until(predicate: Any, timeout: float = 60, what: str = "condition", context: Any = lambda: "",
               alive: Any = lambda: None) -> Any:
    """The first truthy value of ``predicate()``, polled every 0.2 s.

    A predicate that raises one of ``NOT_YET`` counts as "not yet" and is polled again; any
    other exception fails at once. ``alive()`` returns a message when waiting is pointless
    (the server exited). On timeout the message names ``what``, the last value or "not yet"
    exception, and ``context()`` (log tails, say)."""
    deadline = time.monotonic() + timeout
    last: Any = "never polled"
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
            raise AssertionError(f"timed out after {timeout} s waiting for {what}\nlast: {last}\n{context()}")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every test model, built once (cached across runs by modelgen's content hash)."""
    from tests import modelgen

    digest = modelgen_digest()
    cache = Path(os.environ.get("EDGE_TEST_MODEL_CACHE", "/tmp/edge-appliance-test-models")) / digest
    if not (cache / ".complete").exists():
        build = tmp_path_factory.mktemp("models-build")
        modelgen.build_all(build)
        (build / ".complete").write_text("ok")
        cache.parent.mkdir(parents=True, exist_ok=True)
        staged = cache.parent / f".{digest}-{os.getpid()}"
        shutil.copytree(build, staged)
        try:
            os.rename(staged, cache)  # atomic: a concurrent session sees all of it or none
        except OSError:  # another session got there first; theirs is as good
            shutil.rmtree(staged, ignore_errors=True)
    return cache


def modelgen_digest() -> str:
    import hashlib

    return hashlib.sha256((ROOT / "tests" / "modelgen.py").read_bytes()).hexdigest()[:12]


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


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Any]:
    started: list[Server] = []

    def start(*args: str, **kw: Any) -> Server:
        server = launch(list(args), tmp_path, **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def module_server(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Any]:
    """Factory for one server shared by a test module (starting TensorFlow costs seconds)."""
    started: list[Server] = []

    def start(*args: str, **kw: Any) -> Server:
        server = launch(list(args), tmp_path_factory.mktemp("srv"), **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def http_servers() -> Iterator[Any]:
    """``start(app, threads=2, limits=None, security=None)``: appliance.transport.http.server's real
    server on a free loopback port, its loop in a thread, facing the app as the service has it
    (probes unshed, JSON error bodies); closed and joined at teardown."""
    from appliance.core.config import LimitsConfig
    from appliance.core.tls import tls_context
    from appliance.fronts.app import facing
    from appliance.transport.http.server import HTTPServer

    servers: list[tuple[Any, threading.Thread]] = []

    def start(app: Any, threads: int = 2, limits: Any = None, security: Any = None) -> Any:
        context = tls_context(security) if security is not None and security.tls_cert_file else None
        server = HTTPServer(app, "127.0.0.1", 0, threads, 1 << 20, limits=limits or LimitsConfig(),
                            ssl_context=context, facing=facing())
        loop = threading.Thread(target=server.serve_forever, name="http-under-test")
        loop.start()
        servers.append((server, loop))
        return server

    yield start
    for server, loop in servers:
        server.close()
        loop.join(10)


def _children() -> set[int]:
    try:
        import psutil

        return {c.pid for c in psutil.Process().children(recursive=True)}
    except Exception:
        return set()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves threads or child processes behind (module servers excepted)."""
    threads = {t.ident for t in threading.enumerate()}
    children = _children()
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        # "(_poll_wrapper)": grpc.aio's completion-queue poller, one per process, started by the
        # first aio server and kept by gRPC for the life of the process.
        extra_threads = [t for t in threading.enumerate() if t.ident not in threads and t.is_alive()
                         and not t.name.startswith(("ThreadPoolExecutor", "asyncio", "zeroconf", "Dummy"))
                         and not t.name.endswith("(_poll_wrapper)")]
        extra_children = _children() - children
        if not extra_threads and not extra_children:
            return
        time.sleep(0.1)
    module_pids = set()
    for fixture in ("module_server",):
        if fixture in request.fixturenames:
            module_pids = extra_children  # started for the module, stopped at module teardown
    leaked = extra_children - module_pids
    assert not extra_threads, f"test leaked threads: {[t.name for t in extra_threads]}"
    assert not leaked, f"test leaked child processes: {sorted(leaked)}"
