"""Child processes kept running: the serving process's front workers.

``Supervisor(count, argv, on_start, on_exit)`` spawns ``count`` children, each with one
end of a private socketpair as an inherited descriptor (``pass_fds``; ``argv`` gets the
child's index and that descriptor's number appended), and starts a new one when one
exits, until ``stop``. A child that dies within ``QUICK_EXIT_S`` of its start is
restarted after a growing pause (a crash loop must not eat the device's CPU); one that ran
longer is restarted at once. The socketpair's parent end goes to ``on_start``, so the
caller owns the conversation; this module knows nothing of what the children do.

Children read EOF on their channel when the parent dies, however it dies, and exit: no
orphan keeps the port. Thread-safety: ``start``/``stop`` from the owner's thread; the
callbacks run on the supervisor's threads.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("appliance.workers")

QUICK_EXIT_S = 10.0  # a child that exits sooner than this after its start is crash-looping
MAX_PAUSE_S = 30.0


@dataclass
class Child:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restarts: int = 0
    pause: float = 0.0
    exits: list[int] = field(default_factory=list)  # return codes, newest last (a few kept)


class Supervisor:
    def __init__(self, count: int, argv: list[str], on_start: Callable[[int, int, socket.socket], None],
                 on_exit: Callable[[int, int, int, bool], None], env: dict[str, str] | None = None):
        """``on_start(index, pid, parent_end)``; ``on_exit(index, pid, returncode, restarting)``."""
        self.count, self.argv, self.env = count, argv, env
        self.on_start, self.on_exit = on_start, on_exit
        self.children = [Child(i) for i in range(count)]
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for child in self.children:
            self._spawn(child)

    def _spawn(self, child: Child) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen([*self.argv, str(child.index), str(child_end.fileno())],
                                    pass_fds=(child_end.fileno(),), env=self.env)
        except OSError:
            parent_end.close()
            raise
        finally:
            child_end.close()
        child.proc, child.started = proc, time.monotonic()
        self.on_start(child.index, proc.pid, parent_end)
        thread = threading.Thread(target=self._watch, args=(child, proc), name=f"worker-{child.index}-watch",
                                  daemon=True)
        self._threads.append(thread)
        thread.start()

    def _watch(self, child: Child, proc: subprocess.Popen[bytes]) -> None:
        code = proc.wait()
        child.exits = [*child.exits[-4:], code]
        restarting = not self._stopping.is_set()
        self.on_exit(child.index, proc.pid, code, restarting)
        if not restarting:
            return
        quick = time.monotonic() - child.started < QUICK_EXIT_S
        child.pause = min(MAX_PAUSE_S, max(0.5, child.pause * 2)) if quick else 0.0
        if child.pause and self._stopping.wait(child.pause):
            return
        child.restarts += 1
        try:
            self._spawn(child)
        except OSError as exc:  # out of processes or memory: say so, try again after a pause
            log.error("cannot start worker %d: %s", child.index, exc)
            child.started = time.monotonic()
            threading.Thread(target=self._watch_failed, args=(child,), daemon=True).start()

    def _watch_failed(self, child: Child) -> None:
        if not self._stopping.wait(MAX_PAUSE_S):
            try:
                self._spawn(child)
            except OSError as exc:
                log.error("cannot start worker %d: %s", child.index, exc)

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
                proc.wait(5)
        for thread in self._threads:
            thread.join(5)
        return clean

    def halt(self) -> None:
        """Start no more children (those running go on until they exit or ``stop``)."""
        self._stopping.set()
