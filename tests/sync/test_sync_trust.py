"""The threat model of The Update Framework, applied to model manifests, one test per threat.

Real files, real Ed25519 keys, real loopback HTTP servers that stall or never stop sending,
the real Follower, Store and sources, and (for the bucket-writer attack) the real service.
Each refusal checks that nothing reached the model store and that the trusted version stays.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from sync import manifest as mf
from sync.errors import Refused, SourceError
from sync.fetcher import fetch
from sync.publisher import publish, set_channel
from sync.source import Limits
from sync.open_source import open_source
from sync.source_https import HTTPSource
from sync.store import Store, check_version_tree, verify_version
from tests.support.mirror import Mirror
from tests.support.servers import free_port, poll_until
from tests.support.sync_scenario import hpt  # noqa: F401 (fixture)
from tests.support.sync_support import (CPU_TAGS, Device, events, make_version, predict, serving_version,
                                        store_is_complete, version_of)


# -- helpers ---------------------------------------------------------------------------------
@pytest.fixture
def bucket(tmp_path: Path) -> Path:
    b = tmp_path / "bucket"
    b.mkdir()
    return b


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Any, Any]:
    mf.keygen(str(tmp_path / "k.key"), str(tmp_path / "k.pub"))
    return mf.load_private_key(str(tmp_path / "k.key")), mf.load_public_key(str(tmp_path / "k.pub"))


def publish_versions(tmp: Path, bucket: Path, key: Any, count: int, model: str = "m", **kw: Any) -> Any:
    source = open_source(f"file://{bucket}")
    for v in range(1, count + 1):
        publish(source, model, str(make_version(tmp, f"{model}{v}", {"model.tflite": f"{model}-{v}".encode() * 100})),
                v, sign_key=key, **kw)
    return source


def set_latest(bucket: Path, model: str, version: int) -> None:
    """What any bucket writer can do: the unsigned version index names another version."""
    (bucket / model / "versions.json").write_text(json.dumps({"latest": version, "versions": [version]}))


def nothing_new_staged(store: Store) -> bool:
    return not [p for p in Path(store.staging_dir).rglob("*") if p.is_file()]


# -- rollback: replayed older metadata ---------------------------------------------------------
def test_replayed_older_manifest_is_refused_and_the_trusted_version_stays(tmp_path: Path, bucket: Path,
                                                                            keys: Any) -> None:
    private, public = keys
    publish_versions(tmp_path, bucket, private, 2)
    device = Device(tmp_path, f"file://{bucket}", public_key=public)
    device.follower.sync_once()
    assert sorted(device.store.versions("m")) == [2]
    set_latest(bucket, "m", 1)  # replay: the index names the older, validly signed version 1
    result = device.follower.sync_once()
    assert result.refused and "below the highest trusted version 2" in result.refused[0]
    assert device.serving() == 2 and sorted(device.store.versions("m")) == [2]
    assert device.store.trust("m")["version"] == 2


def test_replayed_older_channel_pointer_is_refused(tmp_path: Path, bucket: Path, keys: Any) -> None:
    private, public = keys
    source = publish_versions(tmp_path, bucket, private, 2)
    set_channel(source, "m", "stable", 1, private)
    old_pointer = (bucket / "m/channels/stable.json").read_bytes()
    time.sleep(0.01)
    set_channel(source, "m", "stable", 2, private)
    device = Device(tmp_path, f"file://{bucket}", channel="stable", public_key=public)
    device.follower.sync_once()
    assert device.serving() == 2
    (bucket / "m/channels/stable.json").write_bytes(old_pointer)  # a validly signed, older pointer
    assert "older than one already seen" in device.follower.sync_once().refused[0]
    assert sorted(device.store.versions("m")) == [2]


def test_old_signed_manifest_replayed_under_a_newer_version_number_is_refused(tmp_path: Path, bucket: Path,
                                                                               keys: Any) -> None:
    private, public = keys
    publish_versions(tmp_path, bucket, private, 1)
    device = Device(tmp_path, f"file://{bucket}", public_key=public)
    device.follower.sync_once()
    shutil.copytree(bucket / "m/1", bucket / "m/5")  # files and signed manifest of version 1, as "version 5"
    set_latest(bucket, "m", 5)
    result = device.follower.sync_once()
    assert result.refused and "names 'm' version 1" in result.refused[0], result.refused
    assert sorted(device.store.versions("m")) == [1] and device.store.trust("m")["version"] == 1
    assert device.refusals() and nothing_new_staged(device.store)


# -- an equal version ----------------------------------------------------------------------------
def test_an_equal_version_is_a_no_op_not_an_error(tmp_path: Path, bucket: Path, keys: Any) -> None:
    private, public = keys
    source = publish_versions(tmp_path, bucket, private, 2)
    set_channel(source, "m", "stable", 2, private)
    device = Device(tmp_path, f"file://{bucket}", channel="stable", public_key=public)
    device.follower.sync_once()
    committed = Path(device.store.versions("m")[2])
    inode = (committed / "model.tflite").stat().st_ino
    before = list(device.events)
    time.sleep(0.01)
    set_channel(source, "m", "stable", 2, private)  # re-signed, newer pointer, same version
    # the bucket's manifest of version 2 changes too: a committed version is never fetched again
    doc = json.loads((bucket / "m/2/MANIFEST.json").read_text())
    (bucket / "m/2/MANIFEST.json").write_text(json.dumps({**doc, "publisher": "someone else"}))
    for _ in range(2):
        result = device.follower.sync_once()
        assert result.changed == [] and result.refused == [], result
    assert device.events == before  # nothing to report: no refusal, no fetch
    assert (committed / "model.tflite").stat().st_ino == inode and sorted(device.store.versions("m")) == [2]


# -- freeze -------------------------------------------------------------------------------------
def test_expired_manifest_and_expired_pointer_are_refused(tmp_path: Path, bucket: Path, keys: Any) -> None:
    private, public = keys
    source = publish_versions(tmp_path, bucket, private, 1, channel="stable")
    device = Device(tmp_path, f"file://{bucket}", channel="stable", public_key=public)
    device.follower.sync_once()
    assert device.serving() == 1
    # a signed version whose manifest expired (a mirror frozen on old metadata)
    publish(source, "m", str(make_version(tmp_path, "x", {"model.tflite": b"late" * 10})), 2, sign_key=private,
            expires_days=-1 / 86400)
    set_channel(source, "m", "stable", 2, private)
    result = device.follower.sync_once()
    assert "expired at" in result.refused[0] and device.serving() == 1
    # the channel pointer itself expired: the device does not follow stale metadata
    publish(source, "m", str(make_version(tmp_path, "y", {"model.tflite": b"ok" * 10})), 3, sign_key=private)
    time.sleep(0.01)
    set_channel(source, "m", "stable", 3, private, expires_days=-1 / 86400)
    result = device.follower.sync_once()
    assert "channel stable expired at" in result.refused[0] and device.serving() == 1
    assert sorted(device.store.versions("m")) == [1]


@pytest.mark.parametrize("expires", [float("nan"), True, "2999-01-01", -5])
def test_malformed_expiry_is_refused_not_read_as_never(expires: Any) -> None:
    with pytest.raises(Refused, match="malformed expires"):
        mf.check_expiry({"expires": expires}, "m version 1 manifest")


# -- mix and match ------------------------------------------------------------------------------
def test_mix_and_match_is_refused(tmp_path: Path, bucket: Path, keys: Any) -> None:
    private, public = keys
    publish_versions(tmp_path, bucket, private, 1, model="a")
    publish_versions(tmp_path, bucket, private, 1, model="b")
    source = open_source(f"file://{bucket}")
    publish(source, "a", str(make_version(tmp_path, "gpu", {"model.tflite": b"gpu" * 10})), 2, sign_key=private,
            compat=["cuda"])
    a1 = json.loads((bucket / "a/1/MANIFEST.json").read_text())
    b1 = json.loads((bucket / "b/1/MANIFEST.json").read_text())
    a2 = json.loads((bucket / "a/2/MANIFEST.json").read_text())

    def attempt(doc: dict[str, Any], model: str = "a", version: int = 1) -> str:
        with pytest.raises(Refused) as caught:
            mf.verify(json.dumps(doc).encode(), model, version, public, CPU_TAGS)
        return str(caught.value)

    assert "names 'b' version 1" in attempt(b1)  # model B's signed manifest served as model A's
    assert "invalid signature" in attempt({**a1, "files": b1["files"]})  # A's manifest with B's hashes
    assert "invalid signature" in attempt({**a1, "model": "b"}, model="b")  # A's signature, B's name
    assert "invalid signature" in attempt({**a2, "compat": []}, version=2)  # compat tag removed
    assert "needs cuda" in attempt(a2, version=2)  # intact, but for another kind of device
    for entry in ("path", "size", "sha256"):
        changed = [dict(f) for f in a1["files"]]
        changed[0][entry] = {"path": "other.tflite", "size": 1, "sha256": "0" * 64}[entry]
        assert "invalid signature" in attempt({**a1, "files": changed})
    # a channel pointer signed for model B (or channel beta) does not move model A
    pointer = mf.sign(mf.channel_doc("b", "stable", 1), private)
    with pytest.raises(Refused, match="pointer names 'b'"):
        mf.verify_channel(json.dumps(pointer).encode(), "a", "stable", public)
    pointer = mf.sign(mf.channel_doc("a", "beta", 1), private)
    with pytest.raises(Refused, match="'a'/'beta'"):
        mf.verify_channel(json.dumps(pointer).encode(), "a", "stable", public)
    # and end to end: B's manifest placed as A's version 3 never reaches A's store
    shutil.copytree(bucket / "b/1", bucket / "a/3")
    set_latest(bucket, "a", 3)
    device = Device(tmp_path, f"file://{bucket}", models=("a",), public_key=public)
    assert "names 'b' version 1" in device.follower.sync_once().refused[0]
    assert device.store.versions("a") == {}


# -- trust persisted outside the model store ---------------------------------------------------
def test_highest_trusted_version_survives_deleting_version_dirs(tmp_path: Path, bucket: Path, keys: Any) -> None:
    private, public = keys
    publish_versions(tmp_path, bucket, private, 3)
    device = Device(tmp_path, f"file://{bucket}", public_key=public, retain=3)
    device.follower.sync_once()
    trust_file = Path(device.store.sync_dir) / "trust.json"
    assert json.loads(trust_file.read_text())["m"]["version"] == 3
    assert Path(device.store.models_dir) not in trust_file.parents  # outside the model store
    assert sorted(device.store.versions("m")) == [3]
    shutil.rmtree(Path(device.store.models_dir) / "m" / "3")  # someone (or a disk repair) deletes it
    set_latest(bucket, "m", 2)  # and the bucket offers the older, validly signed version 2
    result = device.follower.sync_once()
    assert result.refused and "below the highest trusted version 3" in result.refused[0]
    assert device.store.versions("m") == {}


def test_corrupt_trust_record_falls_back_to_the_newest_version_on_disk(tmp_path: Path, bucket: Path,
                                                                        keys: Any) -> None:
    private, public = keys
    publish_versions(tmp_path, bucket, private, 2)
    device = Device(tmp_path, f"file://{bucket}", public_key=public)
    device.follower.sync_once()
    trust_file = Path(device.store.sync_dir) / "trust.json"
    trust_file.write_text('{"m": {"version": 2')  # damaged
    set_latest(bucket, "m", 1)
    result = device.follower.sync_once()
    assert result.refused and "below the highest trusted version 2" in result.refused[0]
    assert device.store.problems and "unreadable" in device.store.problems[0]
    assert list(trust_file.parent.glob("trust.json.corrupt-*"))  # kept for a look
    assert sorted(device.store.versions("m")) == [2]


# -- endless data --------------------------------------------------------------------------------
class Misbehaving(Mirror):
    """The loopback mirror with per-key behaviours:
    ``endless`` keys stream forever (no Content-Length), ``padded`` ones announce and send
    more than the file holds, ``stall`` keys send ``stall_after`` bytes and then nothing,
    ``trickle`` keys send one byte every 50 ms."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.endless: set[str] = set()
        self.padded: set[str] = set()
        self.stall: set[str] = set()
        self.trickle: set[str] = set()
        self.stall_after = 1000
        self.sent: dict[str, int] = {}
        self.gets: list[tuple[str, str]] = []  # (key, Range header)
        self.release = threading.Event()

    def serve(self, h: Any) -> None:
        self.gets.append((h.path.lstrip("/"), h.headers.get("Range", "")))
        found = self.found(h)
        if found is None:
            return
        key, data, start = found
        if key in self.endless:
            h.send_response(200)
            h.send_header("Connection", "close")  # no length: the body ends when the server says so
            h.end_headers()
            block = b"\0" * 65536
            while not self.release.is_set():
                h.wfile.write(block)
                self.sent[key] = self.sent.get(key, 0) + len(block)
            return
        if key in self.padded:
            data = data + b"X" * 1000
        body = data[start:]
        self.head(h, data, start)
        if key in self.stall:
            h.wfile.write(body[:self.stall_after])
            h.wfile.flush()
            self.release.wait(60)
            return
        if key in self.trickle:
            for i in range(len(body)):
                if self.release.wait(0.05):
                    return
                h.wfile.write(body[i:i + 1])
                h.wfile.flush()
            return
        h.wfile.write(body)

    def stop(self) -> None:
        self.release.set()  # the stalled and endless answers end first
        super().stop()


