"""The supervisor's and the pool's state machines alone (appliance/fronts/supervisor.py,
backoff.py, health.py): no process is started. A child is a ``Proc`` that ends when killed or
told to; the clock and each child's CPU time are the test's, so every transition is driven
exactly: a heartbeat answered, late, missing; busy against hung; the restart pause; what the
pool reports while workers are missing. The same judgement on real processes:
tests/fronts/test_busy_workers.py and test_worker_supervision.py.
"""

from __future__ import annotations

import socket
import subprocess
import threading
from typing import Any, Iterator

import pytest

from appliance.fronts import supervisor as sup
from appliance.fronts.backoff import next_pause
from appliance.fronts.health import serving_report
from tests.support.servers import poll_until

TIMEOUT_S = 10.0
BUSY_LIMIT_S = 60.0


class Proc:
    """A child as the supervisor sees it (``WorkerProcess``): ends when killed or ``end``ed."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self.done = threading.Event()
        self.kills = 0

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.done.wait(timeout):
            raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        self.kills += 1
        self.end(-9)

    def end(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
            self.done.set()


class World:
    """The supervisor's surroundings: a clock, each pid's CPU ticks, the children it started."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.cpu: dict[int, int] = {}
        self.procs: list[Proc] = []
        self.exits: list[tuple[int, sup.Exit, bool]] = []
        self.turning = True
        self.fail_launch = False

    def launch(self, index: int, channel: socket.socket) -> Proc:
        if self.fail_launch:
            raise OSError("no fork today")
        proc = Proc(100 + len(self.procs))
        self.procs.append(proc)
        return proc

    def make(self, count: int = 1) -> sup.Supervisor:
        s = sup.Supervisor(count, self.launch, lambda index, pid, end: end.close(),
                           lambda index, ended, restarting: self.exits.append((index, ended, restarting)),
                           TIMEOUT_S, lambda: self.turning, busy_limit_s=BUSY_LIMIT_S, clock=lambda: self.now,
                           ticks=lambda pid: self.cpu.get(pid, -1))
        s.start(judge=False)
        return s

    def at(self, s: sup.Supervisor, seconds: float, computing: bool = False) -> None:
        """``seconds`` later, with every running child having used CPU meanwhile or not; judged."""
        self.now += seconds
        if computing:
            for proc in self.procs:
                self.cpu[proc.pid] = self.cpu.get(proc.pid, 0) + 1
        s.check()


@pytest.fixture
def world() -> Iterator[World]:
    w = World()
    yield w
    for proc in w.procs:
        proc.end(0)


@pytest.fixture
def made(world: World) -> Iterator[list[sup.Supervisor]]:
    supervisors: list[sup.Supervisor] = []
    yield supervisors
    for s in supervisors:
        s.halt()
        for proc in world.procs:
            proc.end(0)
        s.stop(10)


def start(world: World, made: list[sup.Supervisor], count: int = 1) -> sup.Supervisor:
    s = world.make(count)
    made.append(s)
    return s


def test_a_child_counts_as_serving_from_its_first_word_while_it_answers(world: World, made: Any) -> None:
    s = start(world, made)
    assert s.serving() == [] and s.missing() == {0: "is starting"}
    s.heard(0)
    assert s.serving() == [0] and s.missing() == {}
    for _ in range(10):  # a word each second: sixty seconds of it, never judged silent
        world.at(s, 6)
        s.heard(0)
    assert world.procs[0].kills == 0 and s.serving() == [0]


def test_a_late_heartbeat_is_borne_up_to_the_timeout_and_a_missing_one_kills(world: World, made: Any) -> None:
    s = start(world, made)
    s.heard(0)
    world.cpu[100] = 5  # its CPU time stands still from here: not computing
    world.at(s, TIMEOUT_S - 0.5)
    assert world.procs[0].kills == 0 and s.serving() == [0]  # late, not missing
    world.at(s, 1.0)
    assert world.procs[0].kills == 1 and s.serving() == []
    poll_until(lambda: len(world.procs) == 2, 30, "the killed child's replacement")
    index, ended, restarting = world.exits[0]
    assert (index, ended.pid, ended.reason, ended.code, restarting) == (0, 100, "heartbeat", -9, True)
    assert "missed its heartbeat" in ended.words() and s.restarts_by_reason["heartbeat"] == 1
    assert s.children[0].restarts == 1 and s.children[0].pause == 0.0  # it ran long before: at once


