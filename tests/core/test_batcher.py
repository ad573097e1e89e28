"""appliance.core.batcher.Batcher, driven directly.

A "gated" numpy backend holds its first batch until the test has queued the requests it
wants merged, so the batches that form are decided by the test, not by timing. One test
runs a real LiteRT servable (the Keras MLP) from many threads and compares every answer
with the model called in-process.
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import pytest

from tests.support.servers import poll_until

from appliance.core.batcher import Batcher
from appliance.core.config import BatchingConfig
from appliance.core.errors import InvalidArgument, QueueFull
from appliance.core.request_context import RequestContext
from runtimes import InputFailure

WAIT = 30  # seconds: a hang guard only, never a timing assertion


class Gated:
    """A backend: y = 2x + 1 per row; records every batch; the first batch waits for ``open()``."""

    def __init__(self, fail_when: Callable[[np.ndarray], bool] | None = None):
        self.batches: list[np.ndarray] = []
        self.entered = threading.Event()
        self._gate = threading.Event()
        self._fail_when = fail_when
        self._lock = threading.Lock()

    def open(self) -> None:
        self._gate.set()

    def __call__(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = inputs["x"]
        with self._lock:
            self.batches.append(x.copy())
        self.entered.set()
        assert self._gate.wait(WAIT), "the test never opened the gate"
        if self._fail_when is not None and self._fail_when(x):
            raise InputFailure("negative values are not allowed")
        return {"y": 2 * x + 1, "sig": np.full((x.shape[0],), len(signature))}


def params(**kw: Any) -> BatchingConfig:
    base = dict(max_batch_size=32, batch_timeout_micros=1000, max_enqueued_batches=64)
    base.update(kw)
    return BatchingConfig(**base)


@pytest.fixture
def batcher_factory():
    made: list[Batcher] = []

    def make(run: Any, threads: int = 1, **kw: Any) -> Batcher:
        b = Batcher(run, params(**kw), "test", threads)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


class Client(threading.Thread):
    """One caller of ``submit`` in its own thread; keeps the result or the error."""

    def __init__(self, batcher: Batcher, x: np.ndarray, signature: str = "serving_default"):
        super().__init__(daemon=True)
        self.batcher, self.x, self.signature = batcher, x, signature
        self.result: dict[str, np.ndarray] | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = submit(self.batcher, self.signature, {"x": self.x})
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def outcome(self) -> dict[str, np.ndarray]:
        self.join(WAIT)
        assert not self.is_alive(), "submit never returned"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def submit(batcher: Batcher, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``batcher.submit`` awaited by a caller on a loop of its own (a thread of the test)."""
    return asyncio.run(batcher.submit(signature, inputs))


def wait_queued(batcher: Batcher, rows: int) -> None:
    """Until ``rows`` rows wait in the queue (the gated first batch is not counted)."""
    deadline = threading.Event()
    for _ in range(WAIT * 100):
        if batcher.snapshot()["queue_depth_rows"] >= rows:
            return
        deadline.wait(0.01)
    raise AssertionError(f"queue never reached {rows} rows: {batcher.snapshot()}")


def hold_first_batch(batcher: Batcher, backend: Gated, x: np.ndarray | None = None) -> Client:
    """Occupy the only worker with one request, so what comes next queues up."""
    first = Client(batcher, np.array([[100.0]], np.float32) if x is None else x)
    assert backend.entered.wait(WAIT)
    return first


def rows(i: int, n: int = 1, width: int = 1) -> np.ndarray:
    return (np.arange(n * width, dtype=np.float32).reshape(n, width) + 10 * i)


