"""``appliance health`` (the image's HEALTHCHECK) and the writable-state check of ``appliance serve``,
outside a container (tests/deploy/test_image.py runs both inside one).

The probe is pointed at a real HTTP server on a free loopback port that answers what the service
answers when ready (200) and when not (503 with the reasons); the state check at a read-only
bind mount (root only: chmod does not stop root) and at a folder that cannot be made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.servers import ROOT, free_port

APPLIANCE = [sys.executable, "-m", "appliance.cli"]


def appliance(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("STATE_DIRECTORY", "EDGE_APPLIANCE_REQUIRE_WRITABLE_STATE")}
    return subprocess.run([*APPLIANCE, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**clean, **(env or {})})


@pytest.fixture
def probe_target() -> Iterator[Any]:
    """A loopback server whose /readyz answers ``state["code"]``."""
    state: dict[str, Any] = {"code": 200, "paths": []}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            state["paths"].append(self.path)
            body = json.dumps({"ready": state["code"] == 200, "not_ready": ["half_plus_two: loading"]}).encode()
            self.send_response(state["code"] if self.path == "/readyz" else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=server.serve_forever, name="probe-target")
    thread.start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    state["port"] = server.server_address[1]
    yield state
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_health_is_0_when_ready_and_1_with_the_reason_when_not(probe_target: Any) -> None:
    ok = appliance("health", "--url", probe_target["url"])
    assert ok.returncode == 0 and "ready:" in ok.stdout, ok.stdout + ok.stderr
    probe_target["code"] = 503
    bad = appliance("health", "--url", probe_target["url"])
    assert bad.returncode == 1 and "answered 503" in bad.stderr and "half_plus_two: loading" in bad.stderr, bad.stderr
    live = appliance("health", "--live", "--url", probe_target["url"])
    assert live.returncode == 0 and probe_target["paths"][-1] == "/healthz"


def test_health_finds_the_port_the_service_recorded_in_its_state(probe_target: Any, tmp_path: Path) -> None:
    (tmp_path / "service.json").write_text(json.dumps({"rest": {"url": probe_target["url"]}}))
    done = appliance("health", "--state", str(tmp_path))
    assert done.returncode == 0, done.stderr
    (tmp_path / "service.json").unlink()  # no record: the config's port (8501 by default), said when unreachable
    config = tmp_path / "appliance.toml"
    config.write_text(f"[server]\nport = {probe_target['port']}\n")
    assert appliance("health", "--state", str(tmp_path), "--config", str(config)).returncode == 0


def test_health_says_where_it_looked_when_nothing_answers(tmp_path: Path) -> None:
    port = free_port()
    done = appliance("health", "--url", f"http://127.0.0.1:{port}")
    assert done.returncode == 1 and f"cannot reach http://127.0.0.1:{port}/readyz" in done.stderr, done.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="a read-only bind mount needs root (chmod does not stop root)")
def test_the_embedded_default_on_a_read_only_state_is_refused_with_why(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(["mount", "--bind", str(state), str(state)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(state)], check=True)
        done = appliance("serve", "--state", str(state), "--port", str(free_port()), "--no-discovery")
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"{state} cannot be written (Read-only file system)" in done.stderr
        assert "the embedded default publishes its sample model there" in done.stderr
        assert "Traceback" not in done.stderr
        # A folder of models may still be served from a read-only state (tests/service/test_faults.py) ...
        # ... unless the state must persist, as the image says:
        strict = appliance("serve", "--state", str(state), "--models", str(tmp_path / "none"),
                           "--port", str(free_port()), "--no-discovery",
                           env={"EDGE_APPLIANCE_REQUIRE_WRITABLE_STATE": "1"})
        assert strict.returncode == 2 and "EDGE_APPLIANCE_REQUIRE_WRITABLE_STATE is set" in strict.stderr, strict.stderr
    finally:
        subprocess.run(["umount", str(state)], check=True)


def test_a_state_folder_that_cannot_be_made_is_refused_with_why(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    done = appliance("serve", "--state", str(blocker / "state"), "--port", str(free_port()), "--no-discovery")
    assert done.returncode == 2 and f"{blocker / 'state'} cannot be written" in done.stderr, done.stderr
