"""The bucket source interface and ``open_source(url)``.

A source is a flat key space under the bucket URL's prefix (keys are ``/``-joined and
relative). Every method counts the requests it makes in ``requests`` (the fleet
benchmark reads it). Methods raise ``SourceError`` when the bucket cannot answer;
``read`` of a key that does not exist returns ``Fetched(status=404)``, not an error.
Thread-safety: one source per sync loop; the publisher makes its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlparse

NOT_MODIFIED, MISSING, OK = 304, 404, 200


@dataclass
class Fetched:
    status: int
    data: bytes = b""
    etag: str = ""


class Source(Protocol):
    url: str
    requests: int
    writable: bool

    def read(self, key: str, etag: str = "") -> Fetched:
        """The object, ``NOT_MODIFIED`` when ``etag`` still matches, or ``MISSING``."""

    def download(self, key: str, path: str, offset: int = 0) -> None:
        """Append the object's bytes from ``offset`` to ``path`` (a ranged GET when > 0).
        A source that cannot resume rewrites ``path`` from the start."""

    def put(self, key: str, data: bytes) -> None:
        """Write one object (atomically for readers where the store allows)."""

    def list_dirs(self, prefix: str) -> list[str]:
        """Names of the immediate 'folders' under ``prefix`` ('' for the top)."""

    def list_keys(self, prefix: str) -> list[str]:
        """Names of the objects directly under ``prefix``."""

    def close(self) -> None: ...


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def open_source(url: str, s3_endpoint_url: str = "", s3_region: str = "") -> Any:
    """A source for ``file:///path``, a plain path, ``s3://bucket/prefix`` or ``https://host/prefix``."""
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        from .source_file import FileSource

        return FileSource(url, os.path.abspath(parsed.path if parsed.scheme else url))
    if parsed.scheme == "s3":
        from .source_s3 import S3Source

        return S3Source(url, parsed.netloc, parsed.path.strip("/"), s3_endpoint_url, s3_region)
    if parsed.scheme in ("https", "http"):
        from .source_https import HTTPSource

        return HTTPSource(url)
    raise ValueError(f"bucket URL {url!r}: use file:///path, s3://bucket/prefix or https://host/prefix")
