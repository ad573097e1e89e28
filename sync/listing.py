"""Every device report under ``_devices/``, read fast: one listing, then only what changed,
many requests in flight.

``list_reports(source, cache)``:

1. one listing of ``_devices/`` (ListObjectsV2 pages carry each object's ETag, size and
   last-modified time, 1000 to a page; a folder gives them by ``stat``);
2. a report whose ETag the cache already holds is taken from the cache: a repeated view
   (``appliance fleet`` again, the fleet page's refresh, ``rollout watch``) reads only the
   reports written since, where a conditional GET per report would still cost a request each;
3. the rest are read with ``workers`` requests in flight. On S3, botocore signs each GET
   (SigV4 headers) and the standard library's http.client sends it, one keep-alive
   connection per thread (sync/keepalive.py): a
   third of a boto3 ``get_object``'s CPU, and the CPU is what bounds a 10,000-report view on
   a small machine (bench/RESULTS.md: 17 s one GET after another, under 10 s this way).
   Other sources read with their own ``read``.

A report is at most ``MAX_REPORT_BYTES``; a longer or unparsable one is listed with its
error, never dropped (the view shows it). Thread-safety: a call uses its own pool; a
``ReportCache`` may be shared by calls made one at a time.
"""

from __future__ import annotations

import http.client
import json
import os
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, cast
from urllib.parse import urlparse

from .errors import Refused, SourceError
from .report import signature_holds
from .source import MISSING, Listed, Source

if TYPE_CHECKING:  # the S3 source (and botocore) only where a bucket is S3
    from .source_s3 import S3Source

PREFIX = "_devices"
MAX_REPORT_BYTES = 1 << 20  # a report is a few KB; a device writing more gets an error, not our memory
DEFAULT_WORKERS = 16  # measured: 8-16 GETs in flight saturate two cores (bench/RESULTS.md)


@dataclass
class Entry:
    """One device's report as listed: ``report`` when it parsed, else ``error``."""

    device_id: str
    etag: str
    modified: float  # when the bucket stored it (the bucket's clock)
    size: int
    report: dict[str, Any] | None = None
    error: str = ""
    signature_holds: bool | None = None  # sync/report.py's check, made once per ETag


@dataclass
class Listing:
    entries: list[Entry] = field(default_factory=list)
    fetched: int = 0  # reports read from the bucket this time
    cached: int = 0  # taken from the cache (ETag unchanged)
    seconds: float = 0.0
    requests: int = 0


class ReportCache:
    """ETag -> parsed report per object name, optionally kept in a file between runs (the
    operator's cache folder; reports are not secrets). A damaged cache file is ignored."""

    def __init__(self, path: str = "", bucket: str = ""):
        self.path, self.bucket = path, bucket
        self._by_name: dict[str, tuple[str, dict[str, Any] | None, str, bool | None]] = {}
        # per device, its last report signed by its registered key: [stored_at, report, etag]
        # (sync/report_trust.py: the high-water mark a replay is judged against, and what the
        # view shows for the device while its current report is not trusted)
        self.trusted: dict[str, list[Any]] = {}
        if path:
            self._load()

    def get(self, name: str, etag: str) -> tuple[dict[str, Any] | None, str, bool | None] | None:
        """(report, error, signature holds) of ``name`` if the cache has it at ``etag``."""
        hit = self._by_name.get(name)
        return (hit[1], hit[2], hit[3]) if hit is not None and etag and hit[0] == etag else None

    def put(self, name: str, etag: str, report: dict[str, Any] | None, error: str, holds: bool | None) -> None:
        self._by_name[name] = (etag, report, error, holds)

    def keep_only(self, names: Iterable[str]) -> None:
        """Forget reports no longer in the bucket (a retired device)."""
        wanted = set(names)
        self._by_name = {k: v for k, v in self._by_name.items() if k in wanted}

    def _reference(self, device_id: str, trusted: list[Any]) -> list[Any]:
        """A trusted report as saved: a reference to the cached report when it is the same
        object version (almost always), so the file does not hold every report twice."""
        hit = self._by_name.get(f"{device_id}.json")
        same = hit is not None and hit[0] == trusted[2]
        return [trusted[0], None if same else trusted[1], trusted[2]]

    def _resolve(self, device_id: str, saved: list[Any]) -> dict[str, Any]:
        if saved[1] is not None:
            return dict(saved[1])
        hit = self._by_name[f"{device_id}.json"]  # KeyError: a damaged file, dropped by _load
        if hit[0] != saved[2] or hit[1] is None:
            raise ValueError("a trusted report's reference does not match the cache")
        return hit[1]

    def _load(self) -> None:
        try:
            with open(self.path) as f:
                doc = json.load(f)
            if doc.get("bucket") == self.bucket:
                self._by_name = {k: (v[0], v[1], v[2], v[3]) for k, v in doc.get("reports", {}).items()}
                self.trusted = {str(k): [float(v[0]), self._resolve(k, v), str(v[2])]
                                for k, v in (doc.get("trusted") or {}).items()}
        except (OSError, ValueError, TypeError, IndexError, AttributeError, KeyError):
            self._by_name, self.trusted = {}, {}

    def save(self) -> None:
        if not self.path:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".fleet-cache-", dir=os.path.dirname(self.path) or ".")
        with os.fdopen(fd, "w") as f:
            json.dump({"bucket": self.bucket, "reports": {k: list(v) for k, v in self._by_name.items()},
                       "trusted": {d: self._reference(d, v) for d, v in self.trusted.items()}}, f)
        os.replace(tmp, self.path)


