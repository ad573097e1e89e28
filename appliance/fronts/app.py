"""The front path: what every REST request meets first, in the serving process and in a worker.

``FrontApp`` is the HTTP server's app in both modes (appliance/transport/http/server.py: its
``FastRoutes`` and its WSGI app). TF Serving's predict/classify/regress and KServe v2's infer
(``hot_mounts``: the requests whose JSON is the work) are answered on the server's event loop
by the API families' own coroutines (appliance/api/family.py) over the core's seams
(appliance/core/seams.py): the ``Appliance`` itself in one process, a ``RemoteCore`` in a front
worker (appliance/fronts/remote.py). No thread hand-off, no Flask, no second copy of any API.

Matching and the token check are the serving app's own (appliance/api/mounts.py ``Mounts``,
appliance/api/auth.py ``authorize``). Token streams (``:generate``, OpenAI's completions) are
answered on the loop too: by their families in the serving process, and in a worker forwarded
to it, awaited and streamed on the worker's loop (``ForwardedStreams``): no thread per stream
on either side. A request they refuse, and every other request (status,
the page, admin, metrics, health) goes to ``fallback``, a WSGI app: the
serving process's Flask app in one process, or in a worker ``Forwarder`` (the same app, in
the serving process), which answers and counts it exactly as it would alone.
"""

from __future__ import annotations

import asyncio
import io
import queue

import orjson
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Protocol

from appliance.version import __version__
from appliance.api.auth import TokenHolder, authorize
from appliance.api.body import content_encoding, inflate, read_raw
from appliance.api.errors import error_body, render_error, status_line
from appliance.api.families import token_mounts
from appliance.api.family import Answer, AsyncFamily, Streamed
from appliance.api.mounts import PROBE_PATHS, Mount, Mounts, normal, raw_path
from appliance.api.sse import client_gone
from appliance.core.errors import ApplianceError
from appliance.core.request_context import RequestContext
from appliance.core.seams import ServingCore
from appliance.fronts import messages as m
from appliance.fronts.link import Link
from appliance.transport.http.server import AppFacing

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

    from appliance.core.appliance import Appliance
    from appliance.core.shared_memory import SharedMemory

WSGIApp = Callable[..., Iterable[bytes]]
GONE_POLL_S = 0.25  # how often a forwarded whole answer looks whether its client is still there


class FrontCore(ServingCore, TokenHolder, Protocol):
    """What the front path reads of its core: the seams, and what the token check reads."""


class Forwarder:
    """WSGI app: the request answered by the serving process's app, whole or streamed."""

    def __init__(self, link: Link):
        self.link = link

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        body = environ["wsgi.input"].read()
        ident = self.link.next_id()
        replies = self.link.open(m.Forward(ident, m.plain_environ(environ), body))
        reply = _first_reply(replies, client_gone(environ))
        if reply is None:  # the client went away: the serving process is told to stop (Cancel)
            self.link.close_stream(ident)
            start_response("499 Client Closed Request", [])  # nginx's code; no one reads it
            return []
        if isinstance(reply, m.Answer):
            start_response(reply.status, reply.headers)
            return [reply.body]
        if isinstance(reply, m.Start):
            start_response(reply.status, reply.headers)
            return _Stream(self.link, ident, replies)
        status_code, error_headers, error_body = render_error(m.unexpected(reply), "the front worker")
        start_response(status_line(status_code), error_headers)
        return [error_body]


def _first_reply(replies: "queue.SimpleQueue[m.Reply]", gone: Callable[[], bool]) -> m.Reply | None:
    """The serving process's first reply; None once the client is gone first (an answer that
    writes nothing until it is whole, a non-streamed completion, would run on for no one)."""
    while True:
        try:
            return replies.get(timeout=GONE_POLL_S)
        except queue.Empty:
            if gone():
                return None


class _Stream:
    """A streamed answer's chunks as they arrive; closing it early cancels the stream there."""

    def __init__(self, link: Link, ident: int, replies: queue.SimpleQueue[m.Reply]):
        self.link, self.ident, self.replies = link, ident, replies
        self.ended = False

    def __iter__(self) -> Iterator[bytes]:
        while True:
            reply = self.replies.get()
            if isinstance(reply, m.Chunk):
                yield reply.data
                continue
            self.ended = True
            if not isinstance(reply, m.End):  # the serving process went away mid-stream: cut the answer
                raise ConnectionAbortedError(m.unexpected(reply).message)
            return

    def close(self) -> None:
        if not self.ended:
            self.ended = True
            self.link.close_stream(self.ident)


