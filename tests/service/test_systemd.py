"""The service as systemd runs it: the unit, the install, sd_notify, SIGTERM and SIGHUP.

Real parts throughout: systemd's own ``systemd-analyze`` judges the unit (skipped only
where systemd is not installed), the real ``appliance serve`` process talks to a real
``AF_UNIX`` datagram socket bound here, and real HTTP clients stream requests through
SIGTERM and SIGHUP. The server runs LiteRT only (``--backend tflite``) so it starts fast.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, get_args, get_origin, get_type_hints

import pytest
import requests

from appliance.core import config as config_mod
from appliance.core import config_file
from appliance.parts.notify import Liveness, watchdog_interval
from tests.support.servers import ROOT, poll_until

SYSTEMD = ROOT / "systemd"
UNIT = SYSTEMD / "edge-appliance.service"
EXAMPLE = SYSTEMD / "appliance.toml"
INSTALLED_VENV = "/opt/edge-appliance/venv"
MODEL = "multisig_tflite"  # LiteRT-only, batchable: signature "add": a, b f32[None, 4] -> sum
ADD = {"signature_name": "add", "instances": [{"a": [1.0, 2.0, 3.0, 4.0], "b": [1.0, 1.0, 1.0, 1.0]}]}
ADD_RESULT = [[2.0, 3.0, 4.0, 5.0]]
DEVICE_KINDS = ("nvidia", "dri", "edgetpu", "coral-usb")


# -- the unit ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        pytest.skip("systemd is not installed (apt-get install systemd)")
    return path


def unit_dir(tmp_path: Path, dropin: str | None = None) -> Path:
    """The unit, its ExecStart pointed at this test venv's real ``appliance`` (the
    device's /opt venv does not exist here), plus an optional drop-in."""
    appliance = Path(sys.prefix) / "bin" / "appliance"
    assert appliance.exists(), f"{appliance} missing: pip install -e . into the test venv"
    target = tmp_path / "units"
    target.mkdir()
    (target / UNIT.name).write_text(UNIT.read_text().replace(INSTALLED_VENV, sys.prefix))
    if dropin is not None:
        (target / f"{UNIT.name}.d").mkdir()
        (target / f"{UNIT.name}.d" / "devices.conf").write_text(dropin)
    return target / UNIT.name


