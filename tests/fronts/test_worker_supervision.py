"""Front workers kept honest (appliance/fronts/supervisor.py, zygote.py): a hung worker is
replaced, a crash loop costs a fork per pause and never the service, restarts show with their
reasons, and a worker holds its request path and nothing else.

Real processes throughout: the service as a user starts it, workers forked by its zygote,
SIGSTOP and SIGKILL sent by PID to processes these tests started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from appliance.fronts import supervisor as sup
from tests.support.servers import poll_until
from tests.fronts.test_fronts import MLP, ROW, Clients, models

TIMEOUT_S = 4  # [server] worker_timeout_s for these tests: short, yet far past a loaded machine's stalls


def serve_config(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "appliance.toml"
    path.write_text(f"[server]\nworker_timeout_s = {TIMEOUT_S}\n{extra}")
    return path


def worker(server: Any, index: int) -> dict[str, Any]:
    return server.status()["workers"][index]  # type: ignore[no-any-return]


def restarts_metric(server: Any, reason: str) -> float:
    for line in server.get("/monitoring/prometheus/metrics").text.splitlines():
        if line.startswith(f'edge_appliance_worker_restarts_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return -1.0


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_if_left(pid: int, server: Any) -> None:
    """Cleanup: a worker of ``server`` (ours, by PID) that a failed test left stopped."""
    try:
        if pid in {c.pid for c in psutil.Process(server.proc.pid).children(recursive=True)}:
            os.kill(pid, signal.SIGKILL)
    except psutil.NoSuchProcess:
        pass


def test_a_stopped_worker_is_replaced_and_the_restart_shows(start_server: Any, models_dir: Path,
                                                            tmp_path: Path) -> None:
    """SIGSTOP (what a deadlock or a stuck C call looks like from outside): the worker's heartbeat
    stops, the supervisor kills and replaces it, every new connection is answered again, and the
    restart shows in /api/status, the metrics and the events, with its reason."""
    server = start_server("--config", str(serve_config(tmp_path)), "--models", str(models(models_dir, tmp_path, MLP)),
                          "--backend", "tflite", "--workers", "2")
    assert all(w["forked"] for w in server.status()["workers"])  # from the zygote
    clients = Clients(f"{server.url}/v1/models/{MLP}:predict", threads=4)
    victim = worker(server, 0)["pid"]
    try:
        server.wait_for(lambda: clients.count() >= 50, 60, "50 answered requests")
        os.kill(victim, signal.SIGSTOP)
        server.wait_for(lambda: worker(server, 0)["pid"] != victim and worker(server, 0)["up"], 60,
                        "a new worker in the stopped one's place")
        assert poll_until(lambda: gone(victim), 30, "the stopped worker to be killed")
        for _ in range(20):  # a fresh connection each: whichever worker the kernel picks answers
            assert requests.post(f"{server.url}/v1/models/{MLP}:predict", json={"instances": [ROW]},
                                 timeout=15).status_code == 200
        before = clients.count()
        server.wait_for(lambda: clients.count() >= before + 50, 60, "50 more answered requests")
    finally:
        clients.finish()
        kill_if_left(victim, server)
    replaced = worker(server, 0)
    assert replaced["restarts"] == 1 and replaced["exits"][-1]["reason"] == "heartbeat", replaced
    assert replaced["exits"][-1]["pid"] == victim and "missed its heartbeat" in replaced["exits"][-1]["words"]
    assert replaced["age_s"] is not None and replaced["pss_bytes"] > 0 and replaced["uss_bytes"] > 0
    server.wait_for(lambda: restarts_metric(server, "heartbeat") == 1.0, 30, "the restart counted by reason")
    assert restarts_metric(server, "signal") == 0.0
    events = [e for e in server.status()["events"] if e["kind"] == "worker_exited"]
    assert events and str(victim) in events[0]["message"] and "heartbeat" in events[0]["message"]
    # only the stopped worker's keep-alive connections were cut, one request each at most
    workers = server.status()["workers"]
    assert workers[1]["restarts"] == 0, workers  # the other worker was never taken for a hung one
    assert all(kind == "cut" for _, kind, _ in clients.failures()), clients.failures()
    assert len(clients.failures()) <= 4, (clients.failures(), workers)


def test_a_worker_that_dies_at_start_up_in_a_loop_does_not_take_the_service_down(
        start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    """A real crash loop: the TLS key is gone when a worker restarts, so every new worker fails
    at start-up. The other worker serves on, /readyz names the missing one (still ready: the port
    is answered), the pause between tries doubles, and once the key is back the worker is too."""
    from tests.transport.test_tls import make_cert

    cert, key, _, _ = make_cert(tmp_path, "server")
    config = serve_config(tmp_path, f'[security]\ntls_cert_file = "{cert}"\ntls_key_file = "{key}"\n')
    server = start_server("--config", str(config), "--models", str(models(models_dir, tmp_path, MLP)),
                          "--backend", "tflite", "--workers", "2", ready=False)
    server.url = f"https://127.0.0.1:{server.port}"

    def get(path: str) -> requests.Response:
        return requests.get(server.url + path, verify=str(cert), timeout=15)

    server.status = lambda: get("/api/status").json()  # type: ignore[method-assign]
    server.wait_for(lambda: get("/readyz").status_code == 200, 120, "the HTTPS service to be ready")
    victim = worker(server, 0)["pid"]
    key.rename(key.with_suffix(".gone"))
    os.kill(victim, signal.SIGKILL)
    server.wait_for(lambda: worker(server, 0)["restarts"] >= 4, 60, "four failed starts of worker 0")
    failing = worker(server, 0)
    assert not failing["up"] and {e["reason"] for e in failing["exits"][1:]} == {"exit"}, failing
    assert failing["pause_s"] >= 2 * sup.FIRST_PAUSE_S  # backing off, not spinning
    ready = get("/readyz")
    assert ready.status_code == 200 and any("1 of 2 front workers serving" in p for p in ready.json()["problems"])
    for _ in range(10):  # the other worker answers every new connection meanwhile
        r = requests.post(f"{server.url}/v1/models/{MLP}:predict", json={"instances": [ROW]}, verify=str(cert),
                          timeout=15)
        assert r.status_code == 200
    key.with_suffix(".gone").rename(key)
    server.wait_for(lambda: worker(server, 0)["up"], 60, "worker 0 to start again once its key is back")
    server.wait_for(lambda: not any("front workers" in p for p in get("/readyz").json().get("problems", [])), 30,
                    "the problem to clear")


def test_a_worker_holds_its_request_path_only(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    """No Flask or werkzeug (everything but inference is forwarded), no backend library (it never
    runs a model), no gRPC or HTTP/2 library when the gRPC port is not the workers'."""
    server = start_server("--models", str(models(models_dir, tmp_path, MLP)), "--backend", "tflite", "--workers", "2")
    server.wait_for(lambda: all(w["imported"] for w in server.status()["workers"]), 30, "the workers' figures")
    for held in (w["imported"] for w in server.status()["workers"]):
        assert {"numpy", "uvloop", "httptools", "orjson", "msgspec"} <= set(held), held
        assert not {"flask", "werkzeug", "jinja2", "tensorflow", "ai_edge_litert", "tflite_runtime", "grpc", "h2",
                    "sqlite_utils", "zeroconf", "boto3"} & set(held), held
    assert "ai_edge_litert" in server.status()["service"]["imported"]  # the serving process runs the model