@pytest.fixture
def mirror(bucket: Path) -> Iterator[Misbehaving]:
    m = Misbehaving(bucket)
    m.start()
    yield m
    m.stop()


def test_endless_manifest_is_cut_off_at_the_cap(tmp_path: Path, bucket: Path, keys: Any, mirror: Misbehaving) -> None:
    private, public = keys
    publish_versions(tmp_path, bucket, private, 1)
    mirror.endless.add("m/1/MANIFEST.json")
    source = HTTPSource(mirror.url, Limits(max_document_bytes=256 << 10))
    with pytest.raises(Refused, match="longer than its 262144-byte limit.*max_manifest_bytes"):
        source.read("m/1/MANIFEST.json")
    device = Device(tmp_path, "", source=source, public_key=public)
    result = device.follower.sync_once()
    assert result.refused and "262144-byte limit" in result.refused[0]
    assert device.store.versions("m") == {}
    # the folder source reads no further either: a manifest padded past the cap is refused
    (bucket / "m/1/MANIFEST.json").write_bytes(b" " * (300 << 10))
    with pytest.raises(Refused, match="262144-byte limit"):
        open_source(f"file://{bucket}", limits=Limits(max_document_bytes=256 << 10)).read("m/1/MANIFEST.json")


def test_a_file_is_cut_off_at_its_signed_size(tmp_path: Path, bucket: Path, keys: Any, mirror: Misbehaving) -> None:
    private, public = keys
    publish_versions(tmp_path, bucket, private, 1)
    size = (bucket / "m/1/model.tflite").stat().st_size
    mirror.endless.add("m/1/model.tflite")  # streams zeros forever
    source = HTTPSource(mirror.url)
    part = tmp_path / "part"
    with pytest.raises(Refused, match=f"longer than its {size}-byte limit"):
        source.download("m/1/model.tflite", str(part), 0, limit=size)
    assert part.stat().st_size == size  # never a byte past the signed size on disk
    mirror.endless.clear()
    mirror.padded.add("m/1/model.tflite")  # announces more than the manifest signed
    with pytest.raises(Refused, match=f"announces {size + 1000} bytes, over the {size}-byte limit"):
        source.download("m/1/model.tflite", str(part), 0, limit=size)
    device = Device(tmp_path, "", source=source, public_key=public)
    result = device.follower.sync_once()
    assert result.refused and device.store.versions("m") == {} and nothing_new_staged(device.store)
    # the folder source: an object grown past its signed size in the bucket folder
    with open(bucket / "m/1/model.tflite", "ab") as f:
        f.write(b"appended" * 1000)
    with pytest.raises(Refused, match=f"longer than its {size}-byte limit"):
        open_source(f"file://{bucket}").download("m/1/model.tflite", str(part), 0, limit=size)
    assert part.stat().st_size == size


