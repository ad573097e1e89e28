"""Run one parsed request through a WSGI app on a worker thread (PEP 3333), and frame its
answer as HTTP/1.1. A list answer (every JSON reply) leaves in one write; any other
iterable (server-sent events) streams chunk by chunk, with the client's pace as the limit.

Headers with an underscore in their name are dropped (``X_Token`` would otherwise reach
the app as ``HTTP_X_TOKEN``, the same key as ``X-Token``), and so are the proxy headers
waitress cleared before (no proxy is trusted), as the app saw them until now.
"""

from __future__ import annotations

import io
import logging
import re
import sys
import time
from email.utils import formatdate
from typing import TYPE_CHECKING, Any, Callable, Iterable
from urllib.parse import unquote_to_bytes

from appliance.transport.http.connection import Connection, Request

if TYPE_CHECKING:
    from typing import Protocol
    from wsgiref.types import WSGIApplication, WSGIEnvironment

    class Listening(Protocol):
        """What ``environ_for`` reads of the server (server.py's HTTPServer, which imports this module)."""

        host: str
        port: int
        scheme: str

log = logging.getLogger("appliance.http")
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 field names
_BREAKS = re.compile(r"[\r\n\0]")


def check_head(status: str, headers: list[tuple[str, str]]) -> None:
    """ValueError for a status line or header an app built from a client's input and that would
    split the answer (CR, LF or NUL) or is not a header at all: never written to the wire."""
    if _BREAKS.search(status):
        raise ValueError(f"the status line {status!r} holds a line break")
    for name, value in headers:
        if not _TOKEN.fullmatch(name) or _BREAKS.search(value):
            raise ValueError(f"the response header {name!r}: {value!r} is not a valid header")

# A fast request's scheduling hints (appliance/core/request_context.py ENVIRON_KEY, spelled the
# same: this layer does not import the core), put by the server when its app asks (AppFacing).
CONTEXT_KEY = "appliance.request_context"
UNTRUSTED = frozenset({b"x-forwarded-for", b"x-forwarded-host", b"x-forwarded-proto", b"x-forwarded-port",
                       b"x-forwarded-by", b"forwarded"})
NO_BODY = (b"1", b"204", b"304")
_date: list[Any] = [0, b""]


def http_date() -> bytes:
    now = int(time.time())
    if _date[0] != now:
        _date[:] = [now, formatdate(now, usegmt=True).encode()]
    return bytes(_date[1])


def environ_for(request: Request, conn: Connection, server: Listening) -> WSGIEnvironment:
    url = request.url
    if url[:1] != b"/" and b"://" in url:  # absolute-form target: the path is what routes
        url = b"/" + url.split(b"://", 1)[1].partition(b"/")[2]
    path, _, query = url.partition(b"?")
    body = b"".join(request.body)
    # A Unix socket's peer has no address: "unix:" says so (shared memory trusts it as this host,
    # appliance/api/kserve/shared_memory.py), where "" would say nothing of who called.
    peer = conn.peer if isinstance(conn.peer, tuple) else ("unix:", 0)
    env: WSGIEnvironment = {
        "REQUEST_METHOD": request.method.decode("latin-1"), "SCRIPT_NAME": "",
        "PATH_INFO": unquote_to_bytes(path).decode("latin-1"), "QUERY_STRING": query.decode("latin-1"),
        "RAW_URI": url.decode("latin-1"), "REQUEST_URI": url.decode("latin-1"),
        "SERVER_NAME": server.host, "SERVER_PORT": str(server.port),
        "SERVER_PROTOCOL": f"HTTP/{request.version}", "REMOTE_ADDR": str(peer[0]), "REMOTE_PORT": str(peer[1]),
        "CONTENT_LENGTH": str(len(body)) if body or request.method in (b"POST", b"PUT", b"PATCH") else "",
        "wsgi.version": (1, 0), "wsgi.url_scheme": server.scheme, "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr, "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False,
        # whether the client went away: an answer that writes nothing until it is whole (a
        # non-streamed completion) stops its work then (appliance/api/sse.py client_gone)
        "appliance.client_gone": conn.client_gone,
    }
    for name, value in request.headers:
        low = name.lower()
        if b"_" in name or low in UNTRUSTED or low == b"content-length":
            continue
        key = "CONTENT_TYPE" if low == b"content-type" else "HTTP_" + low.decode("latin-1").upper().replace("-", "_")
        text = value.decode("latin-1")
        env[key] = f"{env[key]},{text}" if key in env else text
    env.pop("HTTP_TRANSFER_ENCODING", None)  # the body is whole and its length set above
    return env


