"""Standing refusals: what the follower refused, why, and the bucket objects it judged.

A refusal *stands* while every object it judged is unchanged: the manifest and, for a bad
file, that file (same ETag; a missing object still missing), and the channel pointer still
the one written when it was refused (same ``created``: ``appliance channel set`` again is
the operator saying "try again"). While it stands, a poll asks the bucket only whether those
objects changed (one HEAD each: a 100 MB manifest or a 64 MB corrupt file is never fetched
again) and raises the original reason, without a new event. As soon as one changed (a
corrupt object re-uploaded in place, a manifest re-signed, the channel set again), the
version is tried again, and a new failure is a new event.

Not thread-safe: the follower's one thread owns it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from .errors import Refused
from .json_types import JSONObject
from .source import MISSING, Source

Key = tuple[str, int]  # (model, version)


@dataclass
class Refusal:
    """One refused version: the reason as first given, when, and the fingerprints it judged."""

    model: str
    version: int
    reason: str
    since: float
    objects: dict[str, str | None] = field(default_factory=dict)  # key -> ETag ("" missing, None unknown)
    pointer_created: float | None = None  # the channel pointer's ``created`` at the time

    def describe(self) -> JSONObject:
        return {"version": self.version, "reason": self.reason, "since": self.since}


class Refusals:
    """The standing refusal per (model, version)."""

    def __init__(self) -> None:
        self._by: dict[Key, Refusal] = {}

    def record(self, model: str, version: int, reason: str, objects: dict[str, str | None],
               pointer_created: float | None) -> Refusal:
        refusal = Refusal(model, version, reason, time.time(), dict(objects), pointer_created)
        self._by[(model, version)] = refusal
        return refusal

    def get(self, model: str, version: int) -> Refusal | None:
        return self._by.get((model, version))

    def clear(self, model: str, version: int) -> None:
        self._by.pop((model, version), None)

    def standing(self, source: Source, model: str, version: int, pointer_created: float | None) -> Refusal | None:
        """The refusal of ``version`` if nothing it judged has changed (then ``Refused`` is
        raised by the caller with the original reason), else None (and it is forgotten)."""
        refusal = self._by.get((model, version))
        if refusal is None:
            return None
        if refusal.pointer_created != pointer_created or not all(
                etag is not None and _etag_now(source, key) == etag for key, etag in refusal.objects.items()):
            self._by.pop((model, version), None)
            return None
        return refusal


def _etag_now(source: Source, key: str) -> str:
    """The object's ETag now ("" when missing): one HEAD."""
    head = source.head(key)
    return "" if head.status == MISSING else head.etag


def objects_judged(manifest_key: str, manifest_etag: str | None, exc: Refused) -> dict[str, str | None]:
    """The fingerprints a refusal rests on: the manifest's, and the object ``exc`` names."""
    objects: dict[str, str | None] = {manifest_key: manifest_etag}
    if exc.key and exc.key != manifest_key:
        objects[exc.key] = exc.etag
    return objects