def test_concurrent_requests_merge_and_each_gets_its_own_rows(batcher_factory) -> None:
    backend = Gated()
    batcher = batcher_factory(backend)
    first = hold_first_batch(batcher, backend)
    clients = [Client(batcher, rows(i, n=1 + i % 3)) for i in range(7)]
    wait_queued(batcher, sum(1 + i % 3 for i in range(7)))
    backend.open()
    for i, client in enumerate(clients):
        out = client.outcome()
        np.testing.assert_allclose(out["y"], 2 * rows(i, n=1 + i % 3) + 1)
        assert out["sig"].shape == (1 + i % 3,)
    np.testing.assert_allclose(first.outcome()["y"], [[201.0]])
    assert len(backend.batches) == 2 < 8, [b.shape for b in backend.batches]  # 8 requests, 2 backend calls
    assert backend.batches[1].shape[0] == sum(1 + i % 3 for i in range(7))
    snap = batcher.snapshot()
    assert snap["batches"] == 2 and snap["rows"] == 1 + sum(1 + i % 3 for i in range(7))


def test_requests_of_different_shapes_are_not_merged(batcher_factory) -> None:
    backend = Gated()
    batcher = batcher_factory(backend)
    first = hold_first_batch(batcher, backend)
    narrow = [Client(batcher, rows(i, width=2)) for i in range(2)]
    wide = [Client(batcher, rows(i, width=3)) for i in range(2)]
    wait_queued(batcher, 4)
    backend.open()
    for i, c in enumerate(narrow):
        np.testing.assert_allclose(c.outcome()["y"], 2 * rows(i, width=2) + 1)
    for i, c in enumerate(wide):
        np.testing.assert_allclose(c.outcome()["y"], 2 * rows(i, width=3) + 1)
    first.outcome()
    widths = sorted(b.shape for b in backend.batches[1:])
    assert widths == [(2, 2), (2, 3)]


def test_requests_of_different_signatures_are_not_merged(batcher_factory) -> None:
    backend = Gated()
    batcher = batcher_factory(backend)
    first = hold_first_batch(batcher, backend)
    a = Client(batcher, rows(1), "a")
    bb = Client(batcher, rows(2), "bb")
    wait_queued(batcher, 2)
    backend.open()
    assert a.outcome()["sig"].tolist() == [1.0] and bb.outcome()["sig"].tolist() == [2.0]
    first.outcome()
    assert len(backend.batches) == 3


def test_allowed_batch_sizes_pad_and_padding_is_dropped(batcher_factory) -> None:
    backend = Gated()
    batcher = batcher_factory(backend, max_batch_size=8, allowed_batch_sizes=[4, 8])
    first = hold_first_batch(batcher, backend)  # 1 row, padded to 4
    clients = [Client(batcher, rows(i, n=2)) for i in range(2)] + [Client(batcher, rows(5))]
    wait_queued(batcher, 5)
    backend.open()
    for i, c in enumerate(clients[:2]):
        out = c.outcome()
        assert out["y"].shape == (2, 1)
        np.testing.assert_allclose(out["y"], 2 * rows(i, n=2) + 1)
    np.testing.assert_allclose(clients[2].outcome()["y"], 2 * rows(5) + 1)
    assert first.outcome()["y"].shape == (1, 1)
    assert [b.shape[0] for b in backend.batches] == [4, 8]  # 1 -> 4 and 5 -> 8 rows
    assert batcher.snapshot()["padded_rows"] == 3 + 3


def test_a_request_over_max_batch_size_is_split(batcher_factory) -> None:
    backend = Gated()
    backend.open()
    batcher = batcher_factory(backend, max_batch_size=4)
    x = rows(0, n=10)
    out = submit(batcher, "serving_default", {"x": x})
    np.testing.assert_allclose(out["y"], 2 * x + 1)
    assert out["sig"].shape == (10,)
    assert sorted(b.shape[0] for b in backend.batches) == [2, 4, 4]
    assert all(b.shape[0] <= 4 for b in backend.batches)


