"""One HTTP/1.1 connection: an asyncio protocol on httptools' parser (llhttp, Node.js's
HTTP parser), with our limits applied as the bytes arrive. It knows nothing of models.

What a connection enforces, in the loop thread, before any worker is involved:

* the header block is at most ``limits.max_header_bytes`` (431), the body at most
  ``server.max_body_bytes``, refused from its Content-Length before it is read (413);
* an HTTP/1.1 request has exactly one Host header, an HTTP/1.0 one at most one (400:
  RFC 9112 §3.2); anything llhttp refuses (a Content-Length beside Transfer-Encoding,
  RFC 9112 §6.1, bad chunking, bad header bytes) is a 400 and the connection closes, so a
  smuggled second request is never read;
* every request body held anywhere counts against ``limits.max_buffered_bytes``; a body
  that would pass it gets 503 + Retry-After before it is read;
* while a worker serves a request the connection reads nothing (one request at a time,
  as waitress did; what a client pipelined in the same segment waits parsed).

So a connection holds at most ``max_header_bytes`` + ``max_body_bytes`` + one read of
request bytes, and an idle one little more than its socket. Deadlines are the server's
(appliance/transport/http/server.py sweeps every connection each second).

Thread-safety: every method runs in the loop thread except ``stream_write`` and
``worker_done``'s callers, which hop to the loop with ``call_soon_threadsafe``, and
``client_gone``, which only asks the socket.
"""

from __future__ import annotations

import asyncio
import collections
import select
import time
from typing import Any, Callable

import httptools

# poll events of a peer that closed or failed (Linux; elsewhere only a lost connection counts)
PEER_CLOSED = getattr(select, "POLLRDHUP", 0) and (select.POLLRDHUP | select.POLLHUP | select.POLLERR)
LINGER_S = 2.0  # after an error answer, how long what the client still sends is read and dropped
_PHRASES = {400: "Bad Request", 408: "Request Timeout", 413: "Payload Too Large",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}


class Reject(Exception):
    """Answer ``status`` with ``message`` (in the app's error body) and close, from the loop."""

    def __init__(self, status: int, message: str, counter: str, retry_after: bool = False, close: bool = True):
        super().__init__(message)
        self.status, self.message, self.counter = status, message, counter
        self.retry_after, self.close = retry_after, close


ErrorBody = Callable[[str], "tuple[str, bytes]"]  # message -> (Content-Type, body)


def plain_error(message: str) -> tuple[str, bytes]:
    """The error body of a server whose app says nothing of its own: the message as text."""
    return "text/plain; charset=utf-8", message.encode()


def error_response(status: int, message: str, close: bool = True, retry_after: bool = False,
                   body_of: ErrorBody = plain_error) -> bytes:
    """A whole error answer the server writes itself, its body in the app's format (``body_of``)."""
    kind, body = body_of(message)
    head = (f"HTTP/1.1 {status} {_PHRASES.get(status, 'Error')}\r\nContent-Type: {kind}\r\n"
            f"Content-Length: {len(body)}\r\n" + ("Retry-After: 1\r\n" if retry_after else "")
            + ("Connection: close\r\n" if close else "") + "\r\n")
    return head.encode() + body


class Request:
    """One parsed request, handed whole to a worker."""

    __slots__ = ("method", "url", "headers", "body", "size", "version", "keep_alive", "raw")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.method = b"GET"
        self.version = "1.1"
        self.keep_alive = True
        self.raw = 0  # chunk framing read (two CRLFs a chunk at least): the body limit counts it, as waitress did


