"""A front worker process: the REST port's HTTP and JSON on a core of its own.

    python -m appliance.fronts.worker PORT GRPC_PORT INDEX CHANNEL_FD LISTENER_FD GRPC_LISTENER_FD

Started only by appliance/fronts/pool.py, which holds the port (and the gRPC port, 0
for none) and passes its end of a private channel: forked by the zygote (``run_forked``,
appliance/fronts/zygote.py), or as a fresh interpreter with the command above where there is
none, and the REST port's listening socket it accepts on, and the gRPC port's when it serves
gRPC (-1: none; SO_REUSEPORT beside the others'; the serving process keeps them across this
worker's death, so what the kernel queued for it is answered by its replacement). gRPC runs on the
HTTP server's event loop, as the lean server's guest (appliance/fronts/grpc_front.py's
services), so a call's run is awaited on the loop the channel lives on. The first message on the channel is the service's config, read before anything starts; the
worker then serves appliance/fronts/app.py's ``FrontApp`` on appliance/transport/http/
server.py's server (hot requests on its event loop, the rest on its threads), with its
share of the port's limits, the channel on the same loop, until the serving process says
``Drain`` (finish what is held, then exit 0) or goes away (EOF, or this process handed to
init: close everything, exit 1). Ctrl-C in a terminal and systemd's stop reach the whole
process group: a worker ignores SIGINT and SIGTERM and waits for the serving process's word,
so the drain happens in its order (the workers, then the models).

Every ``HEARTBEAT_S`` the worker's loop sends its figures (``Stats``): they are its heartbeat,
so they stop when the loop stops turning, and the supervisor replaces a worker that has been
silent for ``[server] worker_timeout_s`` (appliance/fronts/supervisor.py).

What it imports is its request path and nothing else: no Flask or werkzeug (everything else is
forwarded), no backend library (it never runs a model), gRPC's modules only when it serves the
gRPC port (tests/fronts/test_worker_supervision.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from appliance.fronts import messages as m
from appliance.fronts.app import Forwarder, FrontApp, facing, forward_whole, hot_mounts
from appliance.fronts.remote import RemoteCore
from appliance.fronts.link import Link
from appliance.fronts.pids import open_pidfd
from appliance.core import logs, memory
from appliance.core.cgroup import WORKER_OOM_SCORE, raise_oom_score
from appliance.fronts.shares import worker_grpc, worker_limits, workers_for
from appliance.transport.channel import ChannelProtocol, Codec, read_one
from appliance.transport.http.server import HTTPServer

if TYPE_CHECKING:
    from appliance.transport.grpc.h2_server import LeanServer

log = logging.getLogger("appliance.workers")

# Libraries worth naming when a worker holds them (``/api/status`` ``workers[].imported``): what
# its request path needs, and what it must never hold (tests/fronts/test_worker_supervision.py).
NAMED_MODULES = ("numpy", "uvloop", "httptools", "orjson", "simdjson", "rapidjson", "msgspec", "grpc", "h2",
                 "google.protobuf", "flask", "werkzeug", "jinja2", "tensorflow", "ai_edge_litert", "tflite_runtime",
                 "litert_lm", "sqlite_utils", "prometheus_client", "zeroconf", "boto3", "cryptography", "psutil")
HEARTBEAT_S = 1.0  # HTTP figures and memory to the serving process, from the loop: the heartbeat
# Once gRPC calls held at least this much and then nothing, the freed heap goes back to the OS
# (malloc_trim): glibc serves buffers under its raised mmap threshold (up to 32 MiB) from the
# heap and keeps them after a burst of big calls (issue 47 item 5: bench/big_calls.py).
TRIM_AFTER_BYTES = 8 << 20
# ... and once many connections and streams came and went (issue 47: an attacker's 100 calls a
# connection, closed unread, left each worker 8-23 MiB over idle 30 s after; nghttp2's sessions,
# the calls' messages and answers freed into a fragmented heap), at most every TRIM_EVERY_S.
TRIM_AFTER_CHURN = 1000
TRIM_EVERY_S = 5.0
# ... and once a burst's tail is over: at least this much churn since the last trim, and none
# during the last heartbeat (the last trim came mid-burst; what ended after it stayed).
TRIM_AFTER_QUIET_CHURN = 64
PARENT_CHECK_S = 1.0
# /healthz is answered by the worker itself while the serving process sent it something this
# recently (its loop turns: appliance/fronts/app.py ``FrontApp.route``), else forwarded there.
HEARD_S = 1.0
LISTEN_BACKLOG = 1024  # as appliance/transport/http/sockets.py's listen: bursts wait in the kernel


class Worker:
    def __init__(self, index: int, port: int, grpc_port: int, sock: socket.socket, serving: int,
                 listener: socket.socket, grpc_listener: socket.socket | None = None):
        """``serving``: the serving process's pid (this worker ends with it); ``listener``: the
        REST port's socket to accept on; ``grpc_listener``: the gRPC port's (None: bind one here)."""
        self.index, self.port, self.grpc_port, self.sock, self.serving = index, port, grpc_port, sock, serving
        self.listener, self.grpc_listener = listener, grpc_listener
        self.grpc: Any = None
        self.workers = 1
        self.link = Link(self.on_push)
        self.codec: Codec[m.ToWorker] = Codec(m.ToWorker)
        self.core: RemoteCore | None = None
        self.server: HTTPServer | None = None
        self.done = threading.Event()
        self.exit_code = 0
        self.held_peak = 0  # the most gRPC bytes held seen at a heartbeat since the heap was last trimmed
        self.churn_trimmed = 0  # the gRPC server's churn (connections and streams) at the last trim
        self.churn_seen = 0  # ... at the last heartbeat
        self.trimmed_at = 0.0  # when the heap was last trimmed (monotonic)

    def run(self) -> int:
        first = read_one(self.sock, self.codec)
        if not isinstance(first, m.ConfigPush):
            return 1
        config = m.config_from_plain(first)
        logs.setup(config.log_level)
        core = self.core = RemoteCore(config, self.link)
        app = FrontApp(core, hot_mounts(core), Forwarder(self.link), partial(forward_whole, self.link),
                       heard=partial(self.link.heard_within, HEARD_S))
        context = None
        if config.security.tls_cert_file:
            from appliance.core.tls import tls_context

            context = tls_context(config.security)
        workers = self.workers = workers_for(config)
        self.server = HTTPServer(app, config.server.host, self.port, config.server.threads,
                                 config.server.max_body_bytes, worker_limits(config.limits, workers), context,
                                 sock=listening(self.listener), fast=app,
                                 on_loop=self.open_channel, facing=facing())
        threading.Thread(target=self.watch_parent, name="parent", daemon=True).start()
        memory.tune_gc()
        self.server.serve_forever()
        return self.exit_code

    def start_grpc(self, core: RemoteCore, workers: int, loop: asyncio.AbstractEventLoop) -> LeanServer:
        """The gRPC port's share of this worker, on the HTTP server's loop (so a call's model
        run is awaited on the loop the link lives on: no hand-off between threads): TF
        Serving's and KServe v2's services, the token check, the ``[grpc]`` bounds shared out."""
        from appliance.api.auth import grpc_interceptor
        from appliance.fronts.grpc_front import FrontGRPC
        from appliance.transport.grpc.limits import grpc_limits
        from appliance.core.grpc_tls import grpc_tls
        from appliance.transport.grpc.h2_server import LeanServer

        config = core.config
        cfg = worker_grpc(config.grpc, workers)
        limits = grpc_limits(cfg, self.server.max_connections if self.server is not None else 0)
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes)]
        server = LeanServer(config.server.threads, options, [grpc_interceptor(core)], limits=limits, loop=loop)
        server.add_generic_rpc_handlers([FrontGRPC(core)])
        host = config.server.host or "0.0.0.0"
        address = f"[{host}]:{self.grpc_port}" if ":" in host else f"{host}:{self.grpc_port}"
        tls = grpc_tls(config)  # checked by the serving process before it started the workers
        if self.grpc_listener is not None:  # the serving process's, kept across this worker's death
            server.add_listener(self.grpc_listener, tls.context if tls is not None else None)
        elif tls is not None:
            server.add_secure_port(address, tls.context, reuse_port=True)
        else:
            server.add_insecure_port(address, reuse_port=True)
        server.start()
        return server

    def open_channel(self, loop: asyncio.AbstractEventLoop) -> None:
        """(the HTTP server's loop, before it serves) The channel, and the gRPC port, join the loop."""
        if self.grpc_port and self.core is not None:
            self.grpc = self.start_grpc(self.core, self.workers, loop)

        async def connect() -> None:
            self.sock.setblocking(False)
            _, proto = await loop.connect_accepted_socket(
                lambda: ChannelProtocol(self.codec, self.link.on_message, self.link.on_lost, self.index), self.sock)
            self.link.attach(loop, proto)
            self.beat(loop)  # listening: the serving process counts this worker in
        loop.create_task(connect())

    def beat(self, loop: asyncio.AbstractEventLoop) -> None:
        """(the loop) The figures now, and again in HEARTBEAT_S (module docstring)."""
        if not self.done.is_set():
            self.send_stats()
            self.trim_after_burst()
            loop.call_later(HEARTBEAT_S, self.beat, loop)

    def trim_after_burst(self) -> None:
        """(the loop) Big gRPC calls all done, or a burst of connections and streams over:
        their freed memory back to the OS (``heap_trims`` in the gRPC figures counts it)."""
        grpc = self.grpc
        if grpc is None:
            return
        held, churn, now = grpc.held, grpc.churn, time.monotonic()
        quiet, self.churn_seen = churn == self.churn_seen, churn
        self.held_peak = max(self.held_peak, held)
        if held:
            return
        big = self.held_peak >= TRIM_AFTER_BYTES
        since = churn - self.churn_trimmed
        many = (since >= TRIM_AFTER_CHURN and now - self.trimmed_at >= TRIM_EVERY_S
                or quiet and since >= TRIM_AFTER_QUIET_CHURN)
        if big or many:
            self.held_peak, self.churn_trimmed, self.trimmed_at = 0, churn, now
            if many:  # cancelled calls leave cycles (their tasks' CancelledErrors and frames), rarely collected
                memory.release_freed_memory()  # (memory.GC_THRESHOLDS): collected first, then trimmed
            else:
                memory.trim_heap()
            grpc.count("heap_trims")

    def on_push(self, message: m.Push) -> None:
        """(the loop) What the serving process says unasked."""
        assert self.core is not None
        if isinstance(message, m.ConfigPush):
            self.core.config = m.config_from_plain(message)
        elif isinstance(message, m.ViewPush):
            self.core.handles.view = m.view_from_plain(message)
        elif isinstance(message, m.Drain):
            threading.Thread(target=self.drain, args=(message.timeout,), name="drain", daemon=True).start()
        elif isinstance(message, m.Eof):  # the serving process is gone: nothing here can be answered any more
            self.gone()

    def drain(self, timeout: float) -> None:
        grpc_stop = None
        if self.grpc is not None:  # both ports drain together
            grpc_stop = threading.Thread(target=self.grpc.stop, args=(timeout,), name="grpc-drain", daemon=True)
            grpc_stop.start()
        if self.server is not None:
            self.server.drain(timeout)
        if grpc_stop is not None:
            grpc_stop.join(timeout + 5)
        self.done.set()

    def gone(self) -> None:
        """Stop: the serving process is gone (EOF, or this process was handed to init)."""
        self.exit_code = 1
        self.done.set()
        server = self.server
        if server is not None:
            threading.Thread(target=server.close, name="close", daemon=True).start()
        if self.grpc is not None:
            threading.Thread(target=self.grpc.stop, args=(0,), name="grpc-close", daemon=True).start()

    def watch_parent(self) -> None:
        """Exit when the serving process is gone, should the channel's EOF be missed. Watched by
        a pidfd on it, not by this process's parent: the zygote that forked this worker may die
        and this worker serve on (appliance/fronts/zygote.py). Where there are no pidfds, when
        the parent changes, as before."""
        serving = open_pidfd(self.serving)
        parent = os.getppid()
        while not self.done.is_set():
            if serving is not None:
                gone = serving.ended(PARENT_CHECK_S)
            else:
                gone = not self.done.wait(PARENT_CHECK_S) and os.getppid() != parent
            if gone and not self.done.is_set():
                log.error("front worker %d: the serving process (pid %d) is gone; exiting", self.index, self.serving)
                self.gone()
                return

    def send_stats(self) -> None:
        server, grpc = self.server, self.grpc
        if server is not None:
            figures = None
            if grpc is not None:
                figures = {"connections": len(grpc.connections), "held_bytes": grpc.held,
                           "max_connections": grpc.limits.max_connections, **grpc.stats.copy()}
            self.link.send(m.Stats(os.getpid(), _rss(), dict(server.stats), server.tracker.served,
                                   [name for name in NAMED_MODULES if name in sys.modules], figures))


def listening(sock: socket.socket) -> socket.socket:
    """The REST listener the serving process bound for this worker, listening from now on (a
    replaced worker's is listening already: its queue waited for this one)."""
    sock.listen(LISTEN_BACKLOG)
    return sock


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def run_forked(index: int, port: int, grpc_port: int, channel_fd: int, serving: int, listener_fd: int,
               grpc_listener_fd: int = -1) -> int:
    """The worker's main, in a process the zygote forked or a fresh interpreter: its exit status.
    ``serving``: the serving process's pid; ``listener_fd``: the REST port's listening socket;
    ``grpc_listener_fd``: the gRPC port's (-1: none)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Should the kernel's OOM killer act, a worker goes before the serving process (which holds
    # the models and restarts workers); forked ones have it from the zygote already.
    raise_oom_score(os.getpid(), WORKER_OOM_SCORE)
    memory.limit_arenas()
    sock = socket.socket(fileno=channel_fd)
    sock.setblocking(True)
    listener = socket.socket(fileno=listener_fd)
    grpc_listener = socket.socket(fileno=grpc_listener_fd) if grpc_listener_fd >= 0 else None
    return Worker(index, port, grpc_port, sock, serving, listener, grpc_listener).run()


def main(argv: list[str]) -> int:
    port, grpc_port, index, channel_fd, listener_fd, grpc_listener_fd = (int(a) for a in argv[-6:])
    return run_forked(index, port, grpc_port, channel_fd, os.getppid(), listener_fd,  # started by the serving process
                      grpc_listener_fd)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