def test_a_request_over_max_batch_size_is_refused_without_splitting(batcher_factory) -> None:
    backend = Gated()
    backend.open()
    batcher = batcher_factory(backend, max_batch_size=4, split_large_requests=False)
    with pytest.raises(InvalidArgument) as info:
        submit(batcher, "serving_default", {"x": rows(0, n=5)})
    assert info.value.http_status == 400
    assert info.value.message.startswith("Task size 5 is larger than maximum input batch size 4")  # TF Serving's
    assert "max_batch_size" in info.value.message
    assert backend.batches == []
    out = submit(batcher, "serving_default", {"x": rows(0, n=4)})  # at the limit: fine
    np.testing.assert_allclose(out["y"], 2 * rows(0, n=4) + 1)


def test_a_request_larger_than_the_whole_queue_is_a_permanent_400(batcher_factory, loop_thread) -> None:
    """With splitting, the most rows a request may have is what the queue holds: one larger
    could never be queued, however long a client waited, so it is no QueueFull (503, retry)
    but TF Serving's INVALID_ARGUMENT, on both ways in; one that fits is split and answered."""
    backend = Gated()
    backend.open()
    batcher = batcher_factory(backend, max_batch_size=2, max_enqueued_batches=2)  # the queue holds 4 rows
    calls = {"own loop": lambda x: submit(batcher, "serving_default", {"x": x}),
             "shared loop": lambda x: loop_thread.submit(batcher.submit("serving_default", {"x": x})).result(WAIT)}
    for name, call in calls.items():
        with pytest.raises(InvalidArgument) as info:
            call(rows(0, n=5))
        assert not isinstance(info.value, QueueFull) and info.value.http_status == 400, name
        assert info.value.retry_after is None and info.value.grpc_code == "INVALID_ARGUMENT", name
        message = info.value.message
        assert message.startswith("Task size 5 is larger than maximum input batch size 4"), message
        assert "max_enqueued_batches 2" in message and "max_batch_size 2" in message, message
        assert backend.batches == [], name
        np.testing.assert_allclose(call(rows(1, n=4))["y"], 2 * rows(1, n=4) + 1)  # the whole queue: split, served
        backend.batches.clear()
    assert batcher.snapshot()["rejected_full"] == 0  # never counted as a full queue


def test_full_queue_refuses_at_once(batcher_factory) -> None:
    backend = Gated()
    batcher = batcher_factory(backend, max_batch_size=2, max_enqueued_batches=1)  # room for 2 queued rows
    first = hold_first_batch(batcher, backend)
    queued = [Client(batcher, rows(i)) for i in range(2)]
    wait_queued(batcher, 2)
    refused = Client(batcher, rows(9))
    with pytest.raises(QueueFull) as info:
        refused.outcome()  # returns while the worker is still held: it did not wait for room
    assert info.value.http_status == 503 and info.value.retry_after
    assert batcher.snapshot()["rejected_full"] == 1
    backend.open()
    for i, c in enumerate(queued):
        np.testing.assert_allclose(c.outcome()["y"], 2 * rows(i) + 1)
    first.outcome()
    np.testing.assert_allclose(submit(batcher, "s", {"x": rows(3)})["y"], 2 * rows(3) + 1)  # room again


def test_a_bad_member_fails_alone(batcher_factory) -> None:
    backend = Gated(fail_when=lambda x: bool((x < 0).any()))
    batcher = batcher_factory(backend)
    first = hold_first_batch(batcher, backend)
    good1 = Client(batcher, rows(1, n=2))
    bad = Client(batcher, -rows(2) - 1)
    good2 = Client(batcher, rows(3))
    wait_queued(batcher, 4)
    backend.open()
    np.testing.assert_allclose(good1.outcome()["y"], 2 * rows(1, n=2) + 1)
    np.testing.assert_allclose(good2.outcome()["y"], 2 * rows(3) + 1)
    with pytest.raises(InvalidArgument) as info:
        bad.outcome()
    assert "negative" in info.value.message
    first.outcome()
    assert backend.batches[1].shape[0] == 4  # they were merged, then retried one by one