def verify(analyze: str, unit: Path) -> None:
    """``systemd-analyze verify`` exits 0 and prints nothing: no warning either."""
    out = subprocess.run([analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), out.stdout + out.stderr


def exposure(analyze: str, unit: Path) -> float:
    out = subprocess.run([analyze, "security", "--offline=yes", "--threshold=20", str(unit)],
                         capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", out.stdout)
    assert match, out.stdout + out.stderr
    assert out.returncode == 0, f"exposure above the threshold of 2.0:\n{out.stdout}"
    return float(match.group(1))


def test_unit_verifies_clean(analyze: str, tmp_path: Path) -> None:
    verify(analyze, unit_dir(tmp_path))


def test_unit_exposure_is_ok(analyze: str, tmp_path: Path) -> None:
    assert exposure(analyze, unit_dir(tmp_path)) <= 2.0


@pytest.mark.parametrize("kinds", [*DEVICE_KINDS, ",".join(DEVICE_KINDS)])
def test_device_dropins_verify_and_stay_ok(analyze: str, tmp_path: Path, kinds: str) -> None:
    dropin = subprocess.run([str(SYSTEMD / "install.sh"), "--print-dropin", kinds], capture_output=True,
                            text=True, check=True).stdout
    assert "PrivateDevices=no" in dropin and "DeviceAllow=" in dropin
    unit = unit_dir(tmp_path, dropin)
    verify(analyze, unit)
    assert exposure(analyze, unit) <= 2.0


def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    return settings


def test_unit_execstart_is_a_valid_serve_command() -> None:
    """ExecStart parses with the real CLI, and the stop timeout covers the drain."""
    from appliance.cli import build_parser

    settings = unit_settings()
    argv = settings["ExecStart"][0].split()
    assert argv[0] == f"{INSTALLED_VENV}/bin/appliance"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.config == "/etc/edge-appliance/appliance.toml"
    stop_s = int(settings["TimeoutStopSec"][0].rstrip("s"))
    assert stop_s > config_file.load(str(EXAMPLE)).server.drain_timeout_s
    assert settings["Type"] == ["notify"] and settings["WatchdogSec"]


# -- the example config -----------------------------------------------------------------
def example_with_models() -> str:
    """The example, with its commented-out [[models]] example switched on."""
    text = EXAMPLE.read_text()
    cut = text.index("# [[models]]")
    return text[:cut] + re.sub(r"(?m)^# ?", "", text[cut:])


def undocumented(cls: Any, data: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for f in dataclasses.fields(cls):
        key, hint = f"{prefix}{f.name}", get_type_hints(cls)[f.name]
        if f.name not in data:
            yield key
        elif dataclasses.is_dataclass(hint):
            yield from undocumented(hint, data[f.name], key + ".")
        elif get_origin(hint) is list and dataclasses.is_dataclass(get_args(hint)[0]):
            yield from undocumented(get_args(hint)[0], data[f.name][0], key + "[].")


def test_example_config_documents_every_key_and_loads(tmp_path: Path) -> None:
    assert list(undocumented(config_mod.Config, tomllib.loads(example_with_models()))) == []
    loaded = config_file.load(str(EXAMPLE))
    assert loaded.models_dir == "/var/lib/edge-appliance/models"
    defaults = dataclasses.asdict(config_mod.Config())
    shown = dataclasses.asdict(loaded)
    for section in ("server", "batching", "runtime", "sync", "discovery"):  # "the values below ARE the defaults"
        assert shown[section] == defaults[section], section
    with_models = tmp_path / "with-models.toml"
    with_models.write_text(example_with_models())
    assert [m.name for m in config_file.load(str(with_models)).models] == ["detector"]


# -- install / uninstall ----------------------------------------------------------------
def run_script(name: str, *args: str) -> str:
    out = subprocess.run([str(SYSTEMD / name), *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_install_and_uninstall_staged(analyze: str, tmp_path: Path) -> None:
    root, prefix = tmp_path / "root", tmp_path / "prefix"
    (prefix / "venv" / "bin").mkdir(parents=True)  # the venv ExecStart runs: this test venv's
    (prefix / "venv" / "bin" / "appliance").symlink_to(Path(sys.prefix) / "bin" / "appliance")
    run_script("install.sh", "--root", str(root), "--prefix", str(prefix), "--no-venv", "--devices", "nvidia,dri")
    unit = root / "etc/systemd/system/edge-appliance.service"
    assert f"ExecStart={prefix}/venv/bin/appliance serve" in unit.read_text()
    verify(analyze, unit)  # with its devices.conf drop-in next to it
    config = root / "etc/edge-appliance/appliance.toml"
    assert config_file.load(str(config)).server.port == 8501
    config.write_text('log_level = "debug"\n')  # the operator's edit survives a re-install
    run_script("install.sh", "--root", str(root), "--prefix", str(prefix), "--no-venv")
    assert config.read_text() == 'log_level = "debug"\n'
    assert (config.parent / "appliance.toml.example").read_text() == EXAMPLE.read_text()
    run_script("uninstall.sh", "--root", str(root), "--prefix", str(prefix))
    assert not unit.exists() and not (unit.parent / "edge-appliance.service.d").exists()
    assert config.exists() and not (root / prefix.relative_to("/")).exists()
    run_script("uninstall.sh", "--root", str(root), "--prefix", str(prefix), "--purge")
    assert not config.parent.exists()


# -- sd_notify --------------------------------------------------------------------------
class NotifyListener:
    """The systemd end of $NOTIFY_SOCKET: a bound AF_UNIX datagram socket."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.log: list[dict[str, str]] = []

    def receive(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return None
        message = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
        self.log.append(message)
        return message

    def wait_for(self, predicate: Callable[[dict[str, str]], bool], timeout: float, what: str) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.receive(max(0.05, deadline - time.monotonic()))
            if message is not None and predicate(message):
                return message
        raise AssertionError(f"no {what} within {timeout} s; received {self.log[-10:]}")

    def wait_for_silence(self, key: str, quiet: float, timeout: float) -> None:
        """Until ``quiet`` seconds pass with no message carrying ``key``."""
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while time.monotonic() < deadline:
            message = self.receive(0.1)
            if message is not None and key in message:
                last = time.monotonic()
            elif time.monotonic() - last >= quiet:
                return
        raise AssertionError(f"{key} kept coming for {timeout} s: {self.log[-10:]}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifyListener]:
    folder = tmp_path if len(str(tmp_path)) < 80 else Path(tempfile.mkdtemp(prefix="sdn-"))
    listener = NotifyListener(str(folder / "notify.sock"))
    yield listener
    listener.close()


def write_models_config(path: Path, models: dict[str, Path], **top: Any) -> None:
    """A config serving ``models`` (name: base path); no mDNS announcements from tests."""
    lines = [f"{k} = {v!r}" for k, v in top.items()] + ["[discovery]", "enabled = false"]
    for name, base in models.items():
        lines += ["[[models]]", f'name = "{name}"', f'base_path = "{base}"']
    path.write_text("\n".join(lines) + "\n")


def add_model_atomically(models_dir: Path, tmp_path: Path, base: Path) -> None:
    """Copy the test model next to ``base``, then rename: the poll never sees half a copy."""
    staging = tmp_path / f"staging-{base.name}"
    shutil.copytree(models_dir / MODEL, staging)
    os.rename(staging, base)


def post_add(url: str, model: str, session: Any = requests, timeout: float = 60) -> requests.Response:
    return session.post(f"{url}/v1/models/{model}:predict", json=ADD, timeout=timeout)


def queue_depth(server: Any, model: str) -> int:
    versions = server.status()["models"][model]["versions"]
    return sum((v.get("batching") or {}).get("queue_depth_rows", 0) for v in versions)


def wait_log(server: Any, text: str, timeout: float = 30) -> None:
    server.wait_for(lambda: text in server.log_text(), timeout, f"{text!r} in the log")


def test_watchdog_interval_honours_watchdog_pid() -> None:
    mine = {"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    assert watchdog_interval(mine) == 2.0
    assert watchdog_interval({"WATCHDOG_USEC": "4000000"}) == 2.0
    assert watchdog_interval({**mine, "WATCHDOG_PID": str(os.getpid() + 1)}) is None
    assert watchdog_interval({}) is None


def test_liveness_fails_while_every_http_worker_is_stuck() -> None:
    """The watchdog's HTTP half: a real server whose only worker thread hangs is not alive."""
    from appliance.core.config import LimitsConfig
    from appliance.transport.http.server import HTTPServer

    release = threading.Event()

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ["PATH_INFO"] == "/hang":
            release.wait(30)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    server = HTTPServer(app, "127.0.0.1", 0, threads=1, max_body_bytes=1024, limits=LimitsConfig())
    loop = threading.Thread(target=server.serve_forever, name="http-under-test")
    loop.start()
    liveness = Liveness(SimpleNamespace(core=SimpleNamespace(manager=None), server=server),
                        stall_after_s=1.0, http_timeout_s=0.5)
    try:
        assert liveness.problem() is None
        hung = threading.Thread(target=lambda: requests.get(f"http://127.0.0.1:{server.port}/hang", timeout=30))
        hung.start()
        poll_until(lambda: server.tracker.count > 0, 10, "the /hang request to occupy the only worker")
        problem = liveness.problem()
        assert problem is not None and "/healthz" in problem
        release.set()
        hung.join(30)
        assert liveness.problem() is None
    finally:
        release.set()
        server.drain(5)
        loop.join(10)


def test_sd_notify_ready_status_watchdog_and_wedge(start_server: Any, models_dir: Path, tmp_path: Path,
                                                    notify_socket: NotifyListener) -> None:
    base = tmp_path / "models"
    base.mkdir()
    config = tmp_path / "appliance.toml"
    write_models_config(config, {"mlp": base / "mlp"})
    env = {"NOTIFY_SOCKET": notify_socket.path, "WATCHDOG_USEC": "2000000", "EDGE_APPLIANCE_TEST_HOOKS": "1"}
    server = start_server("--config", str(config), "--backend", "tflite", "--poll-interval", "0.3",
                          env=env, ready=False)

    # Listening but the model is not there: "loading", pings (the service is alive), no READY.
    status = notify_socket.wait_for(lambda m: "STATUS" in m, 60, "STATUS=")
    assert status["STATUS"].startswith("loading") and "mlp" in status["STATUS"], status
    notify_socket.wait_for(lambda m: m.get("WATCHDOG") == "1", 30, "WATCHDOG=1 while loading")
    assert server.get("/healthz").status_code == 200 and server.get("/readyz").status_code == 503
    assert not any("READY" in m for m in notify_socket.log)

    # The model appears: READY=1 comes, and only once /readyz already says 200.
    add_model_atomically(models_dir, tmp_path, base / "mlp")
    ready = notify_socket.wait_for(lambda m: m.get("READY") == "1", 60, "READY=1")
    assert server.get("/readyz").status_code == 200
    assert ready["STATUS"].startswith("serving 1 model: mlp v1"), ready
    for _ in range(3):
        notify_socket.wait_for(lambda m: m.get("WATCHDOG") == "1", 10, "WATCHDOG=1 while serving")

    # Wedge the batcher with a request queued: the pings stop, the status says why.
    server.proc.send_signal(signal.SIGUSR1)
    wait_log(server, "batchers frozen")
    answers: list[requests.Response] = []
    client = threading.Thread(target=lambda: answers.append(post_add(server.url, "mlp")))
    client.start()
    server.wait_for(lambda: queue_depth(server, "mlp") >= 1, 30, "the request to queue")
    notify_socket.wait_for_silence("WATCHDOG", quiet=3.0, timeout=30)
    assert any("not alive" in m.get("STATUS", "") and "batcher" in m["STATUS"] for m in notify_socket.log)

    # Unwedged: the queued request is answered and the pings resume.
    server.proc.send_signal(signal.SIGUSR1)
    client.join(60)
    assert answers and answers[0].status_code == 200 and answers[0].json()["predictions"] == ADD_RESULT
    notify_socket.wait_for(lambda m: m.get("WATCHDOG") == "1", 10, "WATCHDOG=1 after the wedge")

    # SIGHUP: RELOADING=1 with a timestamp, then READY=1 again; SIGTERM: STOPPING=1, exit 0.
    server.proc.send_signal(signal.SIGHUP)
    reloading = notify_socket.wait_for(lambda m: m.get("RELOADING") == "1", 30, "RELOADING=1")
    assert int(reloading["MONOTONIC_USEC"]) > 0
    notify_socket.wait_for(lambda m: m.get("READY") == "1", 30, "READY=1 after the reload")
    server.proc.send_signal(signal.SIGTERM)
    notify_socket.wait_for(lambda m: m.get("STOPPING") == "1", 30, "STOPPING=1")
    assert server.proc.wait(60) == 0


# -- SIGTERM: drain ---------------------------------------------------------------------
class Stream:
    """Client threads each sending requests in a loop on a keep-alive session."""

    def __init__(self, url: str, model: str, threads: int):
        self.url, self.model = url, model
        self.stop = threading.Event()
        self.outcomes: list[list[tuple[float, str, Any]]] = [[] for _ in range(threads)]
        self.pending = [False] * threads  # a request sent, its answer not yet back
        self.threads = [threading.Thread(target=self._run, args=(i,), name=f"stream-{i}") for i in range(threads)]

    def __enter__(self) -> "Stream":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)

    def _run(self, i: int) -> None:
        with requests.Session() as session:
            while not self.stop.is_set():
                self.pending[i] = True
                outcome = self._one(session)
                self.pending[i] = False
                self.outcomes[i].append((time.monotonic(), *outcome))
                if outcome[0] == "refused":
                    return  # the server is gone; stop this client

    def _one(self, session: requests.Session) -> tuple[str, Any]:
        try:
            r = post_add(self.url, self.model, session)
        except requests.ConnectionError as exc:
            refused = "Connection refused" in str(exc) or "[Errno 111]" in str(exc)
            return ("refused" if refused else "cut", repr(exc))
        except requests.RequestException as exc:
            return ("cut", repr(exc))
        ok = r.status_code == 200 and r.json().get("predictions") == ADD_RESULT
        return ("ok" if ok else "bad", (r.status_code, r.text[:300]))

    def count(self, kind: str = "ok") -> int:
        return sum(1 for o in self.outcomes for _, k, _ in o if k == kind)

    def failures(self, allowed: tuple[str, ...] = ("ok",)) -> list[Any]:
        return [o for per in self.outcomes for o in per if o[1] not in allowed]


def unread_bytes(port: int) -> int:
    """Bytes received on the server's established connections that it has not read yet."""
    total = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in list(f)[1:]:
                fields = row.split()
                local_port, state = int(fields[1].rsplit(":", 1)[1], 16), fields[3]
                if local_port == port and state == "01":
                    total += int(fields[4].split(":")[1], 16)
    return total


def test_sigterm_drains_a_steady_stream(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "models"
    base.mkdir()
    add_model_atomically(models_dir, tmp_path, base / "mlp")
    config = tmp_path / "appliance.toml"
    write_models_config(config, {"mlp": base / "mlp"})
    # 2 HTTP threads for 6 clients: at SIGTERM some requests run, the others wait for a thread.
    config.write_text(config.read_text() + "[server]\nthreads = 2\n")
    # A NOTIFY_SOCKET nobody listens on: sending fails, serving must not.
    env = {"EDGE_APPLIANCE_TEST_HOOKS": "1", "NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")}
    server = start_server("--config", str(config), "--backend", "tflite", env=env)
    drain_timeout = config_file.load(str(config)).server.drain_timeout_s

    with Stream(server.url, "mlp", threads=6) as stream:
        server.wait_for(lambda: stream.count() >= 200, 60, "200 answered requests")
        # Freeze the batcher: every client's next request is sent and read by the server,
        # two of them waiting in the batch queue and four for an HTTP thread.
        server.proc.send_signal(signal.SIGUSR1)
        wait_log(server, "batchers frozen")
        server.wait_for(lambda: all(stream.pending) and unread_bytes(server.port) == 0, 30,
                        "a request of every client to be in the server")
        sigterm_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        wait_log(server, "stopping: draining")
        server.proc.send_signal(signal.SIGUSR1)  # release them during the drain
        assert server.proc.wait(drain_timeout + 30) == 0
    answered_in_drain = [o for per in stream.outcomes for o in per if o[1] == "ok" and o[0] > sigterm_at]
    assert len(answered_in_drain) >= 6, stream.outcomes
    assert stream.failures(allowed=("ok", "refused")) == []
    for per in stream.outcomes:  # after its last answer a client only ever found the port closed
        assert per[-1][1] == "refused", per[-3:]
    assert "drain timeout" not in server.log_text()


# -- SIGHUP: reload ---------------------------------------------------------------------
def test_sighup_adds_and_removes_models_without_failing_requests(start_server: Any, models_dir: Path,
                                                                 tmp_path: Path) -> None:
    base = tmp_path / "models"
    base.mkdir()
    for name in ("keep", "drop", "new"):
        add_model_atomically(models_dir, tmp_path, base / name)
    config = tmp_path / "appliance.toml"
    write_models_config(config, {"keep": base / "keep", "drop": base / "drop"}, poll_interval_s=0.5)
    server = start_server("--config", str(config), "--backend", "tflite")
    assert post_add(server.url, "drop").status_code == 200
    assert post_add(server.url, "new").status_code == 404

    with Stream(server.url, "keep", threads=3) as stream:
        server.wait_for(lambda: stream.count() >= 50, 60, "requests to the kept model")
        write_models_config(config, {"keep": base / "keep", "new": base / "new"}, poll_interval_s=0.5)
        server.proc.send_signal(signal.SIGHUP)
        server.wait_for(lambda: post_add(server.url, "new").status_code == 200, 60, "the added model to serve")
        server.wait_for(lambda: post_add(server.url, "drop").status_code == 404, 30, "the removed model's 404")
        # A config that does not load is refused; everything keeps serving.
        config.write_text("[server]\nport = 'not a port'\n")
        server.proc.send_signal(signal.SIGHUP)
        wait_log(server, "config reload refused")
        before = stream.count()
        server.wait_for(lambda: stream.count() >= before + 50, 60, "more requests to the kept model")
        assert post_add(server.url, "new").status_code == 200
    assert stream.failures() == []
    assert post_add(server.url, "drop").json()["error"].startswith("Servable not found")
