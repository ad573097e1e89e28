"""The state database (``<state>/state.db``, sqlite-utils): events and small durable facts.

Tables: ``events`` (every version transition, sync step, refusal and error: what the
status page and ``/api/status`` read) and ``kv`` (cached backend decisions and other small
JSON facts that must survive a restart). Only events and periodic aggregates are written
here, never one row per request. Thread-safe: one connection behind a lock; WAL mode so a
power cut loses at most the last transaction.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from typing import Any, Iterator, MutableMapping

import sqlite_utils

log = logging.getLogger("appliance.events")
MAX_EVENTS = 5000  # older rows are trimmed so the database stays small on a device


class StateDB:
    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite_utils.Database | None = None
        self._listeners: list[Any] = []

    def open(self) -> "StateDB":
        if self._db is None:
            if self.path != ":memory:":
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._db = sqlite_utils.Database(conn)
            self._db["events"].create({"id": int, "ts": float, "kind": str, "model": str, "version": int,
                                       "message": str, "detail": str}, pk="id", if_not_exists=True)
            self._db["kv"].create({"key": str, "value": str}, pk="key", if_not_exists=True)
        return self

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.conn.close()
                self._db = None

    def subscribe(self, callback: Any) -> None:
        """``callback(event_dict)`` after each event (metrics, discovery re-announce)."""
        self._listeners.append(callback)

    def event(self, kind: str, message: str, model: str = "", version: int | None = None, **detail: Any) -> None:
        row = {"ts": time.time(), "kind": kind, "model": model, "version": version,
               "message": message, "detail": json.dumps(detail, default=str) if detail else ""}
        log.info(message, extra={"event": kind, "model": model, "version": version, **detail})
        with self._lock:
            if self._db is not None:
                table = self._db["events"]
                table.insert(row)
                last = table.last_pk
                if last and last % 500 == 0:
                    self._db.execute("DELETE FROM events WHERE id <= ?", [last - MAX_EVENTS])
        for callback in list(self._listeners):
            callback(row)

    def recent(self, limit: int = 50, model: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            if self._db is None:
                return []
            where, args = ("model = ?", [model]) if model else (None, None)
            rows = list(self._db["events"].rows_where(where, args, order_by="id desc", limit=limit))
        for row in rows:
            row["detail"] = json.loads(row["detail"]) if row.get("detail") else {}
        return rows

    def kv(self) -> "KV":
        return KV(self)


class KV(MutableMapping[str, Any]):
    """A dict view of the ``kv`` table (JSON values), used as the backend-decision cache."""

    def __init__(self, db: StateDB):
        self._db = db

    def __getitem__(self, key: str) -> Any:
        with self._db._lock:
            if self._db._db is None:
                raise KeyError(key)
            rows = list(self._db._db["kv"].rows_where("key = ?", [key]))
        if not rows:
            raise KeyError(key)
        return json.loads(rows[0]["value"])

    def __setitem__(self, key: str, value: Any) -> None:
        with self._db._lock:
            if self._db._db is not None:
                self._db._db["kv"].upsert({"key": key, "value": json.dumps(value, default=str)}, pk="key")

    def __delitem__(self, key: str) -> None:
        with self._db._lock:
            if self._db._db is not None:
                self._db._db.execute("DELETE FROM kv WHERE key = ?", [key])

    def __iter__(self) -> Iterator[str]:
        with self._db._lock:
            keys = [r["key"] for r in self._db._db["kv"].rows] if self._db._db is not None else []
        return iter(keys)

    def __len__(self) -> int:
        return len(list(iter(self)))
