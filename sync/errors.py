"""Errors of the sync side, drawn in one place.

    SyncError
    ├── SourceError      the bucket could not be reached or answered an error: retry at the poll
    │   │                interval, serving is unaffected
    │   ├── Throttled    the bucket said "slow down" (429, 503 SlowDown): back off exponentially
    │   │                from the poll interval, capped at two intervals (a longer Retry-After is
    │   │                honoured up to sync.max_backoff_s)
    │   ├── Unavailable  the bucket is there but cannot answer (503 ServiceUnavailable, 500, 502,
    │   │                504: a gateway whose backend is down): retry at the poll interval, as
    │   │                for an unreachable bucket (a Retry-After up to two intervals is honoured)
    │   └── ReadOnlySource   a write to a source that cannot take one (https)
    └── Refused          a version, channel pointer or index failed verification (hash, size,
                         signature, path, expiry, compatibility, rollback, version bounds): never
                         committed; not fetched again until a bucket object it judged changes

``Refused`` may name the bucket object it judged (``key``) and that object's ETag as the
bucket gave it (``etag``; "" when the object is missing or the source could not tell), so the
follower can ask the bucket "changed?" instead of fetching the object again.
"""

from __future__ import annotations


class SyncError(Exception):
    """Base class of every sync failure."""


class SourceError(SyncError):
    """The bucket is unreachable or failed a request (transient: retry at the poll interval)."""


class Throttled(SourceError):
    """The bucket asked us to slow down; ``retry_after`` seconds when it said how long (else 0)."""

    def __init__(self, message: str, retry_after: float = 0.0):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(SourceError):
    """The bucket answered that it cannot serve now (not a request to slow down)."""

    def __init__(self, message: str, retry_after: float = 0.0):
        super().__init__(message)
        self.retry_after = retry_after


class ReadOnlySource(SourceError):
    """This source cannot be written (https)."""


class Refused(SyncError):
    """A bucket object failed verification; the reason is the message."""

    def __init__(self, message: str, key: str = "", etag: str | None = None):
        super().__init__(message)
        self.key = key  # the object judged ("" when the refusal is about no single object)
        self.etag = etag  # its ETag when the source saw one; None: unknown
        self.version: int | None = None  # the version refused, where the follower knows it
        self.fresh = False  # the follower fetched and judged the objects now (not a standing refusal)