# -- slow retrieval -----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_stalled_transfer_times_out_is_reported_and_resumes(tmp_path: Path, bucket: Path, keys: Any,
                                                            mirror: Misbehaving) -> None:
    private, public = keys
    publish(open_source(f"file://{bucket}"), "m", str(make_version(tmp_path, "v", {"model.tflite": os.urandom(50000)})),
            1, sign_key=private)
    limits = Limits(stall_timeout_s=0.5)
    mirror.stall.add("m/1/model.tflite")  # 1000 bytes, then silence
    device = Device(tmp_path, "", source=HTTPSource(mirror.url, limits), public_key=public)
    with pytest.raises(SourceError, match="stalled: no data for 0.5 s"):
        device.follower.sync_once()
    assert [k for k, _ in mirror.gets].count("m/1/model.tflite") == 1  # one attempt per poll, no inner retry
    part = Path(device.store.stage_dir("m", 1)) / "model.tflite.part"
    assert part.stat().st_size == 1000  # kept for a ranged resume
    mirror.stall.clear()
    device.follower.sync_once()
    assert ("m/1/model.tflite", "bytes=1000-") in mirror.gets and sorted(device.store.versions("m")) == [1]
    assert store_is_complete(Path(device.store.models_dir)) == []


@pytest.mark.timeout(60)
def test_trickling_transfer_is_a_stall_too(tmp_path: Path, bucket: Path, mirror: Misbehaving) -> None:
    publish(open_source(f"file://{bucket}"), "m", str(make_version(tmp_path, "v", {"model.tflite": b"t" * 5000})), 1)
    mirror.trickle.add("m/1/model.tflite")  # ~20 B/s: every read returns, the transfer never ends
    with pytest.raises(SourceError, match=r"stalled: \d+ bytes in"):
        HTTPSource(mirror.url, Limits(stall_timeout_s=0.5)).download("m/1/model.tflite", str(tmp_path / "p"), 0, 5000)


