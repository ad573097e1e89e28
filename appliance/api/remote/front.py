"""The front worker's side of the handle across processes (package docstring).

``Link`` is the worker's conversation with the serving process: calls with replies, and
pushes (the serving view, a new config, drain). ``RemoteCore`` is what the API code of a
worker gets as its core: ``config``, ``metrics`` (request observations, shipped to the
serving process in batches) and ``manager``, whose ``handle`` answers from the serving
view (no round trip) and whose handles run through the serving process's batch queues.
``FrontApp`` is the worker's WSGI app: inference answered here, everything else forwarded
whole (``Forwarder``), so status, the page, admin endpoints, metrics and token streams
keep living in the serving process only.

Thread-safety: ``Link.call``/``Link.open`` from any thread; one reader thread (``serve``).
A ``RemoteHandle`` serves one request, as a core ``Handle`` does.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol

import numpy as np

from runtimes import SignatureInfo

from appliance.api.auth import authorize
from appliance.api.body import GzipBodies
from appliance.api.errors import render_error, status_line
from appliance.api.remote import messages as m
from appliance.api.routes import Mount, normal, raw_path
from appliance.core.config import Config
from appliance.core.errors import InvalidArgument, Unavailable
from appliance.core.serving_view import ModelView, ServingView, VersionView

Message = tuple[str, int, Any]


class Channel(Protocol):
    """What ``Link`` needs of its channel (appliance/transport/channel.py ``BlockingChannel``)."""

    def send(self, message: Message) -> None: ...

    def serve(self, on_message: Callable[[Message], None]) -> None: ...

log = logging.getLogger("appliance.front")

MAX_ATTEMPTS = 3  # decodes of one request while versions with other signatures swap in
GONE = "the serving process is gone (restarting); retry"


class StaleView(BaseException):
    """The version that answers decodes inputs differently from the one the request was
    decoded for: decode again against ``view``. A BaseException so that the API families'
    catch-all error renderers let it through to ``FrontApp``, which retries."""

    def __init__(self, model: str, view: VersionView):
        super().__init__(model, view.version)
        self.model, self.view = model, view


class Link:
    """The worker's end of its channel (module docstring)."""

    def __init__(self, channel: Channel, on_push: Callable[[Message], None]):
        self.channel, self.on_push = channel, on_push
        self._ids = itertools.count(1)
        self._waiting: dict[int, Future[tuple[str, Any]] | queue.SimpleQueue[tuple[str, Any]]] = {}
        self._lock = threading.Lock()
        self.gone = False

    def call(self, kind: str, payload: Any) -> tuple[str, Any]:
        """Send a request and wait for its one reply: (kind, payload)."""
        future: Future[tuple[str, Any]] = Future()
        ident = self._register(future)
        self._send((kind, ident, payload), ident)
        return future.result()

    def open(self, kind: str, payload: Any) -> tuple[int, queue.SimpleQueue[tuple[str, Any]]]:
        """Send a request whose replies stream: (its id, the queue they arrive on)."""
        replies: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        ident = self._register(replies)
        self._send((kind, ident, payload), ident)
        return ident, replies

    def close_stream(self, ident: int) -> None:
        with self._lock:
            self._waiting.pop(ident, None)

    def send(self, kind: str, payload: Any) -> None:
        """A message with no reply (observations, stats)."""
        if not self.gone:
            try:
                self.channel.send((kind, 0, payload))
            except OSError:
                pass

    def _register(self, waiter: Any) -> int:
        ident = next(self._ids)
        with self._lock:
            if self.gone:
                raise Unavailable(GONE)
            self._waiting[ident] = waiter
        return ident

    def _send(self, message: Message, ident: int) -> None:
        try:
            self.channel.send(message)
        except OSError:
            self._deliver(ident, (m.FAIL, m.error_to_plain(Unavailable(GONE))))

    def serve(self) -> None:
        """(the reader thread) Replies to their waiters, pushes to ``on_push``, until EOF;
        then every waiter fails (Unavailable) and ``on_push`` hears ("eof", 0, None)."""
        try:
            self.channel.serve(self._on_message)
        finally:
            self._end()

    def _end(self) -> None:
        with self._lock:
            self.gone = True
            waiting, self._waiting = self._waiting, {}
        failure = (m.FAIL, m.error_to_plain(Unavailable(GONE)))
        for waiter in waiting.values():
            _put(waiter, failure)
        self.on_push(("eof", 0, None))

    def _on_message(self, message: Message) -> None:
        kind, ident, payload = message
        try:
            if ident == 0:
                self.on_push(message)
            else:
                self._deliver(ident, (kind, payload))
        except Exception:  # one bad message must not end the conversation
            log.exception("front worker: a %r message failed", kind)

    def _deliver(self, ident: int, reply: tuple[str, Any]) -> None:
        with self._lock:
            waiter = self._waiting.get(ident)
            if isinstance(waiter, Future) or reply[0] in (m.END, m.FAIL, m.ANSWER):
                self._waiting.pop(ident, None)
        if waiter is not None:
            _put(waiter, reply)


def _put(waiter: Any, reply: tuple[str, Any]) -> None:
    if isinstance(waiter, Future):
        if not waiter.done():
            waiter.set_result(reply)
    else:
        waiter.put(reply)


class FrontMetrics:
    """``observe_request`` as the core's ``Metrics`` has it: sent to the serving process, which
    counts it, before the answer it describes leaves (so the next scrape sees it)."""

    def __init__(self, link: Link):
        self.link = link

    def observe_request(self, model: str, api: str, status: int, seconds: float, entrypoint: str = "REST") -> None:
        self.link.send(m.OBSERVE, [[model, api, status, seconds, entrypoint]])


