"""A rollout set by the central team in the channel file, for the whole fleet: a device with
no rollout settings of its own loads the channel's candidate next to the serving version,
judges it under the channel's policy on its real traffic, and promotes it, with no failed
request. A policy the device cannot take is refused with the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sync.publisher import publish, set_channel
from sync.open_source import open_source
from tests.support.sync_scenario import hpt, start_device  # noqa: F401 (fixture)
from tests.support.sync_support import Load, events, serving_version, version_of, predict, wait

POLICY = {"mode": "shadow", "min_requests": 20, "max_duration_s": 600.0, "shadow_busy_share": 1.0,
          "max_p99_latency_ratio": 1000.0, "max_output_drift": 1000.0, "max_error_rate": 0.0}


def test_the_channel_sets_the_rollout_for_the_fleet(start_server: Any, tmp_path: Path, hpt: Path) -> None:
    folder = tmp_path / "bucket"
    bucket = open_source(f"file://{folder}")
    publish(bucket, "hpt", str(hpt / "1"), 1, channel="stable")
    publish(bucket, "hpt", str(hpt / "2"), 2)
    server = start_device(start_server, tmp_path, f"file://{folder}")
    assert version_of(predict(server.url)) == 1

    set_channel(bucket, "hpt", "stable", 1, candidate=2, rollout={**POLICY, "mode": "sideways"})
    server.wait_for(lambda: events(server.status(), "rollout_policy_refused"), 60, "the refused policy")
    refusal = events(server.status(), "rollout_policy_refused")[0]["message"]
    assert "mode" in refusal and "sideways" in refusal, refusal
    assert server.status()["models"]["hpt"].get("candidate_version") is None  # the device's own policy: off

    with Load(server.url) as load:
        set_channel(bucket, "hpt", "stable", 1, candidate=2, rollout=POLICY)
        server.wait_for(lambda: events(server.status(), "rollout_promoted"), 120, "the promotion")
        wait(lambda: 2 in load.versions, 30, "answers from version 2")
    assert load.failures == [], load.failures[:5]
    status = server.status()
    assert serving_version(status) == 2
    promoted = events(status, "rollout_promoted")[0]
    assert promoted["version"] == 2 and "promoted" in promoted["message"]
    assert any(e["kind"] == "sync_rollout_policy" for e in status["events"])
