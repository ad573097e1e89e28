"""Streams bounded by the KV cache memory they hold (appliance/core/stream_limits.py): a stream
is admitted while its cache row fits in ``generation.cache_memory_mb``; the next waits in its
model's queue until one ends; a flood of 1,000 never holds more than the total; the bytes per
stream are what a version's cache tensors declare (appliance/core/generation.py)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from appliance.core.config import GenerationConfig
from appliance.core.errors import Unavailable
from appliance.core.generation import AUTO_CACHE_SHARE, cache_budget, stream_bytes
from appliance.core.stream_limits import StreamLimits
from runtimes.decode_base import Driver, Slots

ROW = 32 << 10  # one stream's cache (32 KiB)


@dataclass
class Config:
    max_streams: int = 4096
    max_streams_per_model: int = 0
    reserved_streams_per_model: int = 0
    max_queued_per_model: int = 2000
    queue_timeout_s: float = 120.0


def _limits(total: int, config: Config | None = None) -> tuple[StreamLimits, threading.Lock]:
    lock = threading.Lock()
    conf = config or Config()
    return StreamLimits(lambda: conf, lambda: [], lock, None, lambda: total), lock


def test_stream_n_plus_1_waits_until_one_ends() -> None:
    """Three rows fit: the fourth request queues (it is not refused), and is admitted the
    moment one of the three ends; a model's bytes show as used."""
    limits, lock = _limits(3 * ROW)

    async def run() -> None:
        tickets = [await limits.reserve("a", 1, each=ROW) for _ in range(3)]
        assert limits.cache_bytes == 3 * ROW and limits.cache_used == {"a": 3 * ROW}
        fourth = asyncio.ensure_future(limits.reserve("a", 1, each=ROW))
        await asyncio.wait_for(_until(lambda: len(limits.waiting) == 1), 30)  # it waits: no room
        assert not fourth.done()
        with lock:
            limits.leave("a", ROW)  # one stream ends
        ticket = await asyncio.wait_for(fourth, 30)
        assert (ticket.model, ticket.each) == ("a", ROW)
        assert limits.cache_bytes == 3 * ROW and not limits.waiting
        for _ in tickets:
            with lock:
                limits.leave("a", ROW)
        with lock:
            limits.leave("a", ROW)
        assert limits.cache_bytes == 0 and limits.cache_used == {} and limits.running == {}

    asyncio.run(run())


def test_a_bigger_model_waits_for_its_bytes_not_a_count() -> None:
    """The bound is bytes: four small streams fit where one of a model with a 4x row would
    not; when the small ones end, the big one runs; a request larger than the total is
    refused at once, naming the setting."""
    limits, lock = _limits(4 * ROW)

    async def run() -> None:
        for _ in range(4):
            await limits.reserve("small", 1, each=ROW)
        big = asyncio.ensure_future(limits.reserve("big", 1, each=4 * ROW))
        await asyncio.wait_for(_until(lambda: len(limits.waiting) == 1), 30)
        for left in range(3):
            with lock:
                limits.leave("small", ROW)
            await asyncio.sleep(0)
            assert not big.done(), f"admitted with {left + 1} of 4 small streams ended"
        with lock:
            limits.leave("small", ROW)
        await asyncio.wait_for(big, 30)
        assert limits.cache_used == {"big": 4 * ROW}
        with pytest.raises(Unavailable, match="generation.cache_memory_mb"):
            await limits.reserve("big", 2, each=4 * ROW)  # 8 rows never fit in 4

    asyncio.run(run())


def test_the_count_ceiling_still_holds() -> None:
    """``generation.max_streams`` stays a ceiling for streams that hold no cache."""
    limits, _ = _limits(4 * ROW, Config(max_streams=2, queue_timeout_s=0))

    async def run() -> None:
        await limits.reserve("a", 1, each=0)
        await limits.reserve("a", 1, each=0)
        with pytest.raises(Unavailable, match="generation.max_streams = 2"):
            await limits.reserve("a", 1, each=0)

    asyncio.run(run())


def test_a_flood_of_1000_streams_stays_within_the_total() -> None:
    """1,000 requests of two models at once against room for 10 rows: every one is answered
    (queued, then admitted as others end), and the bytes held never pass the total."""
    total = 10 * ROW
    limits, lock = _limits(total)
    peak = {"bytes": 0, "streams": 0}

    async def one(i: int) -> None:
        model = "a" if i % 2 else "b"
        await limits.reserve(model, 1, each=ROW)
        with lock:
            peak["bytes"] = max(peak["bytes"], limits.cache_bytes)
            peak["streams"] = max(peak["streams"], limits.total)
        await asyncio.sleep(0)  # the stream runs a step
        with lock:
            limits.leave(model, ROW)

    async def run() -> None:
        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(1000))), 120)

    asyncio.run(run())
    assert peak["bytes"] <= total and peak["streams"] == 10, peak  # filled, never past it
    assert limits.cache_bytes == 0 and not limits.waiting


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


class _Cache(Driver):
    """A driver whose cache is two tensors per row, in a fixed decode batch of 4."""

    batch_size = 4

    def new_slots(self, capacity: int) -> Slots:
        rows = self.batch_size
        return Slots(rows, {"k": np.zeros((rows, 64, 2, 16), np.float32), "v": np.zeros((rows, 64, 2, 16), np.float16)})


def test_the_bytes_of_a_stream_are_its_cache_row() -> None:
    """One row of the cache tensors as declared (shape x dtype), whatever the decode batch."""
    assert stream_bytes(_Cache(None)) == 64 * 2 * 16 * 4 + 64 * 2 * 16 * 2  # type: ignore[arg-type]


