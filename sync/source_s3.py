"""``s3://bucket/prefix`` on any S3-compatible store (AWS S3, MinIO, SeaweedFS, Ceph RGW).

boto3 (imported when the source first talks to the bucket) resolves credentials and the
endpoint the standard way: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, profiles,
``AWS_ENDPOINT_URL``; ``sync.s3_endpoint_url``/``sync.s3_region`` override. Idle polls are
``GetObject`` with ``If-None-Match`` (one request, 304 when nothing changed). Limits as
every source: documents capped at ``max_document_bytes``, downloads at their signed size
(``ContentLength`` checked first), botocore's read timeout is ``stall_timeout_s`` and the
slow-retrieval check runs between 64 KiB chunks.
"""

from __future__ import annotations

import threading
from typing import Any

from .errors import Refused, SourceError
from .source import MISSING, NOT_MODIFIED, OK, Fetched, Limits, Pacer, copy_limited, join, read_limited

MISSING_CODES = {"NoSuchKey", "404", "NotFound"}


class S3Source:
    writable = True

    def __init__(self, url: str, bucket: str, prefix: str, endpoint_url: str = "", region: str = "",
                 limits: Limits | None = None):
        self.url, self.bucket, self.prefix = url, bucket, prefix
        self.limits = limits or Limits()
        self.endpoint_url, self.region = endpoint_url, region
        self.requests = 0
        self._client: Any = None
        self._lock = threading.Lock()

    def _s3(self) -> Any:
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                config = Config(connect_timeout=5, read_timeout=self.limits.stall_timeout_s, retries={"max_attempts": 2, "mode": "standard"})
                self._client = boto3.session.Session().client(
                    "s3", endpoint_url=self.endpoint_url or None, region_name=self.region or None, config=config)
            return self._client

    def _key(self, key: str) -> str:
        return join(self.prefix, key)

    def _call(self, what: str, fn: Any, **kw: Any) -> Any:
        """One S3 call; botocore failures become SourceError, except the caller's codes."""
        from botocore.exceptions import BotoCoreError, ClientError

        self.requests += 1
        try:
            return fn(Bucket=self.bucket, **kw)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in MISSING_CODES or code == "304" or code == "InvalidRange":
                raise _Answer(code) from exc
            raise SourceError(f"{what}: {code} {exc.response.get('Error', {}).get('Message', '')}".strip()) from exc
        except BotoCoreError as exc:
            raise SourceError(f"{what}: {exc}") from exc

    def read(self, key: str, etag: str = "") -> Fetched:
        extra = {"IfNoneMatch": etag} if etag else {}
        try:
            obj = self._call(f"GET {key}", self._s3().get_object, Key=self._key(key), **extra)
            self._check_length(obj, key, self.limits.max_document_bytes)
            return Fetched(OK, self._body(obj, key), obj.get("ETag", ""))
        except _Answer as answer:
            return Fetched(NOT_MODIFIED, etag=etag) if answer.code == "304" else Fetched(MISSING)

    @staticmethod
    def _check_length(obj: Any, key: str, room: int | None) -> None:
        length = obj.get("ContentLength")
        if room is not None and isinstance(length, int) and length > room:
            obj["Body"].close()
            raise Refused(f"{key}: the bucket announces {length} bytes, over the {room}-byte limit")

    def _body(self, obj: Any, key: str) -> bytes:
        from botocore.exceptions import BotoCoreError

        try:
            return read_limited(obj["Body"].read, self.limits.max_document_bytes, key, Pacer(f"GET {key}", self.limits))
        except (BotoCoreError, OSError) as exc:
            raise SourceError(f"GET {key}: {exc}") from exc

    def download(self, key: str, path: str, offset: int = 0, limit: int | None = None) -> None:
        from botocore.exceptions import BotoCoreError

        extra = {"Range": f"bytes={offset}-"} if offset else {}
        try:
            obj = self._call(f"GET {key}", self._s3().get_object, Key=self._key(key), **extra)
        except _Answer as answer:
            if answer.code == "InvalidRange":  # the object shrank below what we hold: start again
                return self.download(key, path, 0, limit) if offset else None
            raise Refused(f"{key} is listed in the manifest but missing from the bucket") from None
        room = None if limit is None else max(0, limit - offset)
        self._check_length(obj, key, room)
        with open(path, "r+b" if offset else "wb") as f:
            f.seek(offset)
            f.truncate()
            def write(block: bytes) -> None:
                f.write(block)
                f.flush()  # what arrived is on disk: a resume after a kill or stall starts there

            try:
                copy_limited(obj["Body"].read, write, room, key, Pacer(f"GET {key}", self.limits))
            except (BotoCoreError, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno is not None and not isinstance(exc, ConnectionError):
                    raise  # a local write error (disk full) is not the bucket's fault
                raise SourceError(f"GET {key} broke off: {exc}") from exc

    def put(self, key: str, data: bytes) -> None:
        content_type = "application/json" if key.endswith(".json") else "application/octet-stream"
        try:
            self._call(f"PUT {key}", self._s3().put_object, Key=self._key(key), Body=data, ContentType=content_type)
        except _Answer as answer:
            raise SourceError(f"PUT {key}: {answer.code}") from None

    def list_dirs(self, prefix: str) -> list[str]:
        return self._list(prefix, "CommonPrefixes", "Prefix")

    def list_keys(self, prefix: str) -> list[str]:
        return self._list(prefix, "Contents", "Key")

    def _list(self, prefix: str, section: str, field: str) -> list[str]:
        base = join(self.prefix, prefix)
        base = base + "/" if base else ""
        names: list[str] = []
        token: dict[str, str] = {}
        while True:
            try:
                page = self._call(f"LIST {base}", self._s3().list_objects_v2, Prefix=base, Delimiter="/", **token)
            except _Answer:
                return names
            names += [p[field][len(base):].strip("/") for p in page.get(section, [])]
            if not page.get("IsTruncated"):
                return sorted(names)
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


class _Answer(Exception):
    """An S3 answer that is not a failure (304, missing key, unsatisfiable range)."""

    def __init__(self, code: str):
        super().__init__(code)
        self.code = code
