"""The fleet page: a read-only web view of every device report, served on the operator's machine.

``FleetPage(view)`` serves, on its own port (``appliance fleet --serve``; the bucket's
credentials stay on the machine that runs it, the browser never sees them):

    GET /                   the page (fleet.html, fleet.js, fleet.css: no CDN, no build step)
    GET /api/fleet          the snapshot: counts, rollouts, one row per device (gzip when asked)
    GET /api/devices/<id>   one device: its row and its last report, as written

Anything but GET and HEAD is 405: the page changes nothing. ``view`` is the seam to the data
(``FleetView``: two callables), so this package imports nothing of the rest of the product.
The script builds the DOM with ``textContent`` only and the CSP allows no inline script and
no other origin, so a crafted hostname or reason in a report is shown, never run.

Thread-safety: requests are served on threads (``ThreadingHTTPServer``); ``view``'s callables
must be safe to call from any thread. ``start``/``close`` from one thread.
"""

from __future__ import annotations

import gzip
import http.server
import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import unquote, urlparse

__all__ = ["FleetPage", "FleetView"]

STATIC = os.path.join(os.path.dirname(__file__), "static")
ASSETS = {"/": ("fleet.html", "text/html; charset=utf-8"), "/fleet.js": ("fleet.js", "text/javascript; charset=utf-8"),
          "/fleet.css": ("fleet.css", "text/css; charset=utf-8")}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")


@dataclass
class FleetView:
    """The data behind the page: ``fleet()`` the snapshot as JSON bytes (already encoded, so
    10,000 rows are encoded once per refresh, not per request); ``device(id)`` one device's
    JSON bytes, or None when there is no such device."""

    fleet: Callable[[], bytes]
    device: Callable[[str], bytes | None]


class FleetPage:
    def __init__(self, view: FleetView, host: str = "127.0.0.1", port: int = 0):
        self.view = view
        self._server = http.server.ThreadingHTTPServer((host, port), _handler(view))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        if isinstance(host, bytes):  # typeshed allows an AF_UNIX path; this server is TCP
            host = host.decode()
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"

    def start(self) -> "FleetPage":
        self._thread = threading.Thread(target=self._server.serve_forever, name="fleet-page", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)


def _handler(view: FleetView) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "edge-appliance-fleet"

        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            path = urlparse(self.path).path
            if path in ASSETS:
                name, kind = ASSETS[path]
                with open(os.path.join(STATIC, name), "rb") as f:
                    self._send(200, f.read(), kind)
            elif path == "/api/fleet":
                self._send(200, view.fleet(), "application/json")
            elif path.startswith("/api/devices/"):
                body = view.device(unquote(path[len("/api/devices/"):]))
                self._send(200, body, "application/json") if body is not None else \
                    self._error(404, "no report of that device in the bucket")
            else:
                self._error(404, "not found")

        def do_HEAD(self) -> None:
            self.do_GET()

        def _refuse(self) -> None:
            self._error(405, "the fleet page is read-only")

        do_POST = do_PUT = do_DELETE = do_PATCH = _refuse

        def _error(self, status: int, message: str) -> None:
            self._send(status, json.dumps({"error": message}).encode(), "application/json")

        def _send(self, status: int, body: bytes, kind: str) -> None:
            if "gzip" in self.headers.get("Accept-Encoding", "") and len(body) > 1024:
                body = gzip.compress(body, 5)
                encoding = "gzip"
            else:
                encoding = ""
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            if encoding:
                self.send_header("Content-Encoding", encoding)
            self.send_header("Content-Security-Policy", CSP)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

    return Handler
