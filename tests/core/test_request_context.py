"""The request's scheduling hints travel as data (appliance/core/request_context.py): each call
carries its own ``RequestContext`` to the batch queue, whatever the ambient state of the task
it runs in. Calls on one loop and in one task take the paths their own contexts say; the old
ambient variable (still set by servers whose API families pass none) decides only for a call
that carries no context, at the seam (``Handle.run``), never in the batch queue.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Mapping

import numpy as np
import pytest

from appliance.core import batcher as batcher_module
from appliance.core.batcher import Batcher
from appliance.core.config import BatchingConfig
from appliance.core.handle import Handle
from appliance.core.request_context import CALL_ALONE, NO_CONTEXT, RequestContext, from_call

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
    """Two concurrent calls on one loop, in one task's context where the ambient variable says
    "alone": the call whose context says alone runs on the loop, the one whose context says
    not alone (or that has none) on a batch thread. Read from the ambient state instead, both
    would run on the loop; dropped on the way, both on a thread."""
    batcher, backend = quick_batcher

    async def main() -> str:
        CALL_ALONE.set(lambda: True)  # the batch queue must not read it
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
    """Through the seam (``Handle.run``): an explicit context is what the batch queue gets, over
    what the call's server set ambiently; without one, the ambient bridge (``from_call``)
    decides, as it does for the API families that pass none yet."""
    batcher, backend = quick_batcher
    held = Handle(_Holder(), _Slot(batcher))

    async def main() -> str:
        assert from_call() is NO_CONTEXT  # nothing set: never alone
        await held.run("s", {"x": row(0)})
        await _idle(batcher, 1)
        CALL_ALONE.set(lambda: True)
        assert from_call().is_alone()
        await held.run("s", {"x": row(1)}, RequestContext(lambda: False))  # explicit: not alone
        await _idle(batcher, 2)
        await held.run("s", {"x": row(2)})  # none given: the server's word
        await _idle(batcher, 3)
        CALL_ALONE.set(None)
        await held.run("s", {"x": row(3)}, RequestContext(lambda: True))  # explicit: alone
        return threading.current_thread().name

    loop_thread = asyncio.run(main())
    assert backend.ran_on[1.0] != loop_thread
    assert backend.ran_on[2.0] == loop_thread
    assert backend.ran_on[3.0] == loop_thread


def test_the_context_is_frozen() -> None:
    context = RequestContext(lambda: True)
    with pytest.raises(AttributeError):
        context.alone = None  # type: ignore[misc]
    assert context.is_alone() and not NO_CONTEXT.is_alone()
