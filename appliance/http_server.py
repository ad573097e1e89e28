"""The production HTTP server, in this process: waitress, plus a graceful drain.

In-process (not a pre-fork server) because batching needs every request in the process
that holds the batch queues. Waitress was chosen by measurement against granian's WSGI
mode (bench/RESULTS.md): granian runs the app in a worker process of its own, which
breaks the single-process lifecycle (signals, sd_notify, one batch queue) for a gain that
the JSON work of a real request mostly hides.

``HTTPServer.drain(timeout)``: stop accepting connections, let requests in flight finish
(bounded), then close every connection. Thread-safety: ``serve_forever`` in one thread,
``drain``/``close`` from any other.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable

import waitress
from waitress import wasyncore
from waitress.server import BaseWSGIServer

log = logging.getLogger("appliance.http")


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


class HTTPServer:
    def __init__(self, app: Callable[..., Any], host: str, port: int, threads: int,
                 max_body_bytes: int, ssl: Any = None):
        self.tracker = InFlight(app)
        self._server: BaseWSGIServer = waitress.create_server(
            self.tracker, host=host, port=port, threads=threads, ident="edge-appliance",
            max_request_body_size=max_body_bytes + 1, channel_timeout=120, connection_limit=1000,
            clear_untrusted_proxy_headers=True, asyncore_use_poll=True)
        self.port = int(self._server.effective_port)
        self.host = str(self._server.effective_host)
        self._closed = threading.Event()

    def serve_forever(self) -> None:
        try:
            self._server.run()
        finally:
            self._closed.set()

    def stop_accepting(self) -> None:
        server = self._server
        server.accepting = False

        def close_listener() -> None:
            try:
                server.del_channel()
                server.socket.close()
            except OSError:
                pass

        server.trigger.pull_trigger(close_listener)

    def drain(self, timeout: float) -> bool:
        """Stop accepting, wait for in-flight requests (at most ``timeout`` s), then close."""
        self.stop_accepting()
        clean = self.tracker.wait_idle(timeout)
        if not clean:
            log.warning("drain timeout: %d requests still in flight", self.tracker.count)
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
