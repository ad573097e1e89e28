"""What a front worker's API code gets as its core, and the handles it runs models with.

``RemoteCore`` has what the hot API handlers read of ``Appliance``: ``config``, ``metrics``
(each request's observation sent to the serving process, which counts it, before the
answer leaves, so the next scrape sees it) and ``manager``. ``RemoteManager.handle``
answers from the serving view (appliance/fronts/view.py) without a round trip and
hands out ``RemoteHandle``s, with the face of appliance/core/handle.py's ``Handle``, whose
``run``/``run_async`` go through the serving process's batch queues.

When the view cannot answer (a model, version or label it does not know) ``handle`` raises
``NeedView``; when the version that answers decodes differently from the one the request
was decoded for, ``run`` raises ``StaleView``. Both are BaseExceptions, so the API families'
catch-all error renderers let them through to the front app, which learns the answer
(``RESOLVE``, or the STALE reply's view), makes it this request's preference
(``prefer``, a context variable: per thread, per task) and runs the request again.

Thread-safety: a handle serves one request; the manager may be used from any thread or task.
"""

from __future__ import annotations

import contextvars
from typing import Any, Awaitable, Callable, Mapping, TypeVar

import numpy as np

from runtimes import SignatureInfo

from appliance.fronts import messages as m
from appliance.fronts.link import Link
from appliance.core.config import Config
from appliance.core.errors import InvalidArgument, Unavailable
from appliance.fronts.view import ModelView, ServingView, VersionView

T = TypeVar("T")
MAX_ATTEMPTS = 4  # decodes of one request while versions with other signatures swap in
CHANGED = "the model's versions changed with other signatures while this request was decoded; retry"
Key = tuple[str, "int | None", "str | None"]  # (model, version, label) as the request names them
# This request's answers learnt from the serving process: a view, or the error to raise.
PREFERRED: contextvars.ContextVar[Mapping[Key, Any]] = contextvars.ContextVar("front_preferred", default={})


class NeedView(BaseException):
    """The serving view does not know what the request names: ask (module docstring)."""

    def __init__(self, key: Key):
        super().__init__(*key)
        self.key = key


class StaleView(BaseException):
    """Decode again against ``view``, the version that answers (module docstring)."""

    def __init__(self, key: Key, view: VersionView):
        super().__init__(*key, view.version)
        self.key, self.view = key, view


class FrontMetrics:
    """``observe_request`` as the core's ``Metrics`` has it, counted by the serving process."""

    def __init__(self, link: Link):
        self.link = link

    def observe_request(self, model: str, api: str, status: int | str, seconds: float, entrypoint: str = "REST") -> None:
        self.link.send(m.OBSERVE, [[model, api, status, seconds, entrypoint]])


class RemoteHandle:
    """A core ``Handle``'s face for a version the serving process holds (module docstring)."""

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

    def run(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._outputs(*self._link.call(m.RUN, self._request(signature, inputs)))

    async def run_async(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._outputs(*await self._link.acall(m.RUN, self._request(signature, inputs)))

    def _request(self, signature: str, inputs: Mapping[str, np.ndarray]) -> list[Any]:
        view, (model, version, label) = self._view, self._key
        return m.RunRequest(model, version, label, self._headers, signature, dict(inputs), view.version,
                            view.fingerprints.get(signature, 0)).plain()

    def _outputs(self, kind: str, payload: Any) -> dict[str, np.ndarray]:
        if kind == m.DONE:
            self._answered = payload[0]
            return payload[1]  # type: ignore[no-any-return]
        if kind == m.STALE:
            raise StaleView(self._key, m.version_from_plain(payload))
        raise m.error_from_plain(payload)

    def release(self) -> None:
        """Nothing is held here: the serving process holds the version while it runs."""

    def __enter__(self) -> "RemoteHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class RemoteManager:
    """``manager.handle`` in a front worker (module docstring)."""

    def __init__(self, link: Link):
        self.link = link
        self.view = ServingView(0, {})

    def handle(self, name: str, version: int | None = None, label: str | None = None,
               route_key: Callable[[str], str | None] | None = None, judged: bool = True) -> RemoteHandle:
        key: Key = (name, version, label)
        learnt = PREFERRED.get().get(key)
        if isinstance(learnt, BaseException):
            raise learnt
        model = self.view.models.get(name)
        chosen = learnt if learnt is not None else _pick(model, version, label) if model is not None else None
        if chosen is None:
            raise NeedView(key)
        headers = {h: route_key(h) for h in model.route_headers} if model is not None and route_key else {}
        return RemoteHandle(self.link, key, headers, chosen)


def _pick(model: ModelView, version: int | None, label: str | None) -> VersionView | None:
    if label is not None:
        version = model.labels.get(label)
        if version is None:
            return None
    if version is None:
        version = model.serving
    return model.versions.get(version) if version is not None else None


def resolved(reply: tuple[str, Any]) -> VersionView | BaseException:
    """What a ``RESOLVE`` reply teaches: the version's view, or the manager's error."""
    kind, payload = reply
    return m.version_from_plain(payload) if kind == m.DONE else m.error_from_plain(payload)


def attempts(link: Link, run: Callable[[], T], again: Callable[[], None] = lambda: None) -> T:
    """``run()`` (on a thread) until it needs no other view of the versions (module
    docstring), ``again()`` before each new attempt; Unavailable after MAX_ATTEMPTS."""
    learnt: dict[Key, Any] = {}
    for attempt in range(MAX_ATTEMPTS):
        if attempt:
            again()
        token = PREFERRED.set(learnt)
        try:
            return run()
        except NeedView as need:
            learnt = {**learnt, need.key: resolved(link.call(m.RESOLVE, list(need.key)))}
        except StaleView as stale:
            learnt = {**learnt, stale.key: stale.view}
        finally:
            PREFERRED.reset(token)
    raise Unavailable(CHANGED)


async def attempts_async(link: Link, run: Callable[[], Awaitable[T]], again: Callable[[], None] = lambda: None) -> T:
    """``attempts`` on an event loop."""
    learnt: dict[Key, Any] = {}
    for attempt in range(MAX_ATTEMPTS):
        if attempt:
            again()
        token = PREFERRED.set(learnt)
        try:
            return await run()
        except NeedView as need:
            learnt = {**learnt, need.key: resolved(await link.acall(m.RESOLVE, list(need.key)))}
        except StaleView as stale:
            learnt = {**learnt, stale.key: stale.view}
        finally:
            PREFERRED.reset(token)
    raise Unavailable(CHANGED)


class RemoteCore:
    """A front worker's core: what the API handlers read of ``Appliance`` (module docstring)."""

    def __init__(self, config: Config, link: Link):
        self.config = config
        self.link = link
        self.manager = RemoteManager(link)
        self.metrics = FrontMetrics(link)

    def add_status(self, name: str, provider: Callable[[], Any]) -> None:
        """Status lives in the serving process; a worker shows none of its own."""
