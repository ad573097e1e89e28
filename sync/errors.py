"""Errors of the sync side, drawn in one place.

    SyncError
    ├── SourceError      the bucket could not be reached or answered an error: retry with backoff,
    │                    serving is unaffected
    │   └── ReadOnlySource   a write to a source that cannot take one (https)
    └── Refused          a version or channel pointer failed verification (hash, size, signature,
                         path, expiry, compatibility, rollback): never committed; not retried until
                         the bucket object changes
"""

from __future__ import annotations


class SyncError(Exception):
    """Base class of every sync failure."""


class SourceError(SyncError):
    """The bucket is unreachable or failed a request (transient: back off and retry)."""


class ReadOnlySource(SourceError):
    """This source cannot be written (https)."""


class Refused(SyncError):
    """A bucket object failed verification; the reason is the message."""
