"""A front worker's core: the seams of appliance/core/seams.py across processes.

``RemoteCore`` is a worker's ``ServingCore``: the running ``config`` (pushed by the serving
process at start and after each reload), ``metrics`` (each request's observation goes to the
serving process, which counts it; a loop tick's observations leave in one message, before the
answers of that tick) and ``handles``, a ``RemoteHandles``.

``RemoteHandles.handle`` answers from the serving view (appliance/fronts/view.py), pushed by
the serving process at every change of what serves, without a round trip; when the view does
not know what the request names (a model, version or label that appeared a moment ago, or
none such), it asks (``Resolve``), and the serving process answers with the version's view or
the manager's own error. ``RemoteHandle.run`` sends the decoded inputs (``Run``); the serving
process resolves the request again as the client named it (rollouts route it there, as in one
process) and runs it through the model's one batch queue. If the version that answers there
cannot take inputs decoded for this one (a swap to a version with another signature since the
view was read), the version decoded for answers while it is still loaded; after that the
answer is a retryable 503 (appliance/fronts/serving.py): a stale view never gives a wrong
answer, and since a new version must serve the old one's signatures (the manager refuses it
otherwise), it costs a retry only across a declared API change.

Thread-safety: a handle serves one request; ``handle`` and ``run`` are awaited on the worker's
loop (gRPC runs there too, as its guest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from runtimes import SignatureInfo

from appliance.core.config import Config
from appliance.core.errors import InvalidArgument
from appliance.core.request_context import NO_CONTEXT, RequestContext
from appliance.core.seams import ModelHandle, RouteKey
from appliance.fronts import messages as m
from appliance.fronts.link import Link
from appliance.fronts.view import ModelView, ServingView, VersionView

if TYPE_CHECKING:
    from appliance.core.json_types import ReadJSONValue

Key = tuple[str, "int | None", "str | None"]  # (model, version, label) as the request names them


class FrontMetrics:
    """``RequestMetrics`` counted by the serving process: one ``Observe`` per loop tick."""

    def __init__(self, link: Link):
        self.link = link
        self._pending: list[m.Observation] = []

    def observe_request(self, model: str, api: str, status: int | str, seconds: float, entrypoint: str = "REST") -> None:
        if not self._pending:
            self.link.soon(self._flush)
        self._pending.append(m.Observation(model, api, status, seconds, entrypoint))

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            self.link.send(m.Observe(pending))


class RemoteHandle:
    """A ``ModelHandle`` on a version the serving process holds (module docstring)."""

    __slots__ = ("_link", "model", "_key", "_headers", "_view", "_answered")

    def __init__(self, link: Link, key: Key, headers: Mapping[str, str | None], view: VersionView):
        self._link, self.model, self._key = link, key[0], key
        self._headers, self._view = headers, view
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

    async def run(self, signature: str, inputs: Mapping[str, np.ndarray],
                  context: RequestContext = NO_CONTEXT) -> dict[str, np.ndarray]:
        """Run in the serving process; ``context`` stays here: whether a run is alone is judged
        there, over every worker's runs (appliance/fronts/serving.py makes its context)."""
        model, version, label = self._key
        request = m.Run(self._link.next_id(), model, version, label, dict(self._headers), signature, dict(inputs),
                        self._view.version)
        reply = await self._link.call(request)
        if not isinstance(reply, m.Ran):
            raise m.unexpected(reply)
        self._answered = reply.version
        return reply.outputs

    def release(self) -> None:
        """Nothing is held here: the serving process holds the version while it runs."""

    def __enter__(self) -> "RemoteHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class RemoteHandles:
    """``HandleSource`` of a front worker (module docstring)."""

    def __init__(self, link: Link):
        self.link = link
        self.view = ServingView(0, {})

    async def handle(self, name: str, version: int | None = None, label: str | None = None,
                     route_key: RouteKey | None = None) -> ModelHandle:
        model = self.view.models.get(name)
        chosen = _pick(model, version, label) if model is not None else None
        if chosen is None:
            chosen = await self._resolve(name, version, label)
        headers = {h: route_key(h) for h in model.route_headers} if model is not None and route_key else {}
        return RemoteHandle(self.link, (name, version, label), headers, chosen)

    async def _resolve(self, name: str, version: int | None, label: str | None) -> VersionView:
        """What the view does not know, from the serving process: the version, or its error."""
        reply = await self.link.call(m.Resolve(self.link.next_id(), name, version, label))
        if not isinstance(reply, m.Resolved):
            raise m.unexpected(reply)
        return m.version_from_plain(reply.version)


def _pick(model: ModelView, version: int | None, label: str | None) -> VersionView | None:
    if label is not None:
        version = model.labels.get(label)
        if version is None:
            return None
    if version is None:
        version = model.serving
    return model.versions.get(version) if version is not None else None


class RemoteCore:
    """A front worker's ``ServingCore`` (module docstring)."""

    def __init__(self, config: Config, link: Link):
        self.config = config
        self.link = link
        self.handles = RemoteHandles(link)
        self.metrics = FrontMetrics(link)

    def add_status(self, name: str, provider: Callable[[], ReadJSONValue]) -> None:
        """Status lives in the serving process; a worker shows none of its own."""


__all__ = ["FrontMetrics", "RemoteCore", "RemoteHandle", "RemoteHandles"]
