"""The serving process's side of the handle across processes (appliance/fronts/).

``FrontService`` talks to every front worker over its channel, on one event loop of its
own (``start``):

Messages are the structs of appliance/fronts/messages.py.

- ``Run``: ``manager.handle`` resolves the request as the client named it (rollouts route
  it here, exactly as in one process), then ``await handle.run``: the model's one batch
  queue takes requests from every worker. A run that is the only call in flight from all the
  workers (Run, GrpcCall, a Forward answered on the loop: ``_runs``) is told so: a ``Run`` by the
  ``RequestContext`` made here and passed to ``handle.run`` (core/request_context.py), a forwarded
  request on its environ (``ENVIRON_KEY``), a forwarded gRPC call on its call context (``alone``),
  where its API family reads it; so a quick model's lone call runs on this loop instead of
  paying two thread hand-offs, and a slow one's gets every core, as in one process. Inputs the answering version's signature cannot
  take (decoded against a view older than a swap to another signature) run on the version
  they were decoded for while it is loaded, else are answered 503, retry (``_answering``).
- ``Resolve``: what the worker's serving view cannot answer, with the manager's errors.
- ``Forward``: a forwarded request that this process's front path answers on its loop (a KServe
  v2 infer naming shared-memory regions, which only this process reads: appliance/fronts/app.py
  ``serving_front``) runs there, as the same request would in one process; any other runs
  through the service's own app on a thread of ``threads`` (``server.threads``), answered
  whole, or streamed chunk by chunk. The
  worker's ``Cancel`` (its client went away) ends a stream, and turns the request's
  ``appliance.client_gone`` true for an answer that is whole only at its end; a ``Cancel`` of
  a ``Run`` or ``GrpcCall`` cancels its task (still queued, it leaves the batcher unrun), so a
  client that sends calls and goes away does not keep the model busy (issue 47, item 3).
- ``GrpcCall``: a forwarded gRPC call runs through the service's own gRPC handlers (TF Serving's
  and KServe v2's, on this process's core) with a context of the lean server's kind.
- ``Observe``: the workers' request metrics join the core's (one registry, one page).
- ``Stats``: each worker's HTTP figures and memory, merged by ``http_stats``; sent from the
  worker's loop every second, they are its heartbeat too (``on_heard``).

It pushes the serving view (appliance/fronts/view.py) to every worker when the manager
says what serves has changed (``Manager.listeners``; rebuilt once per loop tick however many
changes came), and a new config after a reload.

Thread-safety: ``attach``, ``broadcast`` and ``close`` from any thread; messages are
handled on the loop, forwarded requests on the pool.
"""

from __future__ import annotations

import asyncio
import io
import logging
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Coroutine

import grpc

from appliance.api.family import close_chunks
from appliance.api.sse import GONE_KEY
from appliance.fronts import messages as m
from appliance.fronts.app import serving_front
from appliance.fronts import view as serving_view
from appliance.core.errors import ApplianceError, Unavailable
from appliance.core.handle import shape_error
from appliance.core.request_context import ENVIRON_KEY, RequestContext
from appliance.fronts.view import ServingView, version_view
from appliance.transport.channel import ChannelProtocol, Codec
from appliance.transport.grpc.calls import Abort, CallDetails, Context
from appliance.transport.loop_thread import LoopThread, new_event_loop

if TYPE_CHECKING:
    from wsgiref.types import WSGIApplication, WSGIEnvironment

    from appliance.core.appliance import Appliance
    from appliance.transport.http.server import FastHandler
    from appliance.core.config import Config
    from appliance.core.handle import Handle

log = logging.getLogger("appliance.front")
Channel = ChannelProtocol[m.ToServing]

CHANGED = ("the model's versions changed while this request was decoded (version {was} is gone and version {now} "
           "takes other inputs); retry")
