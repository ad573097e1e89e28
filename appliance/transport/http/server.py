"""The production HTTP server, in this process: one event loop (uvloop when installed) with
httptools' parser per connection (appliance/transport/http/connection.py), a pool of worker
threads for the WSGI app, and our policy: limits, deadlines, shedding, drain.

In-process because batching needs every request in the process that holds the batch
queues. Chosen by measurement (bench/RESULTS.md, "REST server"): waitress on select()
stalled behind 200 slow clients and could not pass ~900 descriptors, and was patched
through its internals; granian's embedded server takes no WSGI app, no ``ssl.SSLContext``
and offers no hook for a first-byte deadline, a connection cap or a body refused before it
is read; uvicorn has no header deadline and its protocol classes would have to be
subclassed through their private state. So the parts are the libraries those servers are
built from (llhttp through httptools, uvloop's libuv loop and asyncio's TLS) and the policy
is ours, in plain sight.

``HTTPServer.drain(timeout)``, the graceful stop, in this order:

1. Every response from now on carries ``Connection: close``.
2. New connections are refused: a socket filter drops new SYNs (the client retries and
   then finds the port closed), what the kernel already queued is accepted and served,
   then the listener closes (closing it with connections queued would reset them).
3. Requests already received, queued or running finish and their responses are flushed;
   a keep-alive connection idle since the drain began gets ``IDLE_GRACE_S`` to send its
   next request before it is closed.
4. At ``timeout`` whatever is left is closed.

Slow or stuck clients (``[limits]``, swept every second in the loop thread): at most
``max_connections`` connections are open (bounded further by the descriptor limit, leaving
room for the gRPC port and files); at the cap the connection idle longest is closed to make
room, and with none idle new ones wait in the kernel's accept queue. A connection with no
request in progress is closed after ``idle_timeout_s``; once the first byte of a request
arrives its headers must be complete within ``header_timeout_s`` and the whole request
within ``request_timeout_s``: deadlines from the first byte, not timers reset by each byte.
A request cut at a deadline gets 408 with a JSON error and the connection closes. A slow
client costs a socket and its bytes, never a worker thread: a worker sees only whole
requests. A TLS handshake must finish within ``header_timeout_s`` of the accept.

Thread-safety: ``serve_forever`` in one thread (it owns the loop), ``drain``/``close``/
``stop_accepting`` from any other; connection state is touched only in the loop thread.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Protocol

from appliance.transport.http.connection import (LINGER_S, Connection, ErrorBody, Reject, Request, error_response,
                                                 plain_error)
from appliance.transport.http.queue_delay import SHORT_FRACTION, QueueDelay
from appliance.transport.http.sockets import connection_cap, listen, refuse_new_handshakes
from appliance.transport.http.workers import WorkerPool
from appliance.transport.loop_thread import new_event_loop
from appliance.transport.http.wsgi import CONTEXT_KEY, Responder, environ_for

if TYPE_CHECKING:
    from typing import TypeVar
    from wsgiref.types import WSGIApplication, WSGIEnvironment

    T = TypeVar("T")

log = logging.getLogger("appliance.http")


Answer = tuple[str, list[tuple[str, str]], bytes]  # status line, headers, body: a whole answer
Streamed = tuple[str, list[tuple[str, str]], AsyncIterator[bytes]]  # status line, headers, the chunks as they come
FastHandler = Callable[[dict[str, Any]], Awaitable["Answer | Streamed"]]


class FastRoutes(Protocol):
    """Requests answered on the event loop itself, by a coroutine: ``route(environ)`` names
    the coroutine for a request, or None (the WSGI app on a worker thread answers it). For
    an app whose work per request is mostly waiting on another process (a front worker,
    appliance/fronts/): no thread hand-off in and out of the loop per request. The
    coroutine must not block: what it computes it computes quickly, what it waits for it
    awaits. Its answer is whole, or streamed: an async iterator of chunks (server-sent
    events), written as they come at the client's pace and closed (``aclose``) when the
    client is gone, so what produces them stops; no thread is held while it streams."""

    def route(self, environ: WSGIEnvironment) -> FastHandler | None: ...


class Limits(Protocol):
    """What this server enforces; the service passes its ``[limits]`` section
    (appliance/core/config.py ``LimitsConfig``), which has these."""

    max_connections: int
    header_timeout_s: float
    request_timeout_s: float
    idle_timeout_s: float
    max_queue_wait_s: float
    max_header_bytes: int
    max_buffered_bytes: int


IDLE_GRACE_S = 1.0  # during a drain, how long an idle keep-alive connection may stay open
SWEEP_S = 1.0  # how often the deadlines are checked
# A new request joins the back of the queue and will wait about as long as its head has: once
# that is past this fraction of the wait allowed (limits.max_queue_wait_s, or a tenth of it while
# the queue stands: queue_delay.py), new requests are refused at the door (no worker, body not
# read); one that still waits past the whole limit is shed by the worker that picks it up.
DOOR_FRACTION = 0.5



@dataclass(frozen=True)
class AppFacing:
    """What the app tells the server of itself (the server knows no API): ``unshed``, the
    paths never shed under overload (probes: cheap, and they must tell the truth under load);
    ``error_body``, how the answers the server writes itself (408, 413, 503) say why, in the
    app's error format; ``context_of``, given a function telling whether a request is the
    only one in flight, the request context the server puts in each fast route's environ
    under ``CONTEXT_KEY`` (the batch queue may then run a quick model's lone call right there:
    appliance/core/request_context.py, appliance/core/batcher.py); None: nothing is put."""

    unshed: frozenset[bytes] = frozenset()
    error_body: ErrorBody = plain_error
    context_of: Callable[[Callable[[], bool]], object] | None = None


class InFlight:
    """Requests in the app now, and done; the 'HTTP is making progress' probe reads them."""

    def __init__(self) -> None:
        self.count = 0
        self.served = 0
        self.last_done = time.monotonic()
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            self.count += 1

    def leave(self) -> None:
        with self._lock:
            self.count -= 1
            self.served += 1
            self.last_done = time.monotonic()


def initial_stats(limits: Limits, tls: bool, max_connections: int) -> dict[str, int | float | str | bool]:
    """The figures a server shows under ``/api/status`` ``http``, before it has served anything."""
    return {
        "server": "httptools+" + _loop_name(), "tls": tls,
        "max_connections": max_connections, "header_timeout_s": limits.header_timeout_s,
        "request_timeout_s": limits.request_timeout_s, "idle_timeout_s": limits.idle_timeout_s,
        "max_queue_wait_s": limits.max_queue_wait_s, "max_header_bytes": limits.max_header_bytes,
        "max_buffered_bytes": limits.max_buffered_bytes, "connections": 0, "buffered_bytes": 0,
        "cut_header_timeout": 0, "cut_request_timeout": 0, "cut_idle": 0, "cut_tls_handshake_timeout": 0,
        "tls_handshake_failed": 0, "shed_overload": 0, "shed_memory": 0, "too_large": 0, "bad_request": 0,
        "bad_host": 0, "evicted_idle": 0, "queued": 0, "peak_queued": 0, "queue_standing": False}


class HTTPServer:
    """A WSGI app served on ``host:port`` with ``threads`` workers, ``limits`` enforced, and
    TLS when ``ssl_context`` is given (made by the caller before binding, so a bad
    certificate fails start-up with its config key: appliance/core/tls.py). The
    constructor binds the port (or takes ``sock``, a listening socket it may share with
    other processes serving the same port) and starts nothing."""

    def __init__(self, app: WSGIApplication, host: str, port: int, threads: int,
                 max_body_bytes: int, limits: Limits, ssl_context: ssl.SSLContext | None = None,
                 sock: socket.socket | None = None, fast: FastRoutes | None = None,
                 on_loop: Callable[[asyncio.AbstractEventLoop], None] | None = None,
                 facing: AppFacing = AppFacing()):
        """``fast``: requests answered on the loop (``FastRoutes``); ``on_loop(loop)``: called in
        ``serve_forever`` once the loop exists, before the first connection; ``facing``: what
        the app says of itself (``AppFacing``)."""
        self.app, self.limits, self.ssl_context = app, limits, ssl_context
        self.fast, self.on_loop, self.facing = fast, on_loop, facing
        # every fast request's context (immutable: whether it is alone is asked at the batch queue)
        self.request_context = None if facing.context_of is None else facing.context_of(self._alone)
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = limits.max_header_bytes
        self.max_connections = connection_cap(limits.max_connections)
        self.scheme = "https" if ssl_context else "http"
        self.tracker = InFlight()
        self.streaming: set[asyncio.Task[None]] = set()  # streamed fast answers being written (loop)
        self.pool = WorkerPool(threads)
        self.queue_delay = QueueDelay(limits.max_queue_wait_s) if limits.max_queue_wait_s else None
        self.sock = sock or listen(host, port)
        self.sock.setblocking(False)
        if self.sock.family == socket.AF_UNIX:  # a Unix socket (appliance/service/rest_socket.py): its path
            self.host, self.port = "localhost", 0
        else:
            self.host, self.port = self.sock.getsockname()[:2]
        self.conns: dict[Connection, None] = {}  # insertion order: oldest first
        self.opening = 0  # accepted, TLS handshake under way
        self.buffered = 0  # request body bytes held, all connections together
        self.draining = False
        self.accepting = False
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # made by serve_forever
        self._closed = threading.Event()
        self._started = threading.Event()
        self.stats: dict[str, Any] = initial_stats(limits, ssl_context is not None, self.max_connections)

    def _alone(self) -> bool:
        """Whether the asking request is the only one in the app (fast routes and WSGI)."""
        return self.tracker.count <= 1

    # -- lifecycle -----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Run the loop in this thread until ``close``."""
        self.loop = new_event_loop()
        self.loop.set_exception_handler(_quiet_handler)
        if self.on_loop is not None:
            self.on_loop(self.loop)
        self.pool.start()
        self.accepting = True
        self.loop.add_reader(self.sock.fileno(), self._accept)
        self.loop.call_later(SWEEP_S, self._sweep)
        self._started.set()
        try:
            self.loop.run_forever()
        finally:
            for conn in list(self.conns):
                conn.transport.abort()
            self.loop.run_until_complete(asyncio.sleep(0))  # let the aborts run connection_lost
            self.loop.close()
            self.pool.stop(5)
            self._closed.set()

    def _in_loop(self, fn: Callable[[], T], wait: float = 5.0) -> T | None:
        """Run ``fn`` in the loop thread; its result, or None if the loop is gone."""
        if not self._started.wait(wait) or self.loop.is_closed():
            return None
        result: list[T] = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append(fn())
            finally:
                done.set()

        try:
            self.loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop closed meanwhile
            return None
        return result[0] if done.wait(wait) and result else None

    def stop_accepting(self) -> None:
        """Refuse new connections; serve the ones the kernel already accepted. Idempotent."""
        self.draining = True
        if refuse_new_handshakes(self.sock):
            time.sleep(0.05)  # handshakes already under way complete into the accept queue
        self._in_loop(self._close_listener)

    def _close_listener(self) -> None:
        if self.sock.fileno() < 0:
            return
        self.accepting = True
        self._accept(ignore_cap=True)  # what the kernel queued
        self.accepting = False
        self.loop.remove_reader(self.sock.fileno())
        self.sock.close()

    def drain(self, timeout: float) -> bool:
        """The graceful stop (module docstring); True when every connection ended in time."""
        deadline = time.monotonic() + timeout
        since = time.monotonic()
        self.stop_accepting()
        open_conns: int | None = None
        while time.monotonic() < deadline:
            open_conns = self._in_loop(lambda: self._close_idle(since))
            if open_conns == 0:
                break
            time.sleep(0.05)
        clean = open_conns == 0
        if not clean:
            log.warning("drain timeout after %g s: closing %s connections (%d requests in the app)",
                        timeout, "?" if open_conns is None else open_conns, self.tracker.count)
        self.close()
        return clean

    def _close_idle(self, since: float) -> int:
        now = time.monotonic()
        for conn in list(self.conns):
            if _idle(conn) and now - max(conn.last_active, since) >= IDLE_GRACE_S:
                conn.closing = True
                conn.transport.close()
        return len(self.conns) + self.opening

    def close(self) -> None:
        """Close every connection and the listener; ``serve_forever`` then returns. Idempotent."""
        if self._closed.is_set():
            return
        if not self._started.is_set():  # never served: nothing runs, only the socket to close
            self.sock.close()
            self._closed.set()
            return
        self._in_loop(self._close_listener)
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:
            pass
        self._closed.wait(10)

    # -- accepting -----------------------------------------------------------------------------
    def _accept(self, ignore_cap: bool = False) -> None:
        while self.accepting:
            if not ignore_cap and len(self.conns) + self.opening >= self.max_connections:
                if not select.select([self.sock], [], [], 0)[0]:
                    return  # nobody is waiting: evict no one (the reader wakes us when someone is)
                if not self._evict_idle():
                    self.loop.remove_reader(self.sock.fileno())  # the kernel queues the rest meanwhile
                    self.accepting = False
                    return
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: wait for the sweep, never spin
                log.warning("accept failed: %s", exc)
                self._pause_accepting()
                return
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.opening += 1
            task = self.loop.create_task(self.loop.connect_accepted_socket(
                partial(Connection, self), sock, ssl=self.ssl_context,
                ssl_handshake_timeout=self.limits.header_timeout_s if self.ssl_context else None))
            task.add_done_callback(partial(self._opened, sock))

    def _pause_accepting(self) -> None:
        if self.accepting and self.sock.fileno() >= 0:
            self.loop.remove_reader(self.sock.fileno())
        self.accepting = False

    def _resume_accepting(self) -> None:
        if not self.accepting and not self.draining and self.sock.fileno() >= 0:
            self.accepting = True
            self.loop.add_reader(self.sock.fileno(), self._accept)

    def _opened(self, sock: socket.socket, task: asyncio.Task[object]) -> None:
        exc = task.exception() if not task.cancelled() else None
        if exc is not None or task.cancelled():  # never made: connection_made did not count it over
            self.opening -= 1
        if exc is not None:  # the TLS handshake failed or timed out
            self.count("cut_tls_handshake_timeout" if isinstance(exc, (TimeoutError, asyncio.TimeoutError))
                       else "tls_handshake_failed")
            log.debug("TLS handshake failed: %s", exc)
            sock.close()
            self._resume_accepting()

    def _evict_idle(self) -> bool:
        """At the cap: close the connection idle longest (no request in progress); False if none."""
        oldest = min((c for c in self.conns if _idle(c) and not c.closing), key=lambda c: c.last_active, default=None)
        if oldest is None:
            return False
        self.count("evicted_idle")
        oldest.closing = True
        oldest.transport.close()
        del self.conns[oldest]  # its slot is free now; connection_lost follows
        return True

    def connection_made(self, conn: Connection) -> None:
        # from opening to open in one step: a connection is never counted twice (the cap, the
        # status figure), and the accepting task's callback, which runs later, leaves it alone
        self.opening -= 1
        self.conns[conn] = None

    def connection_lost(self, conn: Connection) -> None:
        self.conns.pop(conn, None)
        self._resume_accepting()

    # -- admission (loop thread) ---------------------------------------------------------------
    def error_response(self, status: int, message: str, close: bool = True, retry_after: bool = False) -> bytes:
        """An error answer the server writes itself, in the app's error body (``AppFacing``)."""
        return error_response(status, message, close, retry_after, self.facing.error_body)

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    def admit(self, request: Request, length: int) -> None:
        """Headers are in: refuse now, before the body is read, what would be refused later."""
        if length > self.max_body_bytes:
            raise Reject(413, f"request body is over the limit of {self.max_body_bytes} bytes (server.max_body_bytes)",
                         "too_large")
        if self.buffered + length > self.limits.max_buffered_bytes:
            raise self._memory_full()
        error = self._door_error(request)
        if error is not None:
            raise Reject(503, error, "shed_overload", retry_after=True)

    def hold(self, conn: Connection, n: int, size: int) -> None:
        self.buffered += n
        if size > self.max_body_bytes:
            raise Reject(413, f"request body is over the limit of {self.max_body_bytes} bytes (server.max_body_bytes)",
                         "too_large")
        if self.buffered > self.limits.max_buffered_bytes:
            raise self._memory_full()

    def unhold(self, n: int) -> None:
        self.buffered -= n

    def _memory_full(self) -> Reject:
        return Reject(503, f"overloaded: request bodies held reach limits.max_buffered_bytes = "
                           f"{self.limits.max_buffered_bytes}; retry later", "shed_memory", retry_after=True)

    def _door_error(self, request: Request) -> str | None:
        delay = self.queue_delay
        if delay is None or request.url.partition(b"?")[0] in self.facing.unshed:
            return None
        waited, allowed = self.pool.oldest_wait(), delay.allowed(time.monotonic())
        return None if waited <= allowed * DOOR_FRACTION else _overload_error(waited, delay, allowed)

    def dispatch(self, conn: Connection, request: Request) -> None:
        """(loop) A whole request: to a worker, or, while overloaded, 503 + Retry-After here (the
        connection stays open for the client's retry)."""
        error = self._door_error(request)
        if error is not None:
            self.count("shed_overload")
            conn.worker_done(self.error_response(503, error, close=False, retry_after=True), not request.keep_alive)
            return
        if self.fast is not None:
            environ = environ_for(request, conn, self)
            handler = self.fast.route(environ)
            if handler is not None:
                if self.request_context is not None:
                    environ[CONTEXT_KEY] = self.request_context
                self.tracker.enter()
                task = asyncio.ensure_future(handler(environ), loop=self.loop)  # (an Awaitable: create_task takes coroutines)
                task.add_done_callback(partial(self._fast_done, conn, request))
                return
        self.pool.submit(partial(self._serve, conn, request))

    def _fast_done(self, conn: Connection, request: Request, task: "asyncio.Task[Answer | Streamed]") -> None:
        """(loop) A fast route's answer, framed as a WSGI app's would be."""
        if task.cancelled():  # its client went away while it waited: nothing to write
            self.tracker.leave()
            conn.worker_done(b"", True)
            return
        responder = Responder(conn, request)
        try:
            status, headers, body = task.result()
            responder.start_response(status, headers)
        except Exception:
            self.tracker.leave()
            log.exception("the fast route failed on %s %s", request.method.decode("latin-1"),
                          request.url.decode("latin-1"))
            conn.worker_done(self.error_response(500, "internal error: see the service log", close=True), True)
            return
        if not isinstance(body, bytes):  # counted in flight until its last chunk
            writer = self.loop.create_task(self._fast_stream(conn, request, responder, body))
            self.streaming.add(writer)  # held: the loop keeps only a weak reference to a task
            writer.add_done_callback(self.streaming.discard)
            return
        self.tracker.leave()
        head, _ = responder.head(len(body))
        conn.worker_done(head + (b"" if request.method == b"HEAD" else body), responder.close)

    async def _fast_stream(self, conn: Connection, request: Request, responder: Responder,
                           chunks: AsyncIterator[bytes]) -> None:
        """(loop) A streamed fast answer, chunk by chunk (``FastRoutes``)."""
        head, chunked = responder.head(None)
        ended = False
        try:
            async for chunk in chunks:
                if not chunk:
                    continue
                if not conn.loop_write(head + (b"%x\r\n%s\r\n" % (len(chunk), chunk) if chunked else chunk)):
                    return  # the client is gone: closing the chunks stops what makes them
                head = b""
                if conn.paused:
                    await conn.wait_drained()
            ended = True
        except Exception:
            log.exception("the streamed answer to %s %s failed", request.method.decode("latin-1"),
                          request.url.decode("latin-1"))
        finally:
            closer = getattr(chunks, "aclose", None)
            if not ended and closer is not None:
                await closer()
            self.tracker.leave()
            conn.worker_done(head + (b"0\r\n\r\n" if chunked else b"") if ended else b"", responder.close or not ended)

    # -- a worker thread -----------------------------------------------------------------------
    def _serve(self, conn: Connection, request: Request, queued_at: float) -> None:
        responder = Responder(conn, request)
        delay = self.queue_delay
        if delay is not None and request.url.partition(b"?")[0] not in self.facing.unshed:
            now = time.monotonic()
            waited = now - queued_at
            delay.observe(waited, now)
            allowed = delay.allowed(now)
            if waited > allowed:  # 503 without running the app: the worker is free again at once
                self.count("shed_overload")
                close = responder.close or self.draining
                responder.finish(self.error_response(503, _overload_error(waited, delay, allowed), close=close,
                                                     retry_after=True), close)
                return
        if conn.lost:
            responder.finish(b"", True)
            return
        self.tracker.enter()
        try:
            responder.run(self.app, environ_for(request, conn, self))
        finally:
            self.tracker.leave()

    # -- deadlines (loop thread, every SWEEP_S) -----------------------------------------------
    def _sweep(self) -> None:
        now = time.monotonic()
        try:
            for conn in list(self.conns):
                self._check(conn, now)
            queued = self.pool.queued()
            delay = self.queue_delay
            self.stats.update(connections=len(self.conns) + self.opening, buffered_bytes=self.buffered,
                              queued=queued, peak_queued=max(queued, self.stats["peak_queued"]),
                              queue_standing=bool(delay is not None and delay.allowed(now) < delay.limit))
            self._resume_accepting()  # after a failed accept (descriptors), try again
        finally:
            if not self.loop.is_closed():
                self.loop.call_later(SWEEP_S, self._sweep)

    def _check(self, conn: Connection, now: float) -> None:
        limits = self.limits
        if conn.lingering_since is not None:
            if now - conn.lingering_since >= LINGER_S:
                conn.transport.abort()
            return
        if conn.closing or conn.busy:
            return
        started = conn.started
        if started is None:
            if now - conn.last_active >= limits.idle_timeout_s:
                self.count("cut_idle")
                conn.closing = True
                conn.transport.close()
            return
        limit = limits.request_timeout_s if conn.headers_done else limits.header_timeout_s
        if now - started >= limit:
            what = "request body" if conn.headers_done else "request headers"
            key = "request" if conn.headers_done else "header"
            log.info("closing the connection from %s: %s not complete after %g s", conn.peer, what, limit)
            conn.reject(Reject(408, f"request timeout: the {what} did not arrive within {limit:g} s "
                                    f"(limits.{key}_timeout_s)", f"cut_{key}_timeout"))


def _idle(conn: Connection) -> bool:
    """No request read, queued, running or partly received."""
    return not conn.busy and conn.started is None and not conn.pipeline


def _overload_error(waited: float, delay: QueueDelay, allowed: float) -> str:
    if allowed < delay.limit:  # the short wait of a standing queue applied
        why = (f"the queue has been standing, so a request may wait {delay.short:g} s "
               f"({SHORT_FRACTION:g} x limits.max_queue_wait_s = {delay.limit:g})")
    else:
        why = f"over limits.max_queue_wait_s = {delay.limit:g}"
    return f"overloaded: requests wait {waited:.1f} s for a worker, {why}; retry later"


def _loop_name() -> str:
    # whether uvloop is installed, without importing it (a worker that does not use it keeps its pages)
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def _quiet_handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Client misbehaviour (a reset, a failed TLS handshake) is counted, not logged as an error."""
    exc = context.get("exception")
    if isinstance(exc, (ConnectionError, ssl.SSLError, TimeoutError, asyncio.TimeoutError)):
        log.debug("connection error: %s", context.get("message"))
        return
    loop.default_exception_handler(context)