@pytest.mark.timeout(90)
def test_the_sync_loop_backs_off_from_a_stalled_bucket(tmp_path: Path, bucket: Path, mirror: Misbehaving) -> None:
    """The real SyncLoop (in-process, no model manager): a stalled transfer is an event and
    the status' last error, reported once; the loop tries again at the poll interval (a stall
    is not the bucket asking for less, so there is nothing to back off from), resuming."""
    from appliance.core.config import Config
    from appliance.core.state import StateDB
    from appliance.parts.sync_loop import SyncLoop, source_limits

    publish(open_source(f"file://{bucket}"), "m", str(make_version(tmp_path, "v", {"model.tflite": b"s" * 5000})), 1)
    mirror.stall.add("m/1/model.tflite")
    mirror.stall_after = 0  # nothing at all: no attempt makes progress
    config = Config()
    config.state_dir = str(tmp_path / "state")
    config.sync.bucket, config.sync.poll_interval_s, config.sync.max_backoff_s = mirror.url, 0.05, 0.8
    config.sync.jitter, config.sync.stall_timeout_s = 0.0, 0.3
    db = StateDB(":memory:").open()
    from appliance.core.metrics import Metrics

    core = types.SimpleNamespace(device={}, db=db, manager=None, device_id="test", add_status=lambda *a: None,
                                 metrics=Metrics(),
                                 add_source=lambda *a, **k: types.SimpleNamespace(scan=lambda: None))
    loop = SyncLoop(types.SimpleNamespace(config=config, core=core))
    loop.source = loop.follower.source = HTTPSource(mirror.url, source_limits(config.sync))  # as sync_loop builds it
    loop.start()
    try:
        poll_until(lambda: loop.status["failures"] >= 4, 30, "four failed polls of the stalling mirror",
                   lambda: f"sync status: {loop.status}")
        status = dict(loop.status)
        errors = [e for e in db.recent(100) if e["kind"] == "sync_error"]
    finally:
        loop.close()
        db.close()
    assert status["failures"] >= 4 and "stalled: no data for 0.3 s" in status["last_error"]
    attempts = [k for k, _ in mirror.gets].count("m/1/model.tflite")
    assert attempts <= status["failures"] + 1  # one transfer per poll, no retry loop inside a poll
    assert len(errors) == 1 and "stalled" in errors[0]["message"]  # reported once, not once per retry
    assert "retrying at the poll interval" in errors[0]["message"]
    assert loop._next_delay() == pytest.approx(0.05)  # jitter 0: the interval, however many failures


