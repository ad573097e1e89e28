"""Fleet sync from a read-only HTTPS mirror (a local TLS static server), end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sync.publisher import publish
from sync.open_source import open_source
from tests.support.sync_scenario import hpt, scenario, signing, start_device  # noqa: F401 (fixtures)
from tests.support.sync_support import StaticHTTPS, TCPProxy, self_signed_cert


# -- static HTTPS mirror ----------------------------------------------------------------------
def test_https_mirror_full_scenario(start_server: Any, tmp_path: Path, hpt: Path, signing: Any) -> None:
    key, pub = signing
    folder = tmp_path / "bucket"
    bucket = open_source(f"file://{folder}")  # the publisher writes the folder the web server serves
    publish(bucket, "hpt", str(hpt / "1"), 1, channel="stable", sign_key=key)
    cert, cert_key = self_signed_cert(tmp_path)
    web = StaticHTTPS(folder, cert, cert_key).start()
    proxy = TCPProxy(web.port).up()
    try:
        server = start_device(start_server, tmp_path, f"https://127.0.0.1:{proxy.port}",
                              env={"SSL_CERT_FILE": str(cert)}, public_key=pub)

        def corrupt(version: int) -> None:
            (folder / "hpt" / str(version) / "saved_model.pb").unlink()  # a missing file

        scenario(server, bucket, hpt, key, proxy.down, proxy.up, corrupt)
        before = web.requests
        # idle polls go on: conditional GETs, answered 304
        server.wait_for(lambda: web.requests > before, 30, "the bucket to be polled again")
    finally:
        proxy.down()
        web.stop()
