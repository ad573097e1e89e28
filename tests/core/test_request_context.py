"""The request's scheduling hints travel as data (appliance/core/request_context.py): each call
carries its own ``RequestContext`` to the batch queue. Calls on one loop and in one task take
the paths their own contexts say; a call that carries none is never alone. No ambient state is
left: the HTTP server puts the context in the request's environ, the lean gRPC server on each
call's context object, and both reach the batch queue through ``run``.
"""

from __future__ import annotations

import ast
import asyncio
import threading
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import pytest

from appliance.core import batcher as batcher_module
from appliance.core.batcher import Batcher
from appliance.core.config import BatchingConfig
from appliance.core.handle import Handle
from appliance.core.request_context import NO_CONTEXT, RequestContext, of_environ, of_grpc

WAIT = 30.0  # seconds: a hang guard only, never a timing assertion


class Recording:
    """A backend, y = 2x + 1, that records which thread ran each batch (by its first value)."""

    def __init__(self) -> None:
        self.ran_on: dict[float, str] = {}

    def __call__(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        for value in x[:, 0]:
            self.ran_on[float(value)] = threading.current_thread().name
        return {"y": 2 * x + 1}


class _Servable:
    signatures: dict[str, Any] = {}  # no declared signature: the handle batches whatever comes
    strict_shapes = False


class _Slot:
    model, version, path = "m", 1, "/nowhere"
    servable: Any = _Servable()

    def __init__(self, batcher: Batcher):
        self.batcher = batcher


class _Holder:
    rollouts = None
    metrics = None

    def release_slot(self, slot: Any) -> None:
        pass

    def handle(self, *args: Any, **kw: Any) -> Handle:
        raise AssertionError("not routed: never asked")


def row(value: float) -> np.ndarray:
    return np.full((1, 1), value, dtype=np.float32)


async def _idle(batcher: Batcher, rows: int) -> None:
    """Until the batcher booked ``rows`` rows and no batch runs (a batch thread books just after answering)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT
    while not (batcher.snapshot()["rows"] == rows and not batcher._busy):
        assert loop.time() < deadline, f"the batcher never booked {rows} rows and went idle"
        await asyncio.sleep(0.005)


@pytest.fixture
def quick_batcher(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(batcher_module, "INLINE_RUN_S", 10.0)  # every measured run counts as quick
    backend = Recording()
    batcher = Batcher(backend, BatchingConfig(max_batch_size=8, batch_timeout_micros=1000, max_enqueued_batches=8),
                      "ctx", 1)
    yield batcher, backend
    batcher.close()


def test_calls_in_one_task_take_the_paths_their_own_contexts_say(quick_batcher: Any) -> None:
    """Two concurrent calls on one loop, in one task: the call whose context says alone runs on
    the loop, the one whose context says not alone (or that has none) on a batch thread."""
    batcher, backend = quick_batcher

    async def main() -> str:
        await batcher.submit("s", {"x": row(0)})  # measured: quick from now on
        await _idle(batcher, 1)
        alone, crowded = RequestContext(lambda: True), RequestContext(lambda: False)
        results = await asyncio.gather(batcher.submit("s", {"x": row(1)}, alone),
                                       batcher.submit("s", {"x": row(2)}, crowded))
        for value, out in zip((1, 2), results):
            np.testing.assert_allclose(out["y"], 2 * row(value) + 1)
        await _idle(batcher, 3)
        await batcher.submit("s", {"x": row(3)}, NO_CONTEXT)
        return threading.current_thread().name

    loop_thread = asyncio.run(main())
    assert backend.ran_on[1.0] == loop_thread
    assert backend.ran_on[2.0] != loop_thread and backend.ran_on[3.0] != loop_thread


def test_the_handle_hands_the_context_it_is_given_to_the_queue(quick_batcher: Any) -> None:
    """Through the seam (``Handle.run``): the context given is what the batch queue gets; none
    given is never alone."""
    batcher, backend = quick_batcher
    held = Handle(_Holder(), _Slot(batcher))

    async def main() -> str:
        await held.run("s", {"x": row(0)})
        await _idle(batcher, 1)
        await held.run("s", {"x": row(1)}, RequestContext(lambda: False))  # explicit: not alone
        await _idle(batcher, 2)
        await held.run("s", {"x": row(2)})  # none given: not alone
        await _idle(batcher, 3)
        await held.run("s", {"x": row(3)}, RequestContext(lambda: True))  # explicit: alone
        return threading.current_thread().name

    loop_thread = asyncio.run(main())
    assert backend.ran_on[1.0] != loop_thread
    assert backend.ran_on[2.0] != loop_thread
    assert backend.ran_on[3.0] == loop_thread


def test_no_ambient_state_is_left() -> None:
    """The module defines no context variable, and no module sets or reads the old bridge."""
    root = Path(__file__).resolve().parents[2] / "appliance"
    tree = ast.parse((root / "core" / "request_context.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert "contextvars" not in imported and "ContextVar" not in imported
    for path in root.rglob("*.py"):
        text = path.read_text()
        for gone in ("CALL_ALONE", "alone_var", "from_call", "ContextVar[Callable[[], bool]"):
            assert gone not in text, f"{path}: {gone}"


def test_a_context_is_read_off_the_request_not_the_task() -> None:
    """``of_environ``: what the HTTP server put in the environ; ``of_grpc``: what the lean
    server's call context carries; grpcio's context (no ``alone``) and a bare environ: none."""
    context = RequestContext(lambda: True)
    assert of_environ({"appliance.request_context": context}) is context
    assert of_environ({}) is NO_CONTEXT and of_environ({"appliance.request_context": "x"}) is NO_CONTEXT

    class Lean:
        alone = staticmethod(lambda: True)

    assert of_grpc(Lean()).is_alone() and of_grpc(object()) is NO_CONTEXT


@pytest.fixture
def told(quick_batcher: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Handle, list[bool]]]:
    """A handle on the quick batcher whose ``submit`` records whether each call's context said alone."""
    batcher, _ = quick_batcher
    said: list[bool] = []
    submit = Batcher.submit

    async def recording(self: Any, signature: str, inputs: Any, context: RequestContext = NO_CONTEXT) -> Any:
        said.append(context.is_alone())
        return await submit(self, signature, inputs, context)

    monkeypatch.setattr(Batcher, "submit", recording)
    yield Handle(_Holder(), _Slot(batcher)), said


@pytest.mark.parametrize("batches", [True, False])
def test_a_rest_call_carries_its_servers_context_to_the_queue(told: Any, batches: bool) -> None:
    """The HTTP server puts the request's context in a fast route's environ (the app facing it
    batches); the route reads it off the environ and passes it to ``run``. A lone request is
    told it is alone at the queue; a server whose app does not batch puts none."""
    from appliance.core.config import LimitsConfig
    from appliance.fronts.app import facing
    from appliance.transport.http.server import HTTPServer

    held, said = told

    async def answer(environ: dict[str, Any]) -> Any:
        await held.run("s", {"x": row(1)}, of_environ(environ))
        return "200 OK", [("Content-Length", "2")], b"ok"

    class Routes:
        def route(self, environ: dict[str, Any]) -> Any:
            return answer

    server = HTTPServer(lambda environ, start: [], "127.0.0.1", 0, 1, 1 << 20, limits=LimitsConfig(),
                        fast=Routes(), facing=facing(batches=batches))
    loop = threading.Thread(target=server.serve_forever, name="http-under-test")
    loop.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/run", timeout=WAIT) as reply:
            assert reply.read() == b"ok"
    finally:
        server.close()
        loop.join(WAIT)
    assert said == [batches]


@pytest.mark.parametrize("tells", [True, False])
def test_a_grpc_call_carries_its_servers_context_to_the_queue(told: Any, tells: bool) -> None:
    """The lean gRPC server gives each call's context its lone-call predicate; the method
    (wrapped as the API families wrap theirs, ``guarded_run``) gets the call's
    ``RequestContext`` and passes it to ``run``. A server that does not tell: never alone."""
    import grpc

    from appliance.api.grpc_errors import guarded_run
    from appliance.transport.grpc.h2_server import LeanServer

    held, said = told

    async def method(request: bytes, context: RequestContext) -> bytes:
        await held.run("s", {"x": row(1)}, context)
        return b"ok"

    handler = grpc.method_handlers_generic_handler(
        "t.Test", {"Run": grpc.unary_unary_rpc_method_handler(guarded_run(method, "Run"))})
    server = LeanServer(1, tells_alone=tells)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert channel.unary_unary("/t.Test/Run")(b"", timeout=WAIT) == b"ok"
    finally:
        server.stop(None)
    assert said == [tells]


def test_the_context_is_frozen() -> None:
    context = RequestContext(lambda: True)
    with pytest.raises(AttributeError):
        context.alone = None  # type: ignore[misc]
    assert context.is_alone() and not NO_CONTEXT.is_alone()
