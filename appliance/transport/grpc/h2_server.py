"""The service's gRPC server for unary calls: HTTP/2 from libnghttp2 (appliance/transport/grpc/
session.py, through cffi: nghttp2.py), gRPC's thin layer over it (calls.py), our bounds
(limits.py) and the calls' accounting (connection.py), on one asyncio event loop.

Why not grpcio's server by default: on a small device its per-call machinery (Cython call
objects, a polling thread, status sending) cost about three times this server's CPU per call,
more than the whole REST path (bench/RESULTS.md). Why not python-hyper's h2 any more: the same
HTTP/2 state machine in pure Python cost ~90 µs of CPU per call, so gRPC stayed slower than
REST through the front workers; nghttp2 does that work in C. Every RPC this service offers (TF
Serving's and KServe v2's) is unary but one (ModelStreamInfer: a stream of ordinary requests),
so the part of gRPC it needs is small: one request message in, one answer or a status out. It takes the same ``grpc.GenericRpcHandler`` objects
and ``grpc.aio.ServerInterceptor`` as a grpc.aio server, so the services and the token check
do not know which server runs them (``[grpc] transport``: "lean", the default, or "grpcio").
It knows nothing of models and holds no global state: it can run in any process.

What it does: TCP or Unix socket listeners, plaintext or TLS (``ssl_context``: ALPN h2, and
client certificates when the context requires them; the TLS handshake and the HTTP/2 preface
together bounded by ``handshake_timeout_s`` from the accept, as a plaintext connection's
preface is); at most ``Limits.max_connections`` connections (at the cap the TLS handshake
under way longest, else the connection idle longest, makes room for a new one that is
waiting; with none, new ones wait in the kernel's queue, so the descriptors gRPC takes are
bounded and REST keeps its own); at most ``Limits.max_open_streams`` streams on all of them
(an eighth of them per peer address: peers.py);
a server-wide budget of client resets (limits.py); budgets per peer address over all its
connections for control frames and abandoned calls (peers.py); ``grpc-timeout`` (DEADLINE_EXCEEDED), gzip and
deflate requests, the maximum message size both ways (RESOURCE_EXHAUSTED); graceful drain
(GOAWAY, then in-flight calls finish within the grace). Bidirectional-streaming calls
(Triton's ModelStreamInfer) run through streams.py; client- and server-streaming ones and
server push are not served. The loop is uvloop's where it is installed
(appliance/transport/loop_thread.py).

Thread-safety: the grpc.Server calls (add handlers and ports, start, stop) from any thread but
the loop's; everything else runs on the loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import ssl
import time
from functools import partial
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence

import grpc

from appliance.transport.grpc.calls import CallDetails
from appliance.transport.grpc.connection import Connection
from appliance.transport.grpc.limits import SERVER_RESET_BURST, SERVER_RESET_RATE, Limits, TokenBucket
from appliance.transport.grpc.peers import Peers
from appliance.transport.loop_thread import LoopThread, new_event_loop

if TYPE_CHECKING:
    # The handler lookup behind the interceptors: awaitable, the method's handler or None.
    Lookup = Callable[[CallDetails], Awaitable["grpc.RpcMethodHandler | None"]]

log = logging.getLogger("appliance.grpc")
SWEEP_S = 1.0  # how often handshake deadlines and stalled streams are checked
BACKLOG = 1024  # connections the kernel queues for us while we are at the cap


class LeanServer(LoopThread):
    """The calls of ``grpc.Server`` (add handlers and ports, start, stop) for this transport;
    methods written as plain functions run on a pool of ``threads``."""

    def __init__(self, threads: int, options: Sequence[tuple[str, int | str]] = (),
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 tells_alone: bool = False,
                 limits: Limits | None = None,
                 loop: asyncio.AbstractEventLoop | None = None):
        """``loop``: serve on that loop as a guest (appliance/transport/loop_thread.py), not on
        one of its own; ``start`` is then called in that loop's thread."""
        super().__init__(threads, loop_factory=new_event_loop, loop=loop)
        # Each call's context (calls.py Context) carries ``self.alone``, so what the call runs
        # (the model handle) can ask whether it is the only call in flight; the server knows
        # nothing of batching.
        self.tells_alone = tells_alone
        opts = dict(options)
        self.max_receive = int(opts.get("grpc.max_receive_message_length", 4 * 1024 * 1024))
        self.max_send = int(opts.get("grpc.max_send_message_length", 2**31 - 1))
        self.limits = limits or Limits()
        self.handlers: list[grpc.GenericRpcHandler] = []
        self.interceptors = list(interceptors)
        self.listeners: list[socket.socket] = []
        self.unix_paths: list[str] = []
        self.connections: set[Connection] = set()
        self.opening = 0  # accepted, transport not made yet
        self.handshakes: dict[asyncio.Task[object], float] = {}  # TLS handshakes under way -> when accepted
        self.accepting = False
        self.closing = False
        self.held = 0  # bytes held for calls, every connection together (admission.py)
        self.held_back = False  # some stream waits for ``held`` to fall (admission.py ``admit``)
        self._readmitting = False
        self.in_flight = 0  # calls dispatched and not finished (their tasks), on every connection
        self.open_streams = 0  # streams open on every connection (Limits.max_open_streams)
        self.churn = 0  # connections accepted and ended, streams opened, in all (a burst of them ended: trim the heap)
        self.resets = TokenBucket(SERVER_RESET_BURST, SERVER_RESET_RATE)  # client resets, all connections
        self.peers = Peers()  # per peer address, all its connections: control frames, abandoned calls
        self.tls: dict[socket.socket, ssl.SSLContext] = {}  # the listeners that speak TLS
        self.stats: dict[str, int] = {}
        self._all_closed: asyncio.Event | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self._cache: dict[str, grpc.RpcMethodHandler] = {}
        self._coroutines: dict[Callable[..., object], bool] = {}
        self.lookup = self._chain()

    def alone(self) -> bool:
        return self.in_flight == 1

    def buffered_bytes(self) -> int:
        """Bytes held for calls now: request messages in methods and answers not yet written."""
        return self.held

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    # -- grpc.Server's calls ---------------------------------------------------------------
    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.handlers.extend(handlers)
        self._cache.clear()

    def add_secure_port(self, address: str, context: ssl.SSLContext, reuse_port: bool = False) -> int:
        """``add_insecure_port``, speaking TLS with ``context`` (ALPN h2; client certificates
        when it requires them: appliance/core/grpc_tls.py makes it). The handshake must end
        within ``Limits.handshake_timeout_s``."""
        bound = self.add_insecure_port(address, reuse_port)
        self.tls[self.listeners[-1]] = context
        return bound

    def add_insecure_port(self, address: str, reuse_port: bool = False) -> int:
        """``host:port`` or ``[v6]:port`` (port 0: any free one) or ``unix:PATH``; the port bound.
        ``reuse_port``: one of several processes' listeners on a port held for them
        (appliance/transport/http/sockets.py ``reserve_port``; SO_REUSEPORT)."""
        try:
            if address.startswith("unix:"):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.bind(address[5:])
                    sock.listen(BACKLOG)
                except OSError:
                    sock.close()
                    raise
                self.unix_paths.append(address[5:])
                bound = 1
            else:
                host, _, port = address.rpartition(":")
                host = host.strip("[]")
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.create_server((host, int(port)), family=family, backlog=BACKLOG, reuse_port=reuse_port)
                bound = int(sock.getsockname()[1])
        except OSError as exc:  # "[Errno 98] address already in use", as asyncio and TF Serving say it
            reason = OSError(exc.errno, (exc.strerror or str(exc)).lower())
            raise RuntimeError(f"cannot bind {address}: {reason}") from reason
        sock.setblocking(False)
        self.listeners.append(sock)
        return bound

    def add_listener(self, sock: socket.socket, context: ssl.SSLContext | None = None) -> int:
        """A TCP socket bound elsewhere (appliance/fronts/pool.py binds a front worker's beside
        the others, SO_REUSEPORT, and keeps it across the worker's death), listening from now on
        (one listening already keeps what the kernel queued on it); TLS with ``context``. Closed
        by ``stop`` (this process's copy). The port bound."""
        sock.listen(BACKLOG)
        sock.setblocking(False)
        self.listeners.append(sock)
        if context is not None:
            self.tls[sock] = context
        return int(sock.getsockname()[1])

    def start(self) -> None:
        """Take connections. A guest calls this in its loop's thread (running or about to)."""
        def serve() -> None:
            self._resume_accepting()
            self._sweeper = self.loop.call_later(SWEEP_S, self._sweep)
        if self.guest:
            serve()
            return

        async def serving() -> None:
            serve()
        self.run(serving())

    def stop(self, grace: float | None) -> None:
        """Stop taking connections and calls (GOAWAY), let in-flight calls finish for up to
        ``grace`` seconds, then close everything and the loop's thread."""
        if self.loop.is_closed():
            return

        async def drain() -> None:
            self.closing = True
            self._all_closed = asyncio.Event()
            self._pause_accepting()
            for sock in self.listeners:
                sock.close()
            if self._sweeper is not None:
                self._sweeper.cancel()
            for connection in list(self.connections):
                connection.go_away()
            self.stream_done(None)
            if grace:
                try:
                    await asyncio.wait_for(self._all_closed.wait(), grace)
                except asyncio.TimeoutError:
                    log.warning("gRPC calls still running after %.1f s of drain: cancelled", grace)
            for connection in list(self.connections):
                connection.close_now()
        try:
            self.run(drain(), (grace or 0) + 5)
        finally:
            self.close_loop()
            for path in self.unix_paths:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    # -- connections (loop thread) ---------------------------------------------------------
    def _accept(self, listener: socket.socket) -> None:
        while self.accepting:
            at_cap = len(self.connections) + self.opening >= self.limits.max_connections
            if at_cap:
                if not select.select([listener], [], [], 0)[0]:
                    return  # nobody is waiting: evict no one
                if not self._evict_handshake() and not self._evict_idle():
                    self._pause_accepting()  # the kernel queues the rest until a connection closes
                    return
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: wait for the sweep, never spin
                if not self.stats.get("accept_failed"):
                    log.warning("gRPC accept failed: %s (retried every %g s, logged once)", exc, SWEEP_S)
                self.count("accept_failed")
                self._pause_accepting()
                return
            self.churn += 1
            if self.peers.refuse(address):  # over its address's budget (peers.py): closed unread
                self.count("peer_refused_connections")
                sock.close()
                continue
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.opening += 1
            context, accepted = self.tls.get(listener), time.monotonic()
            made = partial(Connection, self, accepted)  # its first bytes are due within the deadline of the accept
            connect = (self.loop.connect_accepted_socket(made, sock) if context is None
                       else self.loop.connect_accepted_socket(made, sock, ssl=context,
                                                              ssl_handshake_timeout=self.limits.handshake_timeout_s))
            task = self.loop.create_task(connect)
            if context is not None:
                self.handshakes[task] = accepted
            task.add_done_callback(partial(self._opened, sock))
            if at_cap:  # one eviction a turn of the loop: the evicted handshake's socket closes first
                return

    def _opened(self, sock: socket.socket, task: asyncio.Task[object]) -> None:
        self.opening -= 1
        self.handshakes.pop(task, None)
        if task.cancelled() or task.exception() is not None:
            self.churn += 1  # a connection ended (its TLS handshake state freed): see connection_lost
            if not task.cancelled():  # timed out (a ClientHello trickled in) or refused
                exc = task.exception()
                self.count("tls_handshake_timeout" if isinstance(exc, (TimeoutError, asyncio.TimeoutError))
                           else "tls_handshake_failed")
            sock.close()
            self._resume_accepting()

    def _evict_handshake(self) -> bool:
        """At the cap with a connection waiting: end the TLS handshake under way longest (a
        client that trickles its ClientHello, issue 47 item 6, holds a slot until the deadline
        otherwise, and 2,000 of them kept every slot); False if none is under way. One that
        is honest ends in milliseconds, so the oldest is almost always the slow one."""
        oldest = min(self.handshakes, key=self.handshakes.__getitem__, default=None)
        if oldest is None:
            return False
        del self.handshakes[oldest]
        self.count("evicted_handshakes")
        oldest.cancel()  # its transport is closed by asyncio; _opened frees the slot
        return True

    def _evict_idle(self) -> bool:
        """At the cap with a connection waiting: close the one idle longest; False if none is."""
        oldest = min((c for c in self.connections if c.idle), key=lambda c: c.last_active, default=None)
        if oldest is None:
            return False
        self.count("evicted_idle")
        self.connections.discard(oldest)  # its slot is free now; connection_lost follows
        oldest.go_away()
        return True

    def _pause_accepting(self) -> None:
        if self.accepting:
            for sock in self.listeners:
                if sock.fileno() >= 0:
                    self.loop.remove_reader(sock.fileno())
        self.accepting = False

    def _resume_accepting(self) -> None:
        if self.accepting or self.closing:
            return
        self.accepting = True
        for sock in self.listeners:
            self.loop.add_reader(sock.fileno(), self._accept, sock)

    def readmit_soon(self) -> None:
        """(ServerSide) Once this turn of the loop is over, admit what was held back."""
        if not self._readmitting:
            self._readmitting = True
            self.loop.call_soon(self._readmit)

    def _readmit(self) -> None:
        self._readmitting = self.held_back = False
        for connection in list(self.connections):  # admit() sets held_back again for what still waits
            if connection.waiting and connection.session is not None:
                connection.admit()
                connection.write_later()

    def connection_made(self, connection: Connection) -> None:
        self.connections.add(connection)

    def connection_lost(self, connection: Connection) -> None:
        # Ends count as churn too: an attack's connections, all closed at its end, free their
        # sessions after the last trim of the burst (2,000 slow TLS clients left each worker
        # +33 MiB 30 s after, bench.peer_attacks --attack tls --clients 2000 --tls-cap 0).
        self.churn += 1
        self.connections.discard(connection)
        self._resume_accepting()
        self.stream_done(connection)

    def stream_done(self, connection: Connection | None) -> None:
        """A stream or a connection ended: the drain is over once no connection has a stream."""
        if self.closing and self._all_closed is not None and not any(c.streams for c in self.connections):
            self._all_closed.set()

    def _sweep(self) -> None:
        self._sweeper = self.loop.call_later(SWEEP_S, self._sweep)
        now = time.monotonic()
        for connection in list(self.connections):
            try:
                connection.sweep(now)
            except Exception:  # a bug here must cost one connection, never the deadlines of all
                log.exception("gRPC connection from %s: sweep failed", connection.peer)
                connection.close_now()
        self._resume_accepting()  # after a failed accept (out of descriptors)

    # -- handlers --------------------------------------------------------------------------
    def is_coroutine(self, fn: Callable[..., object]) -> bool:
        """Whether a method runs on the loop (a coroutine) or on the pool; remembered per method."""
        known = self._coroutines.get(fn)
        if known is None:
            if len(self._coroutines) > 4096:  # denying handlers are made per call: never grow without bound
                self._coroutines.clear()
            known = self._coroutines[fn] = asyncio.iscoroutinefunction(fn)
        return known

    def handler_of(self, method: str) -> grpc.RpcMethodHandler | None:
        """The handler of ``method`` without the interceptors: what kind of call a new stream
        is (streams.py); the call itself still goes through ``lookup``."""
        handler = self._cache.get(method)
        if handler is None:  # not cached here: an unknown name must not grow the cache
            details = CallDetails(method, ())
            handler = next((h for h in (g.service(details) for g in self.handlers) if h is not None), None)
        return handler

    async def _find(self, details: CallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._cache.get(details.method)
        if handler is None:
            handler = next((h for h in (g.service(details) for g in self.handlers) if h is not None), None)
            if handler is not None:
                self._cache[details.method] = handler
        return handler

    def _chain(self) -> Lookup:
        """The handler lookup behind the interceptors (the token check), outermost first."""
        continuation: Lookup = self._find
        for interceptor in reversed(self.interceptors):
            continuation = _intercepted(interceptor, continuation)
        return continuation


def _intercepted(interceptor: grpc.aio.ServerInterceptor, continuation: Lookup) -> Lookup:
    async def call(details: CallDetails) -> grpc.RpcMethodHandler | None:
        return await interceptor.intercept_service(continuation, details)
    return call