def test_a_backend_bug_is_an_error_not_a_dead_worker(batcher_factory) -> None:
    calls = []

    def run(signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(inputs["x"].shape)
        if len(calls) == 1:
            raise ZeroDivisionError("boom")
        return {"y": inputs["x"] * 3}

    batcher = batcher_factory(run)
    with pytest.raises(Exception) as info:
        submit(batcher, "s", {"x": rows(0)})
    assert getattr(info.value, "http_status", None) == 500
    np.testing.assert_allclose(submit(batcher, "s", {"x": rows(1)})["y"], 3 * rows(1))


def test_a_lone_request_does_not_wait_for_the_batch_timeout(batcher_factory) -> None:
    backend = Gated()
    backend.open()
    batcher = batcher_factory(backend, batch_timeout_micros=600_000_000)  # ten minutes
    x = rows(4, n=3)
    out = submit(batcher, "serving_default", {"x": x})  # would hang if it waited for the batch timeout
    np.testing.assert_allclose(out["y"], 2 * x + 1)
    assert [b.shape[0] for b in backend.batches] == [3]
    assert batcher.snapshot()["batches"] == 1


def test_unbatchable_inputs_run_directly(batcher_factory) -> None:
    """A scalar input cannot be split by rows: it bypasses the queue and still gets its answer."""
    seen = []

    def run(signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        seen.append(inputs["x"].shape)
        return {"y": inputs["x"] + 1}

    batcher = batcher_factory(run)
    out = submit(batcher, "s", {"x": np.float32(2.0) * np.ones((), np.float32)})
    assert float(out["y"]) == 3.0 and seen == [()]


def test_close_finishes_what_is_queued(batcher_factory) -> None:
    backend = Gated()
    batcher = batcher_factory(backend)
    first = hold_first_batch(batcher, backend)
    queued = [Client(batcher, rows(i)) for i in range(3)]
    wait_queued(batcher, 3)
    closer = threading.Thread(target=batcher.close)
    closer.start()
    backend.open()
    closer.join(WAIT)
    assert not closer.is_alive()
    for i, c in enumerate(queued):
        np.testing.assert_allclose(c.outcome()["y"], 2 * rows(i) + 1)
    first.outcome()


def test_real_litert_servable_under_concurrency(models_dir: Path, batcher_factory) -> None:
    from runtimes import TFLiteBackend
    from tests.support.modelgen import reference_predict_tflite
    from tests.runtimes.test_runtimes import mlp_tflite

    tflite = mlp_tflite(models_dir)
    servable = TFLiteBackend().load(os.path.dirname(tflite), {"num_threads": 1, "pool_size": 2})
    try:
        batcher = batcher_factory(servable.run, threads=2, max_batch_size=16)
        rng = np.random.default_rng(7)
        inputs = [rng.standard_normal((1 + i % 4, 64)).astype(np.float32) for i in range(24)]
        clients = [Client(batcher, x) for x in inputs]
        for x, c in zip(inputs, clients):
            got = c.outcome()["probs"]
            want = reference_predict_tflite(tflite, {"x": x})["probs"]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        snap = batcher.snapshot()
        assert snap["rows"] == sum(len(x) for x in inputs)
    finally:
        batcher.close()
        servable.close()


# -- callers sharing one event loop (the HTTP server's, the gRPC server's) -----------------------
class LoopThread:
    """An event loop in its own thread, as appliance/service/grpc_port.py runs one."""

    def __init__(self) -> None:
        import asyncio

        self.asyncio = asyncio
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro: Any) -> Any:
        return self.asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT)
        self.loop.close()


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


def test_async_and_thread_requests_share_a_batch_and_get_their_own_rows(batcher_factory, loop_thread) -> None:
    backend = Gated()
    batcher = batcher_factory(backend)
    first = hold_first_batch(batcher, backend)
    awaited = [loop_thread.submit(batcher.submit("serving_default", {"x": rows(i, n=2)})) for i in range(5)]
    threaded = [Client(batcher, rows(10 + i)) for i in range(3)]
    wait_queued(batcher, 5 * 2 + 3)
    backend.open()
    for i, future in enumerate(awaited):
        np.testing.assert_allclose(future.result(WAIT)["y"], 2 * rows(i, n=2) + 1)
    for i, client in enumerate(threaded):
        np.testing.assert_allclose(client.outcome()["y"], 2 * rows(10 + i) + 1)
    first.outcome()
    assert [b.shape[0] for b in backend.batches] == [1, 13]  # one batch for all eight waiting requests


