"""The serving process's zygote, kept: replaced when it dies (appliance/fronts/zygote.py).

``Keeper(first)`` holds the zygote the serve command forked (None: there is none, and workers
start as fresh interpreters). When that zygote dies, its workers serve on and a new one is
started at once as a fresh interpreter (``Zygote.start_fresh``: the serving process runs threads
by then, and forking it is not safe), after a pause that doubles while zygotes die young
(appliance/fronts/backoff.py); workers started later are forked by the new one. Meanwhile, or
when none can be started, ``launch`` waits up to ``SPAWN_TIMEOUT_S`` for it, then starts the
worker as a fresh interpreter.

Thread-safety: ``launch`` from the supervisor's threads; ``close`` from any; replacements run on
a thread of their own.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from appliance.fronts.backoff import next_pause
from appliance.fronts.zygote import SPAWN_TIMEOUT_S, WorkerProcess, Zygote, popen_worker

log = logging.getLogger("appliance.workers")

READY_TIMEOUT_S = 120.0  # a new zygote's imports; past this it is used anyway (a spawn then waits its own timeout)


class Keeper:
    """The zygote the serving process forks its workers from, replaced when it dies (module
    docstring). ``launch`` has the supervisor's ``Launcher`` face (with the ports): forked by
    the zygote there is, or by its replacement once that one answers, else a fresh interpreter."""

    def __init__(self, first: Zygote | None):
        self.zygote = first
        self.pause = 0.0
        self._ready = threading.Event()
        self._closed = threading.Event()
        if first is not None:
            self._keep(first)

    def launch(self, index: int, port: int, grpc_port: int, channel: socket.socket,
               listener: socket.socket, grpc_listener: socket.socket | None = None) -> WorkerProcess:
        listeners = (listener,) if grpc_listener is None else (listener, grpc_listener)  # REST, and gRPC if served
        forker = self.current(SPAWN_TIMEOUT_S)
        if forker is not None:
            return forker.spawn(index, port, grpc_port, channel, *listeners)
        return popen_worker(index, port, grpc_port, channel, *listeners)

    def current(self, timeout: float = 0.0) -> Zygote | None:
        """The living zygote; while one is being replaced, waits up to ``timeout`` for it."""
        if self.zygote is not None and not self.zygote.alive and not self._closed.is_set():
            self._ready.wait(timeout)
        forker = self.zygote
        return forker if forker is not None and forker.alive else None

    def close(self) -> None:
        """Close the zygote and replace it no more. Idempotent."""
        self._closed.set()
        self._ready.set()
        if self.zygote is not None:
            self.zygote.close()

    def _keep(self, zygote: Zygote) -> None:
        zygote.on_gone = self._replace
        self._ready.set()

    def _replace(self, dead: Zygote) -> None:
        """(the dead one's reader thread) Start its successor after the pause (``next_pause``)."""
        self._ready.clear()
        self.pause = next_pause(self.pause, time.monotonic() - dead.born)
        threading.Thread(target=self._start_next, args=(dead.grpc,), name="zygote-replace", daemon=True).start()

    def _start_next(self, grpc: bool) -> None:
        while not self._closed.wait(self.pause):
            try:
                fresh = Zygote.start_fresh(grpc, self._replace)
            except OSError as exc:
                log.error("cannot start a new front workers' zygote: %s", exc)
                self.pause = next_pause(self.pause, 0.0)
                continue
            fresh.ready.wait(READY_TIMEOUT_S)  # its imports: a loaded device takes seconds
            if not fresh.alive:
                return  # died already: its own on_gone started the next one
            self.zygote = fresh
            if self._closed.is_set():
                fresh.close()
            log.warning("a new front workers' zygote (pid %d) replaces the one that died", fresh.pid)
            self._keep(fresh)
            return
