"""The REST port served by front worker processes: HTTP and JSON on every core.

With ``[server] workers`` resolving to two or more (``workers_for``), the serving process
holds the port and starts that many front workers (appliance/service/front_worker.py),
each listening on it with SO_REUSEPORT (the kernel spreads new connections over them; one
shared accept queue would let the first worker to wake take every connection of a burst)
and answering inference itself (parse, decode, encode) while the serving process runs the
batches (appliance/api/remote/). It
stays the one process systemd, sd_notify, ``/api/status``, the page and the metrics see:
every other request is forwarded to its app, the workers' request metrics join its
registry, their HTTP figures and memory show under ``/api/status`` ``workers``, and a
worker that exits is started again and shown as an event (``worker_exited``).

``Fronts`` has the face of appliance/transport/http/server.py's ``HTTPServer`` that the
service uses (``host``, ``port``, ``stats``, ``serve_forever``, ``drain``, ``close``), so
the service, the drain on SIGTERM and the parts do not care which one serves. The drain
order: every worker stops accepting and finishes what it holds (their requests still run
here), then they exit, then the service unloads its models.

What a worker's death costs: the connections it held, and those the kernel had queued for
it but it had not accepted, close (a client sees the connection end, never a hang);
requests of it still queued here are dropped when their answer finds no channel. The
other workers go on taking new connections meanwhile.

Limits that bound the whole port (``limits.max_connections``, ``limits.max_buffered_bytes``,
and gRPC's ``max_connections`` and ``max_buffer_bytes``) are shared out among the workers,
so the configured totals hold.

The gRPC TCP port is the workers' too when it can be held at start-up (``serve_grpc``,
called by appliance/service/grpc_port.py): inference is answered there, every other
method forwarded (appliance/api/remote/grpc_front.py). A gRPC Unix socket, and a TCP port
that is retried (``[grpc] bind_retry``), stay with the serving process.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from appliance.api.remote import messages as m
from appliance.core.config import Config, GRPCConfig, LimitsConfig
from appliance.service.front_service import FrontService
from appliance.transport.http.server import connection_cap, initial_stats, reserve_port
from appliance.transport.supervisor import Supervisor

if TYPE_CHECKING:
    from appliance.core.appliance import Appliance

log = logging.getLogger("appliance.workers")

EXIT_GRACE_S = 5.0
MEMORY_PER_WORKER = 512 << 20  # the default runs a worker per CPU, and per this much memory at most
PART = "http workers"  # as the page and /readyz name it while some are still starting  # past the drain timeout, how long workers get to exit before they are killed


def workers_for(config: Config) -> int:
    """How many front workers to run: ``server.workers``, or by default one per CPU but no
    more than one per ``MEMORY_PER_WORKER`` of the device's memory (a worker costs ~45 MB,
    bench/RESULTS.md); 0 or 1 means none (the single-process path)."""
    wanted = config.server.workers or auto_workers()
    return wanted if wanted > 1 else 0


def auto_workers() -> int:
    cpus = os.cpu_count() or 1
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not a POSIX sysconf: by the CPUs alone
        return cpus
    return max(1, min(cpus, memory // MEMORY_PER_WORKER))


def worker_limits(limits: LimitsConfig, workers: int) -> LimitsConfig:
    """One worker's share of the REST port's limits."""
    return dataclasses.replace(limits, max_connections=_share(limits.max_connections, workers),
                               max_buffered_bytes=_share(limits.max_buffered_bytes, workers))


def worker_grpc(cfg: GRPCConfig, workers: int) -> GRPCConfig:
    """One worker's share of the gRPC port's limits (a connection's own bound stays)."""
    return dataclasses.replace(cfg, max_connections=_share(cfg.max_connections, workers),
                               max_buffer_bytes=_share(cfg.max_buffer_bytes, workers),
                               max_open_streams=max(cfg.max_concurrent_streams, _share(cfg.max_open_streams, workers)))


def _share(total: int, workers: int) -> int:
    return max(1, math.ceil(total / workers))


class Fronts:
    """The port, its workers and the service behind them (module docstring)."""

    def __init__(self, core: "Appliance", app: Callable[..., Any], config: Config, count: int):
        server = config.server
        self.core, self.count = core, count
        self.sock = reserve_port(server.host, server.port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.front = FrontService(core, app, server.threads, self._listening)
        self._waiting = set(range(count))  # workers not yet listening at start-up
        self.grpc_port = 0  # the gRPC port the workers serve too (serve_grpc); 0: none
        self.grpc_sock: socket.socket | None = None
        self.supervisor = Supervisor(count, self._argv(), self._started, self._exited)
        self.pids: dict[int, int] = {}
        limits = config.limits
        self._base_stats = {**initial_stats(limits, bool(config.security.tls_cert_file),
                                            connection_cap(limits.max_connections)), "workers": count}
        self._closed = threading.Event()
        self._serving = False

    def _argv(self) -> list[str]:
        return [sys.executable, "-m", "appliance.service.front_worker", str(self.port), str(self.grpc_port)]

    def serve_grpc(self, host: str, port: int) -> int:
        """Have the workers serve gRPC on ``port`` too (before ``serve_forever``): held here
        as the REST port is; OSError when it is busy. The port number bound."""
        self.grpc_sock = reserve_port(host, port)
        self.grpc_port = self.grpc_sock.getsockname()[1]
        self.supervisor.argv = self._argv()
        return self.grpc_port

    @property
    def stats(self) -> dict[str, Any]:
        """The port's HTTP figures: the workers' together."""
        return self.front.http_stats(self._base_stats)

    def grpc_stats(self) -> dict[str, int]:
        """The workers' gRPC figures (connections, bytes held, what was refused), summed."""
        total: dict[str, int] = {}
        for stats in list(self.front.stats.values()):
            for key, value in stats.get("grpc", {}).items():
                total[key] = total.get(key, 0) + value
        return total

    def workers_status(self) -> list[dict[str, Any]]:
        """Each worker: pid, memory, requests served, restarts (``/api/status`` ``workers``)."""
        out = []
        for child in self.supervisor.children:
            stats = self.front.stats.get(child.index, {})
            out.append({"index": child.index, "pid": self.pids.get(child.index), "restarts": child.restarts,
                        "rss_bytes": stats.get("rss_bytes"), "served": stats.get("served", 0),
                        "connections": stats.get("http", {}).get("connections", 0),
                        "up": child.index in self.front.links})
        return out

    # -- lifecycle -------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Start the workers; return once ``close`` (or the end of a drain) stops them. The
        device is not ready until every worker listens (a client that connects before would
        find the port held by fewer of them for as long as its connection lives)."""
        self._report_waiting()
        self.front.start()
        self.supervisor.start()
        self._serving = True
        self._closed.wait()

    def apply_config(self, config: Config) -> None:
        """A reload: the workers' config (tokens, limits the API reads) follows."""
        self.front.push_config(config)

    def drain(self, timeout: float) -> bool:
        """The graceful stop (module docstring); True when every worker drained in time."""
        self.front.broadcast(m.DRAIN, timeout)
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
        self.sock.close()
        if self.grpc_sock is not None:
            self.grpc_sock.close()
        self._closed.set()

    # -- the supervisor's callbacks ---------------------------------------------------------
    def _started(self, index: int, pid: int, sock: socket.socket) -> None:
        self.pids[index] = pid
        self.front.attach(index, sock)

    def _listening(self, index: int) -> None:
        if index in self._waiting:
            self._waiting.discard(index)
            self._report_waiting()

    def _report_waiting(self) -> None:
        waiting = len(self._waiting)
        self.core.report_problem(PART, f"{self.count - waiting} of {self.count} front workers listening"
                                 if waiting else None)

    def _exited(self, index: int, pid: int, code: int, restarting: bool) -> None:
        if not restarting:
            return
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        log.warning("front worker %d (pid %d) %s; starting a new one", index, pid, how)
        self.core.db.event("worker_exited", f"front worker {index} (pid {pid}) {how}; a new one starts",
                           worker=index, pid=pid, code=code, at=time.time())
