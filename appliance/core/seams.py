"""What the API families use of the core, as ``Protocol``s: the one seam between them.

A request reaches a model the same way in every mode, on an event loop:

    with await core.handles.handle(model, version, label, route_key) as held:
        signature = held.signature(name, missing)      # decode against it
        outputs = await held.run(signature.name, inputs, context)  # batched, routed, tallied

Two implementations stand behind these faces, chosen when the service starts (as vLLM's
in-process and multi-process engine clients): in the serving process the manager's own
(appliance/core/local.py ``LocalHandles`` over ``Manager.handle``, its ``Handle``, and the
``Appliance`` as the ``ServingCore``); in a front worker the remote ones
(``appliance/fronts/remote.py``), which decode against the serving view pushed by the serving
process and run the model there. The API families (appliance/api/) are typed against this
module only, so the same code answers in both, and a reader (or a call-graph tool) can follow
a request from the HTTP server to the batch queue.

Contracts:

- ``HandleSource.handle`` resolves the request as the client named it (a version, a label, or
  neither: the serving version, or a rollout's choice, with ``route_key(header)`` for sticky
  canary routing). Errors are the core's (``NotFound``, ``InvalidArgument``, ``Unavailable``).
- A ``ModelHandle`` holds its version until released (``with`` or ``release()``): release it
  promptly; never hold one across a wait for the client. One handle serves one request.
- ``ModelHandle.run`` is awaited on the caller's event loop; it never blocks the loop. The
  request's ``RequestContext`` (made where it arrived) goes with it to the batch queue. Its
  errors are the core's (``QueueFull`` 503, ``InvalidArgument`` 400, ...). ``version`` is the
  version that answered once ``run`` returned (a rollout or a swap may have chosen it).
- ``RequestMetrics.observe_request`` may be called from any thread or loop, and is counted
  before a scrape that follows the answer (a worker sends it before its answer leaves).
- ``TokenStreams.generate`` (the shape of vLLM's ``EngineClient.generate``) is awaited on the
  caller's loop with a handle of a version that generates: the request waits in its model's
  queue without a thread, then its choices' events come as an async iterator (``TokenEvents``),
  woken by the decode loop, never polled; ``abort()`` (a client gone) cancels them at the next
  step. Refusals are the core's (``QueueFull``/``Unavailable`` 503 + Retry-After: the queue is
  full or the wait passed ``generation.queue_timeout_s``). Implemented in the serving process
  (appliance/core/token_streams.py); a front worker forwards the whole HTTP exchange of a token
  stream to it and streams the answer back on its loop (appliance/fronts/app.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from runtimes import SignatureInfo

from appliance.core.config import Config
from appliance.core.policy import State
from appliance.core.request_context import NO_CONTEXT, RequestContext

if TYPE_CHECKING:
    from appliance.core.streams import Event, Stream
    from appliance.core.token_streams import TokenRequest

RouteKey = Callable[[str], "str | None"]  # a request's header (REST) or metadata (gRPC) by name


class ModelHandle(Protocol):
    """A request's hold on one version (module docstring)."""

    @property
    def model(self) -> str: ...

    @property
    def version(self) -> int: ...

    @property
    def path(self) -> str: ...

    @property
    def signatures(self) -> Mapping[str, SignatureInfo]: ...

    @property
    def platform(self) -> str:
        """What the version is, as model metadata names it (KServe v2 ``platform``)."""

    @property
    def reads_examples(self) -> bool:
        """Whether the servable parses serialized ``tf.Example``s (classify, regress)."""

    def signature(self, name: str, missing: str) -> SignatureInfo:
        """The signature ``name``; ``InvalidArgument(missing)`` when the version lacks it."""

    async def run(self, signature: str, inputs: Mapping[str, np.ndarray],
                  context: RequestContext = NO_CONTEXT) -> dict[str, np.ndarray]:
        """The outputs of ``signature`` on ``inputs``, through the version's batch queue.
        ``context``: the request's scheduling hints (appliance/core/request_context.py), made
        where it arrived; ``NO_CONTEXT``: no hints (never alone)."""

    def release(self) -> None: ...

    def __enter__(self) -> "ModelHandle": ...

    def __exit__(self, *exc: object) -> None: ...


class HandleSource(Protocol):
    """Where requests get their handles (module docstring)."""

    async def handle(self, name: str, version: int | None = None, label: str | None = None,
                     route_key: RouteKey | None = None) -> ModelHandle: ...


class VersionStatus(Protocol):
    """One version as model status reports it (TF Serving's ModelVersionStatus)."""

    @property
    def version(self) -> int: ...

    @property
    def state(self) -> State: ...

    @property
    def error(self) -> str: ...

    @property
    def error_code(self) -> str: ...


class ModelStates(Protocol):
    """Model status: every known version of a model, newest first, or the one asked for.
    ``NotFound`` for an unknown model or version (TF Serving's texts). Only the serving process
    has one: front workers forward status requests."""

    def version_states(self, name: str, version: int | None = None,
                       label: str | None = None) -> Sequence[VersionStatus]: ...


class RequestMetrics(Protocol):
    def observe_request(self, model: str, api: str, status: int | str, seconds: float,
                        entrypoint: str = "REST") -> None:
        """One answered request of ``api`` (predict, classify, v2_infer, ...) with its canonical
        code's name ("OK", "NOT_FOUND", ...) or its HTTP status (appliance/core/metrics.py)."""


class ServingCore(Protocol):
    """What an inference API family reads of its core: the running config (replaced whole on a
    reload), request metrics and the handle source."""

    @property
    def config(self) -> Config: ...

    @property
    def metrics(self) -> RequestMetrics: ...

    @property
    def handles(self) -> HandleSource: ...


class TokenEvents(Protocol):
    """One request's token streams: ``(choice index, kind, value)`` events until every choice ended."""

    @property
    def streams(self) -> "list[Stream]": ...

    @property
    def open(self) -> int:
        """Choices not ended yet."""

    def __aiter__(self) -> "TokenEvents": ...

    async def __anext__(self) -> "Event": ...

    def abort(self, reason: str = "cancelled") -> None: ...


class TokenStreams(Protocol):
    """Token generation on a loop (module docstring)."""

    async def generate(self, handle: Any, request: "TokenRequest", gone: Callable[[], bool] | None = None) -> TokenEvents:
        """``handle``: the manager's handle of the version (the generation's once this returns);
        ``gone``: whether the client went away, looked at while the request waits in the queue."""