class Responder:
    """start_response and the framing of one answer; ``run`` sends it through ``conn``."""

    def __init__(self, conn: Connection, request: Request):
        self.conn, self.request = conn, request
        self.close = not request.keep_alive
        self.status = b""
        self.headers: list[tuple[str, str]] = []
        self.sent = False

    def start_response(self, status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
        # Any: PEP 3333's exc_info, where wsgiref.types allows (None, None, None), which the line
        # below does not narrow away; typing it would need a check this server does not make.
        if exc_info and self.sent:
            raise exc_info[1].with_traceback(exc_info[2])
        check_head(status, headers)
        self.status, self.headers = status.encode("latin-1"), headers
        return self._legacy_write

    def _legacy_write(self, data: bytes) -> None:
        raise NotImplementedError("the write() callable of start_response is not supported")

    def head(self, length: int | None) -> tuple[bytes, bool]:
        """The status line and headers; whether the body goes chunked."""
        lines = [b"HTTP/1.1 ", self.status, b"\r\n"]
        has_length = False
        for name, value in self.headers:
            low = name.lower()
            if low == "connection":
                self.close = self.close or value.lower() == "close"
                continue
            if low == "transfer-encoding":
                continue
            has_length = has_length or low == "content-length"
            lines += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
        chunked = False
        if not has_length and not self.status.startswith(NO_BODY):
            if length is not None:
                lines += [b"Content-Length: ", str(length).encode(), b"\r\n"]
            elif self.request.version == "1.1":
                chunked = True
                lines.append(b"Transfer-Encoding: chunked\r\n")
            else:
                self.close = True  # HTTP/1.0 without a length: the close ends the body
        lines += [b"Date: ", http_date(), b"\r\n"]
        self.close = self.close or self.conn.server.draining  # read now: the drain may have begun meanwhile
        if self.close:
            lines.append(b"Connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines), chunked

    def run(self, app: WSGIApplication, environ: WSGIEnvironment) -> None:
        try:
            result = app(environ, self.start_response)
        except Exception:
            log.exception("the app failed on %s %s", environ["REQUEST_METHOD"], environ["PATH_INFO"])
            self.finish(self.conn.server.error_response(500, "internal error: see the service log", close=True), True)
            return
        try:
            if isinstance(result, (list, tuple)):
                body = b"".join(result)
                head, _ = self.head(len(body))
                self.finish(head + (b"" if self.request.method == b"HEAD" else body), self.close)
            else:
                self._stream(result)
        except Exception:
            log.exception("the answer to %s %s failed", environ["REQUEST_METHOD"], environ["PATH_INFO"])
            self.finish(b"" if self.sent else self.conn.server.error_response(500, "internal error: see the service log"),
                        True)
        finally:
            closer = getattr(result, "close", None)
            if closer is not None:
                closer()

    def _stream(self, result: Iterable[bytes]) -> None:
        head, chunked = b"", False
        for chunk in result:
            if not self.sent:
                head, chunked = self.head(None)
            if not chunk and self.sent:
                continue
            data = (b"%x\r\n%s\r\n" % (len(chunk), chunk)) if chunked and chunk else chunk
            if not self.conn.stream_write(head + data):
                return
            self.sent, head = True, b""
        if not self.sent:
            head, chunked = self.head(0)
        self.sent = True
        self.finish(head + (b"0\r\n\r\n" if chunked else b""), self.close)

    def finish(self, data: bytes, close: bool) -> None:
        self.sent = True
        self.conn.server.loop.call_soon_threadsafe(self.conn.worker_done, data, close)
