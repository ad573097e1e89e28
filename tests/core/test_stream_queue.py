"""The admission queue of token streams (appliance/core/stream_limits.py): a burst waits for
room instead of a 503; a refusal only when a model's queue is full or the wait ran out; the
model holding the least of the cache goes first when room frees (here no stream holds a cache:
each counts the same fixed cost, so the fewest running streams; bytes: test_stream_limits_cache.py)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from appliance.core.errors import QueueFull, Unavailable
from appliance.core.stream_limits import StreamLimits
from tests.support.servers import poll_until


@dataclass
class Config:
    max_streams: int = 2
    max_streams_per_model: int = 0
    reserved_streams_per_model: int = 0
    max_queued_per_model: int = 3
    queue_timeout_s: float = 120.0


class Observer:
    def __init__(self) -> None:
        self.depth: dict[str, int] = {}
        self.waits: list[tuple[str, float]] = []

    def queued(self, model: str, delta: int) -> None:
        self.depth[model] = self.depth.get(model, 0) + delta

    def waited(self, model: str, seconds: float) -> None:
        self.waits.append((model, seconds))


class Pool:
    """StreamLimits under its lock, as appliance/core/generation.py drives it."""

    def __init__(self, config: Config):
        self.lock = threading.Lock()
        self.observer = Observer()
        self.limits = StreamLimits(lambda: config, lambda: [], self.lock, self.observer)
        self.admitted: list[str] = []
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    def admit(self, model: str) -> None:
        with self.lock:
            self.limits.admit(model)
            self.admitted.append(model)

    def leave(self, model: str) -> None:
        with self.lock:
            self.limits.leave(model)

    def waiting(self) -> int:
        with self.lock:
            return len(self.limits.waiting)

    def start(self, model: str) -> None:
        def run() -> None:
            try:
                self.admit(model)
            except BaseException as exc:
                self.errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=120)
            assert not thread.is_alive(), "an admission never returned"


def wait(predicate: Callable[[], Any], what: str) -> None:
    poll_until(predicate, 60, what)


def test_a_burst_waits_and_is_admitted_as_streams_end() -> None:
    pool = Pool(Config())
    pool.admit("a")
    pool.admit("a")
    pool.start("a")
    pool.start("a")
    wait(lambda: pool.waiting() == 2, "two requests in the queue")
    assert pool.observer.depth == {"a": 2} and pool.admitted == ["a", "a"]
    pool.leave("a")
    wait(lambda: len(pool.admitted) == 3, "the first waiter to be admitted")
    pool.leave("a")
    pool.join()
    assert len(pool.admitted) == 4 and not pool.errors and pool.observer.depth == {"a": 0}
    assert [m for m, _ in pool.observer.waits] == ["a", "a"]


def test_a_full_queue_refuses_at_once_naming_the_limit() -> None:
    pool = Pool(Config(max_streams=1, max_queued_per_model=1))
    pool.admit("a")
    pool.start("a")
    wait(lambda: pool.waiting() == 1, "one request in the queue")
    with pytest.raises(QueueFull, match="max_queued_per_model"):
        pool.admit("a")
    pool.leave("a")
    pool.join()
    assert not pool.errors


def test_a_wait_past_the_deadline_is_a_retryable_refusal() -> None:
    pool = Pool(Config(max_streams=1, queue_timeout_s=0.05))
    pool.admit("a")
    with pytest.raises(Unavailable, match="queue_timeout_s") as refused:
        pool.admit("a")
    assert refused.value.retry_after and refused.value.http_status == 503
    assert pool.waiting() == 0 and pool.observer.depth == {"a": 0}


def test_the_model_with_fewest_streams_goes_first_without_reserved_slots() -> None:
    pool = Pool(Config(max_streams=2))
    pool.admit("a")
    pool.admit("a")  # one model alone takes the whole pool: nothing is kept back for others
    pool.start("a")
    wait(lambda: pool.waiting() == 1, "a's request in the queue")
    pool.start("b")
    wait(lambda: pool.waiting() == 2, "b's request in the queue behind it")
    pool.leave("a")
    wait(lambda: len(pool.admitted) == 3, "one waiter to be admitted")
    assert pool.admitted[2] == "b"  # b runs none, a runs one: b first, though it came later
    pool.leave("a")
    pool.join()
    assert pool.admitted[3] == "a" and not pool.errors


def test_a_request_no_wait_can_admit_is_refused_at_once() -> None:
    pool = Pool(Config(max_streams=2))
    with pytest.raises(Unavailable, match="more than model 'a' may ever run"):
        with pool.lock:
            pool.limits.admit("a", 3)
