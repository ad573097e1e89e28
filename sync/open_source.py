"""``open_source(url)``: the bucket source for a URL (a folder, S3, HTTPS).

Apart from sync/source.py (the interface the three implement) so that the interface does not
import its implementations: each source module imports the interface, this one imports them all.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

from .source import Limits, Source


def open_source(url: str, s3_endpoint_url: str = "", s3_region: str = "", limits: Limits | None = None) -> Source:
    """A source for ``file:///path``, a plain path, ``s3://bucket/prefix`` or ``https://host/prefix``."""
    parsed = urlparse(url)
    limits = limits or Limits()
    if parsed.scheme in ("", "file"):
        from .source_file import FileSource

        return FileSource(url, os.path.abspath(parsed.path if parsed.scheme else url), limits)
    if parsed.scheme == "s3":
        from .source_s3 import S3Source

        return S3Source(url, parsed.netloc, parsed.path.strip("/"), s3_endpoint_url, s3_region, limits)
    if parsed.scheme in ("https", "http"):
        from .source_https import HTTPSource

        return HTTPSource(url, limits)
    raise ValueError(f"bucket URL {url!r}: use file:///path, s3://bucket/prefix or https://host/prefix")


__all__ = ["open_source"]
