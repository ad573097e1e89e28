"""Fleet sync from a folder bucket (file://), end to end, plus kill -9 and load failures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sync.publisher import publish
from sync.open_source import open_source
from tests.support.servers import ROOT, free_port
from tests.support.sync_scenario import hpt, scenario, signing, start_device  # noqa: F401 (fixtures)
from tests.support.sync_support import events, predict, serving_version, store_is_complete, version_of, wait


def test_folder_bucket_full_scenario(start_server: Any, tmp_path: Path, hpt: Path, signing: Any) -> None:
    key, pub = signing
    folder = tmp_path / "bucket"
    folder.mkdir()
    bucket = open_source(f"file://{folder}")
    cli = [sys.executable, "-m", "appliance.cli"]
    subprocess.run(cli + ["publish", "--bucket", f"file://{folder}", "--model", "hpt", "--channel", "stable",
                          "--sign-key", str(tmp_path / "sign.key"), str(hpt / "1")], check=True, cwd=ROOT)
    creds = tmp_path / "credentials"  # what systemd's LoadCredential=admin-token:... provides
    creds.mkdir()
    (creds / "admin-token").write_text("t0k3n-" + "x" * 26 + "\n")
    server = start_device(start_server, tmp_path, f"file://{folder}", public_key=pub,
                          env={"CREDENTIALS_DIRECTORY": str(creds)})

    def corrupt(version: int) -> None:
        data = next((folder / "hpt" / str(version) / "variables").glob("variables.data-*"))
        data.write_bytes(b"\0" * data.stat().st_size)  # same size, wrong sha256

    scenario(server, bucket, hpt, key, lambda: folder.rename(tmp_path / "away"),
             lambda: (tmp_path / "away").rename(folder), corrupt)

    def report() -> Any:
        found = list((folder / "_devices").glob("*.json"))
        doc = json.loads(found[0].read_text()) if found else {}
        return doc if doc.get("models", {}).get("hpt", {}).get("serving_version") == 2 else None

    doc = wait(report, 30, "a device report showing version 2")
    assert doc["software_version"] and doc["healthy"] and doc["last_sync"]
    fleet = subprocess.run(cli + ["fleet", "--bucket", f"file://{folder}"], capture_output=True, text=True,
                           cwd=ROOT, check=True)
    assert doc["device_id"] in fleet.stdout and "1 devices" in fleet.stdout
    outsider = {k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"}
    refused = subprocess.run(cli + ["sync", "--url", server.url], capture_output=True, text=True, cwd=ROOT,
                             env=outsider)
    assert refused.returncode == 1 and "401" in refused.stderr and "admin token" in refused.stderr, refused.stderr
    inside = {**os.environ, "CREDENTIALS_DIRECTORY": str(creds)}  # the CLI run as the unit finds the credential
    sync = subprocess.run(cli + ["sync", "--url", server.url], capture_output=True, text=True, cwd=ROOT, env=inside)
    assert sync.returncode == 0 and json.loads(sync.stdout)["targets"] == {"hpt": 2}, sync.stderr


def test_unsigned_version_and_unloadable_version_are_refused(start_server: Any, tmp_path: Path, hpt: Path,
                                                             signing: Any) -> None:
    key, pub = signing
    folder = tmp_path / "bucket"
    bucket = open_source(f"file://{folder}")
    publish(bucket, "hpt", str(hpt / "1"), 1, channel="stable", sign_key=key)
    server = start_device(start_server, tmp_path, f"file://{folder}", public_key=pub)
    publish(bucket, "hpt", str(hpt / "2"), 2, channel="stable")  # unsigned pointer and manifest
    server.wait_for(lambda: "not signed" in server.status()["sync"]["last_error"], 30, "unsigned refusal")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "saved_model.pb").write_bytes(b"not a saved model")
    publish(bucket, "hpt", str(broken), 3, channel="stable", sign_key=key)  # verifies, fails to load
    server.wait_for(lambda: "3" in server.status()["models"]["hpt"]["quarantined"], 60, "quarantine of 3")
    assert version_of(predict(server.url)) == 1
    polled = server.status()["sync"]["polls"]
    server.wait_for(lambda: server.status()["sync"]["polls"] >= polled + 3, 60, "three more polls of the bucket")
    status = server.status()  # after several polls, version 3 was never retried in a loop
    assert len([e for e in events(status, "load_failed") if e["version"] == 3]) == 1
    assert serving_version(status) == 1


@pytest.mark.parametrize("point", ["mid_download", "before_commit", "after_commit"])
def test_kill_9_during_sync_converges(start_server: Any, tmp_path: Path, hpt: Path, point: str) -> None:
    folder = tmp_path / "bucket"
    bucket = open_source(f"file://{folder}")
    publish(bucket, "hpt", str(hpt / "1"), 1, channel="stable")
    port = free_port()
    server = start_device(start_server, tmp_path, f"file://{folder}", port=port, env={"EDGE_SYNC_FAULT": point},
                          ready=False)
    server.wait_for(lambda: (server.state / "sync" / f"fault-{point}").exists(), 120, f"fault point {point}")
    server.stop(signal.SIGKILL)
    assert store_is_complete(server.state / "models") == []
    assert point != "after_commit" or (server.state / "models/hpt/1").is_dir()
    restarted = start_device(start_server, tmp_path, f"file://{folder}", port=port)
    assert version_of(predict(restarted.url)) == 1
    assert store_is_complete(restarted.state / "models") == []
    assert not [p for p in (restarted.state / "staging").rglob("*") if p.is_file()]