def test_the_total_is_the_setting_or_a_share_of_memory() -> None:
    assert cache_budget(GenerationConfig(cache_memory_mb=1.5)) == 3 << 19
    assert cache_budget(GenerationConfig(), memory=8 << 30) == (8 << 30) // AUTO_CACHE_SHARE
    assert cache_budget(GenerationConfig()) > 0  # this host's (or its cgroup's) memory


def test_a_large_request_at_the_head_is_not_overtaken_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose row is the whole total waits behind four small streams; small requests keep
    arriving. Once the big one has waited (``HOLD_AFTER_S``, made 0 here: no clock in the test),
    the room that frees is held for it: no small stream starts until it has run, then they do."""
    from appliance.core import stream_limits

    monkeypatch.setattr(stream_limits, "HOLD_AFTER_S", 0.0)
    limits, lock = _limits(4 * ROW)

    async def run() -> None:
        for _ in range(4):
            await limits.reserve("small", 1, each=ROW)
        big = asyncio.ensure_future(limits.reserve("big", 1, each=4 * ROW))
        await asyncio.wait_for(_until(lambda: len(limits.waiting) == 1), 30)
        late = asyncio.ensure_future(limits.reserve("small", 1, each=ROW))  # fits once one small ends
        await asyncio.wait_for(_until(lambda: len(limits.waiting) == 2), 30)
        for ended in range(3):
            with lock:
                limits.leave("small", ROW)
            for _ in range(5):
                await asyncio.sleep(0)
            assert not late.done(), f"a later small stream overtook the big one after {ended + 1} ended"
        with lock:
            limits.leave("small", ROW)
        await asyncio.wait_for(big, 30)
        assert not late.done() and limits.cache_used == {"big": 4 * ROW}
        with lock:
            limits.leave("big", 4 * ROW)
        await asyncio.wait_for(late, 30)
        assert limits.cache_used == {"small": ROW}

    asyncio.run(run())


def test_the_freed_room_goes_to_the_model_holding_fewer_bytes() -> None:
    """Fair shares count bytes, not streams: "big" runs one 4 MiB row, "small" three 64 KiB rows
    (fewer streams, but 16x the bytes for big). Both queue (the count ceiling is reached; big
    first), a small stream ends and either waiter would fit: small goes first, since it holds
    128 KiB against big's 4 MiB. (Counting streams, big, with one against two, went first.)"""
    small, big = 64 << 10, 4 << 20
    limits, lock = _limits(64 << 20, Config(max_streams=4))

    async def run() -> None:
        await limits.reserve("big", 1, each=big)
        for _ in range(3):
            await limits.reserve("small", 1, each=small)
        big_waiter = asyncio.ensure_future(limits.reserve("big", 1, each=big))
        await asyncio.wait_for(_until(lambda: len(limits.waiting) == 1), 30)
        small_waiter = asyncio.ensure_future(limits.reserve("small", 1, each=small))
        await asyncio.wait_for(_until(lambda: len(limits.waiting) == 2), 30)
        assert [w.model for w in limits.waiting] == ["big", "small"]  # big came first
        with lock:
            limits.leave("small", small)  # one slot frees: either waiter fits
        ticket = await asyncio.wait_for(small_waiter, 30)
        assert ticket.model == "small" and not big_waiter.done()
        assert limits.cache_used == {"big": big, "small": 3 * small} and limits.running == {"big": 1, "small": 3}
        with lock:
            limits.leave("small", small)
        await asyncio.wait_for(big_waiter, 30)  # the next freed slot: big's turn
        assert limits.cache_used == {"big": 2 * big, "small": 2 * small}

    asyncio.run(run())


def test_streams_without_a_cache_count_a_fixed_cost() -> None:
    """A stream without a cache counts ``STREAM_FLOOR_BYTES`` (not nothing, not a row): "bare"
    runs two such streams, "cached" one stream of three floors' bytes. Both queue (cached first);
    a bare stream ends: bare holds one floor against cached's three, and goes first (counting
    streams, one each, the older waiter, cached, went first)."""
    from appliance.core.stream_limits import STREAM_FLOOR_BYTES

    limits, lock = _limits(64 << 20, Config(max_streams=3))

    async def run() -> None:
        for _ in range(2):
            await limits.reserve("bare", 1, each=0)
        await limits.reserve("cached", 1, each=3 * STREAM_FLOOR_BYTES)
        assert limits.held == {"bare": 2 * STREAM_FLOOR_BYTES, "cached": 3 * STREAM_FLOOR_BYTES}
        cached_waiter = asyncio.ensure_future(limits.reserve("cached", 1, each=3 * STREAM_FLOOR_BYTES))
        await asyncio.wait_for(_until(lambda: len(limits.waiting) == 1), 30)
        bare_waiter = asyncio.ensure_future(limits.reserve("bare", 1, each=0))
        await asyncio.wait_for(_until(lambda: len(limits.waiting) == 2), 30)
        with lock:
            limits.leave("bare", 0)  # bare holds one floor now, cached three: bare goes first
        assert (await asyncio.wait_for(bare_waiter, 30)).model == "bare" and not cached_waiter.done()
        with lock:
            limits.leave("bare", 0)
        await asyncio.wait_for(cached_waiter, 30)
        for model, each in (("bare", 0), ("cached", 3 * STREAM_FLOOR_BYTES), ("cached", 3 * STREAM_FLOOR_BYTES)):
            with lock:
                limits.leave(model, each)
        assert limits.held == {} and limits.running == {}

    asyncio.run(run())
