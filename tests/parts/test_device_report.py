"""A device's report follows its state (real services on LiteRT, a real folder bucket and a
real SeaweedFS bucket): it says what the device serves after a start and after a swap, a
refused version with its original reason, a version that fails to load with its reason, a
rollback; it is written by the change itself (the heartbeat is an hour away in these
tests), signed with the device's own key, and the fleet view reads it so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sync.publisher import publish, set_channel
from sync.report import SIGNED, UNREGISTERED, MISSIGNED, load_registry, register_keys, trust_mark
from sync.open_source import open_source
from tests.support.servers import ROOT, poll_until
from tests.support.fleet_support import lite_device, lite_models, report_of


@pytest.fixture(scope="module")
def hpt() -> Path:
    return lite_models()


@pytest.fixture(params=["file", "s3"])
def bucket(request: pytest.FixtureRequest, tmp_path: Path, seaweed: Any,
           monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, str]]:
    if request.param == "file":
        return f"file://{tmp_path / 'bucket'}", {}
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    return f"s3://fleet/{tmp_path.name}", seaweed.env()


def served(report: dict[str, Any] | None, version: int) -> bool:
    model = ((report or {}).get("models") or {}).get("hpt") or {}
    states = {v["version"]: v["state"] for v in model.get("versions", [])}
    return model.get("serving_version") == version and states.get(version) == "AVAILABLE" and report["healthy"]


def test_the_report_follows_start_swap_refusal_and_failed_load(start_server: Any, tmp_path: Path, hpt: Path,
                                                               bucket: tuple[str, dict[str, str]]) -> None:
    url, env = bucket
    source = open_source(url)
    publish(source, "hpt", str(hpt / "1"), 1, channel="stable")
    device = lite_device(start_server, tmp_path, url, env=env)
    device_id = device.status()["service"]["device_id"]
    # after a start: what it serves, not LOADING, and written by the start, not a heartbeat
    start = device.wait_for(lambda: served(report_of(source, device_id), 1) and report_of(source, device_id), 60,
                            "a report saying version 1 serves")
    assert start["trigger"] in ("start", "change: loaded") or start["trigger"].startswith("change"), start["trigger"]
    assert start["schema"] == 2 and start["report_interval_s"] == 3600.0 and start["written_at"] > 0
    assert trust_mark(start, None) == UNREGISTERED  # signed by the device's own key
    # after a swap: the new version, written by the change (the heartbeat is an hour away)
    publish(source, "hpt", str(hpt / "2"), 2, channel="stable")
    swapped = device.wait_for(lambda: served(report_of(source, device_id), 2) and report_of(source, device_id), 60,
                              "a report saying version 2 serves")
    assert swapped["trigger"].startswith("change") and swapped["sequence"] > start["sequence"]
    assert swapped["models"]["hpt"]["target_version"] == 2
    # a corrupt version: refused, with its original reason, while version 2 serves on
    publish(source, "hpt", str(hpt / "3"), 3)
    source.put("hpt/3/model.tflite", b"\0" * len((hpt / "3" / "model.tflite").read_bytes()))
    set_channel(source, "hpt", "stable", 3)
    refused = device.wait_for(lambda: (r := report_of(source, device_id)) and r["models"]["hpt"]["refused"] and r, 60,
                              "a report with the refusal")
    reason = refused["models"]["hpt"]["refused"]["reason"]
    assert refused["models"]["hpt"]["refused"]["version"] == 3 and "sha256" in reason
    assert {"version": 3, "state": "REFUSED", "reason": reason, "backend": None} in refused["models"]["hpt"]["versions"]
    assert served(refused, 2)
    # a version that verifies but does not load: failed, with the loader's reason
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.tflite").write_bytes(b"not a flatbuffer " * 10)
    publish(source, "hpt", str(broken), 4, channel="stable")
    failed = device.wait_for(lambda: (r := report_of(source, device_id)) and any(
        v["version"] == 4 and v["reason"] for v in r["models"]["hpt"]["versions"]) and r, 90, "a report with the failed load")
    assert served(failed, 2) and failed["models"]["hpt"]["refused"] is None
    # what the operator sees, once the device's key is registered (an unregistered report is untrusted)
    register_keys(source, {device_id: failed["device_key"]})
    out = subprocess.run([sys.executable, "-m", "appliance.cli", "fleet", "--bucket", url, "--json", "--no-cache"],
                         capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=120)
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)["devices"][0]
    assert row["device_id"] == device_id and row["status"] == "degraded" and row["trust"] == SIGNED
    assert row["models"]["hpt"]["serving"] == 2 and row["models"]["hpt"]["state"] == "failed"


def test_signatures_and_the_key_registry(tmp_path: Path, start_server: Any, hpt: Path) -> None:
    folder = tmp_path / "bucket"
    source = open_source(f"file://{folder}")
    publish(source, "hpt", str(hpt / "1"), 1, channel="stable")
    device = lite_device(start_server, tmp_path, f"file://{folder}")
    device_id = device.status()["service"]["device_id"]
    report = device.wait_for(lambda: served(report_of(source, device_id), 1) and report_of(source, device_id), 60,
                             "the first report")
    key_file = device.state / "device-key.pem"
    assert key_file.exists() and (key_file.stat().st_mode & 0o077) == 0  # the private half stays private
    assert register_keys(source, {device_id: report["device_key"]}) == 1
    registry = load_registry(source)
    assert trust_mark(report, registry[device_id]) == SIGNED
    forged = {**report, "models": {"hpt": {**report["models"]["hpt"], "serving_version": 9}}}
    assert trust_mark(forged, registry[device_id]) == MISSIGNED
    assert trust_mark({k: v for k, v in report.items() if k != "signature"}, registry[device_id]) == "unsigned"
    from sync.report import sign_report
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    impostor = sign_report(report, Ed25519PrivateKey.generate())  # valid, but someone else's key
    assert trust_mark(impostor, registry[device_id]) == "key-changed"
    device.stop()
    restarted = lite_device(start_server, tmp_path, f"file://{folder}", port=device.port)  # same state, same key
    again = restarted.wait_for(lambda: (r := report_of(source, device_id)) and r["started_at"] != report["started_at"]
                               and r, 60, "the report after a restart")
    assert again["device_key"] == report["device_key"] and trust_mark(again, registry[device_id]) == SIGNED


def test_reports_are_coalesced_and_the_heartbeat_keeps_them_fresh(tmp_path: Path, start_server: Any, hpt: Path) -> None:
    folder = tmp_path / "bucket"
    source = open_source(f"file://{folder}")
    publish(source, "hpt", str(hpt / "1"), 1, channel="stable")
    device = lite_device(start_server, tmp_path, f"file://{folder}", poll_interval_s=0.3, report_interval_s=1.0)
    device_id = device.status()["service"]["device_id"]
    first = device.wait_for(lambda: served(report_of(source, device_id), 1) and report_of(source, device_id), 60,
                            "the first report")
    beat = poll_until(lambda: (r := report_of(source, device_id)) and r["trigger"] == "heartbeat" and r, 30,
                      "a heartbeat report")
    assert beat["written_at"] > first["written_at"]
    status = device.status()["sync"]
    idle_polls = status["requests"]["polls"]
    poll_until(lambda: device.status()["sync"]["requests"]["polls"] >= idle_polls + 10, 30, "ten more polls")
    status = device.status()["sync"]
    # one conditional request per idle poll: the polls' count grows by one a poll, the reports apart
    assert status["requests"]["reports"] >= 2 and status["refused"] == {}
