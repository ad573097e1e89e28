"""The bucket source interface (``open_source(url)`` in sync/open_source.py picks one).

A source is a flat key space under the bucket URL's prefix (keys are ``/``-joined and
relative). Every method counts the requests it makes in ``requests`` (the fleet
benchmark reads it). Methods raise ``SourceError`` when the bucket cannot answer;
``read`` of a key that does not exist returns ``Fetched(status=404)``, not an error.
Thread-safety: one source per sync loop; the publisher makes its own. ``sibling()`` gives a
source over the same bucket with its own request counter (the device report's writer), sharing
what is costly to make (an S3 client, which boto3 documents as thread-safe).

Limits (the endless-data and slow-retrieval threats of The Update Framework): ``read``
returns at most ``max_document_bytes`` (manifests, channel pointers, indexes) and refuses a
longer object after reading one byte past the cap; ``download(..., limit=n)`` writes at
most ``n`` bytes (the signed size) and refuses an object that goes on; a transfer that
moves less than ``min_bytes_per_s`` over any ``stall_timeout_s`` window, or nothing at
all for that long, is a ``SourceError`` ("stalled"): the caller backs off, the partial file
stays for a ranged resume.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

from .errors import Refused, SourceError

NOT_MODIFIED, MISSING, OK = 304, 404, 200
MAX_DOCUMENT_BYTES = 4 << 20  # a manifest of ~30,000 files; pointers and indexes are far smaller
STALL_TIMEOUT_S = 30.0
MIN_BYTES_PER_S = 1024  # slower than this over a whole stall window: a trickle, not a transfer
CHUNK = 64 << 10


@dataclass(frozen=True)
class Limits:
    max_document_bytes: int = MAX_DOCUMENT_BYTES
    stall_timeout_s: float = STALL_TIMEOUT_S
    min_bytes_per_s: int = MIN_BYTES_PER_S


@dataclass
class Fetched:
    status: int
    data: bytes = b""
    etag: str = ""


@dataclass(frozen=True, order=True)
class Listed:
    """One object of a listing: its name under the prefix, ETag, size and when the bucket
    last wrote it (epoch seconds, the bucket's clock)."""

    name: str
    etag: str
    size: int
    modified: float


class Source(Protocol):
    url: str
    requests: int
    writable: bool

    def read(self, key: str, etag: str = "") -> Fetched:
        """The object, ``NOT_MODIFIED`` when ``etag`` still matches, or ``MISSING``. An object
        over ``max_document_bytes`` is ``Refused`` carrying its ETag (so a caller can ask
        "changed?" next time with a conditional request instead of reading it again)."""

    def head(self, key: str) -> Fetched:
        """The object's ETag without its bytes (``OK``), or ``MISSING``."""

    def download(self, key: str, path: str, offset: int = 0, limit: int | None = None) -> str:
        """Append the object's bytes from ``offset`` to ``path`` (a ranged GET when > 0);
        returns the object's ETag. A source that cannot resume rewrites ``path`` from the
        start. ``limit``: the most bytes ``path`` may hold (the signed size); an object
        longer than that is cut off there and ``Refused``."""

    def put(self, key: str, data: bytes) -> None:
        """Write one object (atomically for readers where the store allows)."""

    def list_dirs(self, prefix: str) -> list[str]:
        """Names of the immediate 'folders' under ``prefix`` ('' for the top)."""

    def list_keys(self, prefix: str) -> list[str]:
        """Names of the objects directly under ``prefix``."""

    def list_objects(self, prefix: str) -> list[Listed]:
        """The objects directly under ``prefix`` with their ETags, sizes and times (one
        listing: ListObjectsV2 pages carry them, a folder gives them by ``stat``)."""

    def sibling(self) -> "Source":
        """The same bucket, its own ``requests`` counter, costly parts shared."""

    def close(self) -> None: ...


def join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


class Pacer:
    """The slow-retrieval check of one transfer: ``moved(n)`` after each chunk raises
    ``SourceError`` when a whole ``stall_timeout_s`` window moved less than
    ``min_bytes_per_s`` per second (a socket timeout of ``stall_timeout_s`` catches the
    case where nothing arrives at all)."""

    def __init__(self, what: str, limits: Limits, clock: Callable[[], float] = time.monotonic):
        self.what, self.limits, self.clock = what, limits, clock
        self._start, self._bytes = clock(), 0

    def moved(self, n: int) -> None:
        self._bytes += n
        elapsed = self.clock() - self._start
        if elapsed < self.limits.stall_timeout_s:
            return
        if self._bytes < self.limits.min_bytes_per_s * elapsed:
            raise SourceError(f"{self.what} stalled: {self._bytes} bytes in {elapsed:.1f} s (less than "
                              f"{self.limits.min_bytes_per_s} B/s over sync.stall_timeout_s)")
        self._start, self._bytes = self.clock(), 0


def copy_limited(read: Callable[[int], bytes], write: Callable[[bytes], object], room: int | None, what: str,
                 pacer: Pacer | None = None) -> int:
    """Copy until ``read`` returns b''; at most ``room`` bytes (None: no cap), then one byte
    more is asked for: if it exists the object is over its cap, ``Refused`` (cut off there)."""
    copied = 0
    while True:
        want = CHUNK if room is None else min(CHUNK, room - copied + 1)
        block = read(want)
        if not block:
            return copied
        if pacer is not None:
            pacer.moved(len(block))
        if room is not None and copied + len(block) > room:
            write(block[:room - copied])
            raise Refused(f"{what} is longer than its {room}-byte limit; cut off there (endless data?)")
        write(block)
        copied += len(block)


def read_limited(read: Callable[[int], bytes], limit: int, what: str, pacer: Pacer | None = None,
                 etag: str | None = None) -> bytes:
    """A whole document of at most ``limit`` bytes (``Refused`` past it, carrying ``etag``)."""
    parts: list[bytes] = []
    try:
        copy_limited(read, parts.append, limit, what, pacer)
    except Refused as exc:
        raise Refused(f"{exc} (sync.max_manifest_bytes)", key=what, etag=etag) from None
    return b"".join(parts)

