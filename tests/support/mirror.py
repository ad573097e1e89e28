"""A plain-HTTP loopback server over a bucket folder, for the tests whose point is how the
device copes with a bucket that misbehaves mid-download (slow, stalled, endless, gated).

``Mirror.serve(handler)`` is each test's behaviour; ``found`` reads the key a GET names (404
for a missing key or one that climbs out of the folder) and ``head`` writes the status and
headers for a Range from a byte offset, as S3 and static HTTP servers answer them.
"""

from __future__ import annotations

import http.server
import threading
from pathlib import Path
from typing import Any, Self


class Mirror:
    def __init__(self, root: Path, name: str = "mirror"):
        self.root = root
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                try:
                    outer.serve(self)
                except (BrokenPipeError, ConnectionResetError):  # the device gave up on this download
                    pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name=name, daemon=True)

    def serve(self, h: Any) -> None:
        raise NotImplementedError

    def found(self, h: Any) -> tuple[str, bytes, int] | None:
        """(key, the file's bytes, the Range's first byte or 0), or None after answering 404."""
        key = h.path.split("?")[0].lstrip("/")
        path = self.root / key
        if ".." in key.split("/") or not path.is_file():
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return None
        rng = str(h.headers.get("Range", ""))
        start = int(rng[6:-1]) if rng.startswith("bytes=") and rng[6:-1].isdigit() else 0
        return key, path.read_bytes(), start

    @staticmethod
    def head(h: Any, data: bytes, start: int, length: int | None = None) -> None:
        """200, or 206 with its Content-Range from ``start``; Content-Length ``length`` (the
        rest of ``data`` unless said)."""
        h.send_response(206 if start else 200)
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.send_header("Content-Length", str(len(data) - start if length is None else length))
        h.end_headers()

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
