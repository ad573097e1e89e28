"""Zygote loss as a state machine (appliance/fronts/keeper.py, zygote.py, pids.py): the keeper
replaces a zygote that died, backs off while they die young, launches on the new one, falls back
to a fresh interpreter while none answers, and stops replacing once closed; a worker handed over
by a dead zygote is still killed and reaped by its pidfd. Zygotes here are stand-ins (the real
one under load: tests/fronts/test_zygote_loss.py); the pidfd test signals a ``sleep`` it started.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
from typing import Any, Iterator

import pytest

from appliance.fronts import keeper as keeper_module
from appliance.fronts.backoff import next_pause
from appliance.fronts.keeper import Keeper
from appliance.fronts.pids import open_pidfd
from appliance.fronts.zygote import LOST, Forked, Zygote
from tests.support.servers import poll_until


class FakeZygote:
    """A zygote's face as the keeper uses it: alive, ready, born, grpc, spawn, close, on_gone."""

    def __init__(self, grpc: bool, on_gone: Any = None, born: float = 0.0):
        self.grpc, self.on_gone, self.born = grpc, on_gone or (lambda z: None), born
        self.pid = 4242
        self.alive = True
        self.ready = threading.Event()
        self.ready.set()
        self.spawned: list[int] = []
        self.closed = False

    def spawn(self, index: int, port: int, grpc_port: int, channel: socket.socket, listener: socket.socket) -> Any:
        self.spawned.append(index)
        return ("forked", self, index)

    def close(self) -> None:
        self.closed = True

    def die(self) -> None:
        self.alive = False
        self.ready.set()
        self.on_gone(self)


class Fresh:
    """``Zygote.start_fresh`` stood in: each call a new FakeZygote, or OSError while ``failing``."""

    def __init__(self) -> None:
        self.made: list[FakeZygote] = []
        self.failing = 0

    def __call__(self, grpc: bool, on_gone: Any = None) -> FakeZygote:
        if self.failing:
            self.failing -= 1
            raise OSError("cannot exec")
        zygote = FakeZygote(grpc, on_gone, born=keeper_module.time.monotonic())
        self.made.append(zygote)
        return zygote


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[Fresh]:
    made = Fresh()
    monkeypatch.setattr(Zygote, "start_fresh", made)
    monkeypatch.setattr(keeper_module, "next_pause",  # the keeper's pauses, a hundredth of the real ones
                        lambda previous, ran_s: next_pause(previous, ran_s, first_s=0.005, most_s=0.02))
    monkeypatch.setattr(keeper_module, "popen_worker", lambda index, port, grpc_port, channel, listener: ("popen", index))
    yield made


@pytest.fixture
def keepers() -> Iterator[list[Keeper]]:
    made: list[Keeper] = []
    yield made
    for keeper in made:
        keeper.close()


def keep(keepers: list[Keeper], first: Any) -> Keeper:
    keeper = Keeper(first)
    keepers.append(keeper)
    return keeper


def channel() -> socket.socket:
    a, b = socket.socketpair()
    b.close()
    return a


def test_workers_are_forked_by_the_zygote_there_is(fresh: Fresh, keepers: list[Keeper]) -> None:
    first = FakeZygote(grpc=True)
    keeper = keep(keepers, first)
    assert keeper.launch(0, 8501, 8500, channel(), channel()) == ("forked", first, 0)
    assert fresh.made == []


def test_a_dead_zygote_is_replaced_and_later_workers_come_from_the_new_one(fresh: Fresh,
                                                                          keepers: list[Keeper]) -> None:
    first = FakeZygote(grpc=True, born=keeper_module.time.monotonic() - 3600)  # served an hour
    keeper = keep(keepers, first)
    first.die()
    poll_until(lambda: keeper.current() is not None, 30, "a new zygote")
    new = fresh.made[0]
    assert keeper.current() is new and new.grpc is True  # it preloads what the dead one did
    assert keeper.pause == 0.0  # the dead one lived long: replaced at once
    assert keeper.launch(1, 8501, 8500, channel(), channel()) == ("forked", new, 1) and first.spawned == []


def test_zygotes_that_die_young_are_replaced_after_a_pause_that_doubles(fresh: Fresh, keepers: list[Keeper]) -> None:
    keeper = keep(keepers, FakeZygote(grpc=False, born=keeper_module.time.monotonic()))
    pauses = []
    dying: Any = keeper.zygote
    for n in range(4):
        dying.die()
        poll_until(lambda: len(fresh.made) == n + 1 and keeper.current() is fresh.made[n], 30, f"zygote {n + 2}")
        pauses.append(keeper.pause)
        dying = fresh.made[n]
    assert pauses == [0.005, 0.01, 0.02, 0.02]


def test_while_no_zygote_answers_a_worker_starts_as_a_fresh_interpreter(fresh: Fresh, keepers: list[Keeper],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(keeper_module, "SPAWN_TIMEOUT_S", 0.05)
    fresh.failing = 10**6  # no new zygote can be started
    keeper = keep(keepers, FakeZygote(grpc=False))
    keeper.zygote.die()  # type: ignore[union-attr]
    assert keeper.launch(0, 8501, 0, channel(), channel()) == ("popen", 0)
    poll_until(lambda: fresh.failing < 10**6 - 2, 30, "the keeper to go on trying")
    fresh.failing = 0
    poll_until(lambda: keeper.current() is not None, 30, "a new zygote once one can be started")
    assert keeper.launch(0, 8501, 0, channel(), channel()) == ("forked", fresh.made[0], 0)


def test_a_closed_keeper_replaces_nothing(fresh: Fresh, keepers: list[Keeper]) -> None:
    first = FakeZygote(grpc=False)
    keeper = keep(keepers, first)
    keeper.close()
    assert first.closed
    first.die()
    assert keeper.current() is None and fresh.made == []


def test_without_a_zygote_workers_are_fresh_interpreters(fresh: Fresh, keepers: list[Keeper]) -> None:
    assert keep(keepers, None).launch(2, 8501, 0, channel(), channel()) == ("popen", 2)


def test_a_worker_whose_zygote_died_is_killed_and_reaped_by_its_pidfd() -> None:
    """This process stands for the serving process, the ``sleep`` for a worker handed to it."""
    proc = subprocess.Popen(["sleep", "600"])
    try:
        pidfd = open_pidfd(proc.pid)
        if pidfd is None:
            pytest.skip("no pidfds on this kernel: a dead zygote's workers follow it, as before")
        worker = Forked(None, proc.pid, pidfd)  # type: ignore[arg-type]  # no zygote: it is gone
        adopted = threading.Thread(target=worker.adopted)
        adopted.start()
        assert worker.poll() is None
        worker.kill()
        assert worker.wait(30) == -signal.SIGKILL  # its real status, read by this process as its parent
        adopted.join(30)
        assert pidfd.fd == -1  # closed once it ended
    finally:
        proc.kill()
        proc.wait(30)


def test_a_worker_whose_status_nobody_can_read_counts_as_killed() -> None:
    """Ended, but another parent reaped it: how is not known."""
    proc = subprocess.Popen(["sleep", "600"])
    pidfd = open_pidfd(proc.pid)
    if pidfd is None:
        proc.kill()
        proc.wait(30)
        pytest.skip("no pidfds on this kernel")
    proc.kill()
    proc.wait(30)  # reaped here, before the worker's handle looks
    worker = Forked(None, proc.pid, pidfd)  # type: ignore[arg-type]
    worker.adopted()
    assert worker.poll() == LOST
