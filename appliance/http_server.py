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

Thread-safety: ``serve_forever`` in one thread, ``drain``/``close`` from any other; all
channel state is touched only in the server's loop thread (through its trigger).
"""

from __future__ import annotations

import ctypes
import json
import logging
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Iterable

import waitress
from waitress import wasyncore
from waitress.channel import HTTPChannel
from waitress.server import BaseWSGIServer
from waitress.task import ErrorTask, WSGITask

log = logging.getLogger("appliance.http")

IDLE_GRACE_S = 1.0  # during a drain, how long an idle keep-alive connection may stay open
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


class _DrainingTask(WSGITask):
    """A request task that closes its connection after the response once draining."""

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
    task_class = _DrainingTask
    error_task_class = _JSONErrorTask


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
    def __init__(self, app: Callable[..., Any], host: str, port: int, threads: int,
                 max_body_bytes: int, ssl: Any = None):
        self.tracker = InFlight(app)
        self._server: BaseWSGIServer = waitress.create_server(
            self.tracker, host=host, port=port, threads=threads, ident="edge-appliance",
            max_request_body_size=max_body_bytes + 1, channel_timeout=120,
            # select(), not poll(): measured here, waitress's poll loop collapses at 2-8 concurrent
            # clients (MLP c=4: 181 req/s with poll, 593 with select; c=32 the same). select()
            # handles fds below 1024 only, hence the connection limit well under that.
            connection_limit=900, clear_untrusted_proxy_headers=True, asyncore_use_poll=False)
        self._server.channel_class = _DrainingChannel
        self._server.draining = False  # read by _DrainingTask
        self.port = int(self._server.effective_port)
        self.host = str(self._server.effective_host)
        self._closed = threading.Event()

    def serve_forever(self) -> None:
        try:
            self._server.run()
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
