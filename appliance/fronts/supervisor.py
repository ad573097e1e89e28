"""Child processes kept running, and kept honest: the serving process's front workers.

``Supervisor(count, launch, on_start, on_exit, timeout_s)`` starts ``count`` children, each
with one end of a private socketpair (``launch(index, child_end)`` starts the process: forked
by the zygote, or a fresh interpreter; appliance/fronts/zygote.py), and starts a new one when
one ends, until ``stop``. The socketpair's parent end goes to ``on_start``, so the caller owns
the conversation; this module knows nothing of what the children do.

**Heartbeat** (gunicorn's worker timeout, in the channel's terms): a child is alive while it
speaks. The caller reports each sign of life with ``heard(index)`` (a worker sends its figures
from its event loop every second, so they stop when its loop stops turning: a deadlock, a stuck
C call, SIGSTOP). A child not heard for ``timeout_s`` since its last word (or its start) is
killed (SIGKILL: its connections close, the kernel answers its queued ones with a reset) and
replaced like any child that ends; its exit's reason is "heartbeat". **Busy is not hung**: a
child whose main thread (a worker's event loop) used CPU within the last ``timeout_s`` is
computing (a long decode), not stopped, so its silence is borne up to ``busy_limit_s``
(``BUSY_FACTOR`` times ``timeout_s`` by default) and it still counts as serving; its CPU time is
read from ``/proc/<pid>/task/<pid>/stat`` at every check. A stopped child (SIGSTOP, a
deadlock, a wait that never ends) uses none and is killed at ``timeout_s`` as before. The heartbeat is judged
only while the caller's own side is turning (``listening()`` true): if the serving process's
loop is what stalls, killing healthy workers would not help.

**Restarts**: a child that ends is replaced. One that ended within ``QUICK_EXIT_S`` of its
start is crash-looping: it is started again after a pause that doubles from 0.5 s up to
``MAX_PAUSE_S`` (appliance/fronts/backoff.py: a crash loop costs a fork every 30 s, never a
core, and never stops trying: the service keeps serving on the others and says so); one that
ran longer is started at once.
Each exit is kept with its reason (``Exit``): "heartbeat" (killed for silence), "signal"
(killed by another), "exit" (ended by itself), "spawn" (could not be started).

Children read EOF on their channel when the parent dies, however it dies, and exit: no orphan
keeps the port. Thread-safety: ``start``/``stop`` from the owner's thread; ``heard`` from any
thread; the callbacks run on the supervisor's threads.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from appliance.fronts.backoff import FIRST_PAUSE_S, MAX_PAUSE_S, QUICK_EXIT_S, next_pause
from appliance.fronts.zygote import Launcher, WorkerProcess

log = logging.getLogger("appliance.workers")

CHECK_EVERY_S = 0.5  # how often the heartbeat is judged
BUSY_FACTOR = 6  # a child computing without a word is killed past this many heartbeat timeouts
KEPT_EXITS = 5
REASONS = ("heartbeat", "signal", "exit", "spawn")  # why a child was replaced: the metric's label values


@dataclass(frozen=True)
class Exit:
    """How one child ended: ``reason`` (``REASONS``), ``code`` (``Popen.returncode``: negative
    for a signal; None when it never started), when, and after how long."""

    pid: int
    code: int | None
    reason: str
    at: float
    ran_s: float

    def words(self) -> str:
        if self.reason == "heartbeat":
            return "missed its heartbeat and was killed"
        if self.reason == "spawn":
            return "could not be started"
        if self.code is not None and self.code < 0:
            try:
                return f"was killed by signal {-self.code} ({signal.Signals(-self.code).name})"
            except ValueError:
                return f"was killed by signal {-self.code}"
        return f"exited with status {self.code}"


@dataclass
class Child:
    index: int
    proc: WorkerProcess | None = None
    started: float = 0.0  # monotonic
    started_at: float = 0.0  # wall clock, for the page
    heard: float = 0.0  # monotonic: its start, then its last word
    listening: bool = False  # heard since its start: it serves
    restarts: int = 0
    pause: float = 0.0
    killed_for: str | None = None  # set when the supervisor itself killed it
    exits: list[Exit] = field(default_factory=list)  # newest last, KEPT_EXITS of them
    cpu_ticks: int = -1  # its main thread's CPU time at the last check (clock ticks); -1: unknown
    computed: float = 0.0  # monotonic: the last check that saw that CPU time grow


class Supervisor:
    def __init__(self, count: int, launch: Launcher, on_start: Callable[[int, int, socket.socket], None],
                 on_exit: Callable[[int, Exit, bool], None], timeout_s: float,
                 listening: Callable[[], bool] = lambda: True, on_change: Callable[[], None] = lambda: None,
                 busy_limit_s: float | None = None, clock: Callable[[], float] = time.monotonic,
                 ticks: Callable[[int], int] | None = None):
        """``on_start(index, pid, parent_end)``; ``on_exit(index, exit, restarting)``;
        ``listening()``: whether the caller's side of the channels is turning now;
        ``on_change()``: which children serve has changed (``serving``, ``missing``);
        ``clock`` and ``ticks`` (a pid's main thread's CPU time, ``main_thread_ticks``): what the
        judgement reads, given by the unit tests (tests/fronts/test_supervisor_states.py)."""
        self.count, self.launch, self.timeout_s = count, launch, timeout_s
        self.clock, self.ticks = clock, ticks or main_thread_ticks
        self.busy_limit_s = busy_limit_s if busy_limit_s is not None else BUSY_FACTOR * timeout_s
        self.on_start, self.on_exit, self.listening, self.on_change = on_start, on_exit, listening, on_change
        self.children = [Child(i) for i in range(count)]
        self.restarts_by_reason: Counter[str] = Counter({reason: 0 for reason in REASONS})
        self.last_check = clock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self, judge: bool = True) -> None:
        """Start the children, and the heartbeat's judge every ``CHECK_EVERY_S`` (without
        ``judge``, the caller calls ``check``)."""
        for child in self.children:
            self._start(child)
        if judge:
            self._thread(self._judge, "worker-heartbeat")

    def heard(self, index: int) -> None:
        """(any thread) A sign of life from child ``index``."""
        child = self.children[index]
        child.heard = self.clock()
        if not child.listening:
            child.listening = True
            self.on_change()

    def serving(self) -> list[int]:
        """The children that serve now: running, heard since their start, not silent."""
        now = self.clock()
        return [c.index for c in self.children if c.listening and c.proc is not None and c.proc.poll() is None
                and not c.killed_for and (now - c.heard <= self.timeout_s or self._busy(c, now))]

    def missing(self) -> dict[int, str]:
        """Why each child that does not serve does not (``serving``'s complement)."""
        serving, now = set(self.serving()), self.clock()
        out = {}
        for child in self.children:
            if child.index in serving:
                continue
            running = child.proc is not None and child.proc.poll() is None and not child.killed_for
            if running and child.listening:
                out[child.index] = f"has been silent for {now - child.heard:.0f} s"  # and not computing
            elif running or not child.exits:
                out[child.index] = "is starting"
            else:
                out[child.index] = f"{child.exits[-1].words()}; being replaced"
        return out

    # -- starting ------------------------------------------------------------------------------
    def _start(self, child: Child) -> None:
        """Start ``child``; when it cannot be, count that as an exit and try again after a pause."""
        try:
            self._spawn(child)
        except OSError as exc:  # out of processes or memory, or the zygote is gone and so is fork
            log.error("cannot start front worker %d: %s", child.index, exc)
            child.started = self.clock()
            self._thread(lambda: self._ended(child, Exit(0, None, "spawn", time.time(), 0.0)),
                         f"worker-{child.index}-retry")

    def _spawn(self, child: Child) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = self.launch(child.index, child_end)
        except OSError:
            parent_end.close()
            raise
        finally:
            child_end.close()
        now = self.clock()
        child.proc, child.started, child.started_at, child.heard = proc, now, time.time(), now
        child.killed_for, child.listening = None, False
        child.cpu_ticks, child.computed = -1, now
        self.on_start(child.index, proc.pid, parent_end)
        self._thread(lambda: self._watch(child, proc), f"worker-{child.index}-watch")

    def _thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        self._threads = [t for t in self._threads if t.is_alive() or t is thread]
        thread.start()

    # -- ending ----------------------------------------------------------------------------------
    def _watch(self, child: Child, proc: WorkerProcess) -> None:
        code = proc.wait()
        reason = child.killed_for or ("signal" if code < 0 else "exit")
        self._ended(child, Exit(proc.pid, code, reason, time.time(), self.clock() - child.started))

    def _ended(self, child: Child, ended: Exit) -> None:
        child.exits = [*child.exits[-(KEPT_EXITS - 1):], ended]
        restarting = not self._stopping.is_set()
        if restarting:
            self.restarts_by_reason[ended.reason] += 1
        child.listening = False
        self.on_exit(child.index, ended, restarting)
        self.on_change()
        if not restarting:
            return
        child.pause = next_pause(child.pause, ended.ran_s, FIRST_PAUSE_S, MAX_PAUSE_S, QUICK_EXIT_S)
        if child.pause and self._stopping.wait(child.pause):
            return
        child.restarts += 1
        self._start(child)

    # -- the heartbeat -------------------------------------------------------------------------
    def _judge(self) -> None:
        while not self._stopping.wait(CHECK_EVERY_S):
            self.check()

    def check(self) -> None:
        """One judgement of every child's heartbeat (module docstring)."""
        self.last_check = self.clock()
        if self.listening():
            for child in self.children:
                self._check(child, self.last_check)
        self.on_change()  # recomputed from the state each tick: a report raced by another thread heals here

    def stalled(self) -> str | None:
        """Why the workers are not kept honest, for the watchdog: the judge has not run for a
        while, or a child silent for twice the timeout is still not replaced; else None."""
        now = self.clock()
        late = now - self.last_check
        if late > max(5.0, self.timeout_s):
            return f"the front workers' supervisor has not run for {late:.0f} s"
        stuck = [c.index for c in self.children
                 if c.proc is not None and c.proc.poll() is None and now - c.heard > 2 * self.timeout_s]
        if stuck:
            return f"front worker {stuck[0]} has been silent for over {2 * self.timeout_s:g} s and is not replaced"
        return None

    def _check(self, child: Child, now: float) -> None:
        proc = child.proc
        if proc is None or proc.poll() is not None or child.killed_for:
            return
        ticks = self.ticks(proc.pid)
        if ticks > child.cpu_ticks >= 0:
            child.computed = now
        child.cpu_ticks = ticks
        silent = now - child.heard
        if silent < self.timeout_s or (self._busy(child, now) and silent < self.busy_limit_s):
            return
        child.killed_for = "heartbeat"
        self.on_change()
        if self._busy(child, now):
            log.error("front worker %d (pid %d) computed without a word for %.0f s (%g times [server] "
                      "worker_timeout_s): killing it", child.index, proc.pid, silent, self.busy_limit_s / self.timeout_s)
        else:
            log.error("front worker %d (pid %d) sent nothing and computed nothing for %.0f s ([server] "
                      "worker_timeout_s): killing it", child.index, proc.pid, silent)
        proc.kill()

    def _busy(self, child: Child, now: float) -> bool:
        """Its main thread used CPU within the last ``timeout_s``: computing, not stopped."""
        return now - child.computed < self.timeout_s

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children if c.proc is not None and c.proc.poll() is None]

    def stop(self, timeout: float) -> bool:
        """Stop restarting; wait up to ``timeout`` for the children to exit (the caller asked
        them to drain), then kill what is left. True when all exited by themselves."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        clean = True
        for child in self.children:
            proc = child.proc
            if proc is None:
                continue
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                clean = False
                log.warning("worker %d (pid %d) did not exit in time: killed", child.index, proc.pid)
                proc.kill()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    log.error("worker %d (pid %d) did not die", child.index, proc.pid)
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(5)
        return clean

    def halt(self) -> None:
        """Start no more children (those running go on until they exit or ``stop``)."""
        self._stopping.set()


def main_thread_ticks(pid: int) -> int:
    """CPU time (user + system, clock ticks) of ``pid``'s main thread; -1 when unreadable."""
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # past the command name, which may hold spaces
        return int(fields[11]) + int(fields[12])  # utime, stime: the stat's 14th and 15th fields
    except (OSError, IndexError, ValueError):  # gone, or no /proc: never judged busy
        return -1
