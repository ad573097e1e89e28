"""``https://host/prefix``: a read-only static web server or CDN in front of the bucket.

Idle polls are conditional GETs (``If-None-Match`` with the last ETag, else
``If-Modified-Since``); resumes use ``Range``. A static server cannot list folders, so
this source relies on the index files the publisher writes (``_models.json``,
``<model>/versions.json``). TLS is verified against the system store (``SSL_CERT_FILE``
to point elsewhere).
"""

from __future__ import annotations

import http.client
import shutil
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

from .errors import ReadOnlySource, Refused, SourceError
from .source import MISSING, NOT_MODIFIED, OK, Fetched

TIMEOUT_S = 30


class HTTPSource:
    writable = False

    def __init__(self, url: str):
        self.url = url
        self.base = url.rstrip("/")
        self.requests = 0
        self._modified: dict[str, str] = {}

    def _open(self, key: str, headers: dict[str, str]) -> Any:
        self.requests += 1
        request = urllib.request.Request(f"{self.base}/{quote(key)}", headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code in (NOT_MODIFIED, MISSING, 416):
                return exc.code
            raise SourceError(f"GET {key}: HTTP {exc.code} {exc.reason}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise SourceError(f"GET {key}: {getattr(exc, 'reason', exc)}") from exc

    def read(self, key: str, etag: str = "") -> Fetched:
        headers = {}
        if etag.startswith("lm:"):
            headers["If-Modified-Since"] = etag[3:]
        elif etag:
            headers["If-None-Match"] = etag
        response = self._open(key, headers)
        if isinstance(response, int):
            return Fetched(NOT_MODIFIED, etag=etag) if response == NOT_MODIFIED else Fetched(MISSING)
        with response:
            try:
                data = response.read()
            except (OSError, http.client.HTTPException) as exc:
                raise SourceError(f"GET {key} broke off: {exc}") from exc
            tag = response.headers.get("ETag") or ("lm:" + response.headers.get("Last-Modified", "")
                                                   if response.headers.get("Last-Modified") else "")
        return Fetched(OK, data, tag)

    def download(self, key: str, path: str, offset: int = 0) -> None:
        response = self._open(key, {"Range": f"bytes={offset}-"} if offset else {})
        if response == 416 and offset:
            return self.download(key, path, 0)
        if isinstance(response, int):
            raise Refused(f"{key} is listed in the manifest but missing from the bucket")
        with response, open(path, "r+b" if offset else "wb") as f:
            resumed = offset and response.status == 206
            f.seek(offset if resumed else 0)
            f.truncate()
            try:
                shutil.copyfileobj(response, f, 1 << 20)
            except (ConnectionError, TimeoutError, urllib.error.URLError, http.client.HTTPException) as exc:
                raise SourceError(f"GET {key} broke off: {exc}") from exc

    def put(self, key: str, data: bytes) -> None:
        raise ReadOnlySource(f"{self.url} is read-only (https); publish to the bucket behind it")

    def list_dirs(self, prefix: str) -> list[str]:
        raise SourceError(f"{self.url} cannot list folders (https); it needs the publisher's index files")

    def list_keys(self, prefix: str) -> list[str]:
        raise SourceError(f"{self.url} cannot list objects (https); read the reports from the bucket itself")

    def close(self) -> None:
        pass