class RemoteHandle:
    """A core ``Handle``'s face (appliance/core/handle.py) for a version the serving process
    holds: signatures from the serving view, ``run`` through the serving process."""

    __slots__ = ("_link", "model", "_requested", "_label", "_headers", "_view", "_answered")

    def __init__(self, link: Link, model: str, requested: int | None, label: str | None,
                 headers: Mapping[str, str | None], view: VersionView):
        self._link, self.model = link, model
        self._requested, self._label, self._headers, self._view = requested, label, headers, view
        self._answered: int | None = None

    @property
    def version(self) -> int:
        """The version that answered once ``run`` returned; the one decoded for before."""
        return self._answered if self._answered is not None else self._view.version

    @property
    def path(self) -> str:
        return self._view.path

    @property
    def signatures(self) -> Mapping[str, SignatureInfo]:
        return self._view.signatures

    @property
    def platform(self) -> str:
        return self._view.platform

    @property
    def reads_examples(self) -> bool:
        return self._view.reads_examples

    def signature(self, name: str, missing: str) -> SignatureInfo:
        sig = self._view.signatures.get(name)
        if sig is None:
            raise InvalidArgument(missing)
        return sig

    def run(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        view = self._view
        request = m.RunRequest(self.model, self._requested, self._label, self._headers, signature, dict(inputs),
                               view.version, view.fingerprints.get(signature, 0))
        kind, payload = self._link.call(m.RUN, request.plain())
        if kind == m.DONE:
            self._answered = payload[0]
            return payload[1]  # type: ignore[no-any-return]
        if kind == m.STALE:
            raise StaleView(self.model, m.version_from_plain(payload))
        raise m.error_from_plain(payload)

    def release(self) -> None:
        """Nothing is held here: the serving process holds the version while it runs."""

    def __enter__(self) -> "RemoteHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class RemoteManager:
    """``manager.handle`` in a front worker: from the serving view when it knows the answer,
    else asked of the serving process (``RESOLVE``: the same errors the manager raises)."""

    def __init__(self, link: Link):
        self.link = link
        self.view = ServingView(0, {})
        self._prefer = threading.local()  # a retry decodes against the version that answered

    def handle(self, name: str, version: int | None = None, label: str | None = None,
               route_key: Callable[[str], str | None] | None = None, judged: bool = True) -> RemoteHandle:
        model = self.view.models.get(name)
        chosen = _pick(model, version, label) if model is not None else None
        preferred = getattr(self._prefer, "views", {}).get(name)
        if preferred is not None and version is None and label is None:
            chosen = preferred
        if chosen is None:
            kind, payload = self.link.call(m.RESOLVE, [name, version, label])
            if kind != m.DONE:
                raise m.error_from_plain(payload)
            chosen = m.version_from_plain(payload)
        headers = {h: route_key(h) for h in model.route_headers} if model is not None and route_key else {}
        return RemoteHandle(self.link, name, version, label, headers, chosen)

    def prefer(self, views: Mapping[str, VersionView]) -> None:
        """Decode this thread's next unversioned requests of these models against these versions."""
        self._prefer.views = dict(views)


def _pick(model: ModelView, version: int | None, label: str | None) -> VersionView | None:
    if label is not None:
        version = model.labels.get(label)
        if version is None:
            return None
    if version is None:
        version = model.serving
    return model.versions.get(version) if version is not None else None


class RemoteCore:
    """A front worker's core: what the API handlers read of ``Appliance`` (module docstring)."""

    def __init__(self, config: Config, link: Link):
        self.config = config
        self.link = link
        self.manager = RemoteManager(link)
        self.metrics = FrontMetrics(link)

    def add_status(self, name: str, provider: Callable[[], Any]) -> None:
        """Status lives in the serving process; a worker shows none of its own."""


class Forwarder:
    """WSGI app: the request answered by the serving process's app, whole or streamed."""

    def __init__(self, link: Link):
        self.link = link

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        body = environ["wsgi.input"].read()
        try:
            ident, replies = self.link.open(m.WSGI, [m.plain_environ(environ), body])
        except Unavailable as exc:
            return _error(exc, start_response)
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
            self.link.send(m.CANCEL, self.ident)


class FrontApp:
    """The front worker's WSGI app (module docstring): ``hot`` mounts answered here after
    the same token check the serving process makes; a request they refuse, and every other
    request, goes to the serving process, which answers (and counts) it as it would alone."""

    def __init__(self, core: RemoteCore, hot: list[Mount]):
        self.core = core
        self.hot = [(mount, GzipBodies(mount.handler, core)) for mount in hot]  # type: ignore[arg-type]
        self.forward = Forwarder(core.link)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        raw = raw_path(environ).partition("?")[0]
        for mount, handler in self.hot:
            if mount.matches(method, raw) and normal(raw):
                if authorize(self.core, mount.scope, environ.get("HTTP_AUTHORIZATION")).allowed:  # type: ignore[arg-type]
                    return self._answer(handler, environ, start_response)
                break
        return self.forward(environ, start_response)

    def _answer(self, handler: Callable[..., Any], environ: dict[str, Any],
                start_response: Callable[..., Any]) -> Iterable[bytes]:
        manager = self.core.manager
        preferred: dict[str, VersionView] = {}
        try:
            for _ in range(MAX_ATTEMPTS):
                try:
                    return handler(environ, start_response)  # type: ignore[no-any-return]
                except StaleView as stale:
                    preferred[stale.model] = stale.view
                    manager.prefer(preferred)
                    environ["wsgi.input"].seek(0)
        finally:
            manager.prefer({})
        return _error(Unavailable("the model's versions changed with other signatures while this request was "
                                  "decoded; retry"), start_response)


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