# -- the supervisor alone, on real child processes --------------------------------------------------
def _python(code: str) -> sup.Launcher:
    def launch(index: int, channel: Any) -> Any:
        return subprocess.Popen([sys.executable, "-c", code])
    return launch


def test_a_crash_loop_backs_off_to_a_bounded_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sup, "FIRST_PAUSE_S", 0.05)
    monkeypatch.setattr(sup, "MAX_PAUSE_S", 0.4)
    exits: list[sup.Exit] = []
    supervisor = sup.Supervisor(1, _python("raise SystemExit(3)"), lambda *a: a[2].close(),
                                lambda index, ended, restarting: exits.append(ended), timeout_s=60)
    supervisor.start()
    try:
        poll_until(lambda: supervisor.children[0].restarts >= 6, 60, "six restarts")
    finally:
        supervisor.stop(10)
    assert supervisor.children[0].pause == 0.4  # doubled from 0.05, then held at the bound
    assert {e.reason for e in exits} == {"exit"} and {e.code for e in exits} == {3}
    assert supervisor.restarts_by_reason["exit"] >= 6


def test_a_silent_child_is_killed_for_its_heartbeat() -> None:
    exits: list[sup.Exit] = []
    supervisor = sup.Supervisor(1, _python("import time; time.sleep(120)"), lambda *a: a[2].close(),
                                lambda index, ended, restarting: exits.append(ended), timeout_s=0.5)
    supervisor.start()
    try:
        poll_until(lambda: exits, 30, "the silent child to be killed")
    finally:
        supervisor.stop(10)
    assert exits[0].reason == "heartbeat" and exits[0].code == -signal.SIGKILL
    assert supervisor.restarts_by_reason["heartbeat"] == 1


def test_a_child_that_speaks_is_left_alone() -> None:
    exits: list[sup.Exit] = []
    supervisor = sup.Supervisor(1, _python("import time; time.sleep(120)"), lambda *a: a[2].close(),
                                lambda index, ended, restarting: exits.append(ended), timeout_s=0.5)
    supervisor.start()
    try:
        deadline = time.monotonic() + 3  # six timeouts' worth of heartbeats
        while time.monotonic() < deadline:
            supervisor.heard(0)
            time.sleep(0.1)
        assert exits == [] and supervisor.serving() == [0]
    finally:
        supervisor.stop(0)
    assert [e.reason for e in exits] == ["signal"]  # the stop's kill, not the heartbeat


def test_worker_timeout_is_validated() -> None:
    from appliance.core.config_file import load
    from appliance.core.errors import ConfigError

    with pytest.raises(ConfigError, match="server.worker_timeout_s"):
        load(None, {"server.worker_timeout_s": 0.5})
    assert load(None, {}).server.worker_timeout_s == 10.0


def test_zygote_is_not_made_where_threads_run() -> None:
    """Forking a process with threads could copy a lock another thread held: never done."""
    import threading

    from appliance.fronts.zygote import Zygote

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert Zygote.start() is None
    finally:
        stop.set()
        thread.join()

