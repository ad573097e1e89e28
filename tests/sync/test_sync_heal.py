"""A fleet that heals, on the follower with real buckets (a folder and SeaweedFS S3):

* a refused version stands while the objects it was judged on are unchanged: one event,
  the original reason kept, and the refused bytes are never fetched again (a 5 MB manifest
  over the 4 MiB cap, a corrupt file): polls only ask "changed?";
* it is tried again as soon as one of them changes (a corrupt object re-uploaded in place
  with ``appliance publish --repair``, or the channel set again), and then committed;
* version numbers beyond int64 are refused where they enter: ``publish --version``, a
  manifest, a channel pointer, the version index; folder names beyond it are ignored; a
  device that trusted such a number before is not stuck below it;
* an idle poll is one conditional request when the device follows every model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from sync.errors import Refused
from sync.follower import Follower, LocalModel, Options
from sync.manifest import MAX_VERSION
from sync.publisher import publish, repair, set_channel
from sync.open_source import open_source
from sync.source_file import FileSource
from sync.store import Store
from tests.support.servers import ROOT

BIG = MAX_VERSION + 1  # 2^63: one past int64


def recording(source: Any) -> Any:
    """The real source, noting which keys it read whole (GET with a body) and downloaded."""
    source.bodies = []
    read, download = source.read, source.download

    def read_noted(key: str, etag: str = "") -> Any:
        fetched = read(key, etag)
        if fetched.data:
            source.bodies.append(key)
        return fetched

    def download_noted(key: str, path: str, offset: int = 0, limit: int | None = None) -> Any:
        source.bodies.append(key)
        return download(key, path, offset, limit)

    source.read, source.download = read_noted, download_noted
    return source


class Device:
    def __init__(self, tmp: Path, source: Any, **opts: Any):
        self.events: list[tuple[str, str, Any]] = []
        self.store = Store(str(tmp / "device")).open()
        self.source = recording(source)
        self.follower = Follower(self.source, self.store, Options(**{"models": ["m"], **opts}),
                                 lambda kind, msg, model="", version=None, **d: self.events.append((kind, msg, version)),
                                 lambda: {"m": LocalModel(max(self.store.versions("m"), default=None))})

    def refusals(self) -> list[tuple[str, Any]]:
        return [(msg, v) for kind, msg, v in self.events if kind == "sync_refused"]


def version_dir(tmp: Path, name: str, size: int = 4096) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "model.tflite").write_bytes((name.encode() * size)[:size])
    return d


@pytest.fixture(params=["file", "s3"])
def bucket(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           seaweed: Any) -> Iterator[str]:
    if request.param == "file":
        yield f"file://{tmp_path / 'bucket'}"
        return
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    yield f"s3://fleet/{request.node.name.replace('[', '-').replace(']', '')}"


def test_a_refused_manifest_is_one_event_and_is_not_fetched_again_until_it_changes(tmp_path: Path, bucket: str) -> None:
    source = open_source(bucket)
    publish(source, "m", str(version_dir(tmp_path, "one")), 1, channel="stable")
    device = Device(tmp_path, open_source(bucket), channel="stable")
    device.follower.sync_once()
    publish(source, "m", str(version_dir(tmp_path, "two")), 2)
    manifest = json.loads(source.read("m/2/MANIFEST.json").data)
    source.put("m/2/MANIFEST.json", json.dumps({**manifest, "padding": "x" * (5 << 20)}).encode())  # 5 MB > 4 MiB
    set_channel(source, "m", "stable", 2)
    for _ in range(3):
        result = device.follower.sync_once()
        assert result.refused and "4194304-byte limit" in result.refused[0], result
    assert len(device.refusals()) == 1 and device.refusals()[0][1] == 2  # one event, naming the version
    assert device.follower.refused["m"]["version"] == 2 and "4194304" in device.follower.refused["m"]["reason"]
    assert device.source.bodies.count("m/2/MANIFEST.json") <= 1  # the 4 MiB are never fetched again
    source.put("m/2/MANIFEST.json", json.dumps(manifest).encode())  # the publisher puts it right
    device.follower.sync_once()
    assert sorted(device.store.versions("m")) == [1, 2] and "m" not in device.follower.refused


def test_a_corrupt_object_fixed_in_place_is_picked_up(tmp_path: Path, bucket: str) -> None:
    source = open_source(bucket)
    publish(source, "m", str(version_dir(tmp_path, "one")), 1, channel="stable")
    device = Device(tmp_path, open_source(bucket), channel="stable")
    device.follower.sync_once()
    good = version_dir(tmp_path, "two", 200_000)
    publish(source, "m", str(good), 2)
    source.put("m/2/model.tflite", b"\0" * 200_000)  # same size, wrong bytes
    set_channel(source, "m", "stable", 2)
    first = device.follower.sync_once()
    assert "does not match its sha256" in first.refused[0]
    for _ in range(3):  # standing: the original reason, no new event, the bad file not downloaded again
        assert device.follower.sync_once().refused == first.refused
    assert len(device.refusals()) == 1 and device.source.bodies.count("m/2/model.tflite") == 1
    with pytest.raises(Refused, match="is not the file m version 2 signed"):
        repair(source, "m", 2, str(version_dir(tmp_path, "wrong", 200_000)))  # only the signed bytes go up
    repair(source, "m", 2, str(good))
    assert device.follower.sync_once().changed == ["m:2"]
    assert sorted(device.store.versions("m")) == [1, 2] and "m" not in device.follower.refused


def test_setting_the_channel_again_retries_a_refused_version(tmp_path: Path, bucket: str) -> None:
    source = open_source(bucket)
    publish(source, "m", str(version_dir(tmp_path, "one")), 1, channel="stable")
    publish(source, "m", str(version_dir(tmp_path, "two")), 2)
    device = Device(tmp_path, open_source(bucket), channel="stable")
    device.follower.sync_once()
    data = source.read("m/2/model.tflite").data
    source.put("m/2/model.tflite", data[:100])  # truncated
    set_channel(source, "m", "stable", 2)
    device.follower.sync_once()
    device.follower.sync_once()
    assert len(device.refusals()) == 1
    set_channel(source, "m", "stable", 2)  # the operator: try again (the object is still bad)
    device.follower.sync_once()
    assert len(device.refusals()) == 2 and device.source.bodies.count("m/2/model.tflite") == 2


def test_versions_beyond_int64_are_refused_where_they_enter(tmp_path: Path) -> None:
    folder = tmp_path / "bucket"
    source = open_source(f"file://{folder}")
    with pytest.raises(Refused, match="int64"):
        publish(source, "m", str(version_dir(tmp_path, "big")), BIG)
    cli = subprocess.run([sys.executable, "-m", "appliance.cli", "publish", "--bucket", f"file://{folder}", "--model",
                          "m", "--version", "20261205074500123456", str(tmp_path / "big")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert cli.returncode == 2 and "9223372036854775807" in cli.stderr and "int64" in cli.stderr, cli.stderr
    assert not (folder / "m").exists()
    publish(source, "m", str(version_dir(tmp_path, "one")), 1)
    device = Device(tmp_path, open_source(f"file://{folder}"))
    device.follower.sync_once()
    (folder / "m" / str(BIG)).mkdir()  # a hand-made folder beyond int64: ignored, as TF Serving does
    (folder / "m" / "versions.json").unlink()
    assert device.follower.sync_once().refused == [] and sorted(device.store.versions("m")) == [1]
    (folder / "m/versions.json").write_text(json.dumps({"latest": BIG, "versions": [BIG]}))
    assert "int64" in device.follower.sync_once().refused[0]
    pointer = {"model": "m", "channel": "stable", "version": BIG, "created": 1.0, "expires": 0}
    (folder / "m/channels").mkdir()
    (folder / "m/channels/stable.json").write_text(json.dumps(pointer))
    channelled = Device(tmp_path / "b", open_source(f"file://{folder}"), channel="stable")
    assert "int64" in channelled.follower.sync_once().refused[0] and channelled.refusals()


def test_a_device_that_trusted_a_huge_version_before_is_not_stuck_below_it(tmp_path: Path) -> None:
    """What a device left by an older release holds: a committed folder and a trust record
    beyond int64. Both are void now, so a good v9 published afterwards is taken."""
    folder = tmp_path / "bucket"
    source = open_source(f"file://{folder}")
    device = Device(tmp_path, open_source(f"file://{folder}"))
    stale = Path(device.store.models_dir) / "m" / str(20261205074500123456)
    stale.mkdir(parents=True)
    (stale / "MANIFEST.json").write_text("{}")
    device.store.set_trust("m", {"version": 20261205074500123456, "pointer_created": 0})
    publish(source, "m", str(version_dir(tmp_path, "nine")), 9)
    assert device.follower.sync_once().refused == []
    assert 9 in device.store.versions("m")


def test_an_idle_poll_of_every_model_is_one_conditional_request(tmp_path: Path) -> None:
    folder = tmp_path / "bucket"
    source = open_source(f"file://{folder}")
    publish(source, "m", str(version_dir(tmp_path, "one")), 1, channel="stable")
    device = Device(tmp_path, FileSource(f"file://{folder}", str(folder)), models=[], channel="stable")
    assert device.follower.sync_once().changed == ["m:1"]
    for _ in range(3):
        assert device.follower.sync_once().requests == 1  # the channel pointer, answered "not modified"
    assert device.follower.sync_once(force=True).requests == 2  # appliance sync: the list of models too


class Answering:
    """A real HTTP server on loopback answering every request with ``status`` (and ``headers``,
    ``body``): an HTTPS mirror or an S3 endpoint that fails on purpose."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.status, self.headers, self.body = 503, {}, b""
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(outer.status)
                for k, v in {**outer.headers, "Content-Length": str(len(outer.body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(outer.body)

            do_HEAD = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="answering")
        self.thread.start()

    def answer(self, status: int, headers: dict[str, str] | None = None, body: bytes = b"") -> None:
        self.status, self.headers, self.body = status, headers or {}, body

    def stop(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(10)


def sync_loop(tmp_path: Path, bucket: str, **env: str) -> Any:
    import types

    from appliance.core.config import Config
    from appliance.core.metrics import Metrics
    from appliance.core.state import StateDB
    from appliance.parts.sync_loop import SyncLoop

    config = Config()
    config.state_dir = str(tmp_path / "state")
    config.sync.bucket = bucket
    config.sync.models, config.sync.poll_interval_s, config.sync.max_backoff_s, config.sync.jitter = ["m"], 0.5, 5.0, 0.0
    db = StateDB(":memory:").open()
    core = types.SimpleNamespace(device={}, db=db, manager=None, device_id="test", add_status=lambda *a: None,
                                 metrics=Metrics(), add_source=lambda *a, **k: types.SimpleNamespace(scan=lambda: None))
    return SyncLoop(types.SimpleNamespace(config=config, core=core))


def test_an_unavailable_bucket_is_retried_at_the_interval_and_only_slow_down_backs_off(tmp_path: Path) -> None:
    """503 (a gateway whose backend is down) is not throttling: retried at the poll interval,
    a Retry-After honoured up to two intervals. 429 "slow down" backs off, doubling to two
    intervals (a Retry-After up to max_backoff_s). Unreachable: the interval. The problem text
    says which."""
    bucket = Answering()
    loop = sync_loop(tmp_path, bucket.url)
    try:
        for _ in range(4):  # a long 503 outage: the interval every time, however many failures
            assert loop._poll() == pytest.approx(0.5)
        assert "HTTP 503" in loop.status["last_error"] and loop.status["failures"] == 4
        bucket.answer(503, {"Retry-After": "7"})
        assert loop._poll() == pytest.approx(1.0)  # capped at two intervals
        bucket.answer(429)
        assert loop._poll() == pytest.approx(1.0)  # slow down: doubling, capped at two intervals
        bucket.answer(429, {"Retry-After": "7"})
        assert loop._poll() == pytest.approx(5.0)  # as long as it asks, up to max_backoff_s
        bucket.stop()
        assert loop._poll() == pytest.approx(0.5)  # unreachable
        messages = [e["message"] for e in loop.core.db.recent(20) if e["kind"] == "sync_error"]
        assert any("the bucket is unavailable: retrying at the poll interval" in m for m in messages), messages
        assert any("asks for fewer requests: backing off" in m for m in messages), messages
        assert not any("backing off" in m for m in messages if "HTTP 503" in m)
    finally:
        bucket.stop()
        loop.source.close()
        loop.core.db.close()


@pytest.mark.parametrize("status,code,kind", [(503, "SlowDown", "Throttled"), (503, "ServiceUnavailable", "Unavailable"),
                                              (503, "", "Unavailable"), (429, "", "Throttled"),
                                              (500, "InternalError", "Unavailable")])
def test_s3_answers_split_as_the_aws_sdks_split_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: int,
                                                     code: str, kind: str) -> None:
    from sync import errors

    bucket = Answering()
    body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>no</Message></Error>".encode()
            if code else b"")
    bucket.answer(status, {"Content-Type": "application/xml"} if code else {}, body)
    for k, v in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_EC2_METADATA_DISABLED": "true", "AWS_MAX_ATTEMPTS": "1"}.items():
        monkeypatch.setenv(k, v)
    source = open_source("s3://fleet/p", s3_endpoint_url=bucket.url)
    try:
        with pytest.raises(errors.SourceError) as caught:
            source.read("m/channels/stable.json")
        assert type(caught.value).__name__ == kind, caught.value
    finally:
        source.close()
        bucket.stop()


def test_a_malformed_list_of_models_is_one_event_not_a_failing_poll(tmp_path: Path) -> None:
    folder = tmp_path / "bucket"
    source = open_source(f"file://{folder}")
    publish(source, "m", str(version_dir(tmp_path, "one")), 1)
    (folder / "_models.json").write_text("{not json")
    device = Device(tmp_path, open_source(f"file://{folder}"), models=[])
    for _ in range(3):
        assert "_models.json is malformed" in device.follower.sync_once(force=True).refused[0]
    assert len(device.refusals()) == 1 and "the list of models" in device.refusals()[0][0]
    (folder / "_models.json").write_text(json.dumps({"models": ["m"]}))
    assert device.follower.sync_once(force=True).changed == ["m:1"] and device.follower.refused == {}