def test_a_child_never_heard_is_killed_at_the_timeout_after_its_start(world: World, made: Any) -> None:
    s = start(world, made)
    world.at(s, TIMEOUT_S + 1)
    assert world.procs[0].kills == 1


def test_no_child_is_judged_while_this_side_does_not_turn(world: World, made: Any) -> None:
    """The serving process's own loop stalled: the workers' silence is not theirs."""
    s = start(world, made)
    s.heard(0)
    world.turning = False
    world.at(s, 10 * TIMEOUT_S)
    assert world.procs[0].kills == 0
    world.turning = True
    world.at(s, 0.5)
    assert world.procs[0].kills == 1  # still silent once this side turns again: judged then


def test_busy_is_not_hung_up_to_the_busy_limit(world: World, made: Any) -> None:
    s = start(world, made)
    s.heard(0)
    world.at(s, 1, computing=True)  # the first reading: a baseline
    while world.now - s.children[0].heard < BUSY_LIMIT_S - 2:
        world.at(s, 1, computing=True)
        assert world.procs[0].kills == 0 and s.serving() == [0], world.now - s.children[0].heard
        assert s.missing() == {}
    world.at(s, 2, computing=True)
    assert world.procs[0].kills == 1  # computing past the busy limit: killed all the same
    poll_until(lambda: world.exits, 30, "its exit")
    assert world.exits[0][1].reason == "heartbeat"


def test_a_child_that_stops_computing_is_hung_a_timeout_later(world: World, made: Any) -> None:
    s = start(world, made)
    s.heard(0)
    for _ in range(3 * int(TIMEOUT_S)):  # three timeouts of silence, computing all along
        world.at(s, 1, computing=True)
    assert world.procs[0].kills == 0
    world.at(s, TIMEOUT_S - 1)  # no CPU since the last check: stopped, yet within the timeout of it
    assert world.procs[0].kills == 0 and s.serving() == [0]
    world.at(s, 1.5)
    assert world.procs[0].kills == 1


def test_unreadable_cpu_time_is_never_busy(world: World, made: Any) -> None:
    s = start(world, made)
    s.heard(0)
    world.cpu[100] = -1  # /proc unreadable (gone, or no /proc)
    world.at(s, TIMEOUT_S + 1)
    assert world.procs[0].kills == 1


def test_one_silent_child_is_replaced_and_the_other_kept(world: World, made: Any) -> None:
    s = start(world, made, count=2)
    s.heard(0)
    s.heard(1)
    world.at(s, TIMEOUT_S / 2)
    s.heard(1)
    world.at(s, TIMEOUT_S / 2 + 1)
    assert [p.kills for p in world.procs] == [1, 0]
    assert s.serving() == [1]
    poll_until(lambda: len(world.procs) == 3, 30, "worker 0's replacement")
    assert s.missing() == {0: "is starting"}
    s.heard(0)
    assert s.serving() == [0, 1] and s.children[0].proc is world.procs[2]


def test_the_restart_pause_doubles_while_children_die_young(world: World, made: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sup, "FIRST_PAUSE_S", 0.01)
    monkeypatch.setattr(sup, "MAX_PAUSE_S", 0.04)
    s = start(world, made)
    pauses = []
    for n in range(4):  # each exits at once after its start (the clock stands still)
        world.procs[n].end(3)
        poll_until(lambda: len(world.procs) == n + 2, 30, f"start number {n + 2}")
        pauses.append(s.children[0].pause)
    assert pauses == [0.01, 0.02, 0.04, 0.04]
    assert {ended.reason for _, ended, _ in world.exits} == {"exit"} and s.restarts_by_reason["exit"] == 4
    assert s.children[0].exits[-1].words() == "exited with status 3"
    world.now += sup.QUICK_EXIT_S  # the next one runs long, then ends: started again at once
    world.procs[4].end(0)
    poll_until(lambda: len(world.procs) == 6, 30, "the restart after a long run")
    assert s.children[0].pause == 0.0