# -- the bytes verified are the bytes that load -------------------------------------------------
def test_staging_is_private_and_committed_files_are_read_only(tmp_path: Path, bucket: Path) -> None:
    publish(open_source(f"file://{bucket}"), "m", str(make_version(tmp_path, "v", {"a/model.tflite": b"x" * 100})), 1)
    old_umask = os.umask(0)  # the most permissive umask: privacy must not depend on it
    try:
        store = Store(str(tmp_path / "device")).open()
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(store.staging_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.sync_dir).st_mode) == 0o700  # trust records
    assert stat.S_IMODE(os.stat(store.models_dir).st_mode) == 0o755  # no one else adds a version
    assert os.stat(store.staging_dir).st_uid == os.getuid()
    raw = (bucket / "m/1/MANIFEST.json").read_bytes()
    manifest = mf.verify(raw, "m", 1, None, CPU_TAGS)
    stage = store.stage_dir("m", 1)
    old_umask = os.umask(0)
    try:
        fetch(open_source(f"file://{bucket}"), manifest, raw, stage, {})
        assert stat.S_IMODE(os.stat(stage).st_mode) == 0o700
        target = Path(store.commit(stage, "m", 1))
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((target / "a/model.tflite").stat().st_mode) == 0o444
    for folder in (target / "a", target, target.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, folder


def as_nobody(code: str) -> subprocess.CompletedProcess[str]:
    """Run Python as another, unprivileged user (uid/gid 65534): a local process that is not
    the service (the system interpreter: the attacker needs only the standard library)."""

    def drop() -> None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)

    return subprocess.run([SYSTEM_PYTHON, "-c", code], capture_output=True, text=True, preexec_fn=drop, timeout=60,
                          cwd="/")


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder other users may traverse (pytest's own temporary folders are private)."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="edge-trust-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.getuid() != 0 or not os.path.exists(SYSTEM_PYTHON), reason="switching users needs root")
def test_another_user_cannot_change_bytes_between_verify_and_load(shared_dir: Path, bucket: Path) -> None:
    tmp_path = shared_dir
    publish(open_source(f"file://{bucket}"), "m", str(make_version(tmp_path, "v", {"model.tflite": b"x" * 100})), 1)
    store = Store(str(tmp_path / "device")).open()
    os.chmod(store.state_dir, 0o755)
    raw = (bucket / "m/1/MANIFEST.json").read_bytes()
    manifest = mf.verify(raw, "m", 1, None, CPU_TAGS)
    stage = Path(store.stage_dir("m", 1))
    fetch(open_source(f"file://{bucket}"), manifest, raw, str(stage), {})
    # verified and waiting for the rename: another user can neither reach nor replace the file
    attack = as_nobody(f"open({str(stage / 'model.tflite')!r}, 'r+b').write(b'evil')")
    assert attack.returncode != 0 and "PermissionError" in attack.stderr, attack
    attack = as_nobody(f"import os; os.symlink('/etc/passwd', {str(stage / 'extra')!r})")
    assert attack.returncode != 0 and "PermissionError" in attack.stderr, attack
    target = Path(store.commit(str(stage), "m", 1))
    # committed: readable by others, not writable, not replaceable
    assert as_nobody(f"print(len(open({str(target / 'model.tflite')!r}, 'rb').read()))").stdout.strip() == "100"
    for code in (f"open({str(target / 'model.tflite')!r}, 'r+b').write(b'evil')",
                 f"import os; os.rename({str(target / 'model.tflite')!r}, {str(target / 'x')!r})",
                 f"open({str(target / 'new.pb')!r}, 'wb')"):
        attack = as_nobody(code)
        assert attack.returncode != 0 and "PermissionError" in attack.stderr, (code, attack)
    assert verify_version(str(target)) == []


def test_a_change_after_verification_is_caught_before_load(tmp_path: Path, bucket: Path) -> None:
    """What the service user itself (or disk damage) changes after the fetcher verified a
    version is found by ``verify_version`` (the model manager's load-time check) and by
    ``check_version_tree`` (a link planted in a stage is refused at commit)."""
    publish(open_source(f"file://{bucket}"), "m", str(make_version(tmp_path, "v", {"model.tflite": b"x" * 100})), 1)
    store = Store(str(tmp_path / "device")).open()
    raw = (bucket / "m/1/MANIFEST.json").read_bytes()
    manifest = mf.verify(raw, "m", 1, None, CPU_TAGS)
    stage = Path(store.stage_dir("m", 1))
    fetch(open_source(f"file://{bucket}"), manifest, raw, str(stage), {})
    os.symlink("/etc/passwd", stage / "planted")
    with pytest.raises(Refused, match="planted \\(symbolic link\\)"):
        store.commit(str(stage), "m", 1)
    (stage / "planted").unlink()
    target = Path(store.commit(str(stage), "m", 1))
    assert verify_version(str(target)) == []
    os.chmod(target / "model.tflite", 0o644)
    (target / "model.tflite").write_bytes(b"y" * 100)  # same size, other bytes
    (target / "added.bin").write_bytes(b"z")
    assert verify_version(str(target)) == ["model.tflite: missing or changed since it was verified",
                                           "added.bin: not in the manifest"]
    os.symlink("/dev/zero", target / "zeros")
    with pytest.raises(Refused, match="zeros \\(symbolic link\\)"):
        check_version_tree(str(target))


# -- a bucket writer without the private key ----------------------------------------------------
def start_unchannelled_device(start_server: Any, tmp: Path, bucket: str, public_key: str) -> Any:
    """A device following the newest version in the bucket (no channel: the unsigned
    version index decides, so a bucket writer has the most room)."""
    port = free_port()
    config = tmp / f"device-{port}.toml"
    config.write_text("\n".join([f'models_dir = "{tmp}/state-{port}/models"', "poll_interval_s = 0.5", "[sync]",
                                 f'bucket = "{bucket}"', f'public_key = "{public_key}"', "poll_interval_s = 0.3",
                                 "jitter = 0.1", "max_backoff_s = 1.5"]) + "\n")
    return start_server("--config", str(config), "--backend", "tf-cpu", port=port)


def test_a_bucket_writer_without_the_key_cannot_get_a_model_served(start_server: Any, tmp_path: Path, hpt: Path,
                                                                     keys: Any) -> None:
    private, _ = keys
    mf.keygen(str(tmp_path / "attacker.key"), str(tmp_path / "attacker.pub"))
    attacker_key = mf.load_private_key(str(tmp_path / "attacker.key"))
    folder = tmp_path / "bucket"
    source = open_source(f"file://{folder}")
    publish(source, "hpt", str(hpt / "1"), 1, sign_key=private)
    server = start_unchannelled_device(start_server, tmp_path, f"file://{folder}", str(tmp_path / "k.pub"))
    assert version_of(predict(server.url)) == 1

    def attack(version: int, damage: Callable[[], None], reason: str) -> None:
        damage()
        set_latest(folder, "hpt", version)
        server.wait_for(lambda: any(e["version"] == version and reason in e["message"]
                                    for e in events(server.status(), "sync_refused")), 60, f"refusal of {version}")
        assert version_of(predict(server.url)) == 1 and serving_version(server.status()) == 1
        assert not (server.state / "models/hpt" / str(version)).exists()

    publish(source, "hpt", str(hpt / "2"), 2)  # unsigned
    attack(2, lambda: None, "not signed")
    publish(source, "hpt", str(hpt / "3"), 3, sign_key=attacker_key)  # signed with the wrong key
    attack(3, lambda: None, "invalid signature")

    def swap_bytes() -> None:  # a validly signed manifest, the attacker's files
        shutil.copytree(hpt / "1", folder / "hpt/4", dirs_exist_ok=True)
        doc = json.loads((folder / "hpt/1/MANIFEST.json").read_text())
        (folder / "hpt/4/MANIFEST.json").write_text(json.dumps({**doc, "version": 4}))
    attack(4, swap_bytes, "invalid signature")

    def replay_manifest() -> None:  # version 1's intact files and signed manifest, as version 5
        shutil.copytree(folder / "hpt/1", folder / "hpt/5")
    attack(5, replay_manifest, "names 'hpt' version 1")

    def edited_files() -> None:  # a genuine signed version whose bucket files were replaced
        publish(source, "hpt", str(hpt / "2"), 6, sign_key=private)
        shutil.copy(hpt / "3" / "saved_model.pb", folder / "hpt/6/saved_model.pb")
    attack(6, edited_files, "saved_model.pb")
    assert store_is_complete(server.state / "models") == []
    publish(source, "hpt", str(hpt / "3"), 7, sign_key=private)  # the real publisher still gets through
    server.wait_for(lambda: serving_version(server.status()) == 7, 90, "the signed version 7")
    assert version_of(predict(server.url)) == 3