# Figures of the workers' HTTP servers that are settings, not counts: shown once, not summed
# (the shared-out limits, max_connections and max_buffered_bytes, add up to the port's).
TURN_S = 0.5
SETTINGS = frozenset({"server", "tls", "header_timeout_s", "request_timeout_s", "idle_timeout_s",
                      "max_queue_wait_s", "max_header_bytes", "max_connections", "max_buffered_bytes"})


class FrontService:
    def __init__(self, core: "Appliance", app: WSGIApplication, threads: int,
                 on_listening: Callable[[int], None] = lambda index: None,
                 on_heard: Callable[[int], None] = lambda index: None):
        """``on_listening(index)``: a worker's first figures arrived: it listens on the port;
        ``on_heard(index)``: its figures arrived again (its heartbeat, appliance/fronts/supervisor.py)."""
        self.core, self.app, self.threads, self.on_listening = core, app, threads, on_listening
        self.front = serving_front(core, app)  # what this process answers on its loop (``_fast``)
        self.on_heard = on_heard
        self.turned = time.monotonic()  # when this side's loop last turned (``_turn``)
        self.links: dict[int, Channel] = {}  # worker index -> its channel
        self.stats: dict[int, m.Stats] = {}  # worker index -> its last figures
        self.view = ServingView(0, {})
        self._streams: dict[tuple[int, int], threading.Event] = {}  # (worker, id) -> cancelled
        # (worker, id) -> a request answered on the loop: a token stream, a whole answer, a Run or GrpcCall
        self._tasks: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._loop: LoopThread | None = None
        self._grpc_handlers: list[Any] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._view_due = False  # a rebuild of the view is scheduled on the loop
        self._runs = 0  # calls in flight on the loop: RUN, forwarded gRPC, forwarded requests answered here
        self._context = RequestContext(self._alone)  # every Run's (immutable): alone is judged at the queue

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = LoopThread(self.threads, name="front", loop_factory=new_event_loop)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="front-wsgi")
        manager = self.core.manager
        if manager is not None:
            manager.listeners.append(self._view_changed)
        self._view_changed()
        self._loop.loop.call_soon_threadsafe(self._turn)

    def _turn(self) -> None:
        """(loop) Mark the loop as turning, every ``TURN_S``: the workers' heartbeats are judged
        only while this side reads them (appliance/fronts/supervisor.py)."""
        self.turned = time.monotonic()
        loop = self._loop
        if loop is not None:
            loop.loop.call_later(TURN_S, self._turn)

    def close(self) -> None:
        """Close every worker's channel (they exit on EOF) and stop the loop."""
        loop, self._loop = self._loop, None
        if loop is not None:
            loop.loop.call_soon_threadsafe(self._close_links)
            loop.close_loop()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def attach(self, index: int, sock: socket.socket) -> None:
        """A new worker's channel (the supervisor's ``on_start``)."""
        assert self._loop is not None
        self._loop.run(self._connect(index, sock))

    async def _connect(self, index: int, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        _, proto = await loop.connect_accepted_socket(
            lambda: ChannelProtocol(Codec(m.ToServing), self._on_message, self._on_lost, index), sock)
        self.links[index] = proto
        proto.send(m.config_plain(self.core.config))
        proto.send(m.view_plain(self.view))

    def broadcast(self, message: m.Push) -> None:
        """Send a push to every worker."""
        for proto in list(self.links.values()):
            proto.send_threadsafe(message)

    def push_config(self, config: Config) -> None:
        self.broadcast(m.config_plain(config))

    def _close_links(self) -> None:
        for proto in list(self.links.values()):
            proto.shut()

    # -- messages (loop thread) --------------------------------------------------------------
    def _on_message(self, proto: Channel, message: m.ToServing) -> None:
        if isinstance(message, m.Run):
            self._runs += 1  # counted on arrival: of a burst read at once, none is alone
            self._cancellable(proto, message.id, self._run(proto, message))
        elif isinstance(message, m.Resolve):
            proto.send(self._resolve(message))
        elif isinstance(message, m.Forward):
            self._forward(proto, message)
        elif isinstance(message, m.GrpcCall):
            self._runs += 1
            self._cancellable(proto, message.id, self._grpc(proto, message))
        elif isinstance(message, m.Cancel):
            flag = self._streams.get((proto.index, message.stream))
            if flag is not None:
                flag.set()
            task = self._tasks.get((proto.index, message.stream))
            if task is not None:  # its client went away: a stream stops, a queued call leaves the batcher unrun
                task.cancel()
        elif isinstance(message, m.Observe):
            observe = self.core.metrics.observe_request
            for o in message.observations:
                observe(o.model, o.api, o.status, o.seconds, o.entrypoint)
        elif isinstance(message, m.Stats):
            first = proto.index not in self.stats
            self.stats[proto.index] = message
            self.on_heard(proto.index)
            if first:
                self.on_listening(proto.index)

    def _forward(self, proto: Channel, message: m.Forward) -> None:
        ident, environ = message.id, self._environ(message.environ, message.body)
        fast = self.front.route(environ)
        if fast is not None:  # no thread hand-off, no Flask: the loop's own answer
            self._runs += 1
            self._cancellable(proto, ident, self._fast(proto, ident, fast, environ))
            return
        cancelled = self._streams[(proto.index, ident)] = threading.Event()
        assert self._pool is not None
        self._pool.submit(self._wsgi, proto, ident, environ, cancelled)

    def _cancellable(self, proto: Channel, ident: int, work: Coroutine[object, object, None]) -> None:
        """Run a worker's call as a task its ``Cancel`` ends (a gRPC client that went away:
        appliance/fronts/link.py), so an abandoned call is not computed to the end."""
        key = (proto.index, ident)
        task = self._tasks[key] = asyncio.get_running_loop().create_task(work)
        task.add_done_callback(lambda _: self._tasks.pop(key, None))

    def _on_lost(self, proto: Channel) -> None:
        index = proto.index
        if self.links.get(index) is proto:
            del self.links[index]
            self.stats.pop(index, None)
        for (worker, _), flag in list(self._streams.items()):
            if worker == index:
                flag.set()
        for (worker, _), task in list(self._tasks.items()):
            if worker == index:  # nobody is left to answer
                task.cancel()

    async def _run(self, proto: Channel, request: m.Run) -> None:
        try:
            with self._answering(request) as held:
                outputs = await held.run(request.signature, request.inputs, self._context)
                proto.send(m.Ran(request.id, held.version, outputs))
        except Exception as exc:  # the core's own errors, to the client as they are
            proto.send(m.failed(request.id, exc))
        finally:
            self._runs -= 1

    def _alone(self) -> bool:
        return self._runs == 1

    def _answering(self, request: m.Run) -> "Handle":
        """The handle that runs ``request``: as the client named the version, or, when that one
        cannot take inputs decoded for another (a swap since the worker's view), the version
        they were decoded for, while it is loaded."""
        manager = self.core.manager
        if manager is None:
            raise Unavailable("the service is stopping")
        route_key = request.route_headers.get if request.route_headers else None
        held = manager.handle(request.model, request.version, request.label, route_key)
        if held.version == request.decoded_version or _takes(held, request):
            return held
        was, now = request.decoded_version, held.version
        held.release()
        try:
            return manager.handle(request.model, was, judged=False)
        except ApplianceError:
            raise Unavailable(CHANGED.format(was=was, now=now)) from None

    async def _grpc(self, proto: Channel, call: m.GrpcCall) -> None:
        """A gRPC call a worker forwarded, answered by this process's handler for it, as from
        the worker's client (``call.peer``: who may use shared memory is judged by it)."""
        ident, method, request = call.id, call.method, call.request
        pairs = tuple(m.pairs(call.metadata))
        deadline = None if call.seconds_left is None else time.monotonic() + call.seconds_left
        context = Context(pairs, deadline, call.peer, self._alone)  # its family makes the RequestContext of it
        handler = self._grpc_handler(method, pairs)
        try:
            if handler is None:
                raise Abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            message = handler.request_deserializer(request) if handler.request_deserializer else request
            fn = handler.unary_unary
            if asyncio.iscoroutinefunction(fn):
                response = await fn(message, context)
            else:
                response = await asyncio.get_running_loop().run_in_executor(self._pool, fn, message, context)
            if context.code not in (None, grpc.StatusCode.OK):
                raise Abort(context.code, context.details)
            proto.send(m.GrpcDone(ident, handler.response_serializer(response) if handler.response_serializer
                                  else response))
        except Abort as exc:
            proto.send(m.GrpcStatus(ident, exc.code.name, exc.details or "", m.metadata(context.trailing)))
        except Exception:  # a handler's own bug: logged here, INTERNAL there
            log.exception("forwarded gRPC %s failed", method)
            proto.send(m.GrpcStatus(ident, grpc.StatusCode.INTERNAL.name, "internal error: see the service log",
                                    m.metadata(())))
        finally:
            self._runs -= 1

    def _grpc_handler(self, method: str,
                      metadata: tuple[tuple[str, str | bytes], ...]) -> grpc.RpcMethodHandler | None:
        if self._grpc_handlers is None:  # built on first use: a service without gRPC never imports it
            from appliance.api.kserve.grpc_service import V2GRPC
            from appliance.api.tfserving.grpc_service import TFServingGRPC

            core = self.core
            self._grpc_handlers = [*TFServingGRPC(core, core.states, core.request_config).handlers(),
                                   V2GRPC.serving(core).handler()]
        details = CallDetails(method, metadata)
        for generic in self._grpc_handlers:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None

    def _resolve(self, ask: m.Resolve) -> m.Resolved | m.Failed:
        manager = self.core.manager
        try:
            if manager is None:
                raise Unavailable("the service is stopping")
            with manager.handle(ask.model, ask.version, ask.label, judged=False) as held:
                return m.Resolved(ask.id, m.version_plain(_view_of(held)))
        except BaseException as exc:
            return m.failed(ask.id, exc)

    # -- forwarded requests (pool threads) -----------------------------------------------------
    @staticmethod
    def _environ(env: dict[str, str], body: bytes) -> WSGIEnvironment:
        return {**env, "wsgi.input": io.BytesIO(body), "wsgi.errors": sys.stderr, "wsgi.version": (1, 0),
                "wsgi.multithread": True, "wsgi.multiprocess": True, "wsgi.run_once": False}

    async def _fast(self, proto: Channel, ident: int, answer: FastHandler, environ: WSGIEnvironment) -> None:
        """(loop) A forwarded request the front path answers here, whole or streamed (a token
        stream: ``Start``, a ``Chunk`` per chunk, ``End``); the worker's ``Cancel`` cancels it."""
        environ[ENVIRON_KEY] = self._context  # the request's context, as the HTTP server puts it in one process
        counted = True
        try:
            status, headers, body = await answer(environ)
            if isinstance(body, bytes):
                proto.send(m.Answer(ident, status, headers, body))
                return
            self._runs, counted = self._runs - 1, False  # a stream is no call in flight: batches need not wait for it
            proto.send(m.Start(ident, status, headers))
            await _send_chunks(proto, ident, body)
        except Exception as exc:  # the families answer their own errors; this is a bug of ours
            log.exception("forwarded %s %s failed", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"))
            proto.send(m.failed(ident, exc))
        finally:
            if counted:
                self._runs -= 1

    def _wsgi(self, proto: Channel, ident: int, environ: WSGIEnvironment, cancelled: threading.Event) -> None:
        environ[GONE_KEY] = cancelled.is_set  # the worker's CANCEL: its client went away
        started: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            started[:] = [status, list(headers)]
            return None

        result: Any = None
        try:
            result = self.app(environ, start_response)
            if isinstance(result, (list, tuple)):
                proto.send_threadsafe(m.Answer(ident, started[0], started[1], b"".join(result)))
                return
            self._stream(proto, ident, result, started, cancelled)
        except Exception as exc:  # the app's own failure: logged here, a 500 there
            log.exception("forwarded %s %s failed", environ.get("REQUEST_METHOD"), environ.get("PATH_INFO"))
            proto.send_threadsafe(m.failed(ident, exc))
        finally:
            self._streams.pop((proto.index, ident), None)
            closer = getattr(result, "close", None)
            if closer is not None:
                closer()

    @staticmethod
    def _stream(proto: Channel, ident: int, result: Any, started: list[Any],
                cancelled: threading.Event) -> None:
        sent = False
        for chunk in result:
            if cancelled.is_set():
                return
            if not sent:  # start_response may come with the first chunk (PEP 3333)
                proto.send_threadsafe(m.Start(ident, started[0], started[1]))
                sent = True
            if chunk:
                proto.send_threadsafe(m.Chunk(ident, bytes(chunk)))
        if not sent:
            proto.send_threadsafe(m.Start(ident, started[0], started[1]))
        proto.send_threadsafe(m.End(ident))

    # -- the serving view ---------------------------------------------------------------------
    def _view_changed(self) -> None:
        """(any thread, maybe under the manager's lock) Rebuild the view on the loop, once
        for all the changes of one loop tick."""
        loop = self._loop
        if loop is None or self._view_due:
            return
        self._view_due = True
        try:
            loop.loop.call_soon_threadsafe(self._push_view)
        except RuntimeError:  # the loop closed: the service is stopping
            pass

    def _push_view(self) -> None:
        """(loop) The view of what serves now, to every worker when it differs from the last."""
        self._view_due = False
        manager = self.core.manager
        if manager is None:
            return
        view = serving_view.build(manager, self.view.generation + 1)
        if view.models == self.view.models:
            return
        self.view = view
        plain = m.view_plain(view)
        for proto in list(self.links.values()):
            proto.send(plain)

    # -- status ---------------------------------------------------------------------------------
    def http_stats(self, base: dict[str, Any]) -> dict[str, Any]:
        """The workers' HTTP figures together, over ``base`` (the figures of none): counts
        summed, settings shown once (a limit shared out among workers: the port's total)."""
        merged = dict(base)
        reported = [stats.http for stats in list(self.stats.values())]
        for key, value in base.items():
            if key in SETTINGS or not reported:
                continue
            values = [r.get(key, value) for r in reported]
            merged[key] = any(values) if isinstance(value, bool) else sum(values)
        return merged


async def _send_chunks(proto: Channel, ident: int, chunks: AsyncIterator[bytes]) -> None:
    """A streamed answer's chunks to the worker, then ``End``; stopped early (the worker's
    ``Cancel``), the chunks are closed, which cancels their token stream."""
    ended = False
    try:
        async for chunk in chunks:
            if chunk:
                proto.send(m.Chunk(ident, chunk))
        ended = True
        proto.send(m.End(ident))
    finally:
        if not ended:
            await close_chunks(chunks)


def _view_of(held: "Handle") -> serving_view.VersionView:
    return version_view(held.version, held.path, held.platform, held.reads_examples, held.signatures)


def _takes(held: "Handle", request: m.Run) -> bool:
    """Whether ``held``'s signature takes ``request``'s inputs as decoded: the same inputs, each
    of the declared dtype and a shape it fits."""
    sig = held.signatures.get(request.signature)
    if sig is None or set(sig.inputs) != set(request.inputs):
        return False
    return all(arr.dtype == sig.inputs[k].dtype and shape_error(arr, sig.inputs[k], k) is None
               for k, arr in request.inputs.items())