class Connection(asyncio.Protocol):
    """A connection of ``server`` (the HTTPServer's shared state: limits, pool, stats)."""

    __slots__ = ("server", "transport", "parser", "request", "started", "headers_done", "head_bytes",
                 "busy", "pipeline", "last_active", "closing", "lingering_since", "lost", "paused", "peer",
                 "held", "deferred", "fd", "drained")

    def __init__(self, server: Any):  # Any: server.py's HTTPServer, which imports this module
        self.server = server
        self.transport: Any = None
        self.parser: Any = None  # made at the first byte: an idle connection holds none
        self.request: Request | None = None
        self.started: float | None = None  # first byte of the request being received
        self.headers_done = False
        self.head_bytes = 0
        self.busy = False  # a worker serves a request of this connection
        self.pipeline: collections.deque[Request] | None = None
        self.last_active = time.monotonic()
        self.closing = False
        self.lingering_since: float | None = None
        self.lost = False
        self.paused = False  # the transport's write buffer is over its high-water mark
        self.peer: Any = None
        self.held = 0  # request body bytes counted against limits.max_buffered_bytes
        self.deferred: Reject | None = None  # an error in pipelined bytes, answered after the worker's answer
        self.fd = -1  # the socket's descriptor, for client_gone
        self.drained: asyncio.Future[None] | None = None  # a loop writer waits on it while paused (``wait_drained``)

    # -- asyncio callbacks ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        self.fd = sock.fileno() if sock is not None else -1
        self.server.connection_made(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.paused = False
        self._wake_writer()
        self.release()
        self.server.connection_lost(self)

    def client_gone(self) -> bool:
        """(any thread) Whether the client went away while a worker serves its request. The
        connection reads nothing then (``dispatch``), so the loop would learn it only when the
        answer is written; the socket says it at once: Linux's POLLRDHUP (the peer closed or
        shut its side, nginx's "client closed request") or an error, asked without reading."""
        if self.lost:
            return True
        if self.fd < 0 or not PEER_CLOSED:
            return False
        poller = select.poll()
        poller.register(self.fd, PEER_CLOSED)
        return bool(poller.poll(0))

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._wake_writer()

    def _wake_writer(self) -> None:
        waiter, self.drained = self.drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_drained(self) -> None:
        """(loop) Until the client has read enough of what was written (or is gone): a writer on
        the loop bounds what is buffered by it, as ``stream_write`` does for a worker thread."""
        while self.paused and not self.lost:
            if self.drained is None:
                self.drained = asyncio.get_running_loop().create_future()
            await self.drained

    def loop_write(self, data: bytes) -> bool:
        """(loop) Send part of a streamed answer; False once the connection is gone."""
        if self.lost:
            return False
        self.transport.write(data)
        return True

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return  # lingering after an error answer: read and dropped
        now = time.monotonic()
        self.last_active = now
        if self.started is None:
            self.started = now
            self.head_bytes = 0
        if self.parser is None:
            self.parser = httptools.HttpRequestParser(self)
        if not self.headers_done:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, Reject):
                self.reject(exc.__context__)
                return
            raise
        except httptools.HttpParserUpgrade:
            self.reject(Reject(400, "bad request: protocol upgrades are not supported", "bad_request"))
            return
        except httptools.HttpParserError as exc:
            self.reject(Reject(400, f"bad request: {exc}", "bad_request"))
            return
        if not self.headers_done and self.started is not None and self.head_bytes > self.server.max_header_bytes:
            self.reject(self._headers_too_large())

    # -- httptools callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.request = Request()
        self.headers_done = False

    def on_url(self, url: bytes) -> None:
        assert self.request is not None
        self.request.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.request is not None
        self.request.headers.append((name, value))

    def on_headers_complete(self) -> None:
        request = self.request
        assert request is not None
        self.headers_done = True
        request.method = self.parser.get_method()
        request.version = self.parser.get_http_version()
        # the bytes read may hold body bytes already: count the header block itself
        if len(request.url) + sum(len(n) + len(v) + 4 for n, v in request.headers) > self.server.max_header_bytes:
            raise self._headers_too_large()
        self._check_host(request)
        length = self._content_length(request)
        self.server.admit(request, length)  # raises Reject: too large, over the memory bound, or shed
        if length and _expects_continue(request):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        request = self.request
        assert request is not None
        request.body.append(body)
        request.size += len(body)
        self.held += len(body)
        self.server.hold(self, len(body), request.size + request.raw)  # raises Reject past a bound

    def on_chunk_header(self) -> None:
        if self.request is not None:
            self.request.raw += 4

    def on_message_complete(self) -> None:
        request = self.request
        assert request is not None
        request.keep_alive = bool(self.parser.should_keep_alive())
        self.request, self.started, self.headers_done = None, None, False
        if self.busy:  # pipelined behind a request a worker serves: it waits, parsed
            if self.pipeline is None:
                self.pipeline = collections.deque()
            self.pipeline.append(request)
            return
        self.dispatch(request)

    # -- requests and answers ------------------------------------------------------------------
    def dispatch(self, request: Request) -> None:
        self.busy = True
        self.transport.pause_reading()
        self.server.dispatch(self, request)

    def worker_done(self, data: bytes, close: bool) -> None:
        """(loop) The worker's answer, or its last bytes: send, then the next request or close."""
        self.release()
        self.busy = False
        self.last_active = time.monotonic()
        if self.lost:
            return
        if data:
            self.transport.write(data)
        if self.deferred is not None:
            self.reject(self.deferred)
        elif close or self.server.draining:
            self.closing = True
            self.transport.close()  # after what is buffered is sent
        elif self.pipeline:
            self.dispatch(self.pipeline.popleft())
        else:
            self.transport.resume_reading()

    def stream_write(self, data: bytes) -> bool:
        """(worker thread) Send part of a streamed answer, waiting while the client reads slowly;
        False once the connection is gone (the worker stops producing)."""
        if self.lost:
            return False
        self.server.loop.call_soon_threadsafe(self._write, data)
        while self.paused and not self.lost:
            time.sleep(0.005)  # rare (a slow reader); waiting here bounds what is buffered
        return not self.lost

    def _write(self, data: bytes) -> None:
        if not self.lost:
            self.transport.write(data)

    def release(self) -> None:
        if self.held:
            self.server.unhold(self.held)
            self.held = 0

    def reject(self, why: Reject) -> None:
        """(loop) Answer an error now (after the answer a worker is writing, if one is); unless
        it keeps the connection, close it lingering."""
        if self.busy:
            self.deferred, self.closing = why, True
            return
        self.deferred = None
        self.server.count(why.counter)
        self.request, self.started, self.headers_done = None, None, False
        self.release()
        self.transport.write(self.server.error_response(why.status, why.message, why.close, why.retry_after))
        if why.close:
            self.close_lingering()

    def close_lingering(self) -> None:
        """Half-close and drop what still arrives for LINGER_S: closing a socket the client is
        still sending on makes the kernel reset it, and the reset can destroy the answer before
        the client reads it (what Apache and nginx do)."""
        self.closing = True
        self.busy = False
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.lingering_since = time.monotonic()
        else:  # TLS: no half-close; the answer is flushed before the close
            self.transport.close()

    def _headers_too_large(self) -> Reject:
        return Reject(431, f"request headers are over the limit of {self.server.max_header_bytes} bytes "
                           "(limits.max_header_bytes)", "bad_request")

    @staticmethod
    def _check_host(request: Request) -> None:
        hosts = sum(1 for name, _ in request.headers if name.lower() == b"host")
        if hosts > 1 or (hosts == 0 and request.version != "1.0"):
            raise Reject(400, "bad request: an HTTP/1.1 request must have exactly one Host header "
                              f"(RFC 9112 section 3.2); this one has {hosts}", "bad_host")

    @staticmethod
    def _content_length(request: Request) -> int:
        for name, value in request.headers:
            if name.lower() == b"content-length":
                return int(value)  # llhttp checked the digits and refused duplicates that differ
        return 0


def _expects_continue(request: Request) -> bool:
    return any(n.lower() == b"expect" and v.lower() == b"100-continue" for n, v in request.headers)
