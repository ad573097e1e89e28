"""The REST port served by front worker processes: HTTP and JSON on every core.

With ``[server] workers`` resolving to two or more (``workers_for``), the serving process
holds the port and starts that many front workers (appliance/fronts/worker.py),
each listening on it with SO_REUSEPORT (the kernel spreads new connections over them; one
shared accept queue would let the first worker to wake take every connection of a burst)
and answering inference itself (parse, decode, encode) while the serving process runs the
batches (appliance/fronts/). It
stays the one process systemd, sd_notify, ``/api/status``, the page and the metrics see:
every other request is forwarded to its app, the workers' request metrics join its
registry, their HTTP figures and memory show under ``/api/status`` ``workers``, and a
worker that exits, or stops speaking for ``[server] worker_timeout_s`` (its heartbeat,
appliance/fronts/supervisor.py), is started again and shown as an event (``worker_exited``,
with the reason), counted in ``edge_appliance_worker_restarts_total{reason}`` and, while it is
missing, named as a problem ("1 of 2 front workers serving") by ``/readyz`` and the page.

Workers are forked by the zygote when the serve command made one (appliance/fronts/zygote.py:
their imports shared with this process), else started as fresh interpreters. Should the zygote
die, the workers serve on and a new zygote forks the later ones (appliance/fronts/keeper.py).

``Fronts`` has the face of appliance/transport/http/server.py's ``HTTPServer`` that the
service uses (``host``, ``port``, ``stats``, ``serve_forever``, ``drain``, ``close``), so
the service, the drain on SIGTERM and the parts do not care which one serves. The drain
order: every worker stops accepting and finishes what it holds (their requests still run
here), then they exit, then the service unloads its models.

What a worker's death costs: the connections it held close (a client sees the connection
end, never a hang); requests of it still queued here are dropped when their answer finds no
channel. The other workers go on taking new connections meanwhile. What can be drained is:
each worker's REST listener, and its gRPC one when the workers serve gRPC, is bound here
(``bound``; the worker starts it listening once it can serve) and kept across its worker's death
(``listeners``, ``grpc_listeners``), so connections the kernel queued
for a worker that died or was killed (stopped, hung) wait there and its replacement answers them. A worker that ended by itself young (``crash_looping``:
its replacement waits a pause that grows) gives its listeners up, so that new connections go to
the others meanwhile; so do they all at a drain.

Limits that bound the whole port (``limits.max_connections``, ``limits.max_buffered_bytes``,
and gRPC's ``max_connections`` and ``max_buffer_bytes``) are shared out among the workers,
so the configured totals hold.

The gRPC TCP port is the workers' too when it can be held at start-up (``serve_grpc``,
called by appliance/service/grpc_port.py): inference is answered there, every other
method forwarded (appliance/fronts/grpc_front.py). A gRPC Unix socket, and a TCP port
that is retried (``[grpc] bind_retry``), stay with the serving process.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from appliance.fronts import messages as m
from appliance.fronts import zygote
from appliance.fronts.keeper import Keeper
from appliance.core.config import Config
from appliance.fronts.health import RestartCounters, process_memory, serving_report
from appliance.fronts.serving import FrontService
from appliance.transport.http.server import initial_stats
from appliance.transport.http.sockets import bound_beside, connection_cap, reserve_port
from appliance.fronts.backoff import QUICK_EXIT_S
from appliance.fronts.supervisor import Exit, Supervisor

if TYPE_CHECKING:
    from wsgiref.types import WSGIApplication

    from appliance.core.appliance import Appliance
    from appliance.fronts.supervisor import Child

log = logging.getLogger("appliance.workers")

EXIT_GRACE_S = 5.0  # past the drain timeout, how long workers get to exit before they are killed
PART = "http workers"  # as the page and /readyz name it while fewer than configured serve
LOOP_STALL_S = 3.0  # this side's loop silent this long: the workers' silence is not theirs


def bound(host: str, port: int) -> socket.socket:
    """A worker's REST listener: bound to the port beside the others (SO_REUSEPORT), not yet
    listening; its worker starts it listening once it can serve (appliance/fronts/worker.py), so
    one that fails at start-up never has connections queued for it."""
    return bound_beside(host, port)


def crash_looping(ended: Exit) -> bool:
    """A worker that ended by itself (or never started) within ``QUICK_EXIT_S`` of its start: the
    next one waits a pause that grows (appliance/fronts/backoff.py). One killed (for its
    heartbeat, or by a signal) is replaced at once or nearly, and keeps its listener."""
    return ended.reason in ("exit", "spawn") and ended.ran_s < QUICK_EXIT_S


class Fronts:
    """The port, its workers and the service behind them (module docstring)."""

    def __init__(self, core: "Appliance", app: WSGIApplication, config: Config, count: int):
        server = config.server
        self.core, self.count = core, count
        self.sock = reserve_port(server.host, server.port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.front = FrontService(core, app, server.threads, on_heard=self._heard)
        self._started_all = False  # every worker has served once (the device is ready from then on)
        self.grpc_port = 0  # the gRPC port the workers serve too (serve_grpc); 0: none
        self.grpc_sock: socket.socket | None = None
        self._grpc_host = server.host
        self.zygotes = Keeper(zygote.early())
        self.supervisor = Supervisor(count, self._launch, self._started, self._exited, server.worker_timeout_s,
                                     self._turning, self._report_serving)
        self.pids: dict[int, int] = {}
        self.listeners: dict[int, socket.socket] = {}  # worker index -> its REST listener (module docstring)
        self.grpc_listeners: dict[int, socket.socket] = {}  # worker index -> its gRPC listener, as the REST one
        self._listen_host = server.host
        core.metrics.registry.register(RestartCounters(self._counters))
        limits = config.limits
        self._base_stats = {**initial_stats(limits, bool(config.security.tls_cert_file),
                                            connection_cap(limits.max_connections)), "workers": count}
        self._closed = threading.Event()
        self._serving = False

    def _launch(self, index: int, channel: socket.socket) -> zygote.WorkerProcess:
        """Worker ``index``: forked by the zygote while there is one, else a fresh interpreter."""
        listener = self.listeners.get(index)
        if listener is None:
            listener = self.listeners[index] = bound(self._listen_host, self.port)
        grpc_listener = self.grpc_listeners.get(index)
        if grpc_listener is None and self.grpc_port:
            grpc_listener = self.grpc_listeners[index] = bound(self._grpc_host, self.grpc_port)
        return self.zygotes.launch(index, self.port, self.grpc_port, channel, listener, grpc_listener)

    def _give_up_listener(self, index: int) -> None:
        """Close worker ``index``'s listeners here (REST and gRPC): what the kernel queued for it
        is reset, and new connections go to the others (its worker, if alive, holds its own copy)."""
        for listeners in (self.listeners, self.grpc_listeners):
            listener = listeners.pop(index, None)
            if listener is not None:
                listener.close()

    def serve_grpc(self, host: str, port: int) -> int:
        """Have the workers serve gRPC on ``port`` too (before ``serve_forever``): held here
        as the REST port is; OSError when it is busy. The port number bound."""
        self.grpc_sock = reserve_port(host, port)
        self.grpc_port = self.grpc_sock.getsockname()[1]
        self._grpc_host = host
        return self.grpc_port

    @property
    def stats(self) -> dict[str, Any]:
        """The port's HTTP figures: the workers' together."""
        return self.front.http_stats(self._base_stats)

    def grpc_stats(self) -> dict[str, int]:
        """The workers' gRPC figures (connections, bytes held, what was refused), summed."""
        total: dict[str, int] = {}
        for stats in list(self.front.stats.values()):
            for key, value in (stats.grpc or {}).items():
                total[key] = total.get(key, 0) + value
        return total

    def workers_status(self) -> list[dict[str, Any]]:
        """Each worker (``/api/status`` ``workers``): pid, whether it serves, its age, memory
        (RSS, PSS, USS, read here from /proc), requests served, connections, how long since it
        was last heard, its restarts and the last few exits with their reasons, and the pid of
        the zygote that forked it (which may have died since: appliance/fronts/keeper.py)."""
        now, wall = time.monotonic(), time.time()
        serving = set(self.supervisor.serving())
        out = []
        now = time.monotonic()
        for child in self.supervisor.children:
            stats = self.front.stats.get(child.index)
            pid = self.pids.get(child.index)
            running = child.proc is not None and child.proc.poll() is None
            out.append({"index": child.index, "pid": pid, "up": child.index in serving,
                        "age_s": round(now - child.started, 1) if running else None,
                        "started_at": child.started_at, "heard_s_ago": round(now - child.heard, 1),
                        **(process_memory(pid) if pid and running else {}),
                        "served": stats.served if stats else 0,
                        "connections": stats.http.get("connections", 0) if stats else 0,
                        "restarts": child.restarts, "forked": self._forked(child), "pause_s": child.pause,
                        "zygote_pid": child.proc.zygote.pid if isinstance(child.proc, zygote.Forked) else None,
                        "imported": stats.imported if stats else None,
                        "exits": [{"pid": e.pid, "reason": e.reason, "code": e.code, "at": e.at,
                                   "ran_s": round(e.ran_s, 1), "words": e.words()} for e in child.exits],
                        "ago_s_of_last_exit": round(wall - child.exits[-1].at, 1) if child.exits else None})
        return out

    def _forked(self, child: Child) -> bool:
        return isinstance(child.proc, zygote.Forked)

    def serving(self) -> int:
        """How many workers serve now: running, listening, heard within the timeout."""
        return len(self.supervisor.serving())

    def liveness_problem(self) -> str | None:
        """For the systemd watchdog (appliance/parts/notify.py): None while every worker serves
        or is being replaced; else why not (the supervisor itself has stopped judging, or a
        worker has been silent for twice the timeout and is still not replaced)."""
        return self.supervisor.stalled() if self._serving else None

    def _counters(self) -> tuple[dict[str, int], int, int, dict[int, dict[str, int]]]:
        memory = {index: process_memory(pid) for index, pid in self.pids.items() if pid in self.supervisor.pids()}
        return dict(self.supervisor.restarts_by_reason), self.count, self.serving(), memory

    # -- lifecycle -------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Start the workers; return once ``close`` (or the end of a drain) stops them. The
        device is not ready until every worker listens (a client that connects before would
        find the port held by fewer of them for as long as its connection lives)."""
        self._report_serving()
        self.front.start()
        self.supervisor.start()
        self._serving = True
        self._closed.wait()

    def apply_config(self, config: Config) -> None:
        """A reload: the workers' config (tokens, limits the API reads) follows."""
        self.front.push_config(config)

    def drain(self, timeout: float) -> bool:
        """The graceful stop (module docstring); True when every worker drained in time."""
        self.front.broadcast(m.Drain(timeout))
        for index in list({*self.listeners, *self.grpc_listeners}):  # a draining worker's queue goes nowhere: reset, not kept waiting
            self._give_up_listener(index)
        clean = self.supervisor.stop(timeout + EXIT_GRACE_S)
        self.close()
        return clean

    def close(self) -> None:
        """Stop the workers now and close the port. Idempotent."""
        if self._closed.is_set():
            return
        self.supervisor.halt()
        self.front.close()  # the workers read EOF: they close their connections and exit
        self.supervisor.stop(EXIT_GRACE_S)
        self.zygotes.close()
        for index in list({*self.listeners, *self.grpc_listeners}):
            self._give_up_listener(index)
        self.sock.close()
        if self.grpc_sock is not None:
            self.grpc_sock.close()
        self._closed.set()

    # -- the supervisor's callbacks ---------------------------------------------------------
    def _started(self, index: int, pid: int, sock: socket.socket) -> None:
        self.pids[index] = pid
        self.front.attach(index, sock)

    def _heard(self, index: int) -> None:
        self.supervisor.heard(index)

    def _turning(self) -> bool:
        return time.monotonic() - self.front.turned < LOOP_STALL_S

    def _report_serving(self) -> None:
        """(any thread) The problem while fewer workers than configured serve: critical (not
        ready) until every worker has served once, and whenever none serves; shown, not
        critical, while one of several is being replaced (the port is answered meanwhile)."""
        problem, critical, self._started_all = serving_report(self.count, self.supervisor.missing(), self._started_all)
        self.core.report_problem(PART, problem, critical=critical)

    def _exited(self, index: int, ended: Exit, restarting: bool) -> None:
        if not restarting or crash_looping(ended):  # no replacement soon: the others take its share
            self._give_up_listener(index)
        if not restarting:
            return
        how = ended.words()
        log.warning("front worker %d (pid %d) %s; starting a new one", index, ended.pid, how)
        self.core.db.event("worker_exited", f"front worker {index} (pid {ended.pid}) {how}; a new one starts",
                           worker=index, pid=ended.pid, code=ended.code, reason=ended.reason, at=ended.at)