class ForwardedStreams(AsyncFamily):
    """(a front worker) A token-stream request (``:generate``, OpenAI's completions) answered by
    the serving process, awaited on the worker's loop: whole, or chunk by chunk as the serving
    process sends them (``Start``, ``Chunk``..., ``End``). No thread waits for it. A client gone
    cancels it there (``Cancel``): a stream when its chunks are closed early (the HTTP server
    does it), a whole answer when the socket says so (looked at every ``GONE_POLL_S``)."""

    def __init__(self, link: Link):
        self.link = link

    async def answer(self, environ: WSGIEnvironment) -> Answer | Streamed:
        body = environ["wsgi.input"].read()
        ident = self.link.next_id()
        replies = self.link.open_here(m.Forward(ident, m.plain_environ(environ), body))
        reply = await _first(replies, client_gone(environ))
        if reply is None:  # the client went away: the serving process is told to stop
            self.link.close_stream(ident)
            return "499 Client Closed Request", [], b""  # nginx's code; no one reads it
        if isinstance(reply, m.Answer):
            return reply.status, reply.headers, reply.body
        if isinstance(reply, m.Start):
            return reply.status, reply.headers, self._chunks(ident, replies)
        status_code, error_headers, error_body = render_error(m.unexpected(reply), "the front worker")
        return status_line(status_code), error_headers, error_body

    async def _chunks(self, ident: int, replies: "asyncio.Queue[m.Reply]") -> AsyncIterator[bytes]:
        ended = False
        try:
            while True:
                reply = await replies.get()
                if isinstance(reply, m.Chunk):
                    yield reply.data
                    continue
                ended = True
                if not isinstance(reply, m.End):  # the serving process went away mid-stream: cut the answer
                    raise ConnectionAbortedError(m.unexpected(reply).message)
                return
        finally:
            if not ended:
                self.link.close_stream(ident)


async def _first(replies: "asyncio.Queue[m.Reply]", gone: Callable[[], bool]) -> m.Reply | None:
    """The serving process's first reply; None once the client is gone first (a whole answer
    would run on for no one)."""
    while True:
        try:
            return await asyncio.wait_for(replies.get(), GONE_POLL_S)
        except TimeoutError:
            if gone():
                return None


async def forward_whole(link: Link, environ: WSGIEnvironment) -> Answer:
    """A request the serving process answers whole (its own token check included), awaited on
    the worker's loop: no thread of the worker waits for it. For answers that are one message
    (not a stream): a v2 infer naming shared memory is."""
    body = environ["wsgi.input"].read()
    reply = await link.call(m.Forward(link.next_id(), m.plain_environ(environ), body))
    if isinstance(reply, m.Answer):
        return reply.status, reply.headers, reply.body
    status_code, error_headers, error_body = render_error(m.unexpected(reply), "the front worker")
    return status_line(status_code), error_headers, error_body


class FrontApp:
    """The front path (module docstring): the HTTP server's WSGI app and its ``FastRoutes``.

    ``regions_elsewhere``: how a request only the serving process may answer is answered there
    (in a worker, forwarded whole and awaited on the loop; None in the serving process): a v2
    infer naming shared-memory regions (appliance/api/kserve/shared_memory.py), which only it
    holds, and ``GET /healthz``, whose answer says it is alive: unless ``heard()`` (in a worker:
    the serving process's loop sent this worker something within ``HEARD_S``), which says so
    already, and the worker answers it itself."""

    def __init__(self, core: FrontCore, hot: list[Mount], fallback: WSGIApp,
                 regions_elsewhere: Callable[[WSGIEnvironment], Awaitable[Answer]] | None = None,
                 heard: Callable[[], bool] = lambda: False):
        self.core, self.fallback, self.regions_elsewhere, self.heard = core, fallback, regions_elsewhere, heard
        self.hot = Mounts()
        for mount in hot:
            self.hot.add(mount)

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        """(a worker thread) What the loop did not take: the fallback answers it."""
        return self.fallback(environ, start_response)

    def route(self, environ: WSGIEnvironment) -> Callable[[WSGIEnvironment], Awaitable[Answer | Streamed]] | None:
        """(the HTTP server's ``FastRoutes``) The coroutine of a hot request whose token passes;
        None: the fallback answers it (a refusal with the serving app's headers and counters)."""
        raw = raw_path(environ).partition("?")[0]
        if raw == "/healthz" and environ.get("REQUEST_METHOD") == "GET":  # liveness: never behind a thread
            # A worker answers it itself while the serving process's loop is heard from (a flood of
            # streams sends chunks all the time); forwarded, the probe waited for that loop, which
            # shares its GIL with the decode loop and 32 executor threads: 0.2-1.7 s worst probes
            # with 1,000 streams (issue 45, bench/stream_flood.py). Silent (idle, or wedged): forwarded.
            return _alive if self.regions_elsewhere is None or self.heard() else self.regions_elsewhere
        mount = self.hot.match(environ.get("REQUEST_METHOD", "GET"), raw)
        family = mount.handler if mount is not None else None
        if mount is None or not isinstance(family, AsyncFamily) or not normal(raw):
            return None
        if self.regions_elsewhere is not None and mount.name == "kserve-infer" and _names_a_region(environ):
            return self.regions_elsewhere
        if not authorize(self.core, mount.scope, environ.get("HTTP_AUTHORIZATION")).allowed:
            return None
        return lambda env: self._answer(family, env)

    async def _answer(self, family: AsyncFamily, environ: WSGIEnvironment) -> Answer | Streamed:
        if environ.get("HTTP_CONTENT_ENCODING"):
            try:  # inflated off the loop: a large body takes milliseconds
                await asyncio.get_running_loop().run_in_executor(None, self._inflate, environ)
            except ApplianceError as exc:
                status, headers, body = render_error(exc, "the front path")
                return status_line(status), headers, body
        return await family.answer(environ)

    def _inflate(self, environ: WSGIEnvironment) -> None:
        """A compressed body made plain (appliance/api/body.py: bounded while inflating)."""
        limit = self.core.config.server.max_body_bytes
        encoding = content_encoding(environ)
        if encoding:
            body = inflate(read_raw(environ, limit), limit, encoding)
            environ["CONTENT_LENGTH"] = str(len(body))
            environ["wsgi.input"] = io.BytesIO(body)
        environ.pop("HTTP_CONTENT_ENCODING", None)


