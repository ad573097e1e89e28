"""The CLI verbs that talk to the running service find it as it was started, and say what
to pass when they cannot.

One service (``appliance serve`` on its embedded default, as the README starts it) runs
on another state directory and another port than the defaults. ``appliance sync`` finds
it from ``--state``, from ``$STATE_DIRECTORY`` and from a config file naming the state
directory, with no ``--url``; ``rollback`` and ``rollout promote`` the same way. A token
from another state directory, a state directory with no service, and a service that has
stopped each get a message naming what was used and what to pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import ROOT, Server, free_port, launch

MODEL = "half_plus_two"


def appliance(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if k != "STATE_DIRECTORY"}  # as a shell has it
    return subprocess.run([sys.executable, "-m", "appliance.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, env={**environment, **(env or {})})


@pytest.fixture(scope="module")
def service(module_server: Any) -> Server:
    """The embedded default (a local-folder bucket, an admin token in the state directory)
    on a port that is not 8501 and a state directory that is not the default one."""
    return module_server(timeout=240)


def synced(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["targets"] == {MODEL: 1} and status["last_error"] == "", status
    return status


def test_sync_finds_the_service_from_its_state_directory(service: Server) -> None:
    assert service.port != 8501
    record = json.loads((service.state / "service.json").read_text())
    assert record["pid"] == service.proc.pid and record["rest"]["url"] == service.url
    assert record["admin_token"] == {"source": "file", "file": str(service.state / "admin-token")}
    assert "token" not in (service.state / "service.json").read_text().replace("admin-token", "").replace(
        '"admin_token"', "")  # where the token is, never the token
    synced(appliance("sync", "--state", str(service.state)))


def test_sync_finds_it_from_state_directory_and_from_a_config_file(service: Server, tmp_path: Path) -> None:
    synced(appliance("sync", env={"STATE_DIRECTORY": str(service.state)}))
    config = tmp_path / "appliance.toml"
    config.write_text(f'state_dir = "{service.state}"\n')
    synced(appliance("sync", "--config", str(config)))


def test_rollout_and_rollback_find_it_too(service: Server) -> None:
    promote = appliance("rollout", "promote", "--model", MODEL, "--state", str(service.state))
    assert promote.returncode == 1 and "409" in promote.stderr and "no rollout candidate" in promote.stderr, \
        promote.stderr  # the service answered: found, and authorised
    rollback = appliance("rollback", "--model", MODEL, "--to", "1", "--state", str(service.state))
    assert rollback.returncode == 0, rollback.stderr
    assert f"{MODEL} pinned to version 1" in rollback.stdout and json.loads(rollback.stdout.split("\n", 1)[1])
    cleared = appliance("rollback", "--model", MODEL, "--clear", "--state", str(service.state))
    assert cleared.returncode == 0, cleared.stderr


def test_a_token_from_another_state_directory_gets_a_hint(service: Server, tmp_path: Path) -> None:
    """The issue's case: ``--url`` right, the token from another state directory."""
    other = tmp_path / "other-state"
    other.mkdir()
    (other / "admin-token").write_text("a-token-of-another-device-0123456789\n")
    done = appliance("sync", "--url", service.url, "--state", str(other))
    assert done.returncode == 1
    assert "401" in done.stderr and "Traceback" not in done.stderr
    assert str(other / "admin-token") in done.stderr  # the token file it used
    assert "--state" in done.stderr and "--token-file" in done.stderr  # what to pass
    assert "a-token-of-another-device" not in done.stderr


def test_a_state_directory_without_a_service_says_what_to_pass(tmp_path: Path) -> None:
    """No record: the config's address is tried (a read-only state directory cannot hold
    one), and the message says the state directory has no service and what to pass. (The
    port is a free one: on 8501 a service of the user's may answer, tests/service/test_private_home.py.)"""
    empty = tmp_path / "empty-state"
    config = tmp_path / "appliance.toml"
    config.write_text(f'state_dir = "{empty}"\n[server]\nport = {free_port()}\n')
    done = appliance("sync", "--config", str(config))
    assert done.returncode == 1 and "cannot reach the service" in done.stderr, done.stderr
    assert f"no service has recorded itself in {empty}" in done.stderr
    assert "--state" in done.stderr and "--url" in done.stderr


def test_a_stopped_service_is_named_as_stopped(tmp_path: Path) -> None:
    """(One process, no front workers: its record is written too.)"""
    server = launch(["--models", str(ROOT / "appliance" / "sample_models"), "--backend", "tflite", "--workers", "1"],
                    tmp_path)
    record = json.loads((server.state / "service.json").read_text())
    assert record["workers"] == 0 and record["rest"]["served_by"] == "the serving process"
    server.stop()
    done = appliance("sync", "--state", str(server.state))
    assert done.returncode == 1 and f"(pid {server.proc.pid}) is not running" in done.stderr, done.stderr
