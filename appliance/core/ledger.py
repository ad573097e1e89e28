"""What the device remembers about model versions across restarts (the state database's kv).

- **good versions**: each version that became AVAILABLE, with its API and backend. The newest
  one is what a new version must stay compatible with when nothing serves yet (after a
  restart), and a version that served before is never refused for its API (a rollback).
- **loads in progress**: a marker is written before a version is loaded into the serving
  process and removed after. A marker found at start-up means the process ended during that
  load (a crash, an OOM kill, a power cut): the next attempt runs its trial in a child again,
  and a version whose in-process load was interrupted ``MAX_INTERRUPTED`` times is
  quarantined for good (until its directory changes) instead of taking the device down again.
- **quarantines** that must outlive a restart: those above, and every version refused at its
  load (but for a load cancelled by the service stopping), with the settings it was judged
  under: a restart shows it refused with its reason and does not try it again, until its
  directory changes or the settings that judged it do (``runtime``, the model's own section).
- **trial verdicts**, keyed by device fingerprint, model, version and directory mtime: a
  restart loads the chosen backend directly, without a trial.

Thread-safety: as the state database's (one lock); every write is one kv upsert.
"""

from __future__ import annotations

import os
import time
from typing import Any, MutableMapping

MAX_INTERRUPTED = 2  # in-process loads of one version a crash may end before it is quarantined
KEEP_GOOD = 20  # good versions remembered per model


def mtime(path: str) -> float:
    """A version directory's mtime: replacing the directory changes it (0.0 when it is gone)."""
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


class Ledger:
    def __init__(self, kv: MutableMapping[str, Any]):
        self.kv = kv

    # -- good versions -------------------------------------------------------------------
    def record_good(self, model: str, version: int, api: dict[str, Any], backend: str) -> None:
        record = self.kv.get(f"good:{model}") or {}
        versions = dict(record.get("versions") or {})
        versions[str(version)] = {"api": api, "backend": backend, "at": time.time()}
        newest = sorted(versions, key=int)[-KEEP_GOOD:]
        self.kv[f"good:{model}"] = {"versions": {v: versions[v] for v in newest}}

    def good(self, model: str) -> dict[int, dict[str, Any]]:
        """{version: {"api", "backend", "at"}} of every version of ``model`` that served here."""
        record = self.kv.get(f"good:{model}") or {}
        return {int(v): info for v, info in (record.get("versions") or {}).items()}

    # -- loads in the serving process ------------------------------------------------------
    def loading(self, model: str, version: int, path: str) -> int:
        """Mark an in-process load as begun; how many began before without ending (0 usually)."""
        key = f"loading:{model}:{version}"
        marker = self.kv.get(key) or {}
        earlier = int(marker.get("attempts", 0)) if marker.get("mtime") == mtime(path) else 0
        self.kv[key] = {"path": path, "mtime": mtime(path), "since": time.time(), "attempts": earlier + 1}
        return earlier

    def loaded(self, model: str, version: int) -> None:
        """The in-process load ended (either way) in this process."""
        self.kv.pop(f"loading:{model}:{version}", None)

    def interrupted(self, model: str, version: int, path: str) -> int:
        """In-process loads of this version (its directory as it is now) that never ended."""
        marker = self.kv.get(f"loading:{model}:{version}") or {}
        return int(marker.get("attempts", 0)) if marker.get("mtime") == mtime(path) else 0

    # -- quarantines that survive a restart ------------------------------------------------
    def quarantine(self, model: str, version: int, path: str, reason: str, code: str, settings: str = "") -> None:
        """Remember the refusal; ``settings``: a digest of what judged it ('' for any)."""
        self.kv[f"quarantine:{model}:{version}"] = {"mtime": mtime(path), "reason": reason, "code": code,
                                                     "at": time.time(), "settings": settings}

    def quarantined(self, model: str, version: int, path: str, settings: str = "") -> tuple[str, str] | None:
        """(reason, code) of a lasting quarantine of this version as its directory is now, judged
        under ``settings`` (a record made under any settings holds under all)."""
        record = self.kv.get(f"quarantine:{model}:{version}")
        if not record:
            return None
        judged = record.get("settings") or ""
        if record.get("mtime") != mtime(path) or judged and judged != settings:  # replaced, or judged otherwise
            self.kv.pop(f"quarantine:{model}:{version}", None)
            return None
        return str(record.get("reason", "")), str(record.get("code", "INTERNAL"))

    # -- trial verdicts ----------------------------------------------------------------------
    def verdict(self, key: str) -> dict[str, Any] | None:
        found = self.kv.get(f"verdict:{key}")
        return found if isinstance(found, dict) else None

    def set_verdict(self, key: str, verdict: dict[str, Any]) -> None:
        self.kv[f"verdict:{key}"] = verdict


__all__ = ["Ledger", "MAX_INTERRUPTED", "mtime"]