def test_async_requests_alone_are_run_by_the_batchers_own_threads(batcher_factory, loop_thread) -> None:
    backend = Gated()
    backend.open()
    batcher = batcher_factory(backend, threads=2, max_batch_size=4)
    futures = [loop_thread.submit(batcher.submit("serving_default", {"x": rows(i, n=3)})) for i in range(20)]
    for i, future in enumerate(futures):
        np.testing.assert_allclose(future.result(WAIT)["y"], 2 * rows(i, n=3) + 1)
    big = loop_thread.submit(batcher.submit("serving_default", {"x": rows(0, n=10)}))  # split in 3 tasks
    np.testing.assert_allclose(big.result(WAIT)["y"], 2 * rows(0, n=10) + 1)
    assert max(b.shape[0] for b in backend.batches) <= 4


def test_async_errors_and_a_full_queue_reach_the_caller(batcher_factory, loop_thread) -> None:
    backend = Gated(fail_when=lambda x: bool((x < 0).any()))
    batcher = batcher_factory(backend, max_batch_size=2, max_enqueued_batches=2)
    first = hold_first_batch(batcher, backend)
    bad = loop_thread.submit(batcher.submit("serving_default", {"x": -rows(1)}))
    good = loop_thread.submit(batcher.submit("serving_default", {"x": rows(2)}))
    wait_queued(batcher, 2)
    with pytest.raises(QueueFull):  # 2 queued + 3 > 2 batches of 2 rows
        loop_thread.submit(batcher.submit("serving_default", {"x": rows(3, n=3)})).result(WAIT)
    backend.open()
    with pytest.raises(InvalidArgument):
        bad.result(WAIT)
    np.testing.assert_allclose(good.result(WAIT)["y"], 2 * rows(2) + 1)  # the bad member failed alone
    first.outcome()


def test_a_cancelled_async_request_leaves_the_queue(batcher_factory, loop_thread) -> None:
    backend = Gated()
    batcher = batcher_factory(backend)
    first = hold_first_batch(batcher, backend)
    gone = loop_thread.submit(batcher.submit("serving_default", {"x": rows(1, n=5)}))
    kept = loop_thread.submit(batcher.submit("serving_default", {"x": rows(2)}))
    wait_queued(batcher, 6)
    gone.cancel()  # what the gRPC server does when the client goes away
    wait_until = threading.Event()
    for _ in range(WAIT * 100):
        if batcher.snapshot()["queue_depth_rows"] == 1:
            break
        wait_until.wait(0.01)
    assert batcher.snapshot()["queue_depth_rows"] == 1
    backend.open()
    np.testing.assert_allclose(kept.result(WAIT)["y"], 2 * rows(2) + 1)
    first.outcome()
    assert [b.shape[0] for b in backend.batches] == [1, 1]  # the cancelled rows never ran


