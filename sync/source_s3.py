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
from typing import Any, Callable

from . import faults
from .errors import Refused, SourceError, Throttled, Unavailable
from .source import MISSING, NOT_MODIFIED, OK, Fetched, Limits, Listed, Pacer, copy_limited, join, read_limited

MISSING_CODES = {"NoSuchKey", "404", "NotFound"}
# Split as AWS's SDKs split them (botocore's retry "throttling" and "transient" errors): what
# S3 and its look-alikes answer when they want fewer requests (AWS: SlowDown 503; others 429)
# is backed off from; a bucket that cannot answer (503 ServiceUnavailable, or a bare 503 from a
# gateway whose backend is down; 500, 502, 504) is retried at the poll interval.
THROTTLE_CODES = {"SlowDown", "429", "TooManyRequests", "RequestLimitExceeded", "Throttling", "ThrottlingException",
                  "ThrottledException", "RequestThrottled", "RequestThrottledException"}
UNAVAILABLE_CODES = {"503", "ServiceUnavailable", "500", "InternalError", "502", "BadGateway", "504", "GatewayTimeout"}
S3_EXTRA_HINT = ("s3:// buckets need the s3 extra, which this install lacks: "
                 "pip install 'edge-appliance[s3]' (boto3)")


def check_boto3() -> None:
    """``SourceError`` naming the ``s3`` extra when boto3 is not installed (a LiteRT-only
    install), instead of a ModuleNotFoundError from deep inside the first poll."""
    import importlib.util

    if importlib.util.find_spec("boto3") is None:
        raise SourceError(S3_EXTRA_HINT)


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
        self._shared: "S3Source | None" = None  # a sibling's owner of the client
        self._session: Any = None

    def sibling(self) -> "S3Source":
        twin = S3Source(self.url, self.bucket, self.prefix, self.endpoint_url, self.region, self.limits)
        twin._shared = self._shared or self
        return twin

    def _s3(self) -> Any:
        if self._shared is not None:
            return self._shared._s3()
        with self._lock:
            if self._client is None:
                check_boto3()
                import boto3
                from botocore.config import Config

                config = Config(connect_timeout=5, read_timeout=self.limits.stall_timeout_s, retries={"max_attempts": 2, "mode": "standard"})
                self._session = boto3.session.Session(botocore_session=_botocore_session())
                self._client = self._session.client(
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
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            if code in MISSING_CODES or code == "304" or code == "InvalidRange":
                raise _Answer(code) from exc
            message = f"{what}: {code} {error.get('Message', '')}".strip()
            if code in THROTTLE_CODES:
                raise Throttled(message, _retry_after(exc.response)) from exc
            if code in UNAVAILABLE_CODES:
                raise Unavailable(message, _retry_after(exc.response)) from exc
            raise SourceError(message) from exc
        except BotoCoreError as exc:
            raise SourceError(f"{what}: {exc}") from exc

    def read(self, key: str, etag: str = "") -> Fetched:
        extra = {"IfNoneMatch": etag} if etag else {}
        try:
            obj = self._call(f"GET {key}", self._s3().get_object, Key=self._key(key), **extra)
            self._check_length(obj, key, self.limits.max_document_bytes, " (sync.max_manifest_bytes)")
            return Fetched(OK, self._body(obj, key), obj.get("ETag", ""))
        except _Answer as answer:
            return Fetched(NOT_MODIFIED, etag=etag) if answer.code == "304" else Fetched(MISSING)

    def head(self, key: str) -> Fetched:
        try:
            obj = self._call(f"HEAD {key}", self._s3().head_object, Key=self._key(key))
        except _Answer:
            return Fetched(MISSING)
        return Fetched(OK, etag=obj.get("ETag", ""))

    @staticmethod
    def _check_length(obj: Any, key: str, room: int | None, hint: str = "") -> None:
        length = obj.get("ContentLength")
        if room is not None and isinstance(length, int) and length > room:
            obj["Body"].close()
            raise Refused(f"{key}: the bucket announces {length} bytes, over the {room}-byte limit{hint}",
                          key=key, etag=obj.get("ETag", ""))

    def _body(self, obj: Any, key: str) -> bytes:
        from botocore.exceptions import BotoCoreError

        try:
            return read_limited(obj["Body"].read, self.limits.max_document_bytes, key, Pacer(f"GET {key}", self.limits),
                                etag=obj.get("ETag", ""))
        except (BotoCoreError, OSError) as exc:
            raise SourceError(f"GET {key}: {exc}") from exc

    def download(self, key: str, path: str, offset: int = 0, limit: int | None = None) -> str:
        from botocore.exceptions import BotoCoreError

        extra = {"Range": f"bytes={offset}-"} if offset else {}
        try:
            obj = self._call(f"GET {key}", self._s3().get_object, Key=self._key(key), **extra)
        except _Answer as answer:
            if answer.code == "InvalidRange" and offset:  # the object shrank below what we hold: start again
                return self.download(key, path, 0, limit)
            raise Refused(f"{key} is listed in the manifest but missing from the bucket", key=key, etag="") from None
        room = None if limit is None else max(0, limit - offset)
        self._check_length(obj, key, room)
        tag = obj.get("ETag", "")
        with open(path, "r+b" if offset else "wb") as f:
            f.seek(offset)
            f.truncate()
            first = [True]

            def write(block: bytes) -> None:
                f.write(block)
                f.flush()  # what arrived is on disk: a resume after a kill or stall starts there
                if first[0]:
                    first[0] = False
                    faults.point("mid_download")  # the kill -9 tests and the fleet benchmark stop here

            try:
                copy_limited(obj["Body"].read, write, room, key, Pacer(f"GET {key}", self.limits))
            except Refused as exc:
                raise Refused(str(exc), key=key, etag=tag) from None
            except (BotoCoreError, OSError) as exc:
                if isinstance(exc, OSError) and exc.errno is not None and not isinstance(exc, ConnectionError):
                    raise  # a local write error (disk full) is not the bucket's fault
                raise SourceError(f"GET {key} broke off: {exc}") from exc
        return tag

    def put(self, key: str, data: bytes) -> None:
        content_type = "application/json" if key.endswith(".json") else "application/octet-stream"
        try:
            self._call(f"PUT {key}", self._s3().put_object, Key=self._key(key), Body=data, ContentType=content_type)
        except _Answer as answer:
            raise SourceError(f"PUT {key}: {answer.code}") from None

    def list_dirs(self, prefix: str) -> list[str]:
        return sorted(p["Prefix"][len(self._base(prefix)):].strip("/") for p in self._pages(prefix, "CommonPrefixes"))

    def list_keys(self, prefix: str) -> list[str]:
        return [listed.name for listed in self.list_objects(prefix)]

    def list_objects(self, prefix: str) -> list[Listed]:
        base = self._base(prefix)
        return sorted(Listed(o["Key"][len(base):], o.get("ETag", ""), int(o.get("Size", 0)), _epoch(o.get("LastModified")))
                      for o in self._pages(prefix, "Contents"))

    def _base(self, prefix: str) -> str:
        base = join(self.prefix, prefix)
        return base + "/" if base else ""

    def _pages(self, prefix: str, section: str) -> list[dict[str, Any]]:
        """Every entry of ``section`` over all ListObjectsV2 pages (1000 keys a page)."""
        base = self._base(prefix)
        entries: list[dict[str, Any]] = []
        token: dict[str, str] = {}
        while True:
            try:
                page = self._call(f"LIST {base}", self._s3().list_objects_v2, Prefix=base, Delimiter="/", **token)
            except _Answer:
                return entries
            entries += page.get(section, [])
            if not page.get("IsTruncated"):
                return entries
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def get_signer(self) -> Callable[[str], tuple[str, dict[str, str]]]:
        """A function giving the URL and SigV4 headers of a GET of a key: botocore's
        ``S3SigV4Auth`` signs, and the URL's form (endpoint, addressing style) is botocore's
        own, taken from one presigned URL. For reading thousands of small objects (device
        reports) over a plain HTTP pool: a third of a ``get_object``'s CPU. No request is made."""
        from urllib.parse import quote

        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.exceptions import BotoCoreError

        sentinel = "_devices/--sentinel--"
        try:
            client = self._s3()
            template = str(client.generate_presigned_url("get_object", Params={
                "Bucket": self.bucket, "Key": self._key(sentinel)})).split("?", 1)[0]
            credentials = self._credentials()
            auth = S3SigV4Auth(credentials.get_frozen_credentials(), "s3", client.meta.region_name or "us-east-1")
        except BotoCoreError as exc:  # no credentials, a bad endpoint: the bucket cannot be read
            raise SourceError(f"signing GETs for {self.url}: {exc}") from exc
        quoted = quote(self._key(sentinel), safe="/~")

        def sign(key: str) -> tuple[str, dict[str, str]]:
            request = AWSRequest("GET", template.replace(quoted, quote(self._key(key), safe="/~")), headers={})
            auth.add_auth(request)
            return str(request.url), dict(request.headers.items())
        return sign

    def _credentials(self) -> Any:
        """The credentials the client was made with (the same default chain, resolved again)."""
        import boto3

        self._s3()
        owner = self._shared or self
        credentials = owner._session.get_credentials() if owner._session is not None else \
            boto3.session.Session().get_credentials()
        if credentials is None:
            raise SourceError(f"no AWS credentials for {self.url} (AWS_ACCESS_KEY_ID, a profile or a role)")
        return credentials

    def close(self) -> None:
        if self._shared is not None:
            return  # the owner closes the shared client
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


def _botocore_session() -> Any:
    """A botocore session that leaves timestamps as the bucket wrote them (ISO 8601 text):
    dateutil's parser was a fifth of the CPU of listing 10,000 reports; ``_epoch`` reads
    the few we use with ``datetime.fromisoformat`` (botocore's documented parser hook)."""
    import botocore.session

    session = botocore.session.get_session()
    session.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
    return session


def _epoch(value: Any) -> float:
    """An S3 timestamp (ISO 8601 text, or a datetime) as epoch seconds; 0 when absent or unreadable."""
    import datetime

    if isinstance(value, datetime.datetime):
        return value.timestamp()
    try:
        return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def _retry_after(response: Any) -> float:
    """The Retry-After seconds of a throttling answer, 0 when it gave none."""
    value = (response.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}).get("retry-after", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return 0.0


class _Answer(Exception):
    """An S3 answer that is not a failure (304, missing key, unsatisfiable range)."""

    def __init__(self, code: str):
        super().__init__(code)
        self.code = code
