"""``https://host/prefix``: a read-only static web server or CDN in front of the bucket.

Idle polls are conditional GETs (``If-None-Match`` with the last ETag, else
``If-Modified-Since``); resumes use ``Range``. A static server cannot list folders, so
this source relies on the index files the publisher writes (``_models.json``,
``<model>/versions.json``). TLS is verified against the system store (``SSL_CERT_FILE``
to point elsewhere). Bodies are read with ``read1`` (what has arrived, never "wait for a
full buffer"), so the slow-retrieval check sees a trickle as it happens; the socket
timeout is ``stall_timeout_s`` (nothing at all for that long is a stall too). A body
announced longer than its cap (``Content-Length``) is refused before it is read.
"""

from __future__ import annotations

import http.client
import socket
import urllib.error
import urllib.request
from urllib.parse import quote

from .errors import ReadOnlySource, Refused, SourceError, Throttled, Unavailable
from .source import MISSING, NOT_MODIFIED, OK, Fetched, Limits, Listed, Pacer, copy_limited, read_limited

TRANSFER_ERRORS = (OSError, http.client.HTTPException, urllib.error.URLError)  # socket.timeout is an OSError


class HTTPSource:
    writable = False

    def __init__(self, url: str, limits: Limits | None = None):
        self.url = url
        self.base = url.rstrip("/")
        self.limits = limits or Limits()
        self.requests = 0
        self._modified: dict[str, str] = {}

    def sibling(self) -> "HTTPSource":
        return HTTPSource(self.url, self.limits)

    def _open(self, key: str, headers: dict[str, str], method: str = "GET") -> http.client.HTTPResponse | int:
        """The response, or the status of a not-modified, missing or unsatisfiable answer."""
        self.requests += 1
        request = urllib.request.Request(f"{self.base}/{quote(key)}", headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.limits.stall_timeout_s)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code in (NOT_MODIFIED, MISSING, 416):
                return exc.code
            if exc.code == 429:  # "slow down"; a 5xx is a server that cannot answer (sync/errors.py)
                raise Throttled(f"{method} {key}: HTTP {exc.code} {exc.reason}",
                                _seconds(exc.headers.get("Retry-After", ""))) from exc
            if exc.code in (500, 502, 503, 504):
                raise Unavailable(f"{method} {key}: HTTP {exc.code} {exc.reason}",
                                  _seconds(exc.headers.get("Retry-After", ""))) from exc
            raise SourceError(f"{method} {key}: HTTP {exc.code} {exc.reason}") from exc
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise SourceError(f"{method} {key}: {_why(exc, self.limits)}") from exc

    @staticmethod
    def _tag(response: http.client.HTTPResponse) -> str:
        modified = response.headers.get("Last-Modified")
        return response.headers.get("ETag") or (f"lm:{modified}" if modified else "")

    def _announced(self, response: http.client.HTTPResponse, key: str, room: int | None, hint: str = "") -> None:
        """Refuse a body whose Content-Length already says it is over its cap."""
        length = response.headers.get("Content-Length")
        if room is not None and length is not None and length.isdigit() and int(length) > room:
            response.close()
            raise Refused(f"{key}: the server announces {length} bytes, over the {room}-byte limit{hint}",
                          key=key, etag=self._tag(response))

    def read(self, key: str, etag: str = "") -> Fetched:
        headers = {}
        if etag.startswith("lm:"):
            headers["If-Modified-Since"] = etag[3:]
        elif etag:
            headers["If-None-Match"] = etag
        response = self._open(key, headers)
        if isinstance(response, int):
            return Fetched(NOT_MODIFIED, etag=etag) if response == NOT_MODIFIED else Fetched(MISSING)
        self._announced(response, key, self.limits.max_document_bytes, " (sync.max_manifest_bytes)")
        tag = self._tag(response)
        with response:
            try:
                data = read_limited(response.read1, self.limits.max_document_bytes, key, Pacer(f"GET {key}", self.limits),
                                    etag=tag)
            except TRANSFER_ERRORS as exc:
                raise SourceError(f"GET {key} broke off: {_why(exc, self.limits)}") from exc
        return Fetched(OK, data, tag)

    def head(self, key: str) -> Fetched:
        response = self._open(key, {}, "HEAD")
        if isinstance(response, int):
            return Fetched(MISSING)
        with response:
            return Fetched(OK, etag=self._tag(response))

    def download(self, key: str, path: str, offset: int = 0, limit: int | None = None) -> str:
        response = self._open(key, {"Range": f"bytes={offset}-"} if offset else {})
        if response == 416 and offset:
            return self.download(key, path, 0, limit)
        if isinstance(response, int):
            raise Refused(f"{key} is listed in the manifest but missing from the bucket", key=key, etag="")
        start = offset if offset and response.status == 206 else 0
        room = None if limit is None else max(0, limit - start)
        self._announced(response, key, room)
        tag = self._tag(response)
        with response, open(path, "r+b" if start else "wb") as f:
            f.seek(start)
            f.truncate()

            def write(block: bytes) -> None:
                try:
                    f.write(block)
                    f.flush()  # what arrived is on disk: a resume after a kill or stall starts there
                except OSError as exc:  # the local disk (full?), not the bucket: the fetcher decides
                    raise _LocalWriteError(exc) from exc

            try:
                copy_limited(response.read1, write, room, key, Pacer(f"GET {key}", self.limits))
            except Refused as exc:
                raise Refused(str(exc), key=key, etag=tag) from None
            except _LocalWriteError as local:
                raise local.error from None
            except TRANSFER_ERRORS as exc:
                raise SourceError(f"GET {key} broke off: {_why(exc, self.limits)}") from exc
        return tag

    def put(self, key: str, data: bytes) -> None:
        raise ReadOnlySource(f"{self.url} is read-only (https); publish to the bucket behind it")

    def list_dirs(self, prefix: str) -> list[str]:
        raise SourceError(f"{self.url} cannot list folders (https); it needs the publisher's index files")

    def list_keys(self, prefix: str) -> list[str]:
        raise SourceError(f"{self.url} cannot list objects (https); read the reports from the bucket itself")

    def list_objects(self, prefix: str) -> list[Listed]:
        return [Listed(name, "", 0, 0.0) for name in self.list_keys(prefix)]  # raises: nothing to list

    def close(self) -> None:
        pass


class _LocalWriteError(Exception):
    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error


def _seconds(value: str) -> float:
    """Retry-After as seconds (the HTTP-date form counts as "not said")."""
    try:
        return max(0.0, float(value))
    except ValueError:
        return 0.0


def _why(exc: BaseException, limits: Limits) -> str:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, (socket.timeout, TimeoutError)) or isinstance(exc, (socket.timeout, TimeoutError)):
        return f"stalled: no data for {limits.stall_timeout_s:g} s (sync.stall_timeout_s)"
    return str(reason)
