"""The sync side without a server: publisher -> bucket folder -> Follower -> store.

Real files, real Ed25519 keys, real hashes; each refusal checks that nothing reached the
store and that an event says why.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from sync import manifest as mf
from sync.errors import Refused, SourceError
from sync.publisher import publish, set_channel
from sync.open_source import open_source
from sync.store import Store, set_pin
from tests.support.sync_support import Device, make_version


@pytest.fixture
def bucket(tmp_path: Path) -> Path:
    b = tmp_path / "bucket"
    b.mkdir()
    return b


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Any, Any, str]:
    mf.keygen(str(tmp_path / "k.key"), str(tmp_path / "k.pub"))
    return mf.load_private_key(str(tmp_path / "k.key")), mf.load_public_key(str(tmp_path / "k.pub")), str(tmp_path / "k.pub")


def ten_files(seed: str) -> dict[str, bytes]:
    return {f"variables/part-{i}": (f"{seed if i == 0 else 'same'}-{i}-".encode() * 5000) for i in range(10)}


def test_publish_then_follow_commits_verified_version(tmp_path: Path, bucket: Path) -> None:
    src = make_version(tmp_path, "v", {"saved_model.pb": b"graph", "variables/variables.index": b"idx"})
    doc = publish(open_source(f"file://{bucket}"), "m", str(src))
    assert doc["version"] == 1 and (bucket / "m/1/MANIFEST.json").exists()
    device = Device(tmp_path, bucket)
    result = device.follower.sync_once()
    assert result.changed == ["m:1"]
    assert (Path(device.store.models_dir) / "m/1/variables/variables.index").read_bytes() == b"idx"
    assert "sync_committed" in device.kinds()
    assert device.follower.sync_once().requests == 1  # idle: one conditional read of versions.json
    assert not os.listdir(Path(device.store.staging_dir) / "m")


def test_changed_file_only_is_downloaded_and_the_rest_hard_linked(tmp_path: Path, bucket: Path) -> None:
    source = open_source(f"file://{bucket}")
    publish(source, "m", str(make_version(tmp_path, "a", ten_files("a"))))
    device = Device(tmp_path, bucket)
    device.follower.sync_once()
    publish(source, "m", str(make_version(tmp_path, "b", ten_files("b"))))
    device.follower.sync_once()
    committed = [e for e in device.events if e[0] == "sync_committed"][-1]
    changed_size = len(ten_files("b")["variables/part-0"])
    assert f"({changed_size} bytes downloaded, 9 files reused)" in committed[1]
    v1, v2 = (Path(device.store.models_dir) / "m" / v / "variables/part-5" for v in ("1", "2"))
    assert os.stat(v1).st_ino == os.stat(v2).st_ino


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "missing", "traversal", "absolute", "expired",
                                    "incompatible", "wrong_version"])
def test_bad_versions_are_refused_and_old_one_stays(tmp_path: Path, bucket: Path, damage: str) -> None:
    source = open_source(f"file://{bucket}")
    publish(source, "m", str(make_version(tmp_path, "a", {"model.tflite": b"good" * 100})))
    device = Device(tmp_path, bucket, device_tags=frozenset({"any", "x86_64"}))
    device.follower.sync_once()
    publish(source, "m", str(make_version(tmp_path, "b", {"model.tflite": b"new!" * 100, "extra.txt": b"x"})),
            compat=["cuda12-trt10"] if damage == "incompatible" else ())
    man = bucket / "m/2/MANIFEST.json"
    doc = json.loads(man.read_text())
    if damage == "corrupt":
        (bucket / "m/2/model.tflite").write_bytes(b"evil" * 100)
    elif damage == "truncated":
        (bucket / "m/2/model.tflite").write_bytes(b"new!" * 50)
    elif damage == "missing":
        (bucket / "m/2/extra.txt").unlink()
    elif damage in ("traversal", "absolute"):
        doc["files"][0]["path"] = "../../../escape.txt" if damage == "traversal" else "/etc/passwd"
    elif damage == "expired":
        doc["expires"] = time.time() - 10
    elif damage == "wrong_version":
        doc["version"] = 7
    man.write_text(json.dumps(doc))
    result = device.follower.sync_once()
    assert result.refused and not result.changed
    assert sorted(device.store.versions("m")) == [1]
    refused = [e for e in device.events if e[0] == "sync_refused"]
    assert len(refused) == 1 and refused[0][2] == 2
    assert not (tmp_path / "escape.txt").exists()
    device.follower.sync_once()  # unchanged: refused again silently, never retried in a loop
    assert len([e for e in device.events if e[0] == "sync_refused"]) == 1


def test_signatures_required_when_a_key_is_configured(tmp_path: Path, bucket: Path, keys: Any) -> None:
    private, public, _ = keys
    other = tmp_path / "other"
    mf.keygen(str(other) + ".key", str(other) + ".pub")
    source = open_source(f"file://{bucket}")
    publish(source, "m", str(make_version(tmp_path, "a", {"f": b"1"})), sign_key=private)
    publish(source, "m", str(make_version(tmp_path, "b", {"f": b"2"})))  # unsigned
    publish(source, "m", str(make_version(tmp_path, "c", {"f": b"3"})), sign_key=mf.load_private_key(str(other) + ".key"))
    for version in (1, 2, 3):
        source.put("m/versions.json", json.dumps({"latest": version}).encode())
        device = Device(tmp_path / str(version), bucket, public_key=public)
        result = device.follower.sync_once()
        assert bool(result.changed) == (version == 1), result.refused
    assert "not signed" in result.refused[0] or "invalid signature" in result.refused[0]
    # a signed manifest whose files were swapped keeps its signature but fails the hash
    (bucket / "m/1/f").write_bytes(b"9")
    assert Device(tmp_path / "x", bucket, public_key=public).follower.sync_once().refused


def test_channel_move_back_needs_a_pointer_and_replays_are_refused(tmp_path: Path, bucket: Path, keys: Any) -> None:
    private, public, _ = keys
    source = open_source(f"file://{bucket}")
    for name in "abc":
        publish(source, "m", str(make_version(tmp_path, name, {"f": name.encode()})), sign_key=private)
    set_channel(source, "m", "stable", 3, private)
    old_pointer = (bucket / "m/channels/stable.json").read_bytes()
    device = Device(tmp_path, bucket, channel="stable", public_key=public)
    device.follower.sync_once()
    assert device.serving() == 3
    time.sleep(0.01)
    set_channel(source, "m", "stable", 1, private)  # an explicit, signed move back
    device.follower.sync_once()
    assert sorted(device.store.versions("m")) == [1] and sorted(device.store.parked("m")) == [3]
    (bucket / "m/channels/stable.json").write_bytes(old_pointer)  # replay of the older pointer
    assert "older than one already seen" in device.follower.sync_once().refused[0]
    assert device.serving() == 1
    doc = json.loads(old_pointer)
    doc.pop("signature")
    doc["created"] = time.time() + 5
    (bucket / "m/channels/stable.json").write_text(json.dumps(doc))  # unsigned pointer
    assert "not signed" in device.follower.sync_once().refused[0]
    # without a channel, the newest listed version may never go below the trusted one
    source.put("m/versions.json", json.dumps({"latest": 2}).encode())
    nochan = Device(tmp_path / "n", bucket, public_key=public)
    nochan.store.set_trust("m", {"version": 3, "pointer_created": 0})
    assert "below the highest trusted" in nochan.follower.sync_once().refused[0]


def test_pin_parks_newer_versions_and_clearing_restores(tmp_path: Path, bucket: Path) -> None:
    source = open_source(f"file://{bucket}")
    for name in "ab":
        publish(source, "m", str(make_version(tmp_path, name, {"f": name.encode()})))
    device = Device(tmp_path, bucket, retain=2)
    device.follower.sync_once()
    source.put("m/versions.json", json.dumps({"latest": 1}).encode())
    assert device.follower.sync_once().refused  # v1 < trusted 2 without a pointer: refused
    publish(source, "m", str(make_version(tmp_path, "c", {"f": b"c"})))
    device.follower.sync_once()
    assert sorted(device.store.versions("m")) == [2, 3]
    set_pin(device.store.state_dir, "m", 2)
    device.follower.sync_once()
    assert sorted(device.store.versions("m")) == [2] and "sync_pinned" in device.kinds()
    set_pin(device.store.state_dir, "m", None)
    device.follower.sync_once()
    assert sorted(device.store.versions("m")) == [2, 3] and "sync_restored" in device.kinds()


def test_bucket_down_raises_source_error_and_resume_uses_partial(tmp_path: Path, bucket: Path) -> None:
    source = open_source(f"file://{bucket}")
    big = os.urandom(3 << 20)
    publish(source, "m", str(make_version(tmp_path, "a", {"model.tflite": big})))
    device = Device(tmp_path, bucket)
    stage = Path(device.store.stage_dir("m", 1))
    stage.mkdir(parents=True)
    (stage / "model.tflite.part").write_bytes(big[: 1 << 20])  # an earlier attempt broke off here
    marker = stage.parent / ".1.manifest-sha256"
    import hashlib
    marker.write_text(hashlib.sha256((bucket / "m/1/MANIFEST.json").read_bytes()).hexdigest())
    device.follower.sync_once()
    committed = [e for e in device.events if e[0] == "sync_committed"][0]
    assert f"({len(big) - (1 << 20)} bytes downloaded" in committed[1]
    bucket.rename(tmp_path / "gone")
    with pytest.raises(SourceError):
        device.follower.sync_once()
    assert sorted(device.store.versions("m")) == [1]


def test_manifest_paths_and_canonical_signing() -> None:
    for bad in ("../x", "a/../../x", "/abs", "a//b", "./a", "a\\b", "", "MANIFEST.json", "a/./b"):
        with pytest.raises(Refused):
            mf.safe_path(bad)
    assert mf.safe_path("variables/variables.data-00000-of-00001") == "variables/variables.data-00000-of-00001"
    assert mf.canonical({"b": 1, "a": "é", "signature": "x"}) == '{"a":"é","b":1}'.encode()


def test_retention_keeps_k_good_and_never_the_serving_one(tmp_path: Path) -> None:
    store = Store(str(tmp_path)).open()
    for v in (1, 2, 3, 4, 5):
        (Path(store.models_dir) / "m" / str(v)).mkdir(parents=True)
    deleted = store.retain("m", keep=2, protect={1}, bad={5}, serving=1)
    assert deleted == [2, 3, 5] and sorted(store.versions("m")) == [1, 4]  # the failed one goes, whatever its age


def test_retention_keeps_what_a_rollback_can_go_back_to(tmp_path: Path) -> None:
    """Versions 1 and 3 served; 2 was skipped, 4 failed, 5 is the new target."""
    store = Store(str(tmp_path)).open()
    for v in (1, 2, 3, 4, 5):
        (Path(store.models_dir) / "m" / str(v)).mkdir(parents=True)
    store.note_served("m", 1)
    assert store.retain("m", keep=2, protect={5, 3}, bad={4}, target=5, serving=3) == []  # 5 has not loaded yet
    assert store.served("m") == {1, 3}
    assert store.retain("m", keep=2, protect={5, 3}, bad={4, 5}, target=5, serving=3) == [2, 4]  # 5 failed
    assert sorted(store.versions("m")) == [1, 3, 5] and store.previous_version("m") == 3
    assert store.retain("m", keep=1, protect={5}, bad={4, 5}, target=5) == [1]  # the last good one stays
    assert sorted(store.versions("m")) == [3, 5] and store.previous_version("m") == 3
    (Path(store.models_dir) / "m" / "9223372036854775808").mkdir()  # past int64: not a version
    assert sorted(store.versions("m")) == [3, 5]


def test_a_signing_key_that_is_not_ed25519_is_refused_by_name(tmp_path: Path) -> None:
    """An operator pointing ``--sign-key`` or ``sync.public_key`` at another kind of key (an RSA
    key from an old PKI) is told so when the key is read, not with a TypeError at the first use."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private, public = tmp_path / "rsa.pem", tmp_path / "rsa.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(Refused, match="RSAPrivateKey.*Ed25519"):
        mf.load_private_key(str(private))
    with pytest.raises(Refused, match="RSAPublicKey.*Ed25519"):
        mf.load_public_key(str(public))
    mf.keygen(str(tmp_path / "ok.pem"), str(tmp_path / "ok.pub"))  # what keygen makes loads as before
    doc = mf.sign({"a": 1}, mf.load_private_key(str(tmp_path / "ok.pem")))
    mf.check_signature(doc, mf.load_public_key(str(tmp_path / "ok.pub")), "doc")
