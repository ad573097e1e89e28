"""``appliance rollout controller``: a rollout's failure threshold enforced with nobody
watching. On SeaweedFS with real LiteRT devices: version 2 goes out, devices fail it past
the threshold, the controller (a process the test starts and ends) points the channel back
at version 1 (``on_failure = "rollback"``), and the devices that took version 2 return to
version 1; the view says what happened; a second controller round writes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sync.listing import ReportCache
from sync.open_source import open_source
from sync.publisher import publish, set_channel
from sync.report import public_text, register_keys
from sync.rollout_guard import control_round
from tests.support.fleet_support import device_ids, fleet_report, lite_device, lite_models, report_of, write_reports
from tests.support.servers import ROOT, poll_until, stop_process
from tests.support.sync_support import serving_version


def controller(url: str, env: dict[str, str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "appliance.cli", "rollout", "controller", "--bucket", url, "--model", "hpt",
            "--channel", "stable", "--no-cache", *extra]


def pointer(source: Any) -> dict[str, Any]:
    return json.loads(source.read("hpt/channels/stable.json").data)


def test_the_controller_rolls_the_channel_back_and_the_devices_return(start_server: Any, tmp_path: Path, seaweed: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://fleet/{tmp_path.name}"
    admin = open_source(url)
    publish(admin, "hpt", str(lite_models() / "1"), 1, channel="stable")
    devices = [lite_device(start_server, tmp_path, url, env=seaweed.env(), models=["hpt"]) for _ in range(2)]
    ids = [d.status()["service"]["device_id"] for d in devices]
    reports = [poll_until(lambda i=i: report_of(admin, i), 60, f"the report of {i}") for i in ids]
    register_keys(admin, {i: r["device_key"] for i, r in zip(ids, reports)})
    publish(admin, "hpt", str(lite_models() / "2"), 2)
    set_channel(admin, "hpt", "stable", 2, failure_threshold={"percent": 50, "min_devices": 1}, on_failure="rollback")
    assert pointer(admin)["previous_version"] == 1
    for device in devices:
        device.wait_for(lambda d=device: serving_version(d.status()) == 2, 90, "version 2 serving")
    for i in ids:  # their reports say so: the controller judges the fleet by them
        poll_until(lambda i=i: (r := report_of(admin, i)) and r["models"]["hpt"]["serving_version"] == 2, 60,
                   f"{i} reporting version 2")
    # three more devices failed version 2's trial and serve version 1 (their signed reports)
    key = Ed25519PrivateKey.generate()
    failing = device_ids(3, seed=48)
    register_keys(admin, {d: public_text(key) for d in failing})
    write_reports(admin, [fleet_report(d, 1, 2, "failed", key=key, report_interval_s=3600) for d in failing])
    env = {**os.environ, **seaweed.env()}
    proc = subprocess.Popen(controller(url, env, "--interval", "0.5"), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        back = poll_until(lambda: (p := pointer(admin)).get("rolled_back") and p, 60, "the channel rolled back")
        assert back["version"] == 1 and back["rolled_back"]["from"] == 2 and "failed version 2" in back["rolled_back"]["reason"]
        for device in devices:  # the devices that took version 2 go back to the last good one
            device.wait_for(lambda d=device: serving_version(d.status()) == 1, 90, "version 1 serving again")
    finally:
        stop_process(proc)
    output = proc.stdout.read().decode() if proc.stdout else ""
    assert "ROLLED BACK from version 2 to 1" in output, output
    view = subprocess.run([sys.executable, "-m", "appliance.cli", "fleet", "--bucket", url, "--model", "hpt",
                           "--channel", "stable", "--json", "--no-cache"], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)
    progress = json.loads(view.stdout)["rollouts"][0]
    assert progress["target_version"] == 1 and progress["rolled_back"]["from"] == 2
    again = subprocess.run(controller(url, env, "--once"), capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert pointer(admin) == back  # a second controller (or round) writes nothing
    admin.close()


def test_without_a_previous_version_or_with_halt_the_controller_halts(tmp_path: Path) -> None:
    source = open_source(f"file://{tmp_path / 'bucket'}")
    for version in (1, 2):
        d = tmp_path / f"v{version}"
        d.mkdir()
        (d / "model.tflite").write_bytes(b"v%d" % version * 100)
        publish(source, "hpt", str(d), version)
    set_channel(source, "hpt", "stable", 2, failure_threshold={"percent": 50, "min_devices": 1})  # on_failure: halt
    key = Ed25519PrivateKey.generate()
    ids = device_ids(2, seed=3)
    register_keys(source, {d: public_text(key) for d in ids})
    write_reports(source, [fleet_report(ids[0], 1, 2, "failed", key=key), fleet_report(ids[1], 2, key=key)])
    cache = ReportCache()
    first = control_round(source, "hpt", "stable", cache)
    assert first.halted_now and pointer(source)["halt"] is True and pointer(source)["version"] == 2
    halted = pointer(source)
    assert not control_round(source, "hpt", "stable", cache).halted_now and pointer(source) == halted


def test_a_rollback_judged_on_a_pointer_that_moved_since_writes_nothing(tmp_path: Path) -> None:
    """An operator published a fix between the controller's look and its write: the fix stays."""
    from sync.errors import Refused
    from sync.open_source import open_source
    from sync.manifest import channel_doc
    from sync.publisher import roll_back_channel

    source = open_source(f"file://{tmp_path}")
    # the fix, version 3, published after version 2 was judged failing
    source.put("hpt/channels/stable.json", json.dumps(channel_doc("hpt", "stable", 3, 0)).encode())
    with pytest.raises(Refused, match="moved to version 3 after version 2"):
        roll_back_channel(source, "hpt", "stable", 1, judged=2)
    assert json.loads(source.read("hpt/channels/stable.json").data)["version"] == 3
    doc = roll_back_channel(source, "hpt", "stable", 2, judged=3)
    assert doc["version"] == 2 and doc["rolled_back"]["from"] == 3
