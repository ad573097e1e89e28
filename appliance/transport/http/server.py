"""The production HTTP server, in this process: waitress, plus a graceful drain.

In-process (not a pre-fork server) because batching needs every request in the process
that holds the batch queues. Waitress was chosen by measurement against granian's WSGI
mode (bench/RESULTS.md): granian runs the app in a worker process of its own, which
breaks the single-process lifecycle (signals, sd_notify, one batch queue) for a gain that
the JSON work of a real request mostly hides.

``HTTPServer.drain(timeout)``, the graceful stop, in this order:

1. Every response from now on carries ``Connection: close``, so no client reuses a
   connection for a request that could be cut.
2. New connections are refused: a socket filter drops new SYNs (the client retries and
   then finds the port closed: connection refused), what the kernel already queued is
   accepted and served, then the listener closes. Closing a listener with connections
   still queued would reset them, and those clients had already sent their requests.
3. Requests already received, queued or running finish, their responses are flushed,
   and each connection closes once idle. A keep-alive connection idle since the drain
   began gets ``IDLE_GRACE_S`` to send its next request before it is closed.
4. At ``timeout`` whatever is left is closed.

Slow or stuck clients (``[limits]``, checked every second by the loop thread): at most
``max_connections`` connections are open (more wait in the kernel's accept queue); a
connection with no request in progress is closed after ``idle_timeout_s``; once the first
byte of a request arrives, its headers must be complete within ``header_timeout_s`` and the
whole request, body included, within ``request_timeout_s``. These are deadlines from the
first byte, not timers reset by every byte (waitress's ``channel_timeout`` is one of those,
and a client sending a byte every few seconds keeps it alive forever). A request cut at a
deadline gets ``408`` with a JSON error and the connection closes. A worker thread is never
involved: waitress hands a request to a worker only once it is complete, so slow clients
cost a socket and a buffer each, never a thread.

TLS (``[security] tls_cert_file``/``tls_key_file``): each accepted socket is wrapped with
``ssl`` inside waitress's own event loop (non-blocking handshake, then TLS records in and
out of the same channel), so TLS connections keep every property above: the same drain,
limits, deadlines (the handshake must finish within ``header_timeout_s``) and worker pool.
Chosen over the alternatives because those would fork the serving path: a second WSGI
server only when TLS is on (cheroot, gunicorn) has its own timeouts, drain and threading
model to verify twice; a TLS-terminating proxy thread per connection doubles sockets and
adds a thread per slow client, the very thing the limits above prevent.

Thread-safety: ``serve_forever`` in one thread, ``drain``/``close`` from any other; all
channel state is touched only in the server's loop thread (through its trigger). A TLS
connection reads only while no worker writes to it (waitress does not read a connection
whose request is being served), so one ``SSLSocket`` is never used by two threads at once.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import socket
import ssl
import struct
import sys
import threading
import time
from typing import Any, Callable, Iterable, Protocol

import waitress
from waitress import wasyncore
from waitress.channel import HTTPChannel
from waitress.parser import HTTPRequestParser
from waitress.server import BaseWSGIServer
from waitress.task import ErrorTask, WSGITask

from appliance.transport.http import loop_io
from appliance.transport.http.queue_delay import SHORT_FRACTION, QueueDelay

log = logging.getLogger("appliance.http")


class Limits(Protocol):
    """What this server enforces per connection and request; the service passes its
    ``[limits]`` section (appliance/core/config.py ``LimitsConfig``), which has these."""

    max_connections: int
    header_timeout_s: float
    request_timeout_s: float
    idle_timeout_s: float
    max_queue_wait_s: float

IDLE_GRACE_S = 1.0  # during a drain, how long an idle keep-alive connection may stay open
RECV_BYTES = 256 * 1024
# A new request joins the back of the queue and will wait about as long as its head has:
# once that is past this fraction of the wait allowed (limits.max_queue_wait_s, or a tenth
# of it while the queue stands: appliance/transport/http/queue_delay.py), new requests are refused at
# the door (fast, no worker), so the ones admitted stay within the limit; a request that
# still waits past the whole limit is shed by the worker that picks it up.
DOOR_FRACTION = 0.5
LINGER_S = 2.0  # after a 408, how long what the client still sends is read and dropped
UNSHED_PATHS = frozenset({"/healthz", "/readyz"})  # probes are cheap and must tell the truth under load
SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
# Classic BPF on the listening socket, run on TCP headers: drop a segment whose flags are
# SYN without ACK (a new handshake), accept everything else (handshakes under way).
_DROP_SYN = [(0x30, 0, 0, 13),          # ldb [13]          TCP flags
             (0x54, 0, 0, 0x12),        # and #(SYN|ACK)
             (0x15, 0, 1, 0x02),        # jeq #SYN, drop, keep
             (0x06, 0, 0, 0),           # drop: ret #0
             (0x06, 0, 0, 0xFFFFFFFF)]  # keep: ret #-1


class InFlight:
    """WSGI middleware counting requests in flight; also the 'HTTP is making progress' probe."""

    def __init__(self, app: Callable[..., Any]):
        self.app = app
        self.count = 0
        self.served = 0
        self.last_done = time.monotonic()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        with self._lock:
            self.count += 1
        try:
            return self.app(environ, start_response)
        finally:
            with self._lock:
                self.count -= 1
                self.served += 1
                self.last_done = time.monotonic()
                if self.count == 0:
                    self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            while self.count > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True


class _StampedParser(HTTPRequestParser):
    """Notes when the request was complete: from then on it waits for a worker thread."""

    completed_at: float | None = None

    def received(self, data: bytes) -> int:
        n = super().received(data)  # type: ignore[no-untyped-call]
        if self.completed and self.completed_at is None:
            self.completed_at = time.monotonic()
        return int(n)


class _DrainingTask(WSGITask):
    """A request task that closes its connection after the response once draining, and
    that sheds its request when it waited too long for a worker (overload)."""

    def execute(self) -> None:
        delay = getattr(self.channel.server, "queue_delay", None)
        done = getattr(self.request, "completed_at", None)
        if delay is not None and done is not None and self.request.path not in UNSHED_PATHS:
            now = time.monotonic()
            waited = now - done
            delay.observe(waited, now)
            allowed = delay.allowed(now)
            if waited > allowed:
                self._shed(waited, delay, allowed)
                return
        super().execute()

    def _shed(self, waited: float, delay: QueueDelay, allowed: float) -> None:
        """503 + Retry-After without running the app: the worker is free again in microseconds,
        so the queue drains at once and the requests it does serve keep a bounded wait."""
        self.channel.server.guard.count("shed_overload")
        body = _overload_error(waited, delay, allowed)
        self.status = "503 Service Unavailable"
        self.response_headers.extend([("Content-Type", "application/json"), ("Retry-After", "1")])
        self.content_length = len(body)
        self.complete = True  # what start_response would have set
        self.write(body)

    def build_response_header(self) -> bytes:
        if getattr(self.channel.server, "draining", False) and not self.close_on_finish:
            self.set_close_on_finish()
        return super().build_response_header()  # type: ignore[no-any-return, unused-ignore]


class _JSONErrorTask(ErrorTask):
    """Waitress's own refusals (body over the limit, malformed request) as TF Serving's
    ``{"error": ...}`` JSON, like every other error of the API."""

    def execute(self) -> None:
        e = self.request.error
        if e.code == 413:
            limit = self.channel.server.adj.max_request_body_size - 1  # HTTPServer adds 1
            message = f"request body is over the limit of {limit} bytes (server.max_body_bytes)"
        else:
            message = f"{e.reason}: {e.body}"
        body = json.dumps({"error": message}).encode()
        self.status = f"{e.code} {e.reason}"
        self.response_headers.append(("Content-Type", "application/json"))
        self.set_close_on_finish()
        self.content_length = len(body)
        self.write(body)


class _DrainingChannel(HTTPChannel):
    """A connection that closes after its response once draining and that knows when the
    request it is receiving began (``request_started``, monotonic; None between requests)."""

    task_class = _DrainingTask
    error_task_class = _JSONErrorTask
    parser_class = _StampedParser
    request_started: float | None = None

    # -- socket calls that keep the GIL (appliance/transport/http/loop_io.py): plain TCP only ---------------
    def recv(self, buffer_size: int) -> bytes:
        if not loop_io.AVAILABLE or self._fileno is None:
            return bytes(super().recv(buffer_size))
        try:
            data = loop_io.recv(self._fileno, buffer_size)
        except OSError as why:
            if why.args[0] in wasyncore._DISCONNECTED:
                self.handle_close()
                return b""
            raise
        if not data:  # the peer closed
            self.handle_close()
        return data

    def send(self, data: Any, do_close: bool = True) -> int:
        if not loop_io.AVAILABLE or self._fileno is None:
            return int(super().send(data, do_close))
        try:
            return loop_io.send(self._fileno, data)
        except OSError as why:
            if why.args[0] in wasyncore._DISCONNECTED:
                if do_close:
                    self.handle_close()
                return 0
            raise

    def received(self, data: bytes) -> bool:
        partial = self.request
        result = super().received(data)  # type: ignore[no-untyped-call]
        request = self.request
        if request is None:
            self.request_started = None
        elif request is not partial or self.request_started is None:  # a new request began
            self.request_started = time.monotonic()
        if request is not None and request.headers_finished and not self.requests \
                and not getattr(request, "admitted", False):
            request.admitted = True  # decided once, when its headers are in
            self.server.guard.shed_at_the_door(self, request)
        return bool(result)

    # -- lingering close after a 408 ---------------------------------------------------------
    # Closing a socket whose client is still sending makes the kernel answer with a reset,
    # and a reset can destroy the 408 before the client reads it. So, as Apache and nginx
    # do: half-close (the 408 and FIN go out), discard what still arrives for LINGER_S at
    # most, then close.
    linger_pending = False
    lingering_since: float | None = None

    def readable(self) -> bool:
        return True if self.lingering_since is not None else bool(super().readable())

    def writable(self) -> bool:
        return False if self.lingering_since is not None else bool(super().writable())

    def handle_read(self) -> None:
        if self.lingering_since is not None:
            self._discard()
        else:
            super().handle_read()

    def handle_close(self) -> None:
        if self.linger_pending and self.connected:
            self.linger_pending = False
            try:
                self.socket.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            else:
                self.lingering_since = time.monotonic()
                self.will_close = self.close_when_flushed = False
                return
        self.lingering_since = None
        super().handle_close()

    def _discard(self) -> None:
        plain = loop_io.AVAILABLE and not isinstance(self.socket, ssl.SSLSocket) and self._fileno is not None
        try:
            data = loop_io.recv(self._fileno, 65536) if plain else self.socket.recv(65536)
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            data = b""
        if not data:
            self.handle_close()


class _TLSChannel(_DrainingChannel):
    """A connection speaking TLS inside waitress's non-blocking loop (module docstring).

    ``handshaking`` until the TLS handshake completes (it counts against the header
    deadline from accept); then reads drain the TLS buffer (``pending()``) since select()
    cannot see bytes that OpenSSL already decrypted."""

    def __init__(self, server: Any, sock: socket.socket, addr: Any, adj: Any, map: Any = None):
        sock.setblocking(False)
        tls = server.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        super().__init__(server, tls, addr, adj, map)
        self.handshaking = True
        self.want_write = False
        self.request_started = time.monotonic()

    def readable(self) -> bool:
        return True if self.handshaking else bool(super().readable())

    def writable(self) -> bool:
        if self.handshaking:
            return self.want_write or self.will_close
        return bool(super().writable())

    def _handshake(self) -> bool:
        try:
            self.socket.do_handshake()
        except ssl.SSLWantReadError:
            self.want_write = False
            return False
        except ssl.SSLWantWriteError:
            self.want_write = True
            return False
        except OSError as exc:  # not TLS, a bad client certificate, a reset: drop the connection
            log.debug("TLS handshake with %s failed: %s", self.addr, exc)
            self.server.guard.count("tls_handshake_failed")
            self.handle_close()
            return False
        self.handshaking = self.want_write = False
        self.request_started = None
        self.last_activity = time.time()
        return True

    def handle_read(self) -> None:
        if self.lingering_since is not None:
            self._discard()
            return
        if self.handshaking and not self._handshake():
            return
        while self.connected and not self.will_close:
            try:
                data = self.socket.recv(self.adj.recv_bytes)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError:
                self.handle_close()
                return
            if not data:  # close_notify or EOF
                self.handle_close()
                return
            self.last_activity = time.time()
            self.received(data)
            # A request now in a worker's hands: stop; maintenance reads what TLS still holds.
            if self.requests or not self.socket.pending():
                return

    def handle_write(self) -> None:
        if self.handshaking:
            if self.will_close:
                self.handle_close()
            else:
                self._handshake()
            return
        super().handle_write()

    def recv(self, buffer_size: int) -> bytes:
        return bytes(wasyncore.dispatcher.recv(self, buffer_size))  # through OpenSSL, not libc

    def send(self, data: Any, do_close: bool = True) -> int:
        try:
            return int(wasyncore.dispatcher.send(self, data, do_close))
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            return 0  # retried with the same bytes when the socket is writable again


def _overload_error(waited: float, delay: QueueDelay, allowed: float) -> bytes:
    if allowed < delay.limit:  # the short wait of a standing queue applied
        why = (f"the queue has been standing, so a request may wait {delay.short:g} s "
               f"({SHORT_FRACTION:g} x limits.max_queue_wait_s = {delay.limit:g})")
    else:
        why = f"over limits.max_queue_wait_s = {delay.limit:g}"
    return json.dumps({"error": f"overloaded: requests wait {waited:.1f} s for a worker, {why}; "
                                "retry later"}).encode()


def _timeout_response(what: str, limit: float) -> bytes:
    body = json.dumps({"error": f"request timeout: the {what} did not arrive within {limit:g} s "
                                f"(limits.{'header' if what == 'request headers' else 'request'}_timeout_s)"}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode()
    return head + body


class _Guard:
    """The deadlines of the module docstring, run by the server's maintenance each second
    (loop thread), and the figures shown in /api/status under ``http``."""

    def __init__(self, server: Any, limits: Limits, tls: bool):
        self.server = server
        self.limits = limits
        self.stats: dict[str, Any] = {"tls": tls, "max_connections": limits.max_connections,
                                      "header_timeout_s": limits.header_timeout_s,
                                      "request_timeout_s": limits.request_timeout_s,
                                      "idle_timeout_s": limits.idle_timeout_s, "connections": 0,
                                      "cut_header_timeout": 0, "cut_request_timeout": 0,
                                      "cut_tls_handshake_timeout": 0, "tls_handshake_failed": 0,
                                      "max_queue_wait_s": limits.max_queue_wait_s, "shed_overload": 0}

    def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    def maintenance(self, now: float) -> None:
        BaseWSGIServer.maintenance(self.server, now)  # waitress's idle timeout (channel_timeout)
        mono = time.monotonic()
        channels = list(self.server.active_channels.values())
        self.stats["connections"] = len(channels)
        queued = len(self.server.task_dispatcher.queue)  # complete requests waiting for a worker
        self.stats["queued"] = queued
        self.stats["peak_queued"] = max(queued, self.stats.get("peak_queued", 0))
        delay = self.server.queue_delay
        self.stats["queue_standing"] = bool(delay is not None and delay.allowed(mono) < delay.limit)
        for channel in channels:
            self._check(channel, mono)

    def _check(self, channel: Any, mono: float) -> None:
        lingering = getattr(channel, "lingering_since", None)
        if lingering is not None and mono - lingering >= LINGER_S:
            channel.handle_close()
            return
        if channel.will_close or channel.close_when_flushed or lingering is not None:
            return
        if isinstance(channel, _TLSChannel) and not channel.handshaking and not channel.requests \
                and channel.socket.pending():
            channel.handle_read()  # bytes TLS decrypted while a worker held the connection
        started = channel.request_started
        if started is None:
            return
        if channel.requests:  # a worker serves an earlier request: the clock runs once it is done
            channel.request_started = mono
            return
        if getattr(channel, "handshaking", False):
            if mono - started >= self.limits.header_timeout_s:
                self.count("cut_tls_handshake_timeout")
                channel.will_close = True
            return
        headers_done = channel.request is not None and channel.request.headers_finished
        limit = self.limits.request_timeout_s if headers_done else self.limits.header_timeout_s
        if mono - started >= limit:
            self._cut(channel, "request body" if headers_done else "request headers", limit)

    def queue_wait(self) -> float:
        """How long the oldest request waiting for a worker has waited (loop thread)."""
        try:
            return time.monotonic() - float(self.server.task_dispatcher.queue[0].requests[0].completed_at)
        except (IndexError, AttributeError, TypeError):  # empty, or popped meanwhile
            return 0.0

    def shed_at_the_door(self, channel: Any, request: Any) -> None:
        """Overloaded (the oldest queued request already waited past ``max_queue_wait_s``):
        answer a new request 503 + Retry-After from the loop thread as soon as its headers
        are in, without reading its body or taking a worker; the connection then closes."""
        body = self._door_error(request)
        if body is not None:
            self._answer(channel, b"503 Service Unavailable", body, b"Retry-After: 1\r\n")

    def _door_error(self, request: Any) -> bytes | None:
        """The 503 body when a new request is to be refused at the door (counted), else None."""
        delay = self.server.queue_delay
        if delay is None or request.path in UNSHED_PATHS:
            return None
        waited, allowed = self.queue_wait(), delay.allowed(time.monotonic())
        if waited <= allowed * DOOR_FRACTION:
            return None
        self.count("shed_overload")
        return _overload_error(waited, delay, allowed)

    def add_task(self, channel: Any) -> None:
        """(loop thread, the channel's requests_lock held) Queue a complete request for a
        worker, or, while overloaded, answer it 503 + Retry-After here at once: it costs no
        worker, and the connection stays open for the client's retry."""
        request = channel.requests[0] if len(channel.requests) == 1 else None
        body = self._door_error(request) if request is not None and not request.error else None
        if body is not None:
            channel.requests.pop()
            head = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Retry-After: 1\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
            with channel.outbuf_lock:
                channel.outbufs[-1].append(head + body)
                channel.total_outbufs_len += len(head) + len(body)
            return
        self.server.task_dispatcher.add_task(channel)

    def _cut(self, channel: Any, what: str, limit: float) -> None:
        self.count("cut_request_timeout" if what == "request body" else "cut_header_timeout")
        log.info("closing the connection from %s: %s not complete after %g s", channel.addr, what, limit)
        response = _timeout_response(what, limit)
        self._send_and_close(channel, response)

    def _answer(self, channel: Any, status: bytes, body: bytes, extra: bytes = b"") -> None:
        head = (b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\n" + extra + b"Connection: close\r\n\r\n")
        self._send_and_close(channel, head + body)

    @staticmethod
    def _send_and_close(channel: Any, response: bytes) -> None:
        """(loop thread) Drop the request being received, send ``response``, close lingering."""
        with channel.requests_lock:
            channel.request = None
            channel.request_started = None
            channel.close_when_flushed = True  # nothing more is parsed; closed once the answer is sent
            channel.linger_pending = True
        with channel.outbuf_lock:
            channel.outbufs[-1].append(response)
            channel.total_outbufs_len += len(response)


def _idle(channel: Any) -> bool:
    """No request read, queued, running or partly received, and no output left to send."""
    return not (channel.requests or channel.request is not None or channel.total_outbufs_len
                or channel.close_when_flushed)


def refuse_new_handshakes(sock: socket.socket) -> bool:
    """Drop new SYNs arriving at listener ``sock`` (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    code = b"".join(struct.pack("HBBI", *insn) for insn in _DROP_SYN)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = struct.pack("HL", len(_DROP_SYN), ctypes.addressof(buf))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, prog)
        return True
    except OSError as exc:
        log.info("cannot filter new connections during the drain (%s); closing the listener directly", exc)
        return False


class HTTPServer:
    """A WSGI app served on ``host:port`` with ``threads`` workers, ``limits`` enforced, and
    TLS when ``ssl_context`` is given (made by the caller, before binding, so a bad
    certificate fails start-up with its config key: appliance/service/tls.py)."""

    def __init__(self, app: Callable[..., Any], host: str, port: int, threads: int,
                 max_body_bytes: int, limits: Limits, ssl_context: ssl.SSLContext | None = None):
        context = ssl_context
        self.tracker = InFlight(app)
        self._server: BaseWSGIServer = waitress.create_server(
            self.tracker, host=host, port=port, threads=threads, ident="edge-appliance",
            max_request_body_size=max_body_bytes + 1, channel_timeout=max(1, math.ceil(limits.idle_timeout_s)),
            cleanup_interval=1,  # the deadlines are checked every second
            # One recv() per request body where waitress reads 8 KiB: under load the loop thread
            # waits for the GIL after every recv, so bigger reads are what keeps it receiving
            # (and shedding) while the workers parse JSON (bench/overload_bench.py).
            recv_bytes=RECV_BYTES,
            # select(), not poll(): measured here, waitress's poll loop collapses at 2-8 concurrent
            # clients (MLP c=4: 181 req/s with poll, 593 with select; c=32 the same). select()
            # handles fds below 1024 only, hence the connection limit (at most 900) under that.
            connection_limit=limits.max_connections + 2,  # + the listener and waitress's trigger
            clear_untrusted_proxy_headers=True, asyncore_use_poll=False,
            url_scheme="https" if context else "http")
        self._server.channel_class = _TLSChannel if context else _DrainingChannel
        self._server.ssl_context = context
        self._server.draining = False  # read by _DrainingTask
        # read by _DrainingTask and the door; None: never shed (limits.max_queue_wait_s = 0)
        self._server.queue_delay = QueueDelay(limits.max_queue_wait_s) if limits.max_queue_wait_s else None
        self.guard = self._server.guard = _Guard(self._server, limits, context is not None)
        self._server.maintenance = self.guard.maintenance  # type: ignore[method-assign]
        self._server.add_task = self.guard.add_task  # type: ignore[method-assign]
        self.port = int(self._server.effective_port)
        self.host = str(self._server.effective_host)
        self._closed = threading.Event()

    def serve_forever(self) -> None:
        server = self._server
        try:
            # waitress's run(), with the loop of appliance/transport/http/loop_io.py (no GIL convoy)
            loop_io.loop(server.adj.asyncore_loop_timeout, server._map)
        except (SystemExit, KeyboardInterrupt):
            server.task_dispatcher.shutdown()
        finally:
            self._closed.set()

    def _in_loop(self, fn: Callable[[], Any], wait: float = 5.0) -> Any:
        """Run ``fn`` in the server's loop thread; its result, or None if the loop is gone."""
        result: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                result.append(fn())
            finally:
                done.set()

        try:
            self._server.trigger.pull_trigger(run)
        except OSError:  # trigger closed: the loop has ended
            return None
        return result[0] if done.wait(wait) and result else None

    def stop_accepting(self) -> None:
        """Refuse new connections; serve the ones the kernel already accepted. Idempotent."""
        server = self._server
        server.draining = True
        if not server.accepting:
            return
        if refuse_new_handshakes(server.socket):
            time.sleep(0.05)  # handshakes already under way complete into the accept queue

        def accept_queued_then_close() -> None:
            while server.accepting:
                before = len(server._map)
                server.handle_accept()
                if len(server._map) == before:  # EAGAIN: the queue is empty
                    break
            server.accepting = False
            try:
                server.del_channel()
                server.socket.close()
            except OSError:
                pass

        self._in_loop(accept_queued_then_close)

    def _close_idle(self, since: float) -> int:
        """(loop thread) Close connections idle for IDLE_GRACE_S; return how many are open."""
        now = time.time()
        channels = list(self._server.active_channels.values())
        for channel in channels:
            if _idle(channel) and now - max(channel.last_activity, since) >= IDLE_GRACE_S:
                channel.will_close = True  # the loop closes it on its next pass
        return len(channels)

    def drain(self, timeout: float) -> bool:
        """The graceful stop (module docstring); True when every connection ended in time."""
        deadline = time.monotonic() + timeout
        since = time.time()
        self.stop_accepting()
        open_channels: int | None = None
        while time.monotonic() < deadline:
            open_channels = self._in_loop(lambda: self._close_idle(since))
            if open_channels == 0:
                break
            time.sleep(0.05)
        clean = open_channels == 0
        if not clean:
            log.warning("drain timeout after %g s: closing %s connections (%d requests in the app)",
                        timeout, "?" if open_channels is None else open_channels, self.tracker.count)
        self.close()
        return clean

    def close(self) -> None:
        """Close every connection and the listener; ``serve_forever`` then returns."""
        server = self._server
        if self._closed.is_set():
            return
        try:
            server.trigger.pull_trigger(lambda: wasyncore.close_all(server._map))
        except OSError:  # trigger already closed: the loop is gone
            pass
        self._closed.wait(5)
        server.task_dispatcher.shutdown(timeout=5)
