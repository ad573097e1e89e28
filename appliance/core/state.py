"""The state database (``<state>/state.db``, the standard library's sqlite3): events and small durable facts.

Tables: ``events`` (every version transition, sync step, refusal and error: what the
status page and ``/api/status`` read) and ``kv`` (cached backend decisions and other small
JSON facts that must survive a restart). Only events and periodic aggregates are written
here, never one row per request. Thread-safe: one connection behind a lock; WAL mode so a
power cut loses at most the last transaction.

A state database must never stop the service from serving. ``open()`` checks the file
(``PRAGMA quick_check``) and falls back instead of raising: a corrupt database (with its
``-wal``/``-shm``) is moved aside to ``state.db.corrupt-<time>`` and a fresh one is made;
one that cannot be opened or written (read-only file, folder or filesystem, missing
folder that cannot be made) is replaced by an in-memory database until the next start.
Either way ``problems`` says what happened, for ``/readyz`` and the status page. Later
write failures (disk full, damage under us) are logged and added to ``problems`` once,
never raised into the caller (a model swap must not fail because an event could not be
stored).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from typing import Any, Callable, Iterator, Mapping, MutableMapping

from appliance.core.json_types import JSONObject

log = logging.getLogger("appliance.events")
MAX_EVENTS = 5000  # older rows are trimmed so the database stays small on a device
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # what an SQLite integer holds
# The schema (as sqlite-utils made it before: existing databases open unchanged). Plain sqlite3,
# since four statements are all this needs: sqlite-utils and its seven dependencies (click,
# dateutil with tzdata, tabulate, pluggy, pip ...) cost a LiteRT-only device 5 MB of disk.
SCHEMA = ('CREATE TABLE IF NOT EXISTS "events" ("id" INTEGER PRIMARY KEY, "ts" REAL, "kind" TEXT, "model" TEXT, '
          '"version" INTEGER, "message" TEXT, "detail" TEXT)',
          'CREATE TABLE IF NOT EXISTS "kv" ("key" TEXT PRIMARY KEY, "value" TEXT)')
EVENT_COLUMNS = ("id", "ts", "kind", "model", "version", "message", "detail")


# An event's row as listeners get it: ts, kind, model, version, message, detail (JSON text).
Listener = Callable[[Mapping[str, object]], None]


class StateDB:
    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._listeners: list[Listener] = []
        self.problems: list[str] = []  # what went wrong with the database (shown, never raised)
        self.in_memory = path == ":memory:"

    def open(self) -> "StateDB":
        """Open (or create) the database; never raises for a bad file: see the module docstring."""
        if self._db is not None:
            return self
        try:
            self._db = self._connect(self.path)
        except sqlite3.OperationalError as exc:  # cannot open or write: read-only, missing folder, I/O
            self._fall_back(f"cannot be opened for writing ({exc})")
        except sqlite3.DatabaseError as exc:  # not a database, malformed, failed its check
            self._replace_corrupt(exc)
        except OSError as exc:  # the folder cannot be made
            self._fall_back(f"cannot be created ({exc.strerror or exc})")
        return self

    @staticmethod
    def _connect(path: str) -> sqlite3.Connection:
        if path != ":memory:":
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if path != ":memory:" and str(mode).lower() != "wal":
                raise sqlite3.OperationalError(f"journal_mode is {mode}, not wal (read-only?)")
            conn.execute("PRAGMA synchronous=NORMAL")
            check = [row[0] for row in conn.execute("PRAGMA quick_check").fetchall()]
            if check != ["ok"]:
                raise sqlite3.DatabaseError(f"integrity check failed: {'; '.join(map(str, check[:3]))}")
            for statement in SCHEMA:
                conn.execute(statement)
            conn.execute("INSERT OR REPLACE INTO kv(key, value) VALUES ('state_db_opened', ?)",
                         [json.dumps(time.time())])  # a write now: a read-only file fails here, not later
            return conn
        except BaseException:
            conn.close()
            raise

    def _replace_corrupt(self, exc: Exception) -> None:
        """Move a damaged database (and its WAL) aside and start a fresh one."""
        aside = f"{self.path}.corrupt-{int(time.time())}"
        try:
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(self.path + suffix):
                    os.replace(self.path + suffix, aside + suffix)
            self._db = self._connect(self.path)
        except (OSError, sqlite3.Error) as again:
            self._fall_back(f"is damaged ({exc}) and could not be replaced ({again})")
            return
        self._problem(f"state database {self.path} was damaged ({exc}); moved to {aside}, started a fresh one "
                      "(event history and cached backend decisions are lost)")

    def _fall_back(self, why: str) -> None:
        self._problem(f"state database {self.path} {why}; events and cached decisions are kept in memory "
                      "until the next start")
        self.in_memory = True
        self._db = self._connect(":memory:")

    def _problem(self, message: str) -> None:
        if message not in self.problems:
            self.problems.append(message)
            log.error(message)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def subscribe(self, callback: Listener) -> None:
        """``callback(event_dict)`` after each event (metrics, discovery re-announce)."""
        self._listeners.append(callback)

    def event(self, kind: str, message: str, model: str = "", version: int | None = None, **detail: object) -> None:
        """Record (and log) one event. Never raises: a version number SQLite cannot hold (past
        int64) is stored as NULL with the number kept in ``detail``; a failed write is a problem."""
        if version is not None and not INT64_MIN <= version <= INT64_MAX:
            detail, version = {**detail, "version_number": str(version)}, None
        row = {"ts": time.time(), "kind": kind, "model": model, "version": version,
               "message": message, "detail": json.dumps(detail, default=str) if detail else ""}
        log.info(message, extra={"event": kind, "model": model, "version": version, **detail})
        with self._lock:
            if self._db is not None:
                try:
                    last = self._db.execute(
                        "INSERT INTO events(ts, kind, model, version, message, detail) VALUES (?, ?, ?, ?, ?, ?)",
                        [row["ts"], kind, model, version, message, row["detail"]]).lastrowid
                    if last and last % 500 == 0:
                        self._db.execute("DELETE FROM events WHERE id <= ?", [last - MAX_EVENTS])
                except (sqlite3.Error, OverflowError, ValueError) as exc:  # disk full, damage: serving goes on
                    self._problem(f"state database {self.path}: writing an event failed ({exc})")
        for callback in list(self._listeners):
            callback(row)

    def recent(self, limit: int = 50, model: str | None = None) -> list[JSONObject]:
        with self._lock:
            if self._db is None:
                return []
            where, args = ("WHERE model = ?", [model]) if model else ("", [])
            try:
                found = self._db.execute(f"SELECT {', '.join(EVENT_COLUMNS)} FROM events {where} "
                                         "ORDER BY id DESC LIMIT ?", [*args, limit]).fetchall()
                rows: list[JSONObject] = [dict(zip(EVENT_COLUMNS, values)) for values in found]  # SQLite's values
            except sqlite3.Error as exc:
                self._problem(f"state database {self.path}: reading events failed ({exc})")
                return []
        for row in rows:
            text = row.get("detail")
            row["detail"] = json.loads(text) if isinstance(text, str) and text else {}  # stored as JSON text
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
            try:
                rows = self._db._db.execute("SELECT value FROM kv WHERE key = ?", [key]).fetchall()
            except sqlite3.Error:
                rows = []
        if not rows:
            raise KeyError(key)
        return json.loads(rows[0][0])

    def __setitem__(self, key: str, value: Any) -> None:
        with self._db._lock:
            if self._db._db is not None:
                try:
                    self._db._db.execute("INSERT OR REPLACE INTO kv(key, value) VALUES (?, ?)",
                                         [key, json.dumps(value, default=str)])
                except sqlite3.Error as exc:  # a cache: losing an entry costs a re-measure, never a request
                    self._db._problem(f"state database {self._db.path}: writing {key!r} failed ({exc})")

    def __delitem__(self, key: str) -> None:
        with self._db._lock:
            if self._db._db is not None:
                self._db._db.execute("DELETE FROM kv WHERE key = ?", [key])

    def __iter__(self) -> Iterator[str]:
        with self._db._lock:
            keys = [r[0] for r in self._db._db.execute("SELECT key FROM kv")] if self._db._db is not None else []
        return iter(keys)

    def __len__(self) -> int:
        return len(list(iter(self)))