def cache_for(bucket_url: str, enabled: bool = True) -> ReportCache:
    """The operator's cache of ``bucket_url``'s reports (an empty one when not ``enabled``)."""
    return ReportCache(default_cache_path(bucket_url), bucket_url) if enabled else ReportCache()


def default_cache_path(bucket_url: str) -> str:
    """``$XDG_CACHE_HOME/edge-appliance/fleet/<hash of the bucket URL>.json``."""
    import hashlib

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = hashlib.sha256(bucket_url.encode()).hexdigest()[:16]
    return os.path.join(base, "edge-appliance", "fleet", f"{name}.json")


def list_reports(source: Source, cache: ReportCache | None = None, workers: int = DEFAULT_WORKERS) -> Listing:
    """Every report under ``_devices/`` (see the module docstring); ``SourceError`` when the
    bucket cannot be listed."""
    started, before = time.monotonic(), source.requests
    cache = cache or ReportCache()
    listing = Listing()
    objects = [o for o in source.list_objects(PREFIX) if o.name.endswith(".json")]
    missing: list[Listed] = []
    for obj in objects:
        hit = cache.get(obj.name, obj.etag)
        if hit is None:
            missing.append(obj)
            continue
        listing.cached += 1
        listing.entries.append(Entry(obj.name[:-5], obj.etag, obj.modified, obj.size, *hit))
    for obj, (report, error) in zip(missing, _read_all(source, [f"{PREFIX}/{o.name}" for o in missing], workers)):
        holds = signature_holds(report) if report is not None and report.get("signature") else None
        cache.put(obj.name, obj.etag, report, error, holds)
        listing.entries.append(Entry(obj.name[:-5], obj.etag, obj.modified, obj.size, report, error, holds))
    listing.fetched = len(missing)
    cache.keep_only(o.name for o in objects)
    listing.entries.sort(key=lambda e: e.device_id)
    listing.seconds = time.monotonic() - started
    listing.requests = source.requests - before
    return listing


def _read_all(source: Source, keys: list[str], workers: int) -> list[tuple[dict[str, Any] | None, str]]:
    if not keys:
        return []
    if hasattr(source, "get_signer") and not _proxied(source):
        return _read_signed(cast("S3Source", source), keys, workers)
    if getattr(source, "root", None):  # a local folder: reading is cheaper than any thread hand-off
        return [_parse(_read_one(source, key)) for key in keys]
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="fleet-read") as pool:
        return list(pool.map(lambda key: _parse(_read_one(source, key)), keys))


def _read_one(source: Source, key: str) -> bytes | str:
    """The object's bytes, or the reason it could not be read."""
    try:
        fetched = source.read(key)
    except (Refused, SourceError) as exc:
        return str(exc)
    return "the report vanished while listing" if fetched.status == MISSING else fetched.data


def _parse(data: bytes | str) -> tuple[dict[str, Any] | None, str]:
    if isinstance(data, str):
        return None, data
    if len(data) > MAX_REPORT_BYTES:
        return None, f"the report is {len(data)} bytes, over {MAX_REPORT_BYTES}"
    try:
        doc = json.loads(data)
    except ValueError as exc:
        return None, f"unreadable report: {exc}"
    return (doc, "") if isinstance(doc, dict) else (None, "unreadable report: not a JSON object")


def _proxied(source: Source) -> bool:
    """True when an HTTP(S) proxy applies to the bucket's endpoint (botocore would use it;
    the signed path does not, so such setups read through boto3 instead)."""
    url = urlparse(getattr(source, "endpoint_url", "") or "https://s3.amazonaws.com")
    proxies = urllib.request.getproxies()
    return url.scheme in proxies and not urllib.request.proxy_bypass(url.hostname or "")


def _read_signed(source: S3Source, keys: list[str], workers: int) -> list[tuple[dict[str, Any] | None, str]]:
    """GETs signed by botocore (SigV4 headers), sent over keep-alive connections, ``workers``
    at a time (sync/keepalive.py)."""
    from .keepalive import KeepAlive

    sign = source.get_signer()
    connections = KeepAlive(sign(keys[0])[0], source.limits.stall_timeout_s, MAX_REPORT_BYTES)

    def get(key: str) -> bytes | str:
        url, headers = sign(key)
        try:
            status, body = connections.get(url, headers)
        except (OSError, http.client.HTTPException) as exc:
            return f"GET {key}: {exc}"
        return body if status == 200 else f"GET {key}: HTTP {status}"

    try:
        with ThreadPoolExecutor(max(1, workers), thread_name_prefix="fleet-read") as executor:
            return list(executor.map(lambda key: _parse(get(key)), keys))
    finally:
        source.requests += len(keys)  # counted as the source's own GETs would be
        connections.close()