def test_a_child_that_cannot_be_started_is_tried_again(world: World, made: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sup, "FIRST_PAUSE_S", 0.01)
    world.fail_launch = True
    s = start(world, made)
    poll_until(lambda: s.restarts_by_reason["spawn"] >= 2, 30, "two failed starts")
    assert s.children[0].exits[-1].words() == "could not be started" and s.children[0].proc is None
    world.fail_launch = False
    poll_until(lambda: world.procs, 30, "a start once launching works again")


def test_a_stop_asks_then_kills_what_is_left(world: World, made: Any) -> None:
    s = start(world, made, count=2)
    world.procs[0].end(0)  # this one exits by itself when asked
    poll_until(lambda: len(world.procs) == 3, 30, "its replacement")
    world.procs[2].end(0)
    assert s.stop(0.2) is False  # worker 1 had to be killed
    assert world.procs[1].kills == 1 and all(restarting is False for _, _, restarting in world.exits[1:])
    assert len(world.procs) == 3  # nothing started after the stop


def test_the_watchdog_hears_of_a_judge_that_stopped_or_a_child_not_replaced(world: World, made: Any) -> None:
    s = start(world, made)
    s.heard(0)
    assert s.stalled() is None
    world.now += TIMEOUT_S + 1
    assert "has not run for 11 s" in (s.stalled() or "")
    world.turning = False  # judged, but not while this side stalls: the child stays unreplaced
    world.at(s, TIMEOUT_S)
    assert "front worker 0 has been silent for over 20 s" in (s.stalled() or "")


# -- pure arithmetic -------------------------------------------------------------------------------
def test_next_pause_doubles_to_its_bound_and_resets_after_a_long_run() -> None:
    pause, seen = 0.0, []
    for _ in range(9):
        pause = next_pause(pause, ran_s=1.0)
        seen.append(pause)
    assert seen == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert next_pause(30.0, ran_s=10.0) == 0.0


def test_the_pool_is_not_ready_until_every_worker_served_once_and_never_with_none() -> None:
    starting = {0: "is starting", 1: "is starting"}
    assert serving_report(2, starting, False) == ("0 of 2 front workers serving (worker 0 is starting; worker 1 "
                                                  "is starting)", True, False)
    problem, critical, started_all = serving_report(2, {1: "is starting"}, False)
    assert critical and not started_all and problem and problem.startswith("1 of 2")
    assert serving_report(2, {}, False) == (None, False, True)
    problem, critical, started_all = serving_report(2, {0: "was killed by signal 9 (SIGKILL); being replaced"}, True)
    assert not critical and started_all and problem and "worker 0 was killed" in problem  # shown, still ready
    assert serving_report(2, starting, True)[1] is True  # none serves: not ready whatever came before


def test_a_worker_keeps_its_listener_unless_it_is_crash_looping() -> None:
    """appliance/fronts/pool.py: a killed worker's queued connections wait for its replacement;
    one that keeps ending by itself at start-up gives its share of new connections to the others."""
    from appliance.fronts.pool import crash_looping

    young, old = 1.0, sup.QUICK_EXIT_S + 1
    assert crash_looping(sup.Exit(1, 1, "exit", 0.0, young)) and crash_looping(sup.Exit(0, None, "spawn", 0.0, 0.0))
    assert not crash_looping(sup.Exit(1, 1, "exit", 0.0, old))
    assert not crash_looping(sup.Exit(1, -9, "heartbeat", 0.0, young))
    assert not crash_looping(sup.Exit(1, -9, "signal", 0.0, young))
