"""The pieces of the async token path (issue 45): a request waits for a stream in its model's
queue without a thread (``StreamLimits.reserve``), and reads its events woken by the decode
loop's thread (``LoopQueue``), never by a poll."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from appliance.core.errors import QueueFull, Unavailable
from appliance.core.stream_limits import ADMITTED, StreamLimits
from appliance.core.streams import LoopQueue
from tests.core.test_stream_queue import Config, Observer

WAIT_S = 60  # how long any awaited condition here may take on a loaded box


def _limits(config: Config) -> tuple[StreamLimits, threading.Lock, Observer]:
    lock, observer = threading.Lock(), Observer()
    return StreamLimits(lambda: config, lambda: [], lock, observer), lock, observer


def test_loop_queues_get_every_event_of_a_thread_in_order() -> None:
    """50 readers on one loop, one producing thread: nothing lost, nothing reordered (a lost
    wake would leave a reader waiting: wait_for names it)."""
    async def main() -> list[list[int]]:
        loop = asyncio.get_running_loop()
        queues = [LoopQueue(loop) for _ in range(50)]

        def produce() -> None:
            for i in range(500):
                for q in queues:
                    q.put((0, "token", i))
            for q in queues:
                q.put((0, "done", None))

        async def read(q: LoopQueue) -> list[int]:
            got = []
            while (event := await q.get())[1] != "done":
                got.append(event[2])
            return got
        thread = threading.Thread(target=produce)
        thread.start()
        try:
            return await asyncio.wait_for(asyncio.gather(*[read(q) for q in queues]), WAIT_S)
        finally:
            thread.join()
    assert all(got == list(range(500)) for got in asyncio.run(main()))


def test_reserve_waits_without_a_thread_and_is_admitted_when_a_stream_ends() -> None:
    limits, lock, observer = _limits(Config(max_streams=1, max_queued_per_model=2))

    async def main() -> None:
        first = await limits.reserve("m")  # room: counted in at once
        assert limits.running == {"m": 1}
        waiting = asyncio.ensure_future(limits.reserve("m"))
        while not limits.waiting:  # it joins the queue on the loop's next turn
            await asyncio.sleep(0)
        assert observer.depth == {"m": 1}
        with pytest.raises(QueueFull):  # max_queued_per_model = 2: a second waiter fits, a third not
            second = asyncio.ensure_future(limits.reserve("m"))
            while len(limits.waiting) < 2:
                await asyncio.sleep(0)
            await limits.reserve("m")
        second.cancel()  # a client gone while it waits: it leaves the queue
        await asyncio.gather(second, return_exceptions=True)
        assert len(limits.waiting) == 1
        ender = threading.Thread(target=_leave, args=(limits, lock, "m"))  # a stream ends on the decode thread
        ender.start()
        ticket = await asyncio.wait_for(waiting, WAIT_S)
        ender.join()
        assert limits.running == {"m": 1} and not limits.waiting and observer.depth == {"m": 0}
        token = ADMITTED.set(ticket)  # the generation's admit takes the reserved stream without counting it again
        try:
            with lock:
                limits.admit("m")
        finally:
            ADMITTED.reset(token)
        assert limits.running == {"m": 1}
        limits.give_back(ticket)  # used: nothing to give back
        assert limits.running == {"m": 1}
        limits.give_back(first)  # never started: counted out
        assert limits.running == {}
    asyncio.run(main())


def test_reserve_refuses_once_its_deadline_passes() -> None:
    limits, _, observer = _limits(Config(max_streams=1, queue_timeout_s=0.05))

    async def main() -> None:
        await limits.reserve("m")
        with pytest.raises(Unavailable, match="generation.queue_timeout_s"):
            await asyncio.wait_for(limits.reserve("m"), WAIT_S)
        assert not limits.waiting and observer.waits and observer.depth == {"m": 0}
    asyncio.run(main())


def _leave(limits: StreamLimits, lock: Any, model: str) -> None:
    with lock:
        limits.leave(model)


def test_a_long_queue_is_admitted_in_order_one_wake_at_a_time() -> None:
    """20 awaiting requests, one stream allowed: as each stream ends (on another thread), the
    next in line is admitted, oldest first; only it is woken, and it wakes the next when it goes."""
    limits, lock, observer = _limits(Config(max_streams=1, max_queued_per_model=20))

    async def main() -> list[int]:
        await limits.reserve("m")
        order: list[int] = []
        enders: list[threading.Thread] = []

        def end_one() -> None:  # a stream ends, on another thread (the decode loop's)
            enders.append(threading.Thread(target=_leave, args=(limits, lock, "m")))
            enders[-1].start()

        async def wait(i: int) -> None:
            await limits.reserve("m")
            order.append(i)
            end_one()
        tasks = []
        for i in range(20):
            tasks.append(asyncio.ensure_future(wait(i)))
            while len(limits.waiting) <= i:  # queued in this order
                await asyncio.sleep(0)
        end_one()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
        for ender in enders:
            ender.join()
        return order
    assert asyncio.run(main()) == list(range(20))
    assert not limits.waiting and observer.depth == {"m": 0}