def test_a_lone_call_of_a_quick_model_runs_on_its_loop_and_others_queue(batcher_factory, loop_thread,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A request context saying the call is alone (core/request_context.py) lets it run a quick
    model right there on its loop; a call that is not alone, a caller that passes none, or a slow model go
    through the batcher's own threads. "Quick" is a measured average: the test sets what the
    model measured instead of relying on how busy the machine is (a loaded box made the
    measured 2x+1 slower than INLINE_RUN_S and the test fail at random)."""
    from appliance.core import batcher as batcher_module

    monkeypatch.setattr(batcher_module, "INLINE_RUN_S", 10.0)  # every measured run counts as quick

    ran_on: list[str] = []

    def backend(signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        ran_on.append(threading.current_thread().name)
        if (inputs["x"] < 0).any():
            raise InputFailure("negative values are not allowed")
        return {"y": 2 * inputs["x"] + 1}

    batcher = batcher_factory(backend)
    alone = {"now": True}

    async def call(x: np.ndarray, lone: bool | None) -> Any:
        if lone is None:
            return await batcher.submit("serving_default", {"x": x})
        alone["now"] = lone
        return await batcher.submit("serving_default", {"x": x}, RequestContext(lambda: alone["now"]))

    def run(x: np.ndarray, lone: bool | None) -> Any:  # each call a task, with a context of its own
        return loop_thread.submit(call(x, lone)).result(WAIT)

    loop_name = loop_thread.submit(_thread_name()).result(WAIT)
    def settled(n: int) -> None:  # a batch thread books its batch just after answering: idle again
        poll_until(lambda: batcher.snapshot()["rows"] == n and not batcher._busy, 10, f"{n} rows booked, the batcher idle")

    np.testing.assert_allclose(run(rows(1), True)["y"], 2 * rows(1) + 1)
    assert ran_on[-1] != loop_name  # no run measured yet: the model is not known to be quick
    settled(1)
    np.testing.assert_allclose(run(rows(2), True)["y"], 2 * rows(2) + 1)
    assert ran_on[-1] == loop_name
    with pytest.raises(InvalidArgument, match="negative"):  # errors come back as from a batch
        run(-rows(3), True)
    assert ran_on[-1] == loop_name
    run(rows(4), False)
    assert ran_on[-1] != loop_name
    settled(4)
    run(rows(5), None)
    assert ran_on[-1] != loop_name
    settled(5)  # counted as batches of one
    batcher.stats.run_seconds = batcher.stats.batches * 2 * batcher_module.INLINE_RUN_S  # as a slow model
    run(rows(6), True)
    assert ran_on[-1] != loop_name


async def _thread_name() -> str:
    return threading.current_thread().name


def test_a_lone_call_of_a_slow_model_goes_to_the_wide_run_and_others_do_not(loop_thread) -> None:
    """With ``run_wide`` (a servable that can give a lone batch every core, runtimes/base.py),
    a call whose context says it is alone of a model measured slow goes there when no
    other batch runs; a call not said alone, one taken while another batch runs, or one of a
    quick model goes to ``run``. (The test sets what the model measured, as the lone-call
    test does.)"""
    narrow, wide = Gated(), Gated()
    batcher = Batcher(narrow, params(max_batch_size=1), "test", 2, run_wide=wide)

    async def call(x: np.ndarray, lone: bool) -> Any:
        return await batcher.submit("serving_default", {"x": x}, RequestContext(lambda: lone))

    def run(x: np.ndarray, lone: bool) -> Any:
        return loop_thread.submit(call(x, lone))

    try:
        narrow.open()
        run(rows(0), True).result(WAIT)  # not measured yet: as any batch
        batcher.stats.run_seconds = 0.0  # measured quick: more threads would not pay
        run(rows(0), True).result(WAIT)
        assert len(narrow.batches) == 2 and wide.batches == []
        batcher.stats.run_seconds = 1e6  # as a slow model, whatever the next batches measure
        run(rows(0), False).result(WAIT)  # not said alone: as any batch
        assert len(narrow.batches) == 3 and wide.batches == []
        narrow.batches.clear()
        narrow._gate.clear()
        wide.open()
        np.testing.assert_allclose(run(rows(1), True).result(WAIT)["y"], 2 * rows(1) + 1)
        assert [len(b) for b in wide.batches] == [1] and narrow.batches == []
        wide._gate.clear()  # the next lone call waits inside the wide run
        wide.entered.clear()
        first = run(rows(2), True)
        assert wide.entered.wait(WAIT)
        narrow.open()
        second = run(rows(3), True)  # taken by the other thread while the first runs: not alone
        np.testing.assert_allclose(second.result(WAIT)["y"], 2 * rows(3) + 1)
        assert len(narrow.batches) == 1
        wide.open()
        first.result(WAIT)
        assert len(wide.batches) == 2
    finally:
        batcher.close()
