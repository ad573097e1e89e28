"""appliance/transport/http/queue_delay.py: a burst keeps the whole queue-wait limit, a standing queue
gets the short one, and an emptied queue gets the whole limit back. Times are given, not
slept: the decisions depend on the waits observed, never on this machine's speed."""

from __future__ import annotations

from appliance.transport.http.queue_delay import FORGET_INTERVALS, QueueDelay


def feed(delay: QueueDelay, start: float, waits: list[float], step: float = 0.01) -> float:
    now = start
    for waited in waits:
        now += step
        delay.observe(waited, now)
    return now


def test_a_burst_on_an_empty_queue_keeps_the_whole_limit() -> None:
    delay = QueueDelay(2.0)  # interval 0.5 s
    # bursts: each leaves waits up to 1.5 s behind it for 0.3 s, then the queue is empty again
    burst = [0.0] + [0.3, 0.6, 0.9, 1.2, 1.5] * 6 + [0.0] * 5
    now = feed(delay, 0.0, burst * 6)
    assert not delay.standing and delay.allowed(now) == 2.0


def test_a_standing_queue_gets_the_short_wait_then_the_limit_comes_back() -> None:
    delay = QueueDelay(2.0)
    now = feed(delay, 0.0, [0.5] * 150)  # 1.5 s, three intervals, in which nobody waited less than 0.5 s
    assert delay.standing and delay.allowed(now) == delay.short == 0.2
    now = feed(delay, now, [0.15] * 20 + [0.0] + [0.15] * 40)  # the queue emptied once: not standing
    assert not delay.standing and delay.allowed(now) == 2.0
    now = feed(delay, now, [0.5] * 150)
    assert delay.allowed(now) == 0.2
    assert delay.allowed(now + FORGET_INTERVALS * delay.interval) == 2.0  # nothing left the queue since


def test_the_target_is_a_fraction_of_the_limit() -> None:
    delay = QueueDelay(10.0)  # target 0.5 s: waits of 0.4 s are a healthy queue for this limit
    now = feed(delay, 0.0, [0.4] * 1000)
    assert not delay.standing and delay.allowed(now) == 10.0
