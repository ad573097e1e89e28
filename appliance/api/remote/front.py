"""The front worker's app: inference answered here, everything else forwarded whole.

``FrontApp`` serves a front worker's port. TF Serving's predict/classify/regress and KServe
v2's infer (``hot_mounts``: the requests whose JSON is the work) are decoded and encoded
here by the API families' own code on a ``RemoteCore`` (appliance/api/remote/handles.py),
after the same token check the serving process makes. On the event loop (``route``, the
HTTP server's fast path: no thread hand-off per request) when the family can answer
asynchronously, else as WSGI on a worker thread. A request they refuse the token, and every
other request (status, the page, admin, metrics, health, token streams), goes whole to the
serving process (``Forwarder``, a WSGI call there), which answers and counts it as it would
alone.

``NeedView`` and ``StaleView`` (handles.py) are caught here (``attempts``): the answer is
learnt (RESOLVE, or the STALE reply) and the request decoded again.
"""

from __future__ import annotations

import queue
from typing import Any, Awaitable, Callable, Iterable, Iterator

from appliance.api.auth import authorize
from appliance.api.body import GzipBodies
from appliance.api.errors import render_error, status_line
from appliance.api.remote import messages as m
from appliance.api.remote.handles import RemoteCore, attempts, attempts_async
from appliance.api.remote.link import Link
from appliance.api.routes import Mount, normal, raw_path
from appliance.core.errors import Unavailable

Answer = tuple[str, list[tuple[str, str]], bytes]


class Forwarder:
    """WSGI app: the request answered by the serving process's app, whole or streamed."""

    def __init__(self, link: Link):
        self.link = link

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = environ["wsgi.input"].read()
        ident, replies = self.link.open(m.WSGI, [m.plain_environ(environ), body])
        kind, payload = replies.get()
        if kind == m.ANSWER:
            status, headers, data = payload
            start_response(status, [tuple(h) for h in headers])
            return [data]
        if kind == m.START:
            status, headers = payload
            start_response(status, [tuple(h) for h in headers])
            return _Stream(self.link, ident, replies)
        return _error(m.error_from_plain(payload), start_response)


def _error(exc: Exception, start_response: Callable[..., Any]) -> list[bytes]:
    status, headers, body = render_error(exc, "the front worker")
    start_response(status_line(status), headers)
    return [body]


class _Stream:
    """A streamed answer's chunks as they arrive; closing it early cancels the stream there."""

    def __init__(self, link: Link, ident: int, replies: queue.SimpleQueue[tuple[str, Any]]):
        self.link, self.ident, self.replies = link, ident, replies
        self.ended = False

    def __iter__(self) -> Iterator[bytes]:
        while True:
            kind, payload = self.replies.get()
            if kind == m.CHUNK:
                yield payload
                continue
            self.ended = True
            if kind == m.FAIL:  # the serving process went away mid-stream: cut the answer
                raise ConnectionAbortedError(m.error_from_plain(payload).message)
            return

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self.link.close_stream(self.ident)