async def _alive(environ: WSGIEnvironment) -> Answer:
    """``GET /healthz`` on the loop of the process that holds the versions (the Flask route's
    body): a probe answered behind no thread, and through a worker forwarded here and awaited
    (``regions_elsewhere``), so it still says the serving process is alive."""
    body = orjson.dumps({"status": "alive", "version": __version__})
    return "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))], body


def _names_a_region(environ: WSGIEnvironment) -> bool:
    from appliance.api.kserve.shared_memory import uses_shared_memory

    with environ["wsgi.input"].getbuffer() as body:  # searched in place, never copied
        return uses_shared_memory(body)


def hot_mounts(core: ServingCore, regions: "SharedMemory | None" = None) -> list[Mount]:
    """What the front path answers on its loop: TF Serving's predict/classify/regress and KServe
    v2's infer (the requests whose JSON is the work), and in a worker the token mounts, forwarded
    (OpenAI's ``/v1/models[/{id}]`` among them, TF Serving's status of a plain name included: the
    serving process answers it on its loop). Metadata, other status, health and everything else
    goes to the fallback: cheap to answer there, and always answered by the process that holds
    the versions. ``regions``: the serving process's shared memory."""
    from appliance.api.kserve.rest import V2API
    from appliance.api.kserve.service import V2Service
    from appliance.api.mounts import INFERENCE
    from appliance.api.tfserving.rest import POST_RE, V1API

    from appliance.fronts.remote import RemoteCore

    return [Mount("tfserving-infer", "/v1/", INFERENCE, V1API(core), methods=frozenset({"POST"}), pattern=POST_RE),
            Mount("kserve-infer", "/v2/models/", INFERENCE, V2API(V2Service(core, regions=regions)),
                  methods=frozenset({"POST"}),
                  suffix="/infer"),
            *(token_mounts(ForwardedStreams(core.link), ForwardedStreams(core.link)) if isinstance(core, RemoteCore)
              else [])]


def serving_token_mounts(core: "Appliance") -> list[Mount]:
    """The token-stream families on the core itself (the process that generates)."""
    from appliance.api.generate import GenerateAPI
    from appliance.api.openai import OpenAIAPI

    return token_mounts(GenerateAPI(core), OpenAIAPI(core))


def facing(batches: bool = False) -> AppFacing:
    """What the HTTP server needs to know of this app: probes are never shed, the errors it
    writes itself are ``{"error": ...}``, and (``batches``: in the process that batches) each
    fast request carries a ``RequestContext`` telling a lone call apart
    (appliance/core/request_context.py)."""
    return AppFacing(frozenset(p.encode() for p in PROBE_PATHS), error_body, RequestContext if batches else None)


def serving_front(core: "Appliance", app: WSGIApp) -> FrontApp:
    """The front path in the process that holds the versions (one process, or its REST Unix
    socket): the families on the core's own seams, the regions read here, ``app`` (the Flask app)
    for everything else."""
    return FrontApp(core, hot_mounts(core, core.shared_memory) + serving_token_mounts(core), app)
