"""Retention by what served, on SeaweedFS: the versions kept are those that served most
recently and the channel's previous target, whatever their numbers, so a move back finds its
version on disk and fetches nothing; a version set aside while loaded keeps its directory
until the manager lets it go."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from sync.follower import LocalModel
from sync.open_source import open_source
from sync.publisher import publish, set_channel
from tests.support.sync_support import Device, make_version


@pytest.fixture
def s3_bucket(seaweed: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    source = open_source(f"s3://fleet/{tmp_path.name}")
    yield source
    source.close()


def fetches(device: Device, version: int) -> int:
    return sum(1 for kind, _, v in device.events if kind == "sync_fetch" and v == version)


def move(source: Any, device: Device, version: int) -> None:
    time.sleep(0.01)  # each pointer newer than the last (created is its clock)
    set_channel(source, "m", "stable", version)
    device.follower.sync_once()
    assert device.serving() == version
    device.follower.sync_once()  # the target has served: retention runs


def test_a_move_back_to_the_version_before_fetches_nothing(s3_bucket: Any, tmp_path: Path) -> None:
    for v in (12, 13, 14):
        publish(s3_bucket, "m", str(make_version(tmp_path, f"v{v}", {"model.tflite": f"v{v}".encode() * 100})), v)
    device = Device(tmp_path, f"s3://fleet/{tmp_path.name}", source=open_source(f"s3://fleet/{tmp_path.name}"),
                    channel="stable", retain=2)
    for version in (12, 13, 12, 14):
        move(s3_bucket, device, version)
    on_disk = set(device.store.versions("m")) | set(device.store.parked("m"))
    assert 12 in on_disk and 13 not in on_disk  # 14 and 12 served last; 13 is the one that goes
    requests = device.source.requests
    move(s3_bucket, device, 12)
    assert fetches(device, 12) == 1  # downloaded once, at the start
    assert device.source.requests - requests <= 4  # pointer reads only, no manifest or object


def test_the_previous_target_is_kept_even_if_it_never_served(s3_bucket: Any, tmp_path: Path) -> None:
    for v in (1, 2, 3):
        publish(s3_bucket, "m", str(make_version(tmp_path, f"v{v}", {"f": f"v{v}".encode()})), v)
    device = Device(tmp_path, f"s3://fleet/{tmp_path.name}", source=open_source(f"s3://fleet/{tmp_path.name}"),
                    channel="stable", retain=1)
    for version in (3, 1, 2):
        move(s3_bucket, device, version)
    assert device.store.trust("m")["previous_target"] == 1
    assert sorted(device.store.versions("m")) == [1, 2]  # retain=1 keeps 2; 1 is where the channel came from
    assert device.store.parked("m") == {}  # 3, the highest number, is what goes


def test_a_loaded_version_is_withdrawn_first_and_parked_once_unloaded(s3_bucket: Any, tmp_path: Path) -> None:
    for v in (1, 2):
        publish(s3_bucket, "m", str(make_version(tmp_path, f"v{v}", {"f": f"v{v}".encode()})), v)
    loaded: set[int] = set()
    device = Device(tmp_path, f"s3://fleet/{tmp_path.name}", source=open_source(f"s3://fleet/{tmp_path.name}"),
                    channel="stable", retain=2)
    device.follower.local = lambda: {"m": LocalModel(max(device.store.served_versions("m"), default=None), loaded=frozenset(loaded))}
    set_channel(s3_bucket, "m", "stable", 2)
    device.follower.sync_once()
    loaded.add(2)
    move(s3_bucket, device, 1)
    store = device.store
    assert sorted(store.versions("m")) == [1, 2] and store.withdrawn("m") == {2}  # still open: left in place
    assert sorted(store.served_versions("m")) == [1]  # but no longer pushed to the manager
    device.follower.sync_once()
    assert 2 in store.versions("m")  # still loaded: still in place
    loaded.discard(2)
    device.follower.sync_once()
    assert sorted(store.versions("m")) == [1] and sorted(store.parked("m")) == [2] and store.withdrawn("m") == set()
    # a move forward before it was parked just serves it again
    loaded.add(1)
    move(s3_bucket, device, 2)
    loaded.add(2)
    move(s3_bucket, device, 1)
    assert store.withdrawn("m") == {2}
    move(s3_bucket, device, 2)
    assert store.withdrawn("m") == set() and sorted(store.served_versions("m")) == [1, 2]
    assert fetches(device, 2) == 1