class FrontApp:
    """The front worker's app (module docstring): a WSGI app, and the HTTP server's
    ``FastRoutes`` for the hot paths whose family answers asynchronously."""

    def __init__(self, core: RemoteCore, hot: list[Mount]):
        self.core = core
        self.hot = [(mount, GzipBodies(mount.handler, core)) for mount in hot]  # type: ignore[arg-type]
        self.forward = Forwarder(core.link)

    # -- WSGI (worker threads) ------------------------------------------------------------------
    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        handler = self._hot(environ)
        if handler is None:
            return self.forward(environ, start_response)
        try:
            return attempts(self.core.link, lambda: handler(environ, start_response),
                            lambda: environ["wsgi.input"].seek(0))
        except Unavailable as exc:
            return _error(exc, start_response)

    def _hot(self, environ: dict[str, Any]) -> Callable[..., Any] | None:
        """The hot handler of a request whose token passes; None: forward it."""
        method = environ.get("REQUEST_METHOD", "GET")
        raw = raw_path(environ).partition("?")[0]
        for mount, handler in self.hot:
            if mount.matches(method, raw) and normal(raw):
                if _names_a_region(mount, environ):
                    return None
                allowed = authorize(self.core, mount.scope, environ.get("HTTP_AUTHORIZATION"))  # type: ignore[arg-type]
                return handler if allowed.allowed else None
        return None

    # -- the event loop ------------------------------------------------------------------------
    def route(self, environ: dict[str, Any]) -> Callable[[dict[str, Any]], Awaitable[Answer]] | None:
        """(the HTTP server's ``FastRoutes``) The coroutine for a hot request that needs no
        gzip inflating and whose family answers asynchronously; None: the WSGI path."""
        if environ.get("HTTP_CONTENT_ENCODING"):
            return None
        method = environ.get("REQUEST_METHOD", "GET")
        raw = raw_path(environ).partition("?")[0]
        for mount, _ in self.hot:
            if mount.matches(method, raw) and normal(raw):
                answer = getattr(mount.handler, "answer_async", None)
                if answer is None:
                    return None
                if _names_a_region(mount, environ):  # to the serving process, awaited here on the loop
                    return self._forward_async
                if not authorize(self.core, mount.scope, environ.get("HTTP_AUTHORIZATION")).allowed:  # type: ignore[arg-type]
                    return None  # the serving process refuses it, with its headers and counters
                return lambda env: self._answer_async(answer, env)
        return None

    async def _forward_async(self, environ: dict[str, Any]) -> Answer:
        """A request the serving process answers whole (its own token check included), awaited on
        this loop: no thread of this worker waits for it. Only for answers that are one message
        (not a stream): a v2 infer is."""
        body = environ["wsgi.input"].read()
        kind, payload = await self.core.link.acall(m.WSGI, [m.plain_environ(environ), body])
        if kind == m.ANSWER:
            status, headers, data = payload
            return status, [tuple(h) for h in headers], data
        status_code, headers, data = render_error(m.error_from_plain(payload), "the front worker")
        return status_line(status_code), headers, data

    async def _answer_async(self, answer: Callable[[dict[str, Any]], Awaitable[Answer]],
                            environ: dict[str, Any]) -> Answer:
        try:
            return await attempts_async(self.core.link, lambda: answer(environ),
                                        lambda: environ["wsgi.input"].seek(0))
        except Unavailable as exc:
            status, headers, body = render_error(exc, "the front worker")
            return status_line(status), headers, body


def _names_a_region(mount: Mount, environ: dict[str, Any]) -> bool:
    """A v2 infer request that uses shared memory: answered by the serving process, which holds
    the regions (appliance/api/kserve/shared_memory.py; its body carries no tensor to decode)."""
    if mount.name != "kserve-infer":
        return False
    from appliance.api.kserve.shared_memory import uses_shared_memory

    with environ["wsgi.input"].getbuffer() as body:
        return uses_shared_memory(body)


def hot_mounts(core: RemoteCore) -> list[Mount]:
    """What a front worker answers itself: TF Serving's predict/classify/regress and KServe
    v2's infer (the requests whose JSON is the work). Metadata, model status, health and
    everything else is forwarded: cheap to answer there, and always answered by the process
    that holds the versions."""
    from appliance.api.kserve.rest import V2API
    from appliance.api.routes import INFERENCE
    from appliance.api.tfserving.rest import POST_RE, V1API

    return [Mount("tfserving-infer", "/v1/", INFERENCE, V1API(core), methods=frozenset({"POST"}),  # type: ignore[arg-type]
                  pattern=POST_RE),
            Mount("kserve-infer", "/v2/models/", INFERENCE, V2API(core), methods=frozenset({"POST"}),  # type: ignore[arg-type]
                  suffix="/infer")]
