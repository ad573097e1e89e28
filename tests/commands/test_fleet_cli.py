"""``appliance fleet`` and the rollout verbs as an operator runs them, on a folder bucket and
on SeaweedFS: filters, staleness by three heartbeats, trust marks, the JSON schema, the
listing cache (a repeated view reads only what changed), a rollout's progress with the
failing devices' own reasons, waves from ``channel set --waves``, and ``rollout watch``
halting a rollout at its failure threshold. The reports are written as devices write them
(tests/support/fleet_support.py), for a fleet larger than this machine runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sync.listing import ReportCache, list_reports
from sync.publisher import publish
from sync.report import public_text, register_keys
from sync.open_source import open_source
from sync.waves import share
from tests.support.servers import ROOT
from tests.support.fleet_support import device_ids, fleet_report, write_reports

IDS = device_ids(40)


def appliance(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=180, env={**os.environ, **(env or {})})


def version_dir(tmp: Path, name: str) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "model.tflite").write_bytes(name.encode() * 100)
    return d


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    source = open_source(f"file://{tmp_path / 'bucket'}")
    for version in (1, 2):
        publish(source, "hpt", str(version_dir(tmp_path, f"v{version}")), version)
    return tmp_path / "bucket"


def test_filters_staleness_and_trust_marks(folder: Path, tmp_path: Path) -> None:
    source = open_source(f"file://{folder}")
    key = Ed25519PrivateKey.generate()
    reports = [fleet_report(IDS[0], 2, key=key), fleet_report(IDS[1], 1, 2, "refused", key=key),
               fleet_report(IDS[2], 1, 2, "failed"), fleet_report(IDS[3], 2, state="unhealthy", key=key),
               fleet_report(IDS[4], 2, key=key, channel="beta"), fleet_report(IDS[5], 2, key=key)]
    reports[5] = {**reports[5], "healthy": False}  # changed after signing
    write_reports(source, reports)
    gone = folder / "_devices" / f"{IDS[0]}.json"
    os.utime(gone, (time.time() - 3 * 300 - 60,) * 2)  # last written more than three heartbeats ago
    (folder / "_devices" / "junk.json").write_text("{not json")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}

    def rows(*args: str) -> dict[str, dict[str, Any]]:
        out = appliance("fleet", "--bucket", f"file://{folder}", "--json", *args, env=env)
        assert out.returncode == 0, out.stderr
        return {r["device_id"]: r for r in json.loads(out.stdout)["devices"]}

    every = rows()  # no key registered yet: what the reports claim is shown, as untrusted
    assert {d: r["status"] for d, r in every.items()} == {**{d: "untrusted" for d in IDS[:6]}, "junk": "unreadable"}
    assert {d: r["trust"] for d, r in every.items() if d != "junk"} == {
        IDS[0]: "unregistered", IDS[1]: "unregistered", IDS[2]: "unsigned", IDS[3]: "unregistered",
        IDS[4]: "unregistered", IDS[5]: "mis-signed"}
    out = appliance("fleet", "--bucket", f"file://{folder}", "--register-keys", env=env)
    assert out.returncode == 0 and "registered the keys of 4 devices" in out.stderr, out.stderr
    every = rows()
    assert {d: r["status"] for d, r in every.items()} == {
        IDS[0]: "stale", IDS[1]: "degraded", IDS[2]: "untrusted", IDS[3]: "unhealthy", IDS[4]: "ok",
        IDS[5]: "untrusted", "junk": "unreadable"}
    assert every[IDS[1]]["models"]["hpt"]["state"] == "refused" and "sha256" in every[IDS[1]]["models"]["hpt"]["reason"]
    assert every[IDS[2]]["models"]["hpt"]["state"] == "failed" and "Could not open" in every[IDS[2]]["models"]["hpt"]["reason"]
    marks = {d: r["trust"] for d, r in every.items()}
    assert marks[IDS[1]] == "signed" and marks[IDS[5]] == "mis-signed" and marks[IDS[2]] == "unsigned"
    assert set(rows("--stale")) == {IDS[0]}
    assert set(rows("--unhealthy")) == {IDS[1], IDS[2], IDS[3], IDS[5], "junk"}
    assert set(rows("--channel", "beta")) == {IDS[4]}
    assert set(rows("--model", "hpt", "--version", "1")) == {IDS[1], IDS[2]}
    text = appliance("fleet", "--bucket", f"file://{folder}", env=env).stdout
    assert "STALE" in text and "7 devices: 1 ok, 1 degraded, 1 unhealthy, 1 stale, 1 unreadable, 2 untrusted" in text, text
    assert "0 read, 7 unchanged" in text  # the repeated view read nothing


def test_a_repeated_view_reads_only_the_reports_written_since(folder: Path, tmp_path: Path) -> None:
    source = open_source(f"file://{folder}")
    write_reports(source, [fleet_report(d, 1) for d in IDS])
    cache = ReportCache(str(tmp_path / "cache.json"), "b")
    first = list_reports(open_source(f"file://{folder}"), cache)
    assert first.fetched == 40 and first.cached == 0
    cache.save()
    time.sleep(0.01)
    write_reports(source, [fleet_report(d, 2) for d in IDS[:3]])
    (folder / "_devices" / f"{IDS[-1]}.json").unlink()  # a retired device
    again = list_reports(open_source(f"file://{folder}"), ReportCache(str(tmp_path / "cache.json"), "b"))
    assert again.fetched == 3 and again.cached == 36 and len(again.entries) == 39
    assert {e.device_id: e.report["models"]["hpt"]["serving_version"] for e in again.entries}[IDS[0]] == 2


def test_rollout_progress_waves_from_the_cli_and_a_halt_at_the_threshold(folder: Path, tmp_path: Path) -> None:
    first = [d for d in IDS if share(d, 2) < 0.25]  # wave 1 of "25:60,100" for version 2
    later = [d for d in IDS if share(d, 2) >= 0.25]
    threshold_percent = round(150 / len(first), 1)  # between one and two failing devices of wave 1
    out = appliance("channel", "set", "--bucket", f"file://{folder}", "--model", "hpt", "--channel", "stable",
                    "--version", "2", "--waves", "25:60,100", "--failure-threshold", str(threshold_percent),
                    "--min-devices", "2")
    assert out.returncode == 0 and "in waves 25% (hold 60 min), 100%" in out.stdout, out.stderr
    pointer = json.loads((folder / "hpt/channels/stable.json").read_text())
    assert pointer["waves"] == [{"percent": 25, "hold_minutes": 60}, {"percent": 100}]
    assert pointer["failure_threshold"] == {"percent": threshold_percent, "min_devices": 2}
    source = open_source(f"file://{folder}")
    key = Ed25519PrivateKey.generate()  # only reports signed by a registered key count
    register_keys(source, {d: public_text(key) for d in IDS})
    reports = [fleet_report(d, 2, key=key) for d in first[1:]] + [fleet_report(d, 1, 2, "waiting", key=key) for d in later]
    write_reports(source, reports + [fleet_report(first[0], 1, 2, "refused", key=key)])
    watch = appliance("rollout", "watch", "--bucket", f"file://{folder}", "--model", "hpt", "--once", "--no-cache")
    assert watch.returncode == 0 and "HALTED" not in watch.stdout, watch.stdout + watch.stderr  # one failure: under
    progress = json.loads(appliance("fleet", "--bucket", f"file://{folder}", "--model", "hpt", "--channel", "stable",
                                    "--json", "--no-cache").stdout)["rollouts"][0]
    assert progress["target_version"] == 2 and progress["devices"] == len(IDS)
    assert progress["on_target"] == len(first) - 1 and progress["waiting"] == len(later)
    assert progress["on_target_percent"] == round(100 * (len(first) - 1) / len(IDS), 1)
    assert progress["on_other_versions"] == {"1": len(later) + 1}
    assert progress["failing"] == [{"device_id": first[0], "state": "refused", "version": 2,
                                    "reason": "hpt version 2: model.tflite does not match its sha256 (corrupt object)"}]
    assert progress["waves"]["open"] == 1 and progress["waves"]["per_wave"]["1"]["devices"] == len(first)
    threshold = progress["threshold"]
    assert threshold["failing_in_open_waves"] == 1 and threshold["devices_in_open_waves"] == len(first)
    assert not threshold["breached"] and not progress["halted"]
    # a second device of the open wave fails to load it: over the threshold, the watch halts the channel
    write_reports(source, [fleet_report(first[1], 1, 2, "failed", key=key)])
    watch = appliance("rollout", "watch", "--bucket", f"file://{folder}", "--model", "hpt", "--once", "--no-cache")
    assert watch.returncode == 3 and "HALTED" in watch.stdout, watch.stdout + watch.stderr
    halted = json.loads((folder / "hpt/channels/stable.json").read_text())
    assert halted["halt"] is True and f"2 of {len(first)} devices in the open waves" in halted["halted"]["reason"]
    assert halted["created"] == pointer["created"]  # devices do not read a halt as a new rollout
    text = appliance("fleet", "--bucket", f"file://{folder}", "--model", "hpt", "--channel", "stable", "--no-cache").stdout
    assert "HALTED: 2 of" in text and f"FAILING {first[0]}: refused version 2" in text, text
    assert f"FAILING {first[1]}: failed version 2: Could not open" in text


def test_listing_from_s3_matches_the_reports_and_caches(seaweed: Any, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://fleet/{tmp_path.name}"
    source = open_source(url)
    ids = device_ids(300, seed=1)
    key = Ed25519PrivateKey.generate()
    write_reports(source, [fleet_report(d, 1 + i % 2, key=key) for i, d in enumerate(ids)])
    source.put("_devices/huge.json", b" " * ((1 << 20) + 10))  # a report over the cap: listed with its error
    cache = ReportCache()
    listing = list_reports(open_source(url), cache, workers=8)
    assert len(listing.entries) == 301 and listing.fetched == 301
    by_id = {e.device_id: e for e in listing.entries}
    assert by_id["huge"].report is None and "over 1048576" in by_id["huge"].error
    assert all(by_id[d].report["device_key"] == public_text(key) for d in ids)
    assert [by_id[d].report["models"]["hpt"]["serving_version"] for d in ids] == [1 + i % 2 for i in range(300)]
    assert all(by_id[d].modified > time.time() - 600 and by_id[d].etag for d in ids)
    again = list_reports(open_source(url), cache, workers=8)
    assert again.fetched == 0 and again.cached == 301 and again.requests == 1  # one listing page, nothing read
    out = appliance("fleet", "--bucket", url, "--json", "--no-cache")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["counts"]["devices"] == 301


def test_a_replay_is_caught_by_the_next_cli_run_and_the_cache_file_holds_each_report_once(folder: Path,
                                                                                        tmp_path: Path) -> None:
    source = open_source(f"file://{folder}")
    key = Ed25519PrivateKey.generate()
    register_keys(source, {d: public_text(key) for d in IDS[:2]})
    now = time.time()
    old = {**fleet_report(IDS[0], 1, 2, "failed", written_at=now - 725), "sequence": 7}
    from sync.report import sign_report

    write_reports(source, [sign_report({**fleet_report(IDS[0], 2, written_at=now), "sequence": 8}, key)])
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}

    def rows() -> dict[str, dict[str, Any]]:
        out = appliance("fleet", "--bucket", f"file://{folder}", "--json", env=env)
        assert out.returncode == 0, out.stderr
        return {r["device_id"]: r for r in json.loads(out.stdout)["devices"]}

    assert rows()[IDS[0]]["trust"] == "signed"
    cache_file = next((tmp_path / "cache").rglob("*.json"))
    saved = json.loads(cache_file.read_text())
    assert saved["trusted"][IDS[0]][1] is None  # a reference to the cached report, not a second copy
    write_reports(source, [sign_report(old, key)])  # the device's own report from 725 s before, replayed
    row = rows()[IDS[0]]
    assert row["trust"] == "replayed" and row["status"] == "ok" and row["models"]["hpt"]["serving"] == 2
    assert row["untrusted_report"]["sequence"] == 7
    source.put(f"_devices/{IDS[0]}.json", b"{not json")  # the device's own file, broken
    row = rows()[IDS[0]]
    assert row["status"] == "unreadable" and row["error"], row  # said as such, not its last trusted report
