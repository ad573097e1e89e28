"""Many small GETs to one endpoint over keep-alive connections, one per thread (the standard
library's ``http.client``): how the fleet listing reads thousands of reports. Measured against
urllib3's pool for the same signed GETs (bench/RESULTS.md): less CPU per request, which is
what bounds a 10,000-report view on a small machine.

``KeepAlive(url).get(url, headers)`` -> (status, body of at most ``limit`` + 1 bytes). A
connection the server closed between requests is opened again once; any other failure is
the caller's (``OSError``, ``http.client.HTTPException``). TLS is verified against
``AWS_CA_BUNDLE`` when set, else the CA bundle botocore itself uses. Thread-safety: ``get``
from any thread (each thread has its own connection); ``close`` once, after the last ``get``.
"""

from __future__ import annotations

import http.client
import os
import ssl
import threading
from urllib.parse import urlsplit

RETRYABLE = (http.client.RemoteDisconnected, http.client.BadStatusLine, ConnectionResetError, BrokenPipeError)


class KeepAlive:
    def __init__(self, base_url: str, timeout: float, limit: int):
        parts = urlsplit(base_url)
        self.scheme, self.host, self.port = parts.scheme, parts.hostname or "", parts.port
        self.timeout, self.limit = timeout, limit
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._context = _tls_context() if self.scheme == "https" else None

    def _connection(self, fresh: bool = False) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and not fresh:
            return conn
        if conn is not None:
            conn.close()
        if self._context is not None:
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout, context=self._context)
        else:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        self._local.conn = conn
        with self._lock:
            self._all.append(conn)
        return conn

    def get(self, url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        parts = urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            return self._exchange(self._connection(), target, headers)
        except RETRYABLE:  # the server closed the idle connection: once more on a new one
            return self._exchange(self._connection(fresh=True), target, headers)

    def _exchange(self, conn: http.client.HTTPConnection, target: str, headers: dict[str, str]) -> tuple[int, bytes]:
        try:
            conn.request("GET", target, headers=headers)
            response = conn.getresponse()
            body = response.read(self.limit + 1)
        except BaseException:
            conn.close()
            raise
        if response.will_close or not response.isclosed():  # over the limit, or the server said so
            conn.close()  # never reuse a connection with a body left unread
            self._local.conn = None
        return response.status, body

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


def _tls_context() -> ssl.SSLContext:
    cafile = os.environ.get("AWS_CA_BUNDLE")
    if not cafile:
        try:
            from botocore.httpsession import where

            cafile = where()
        except ImportError:  # no botocore bundle: the system's store
            cafile = None
    return ssl.create_default_context(cafile=cafile)
