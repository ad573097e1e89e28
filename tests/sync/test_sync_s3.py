"""Fleet sync from SeaweedFS S3 (a real `weed server -s3` on loopback), end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sync.publisher import publish
from sync.open_source import open_source
from tests.support.sync_scenario import hpt, scenario, start_device  # noqa: F401 (fixtures)
from tests.support.sync_support import TCPProxy, wait


def test_s3_bucket_full_scenario(start_server: Any, tmp_path: Path, hpt: Path, seaweed: Any,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = TCPProxy(int(seaweed.endpoint.rsplit(":", 1)[1])).up()
    env = {**seaweed.env(), "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    url = f"s3://fleet/{tmp_path.name}"
    bucket = open_source(url)
    try:
        publish(bucket, "hpt", str(hpt / "1"), 1, channel="stable")
        server = start_device(start_server, tmp_path, url, env=env)

        def corrupt(version: int) -> None:
            key = f"hpt/{version}/saved_model.pb"
            bucket.put(key, b"x" * 10)  # truncated and wrong: size and sha256 differ

        scenario(server, bucket, hpt, None, proxy.down, proxy.up, corrupt)
        wait(lambda: bucket.list_keys("_devices"), 30, "a device report in S3")
    finally:
        proxy.down()
        bucket.close()


