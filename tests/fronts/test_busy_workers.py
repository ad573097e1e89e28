"""Busy is not hung (appliance/fronts/supervisor.py): a child that computes for longer than the
heartbeat timeout without a word (a front worker decoding a huge body on its loop) is kept and
counted as serving; a stopped one (SIGSTOP) is killed and replaced; one that computes past the
busy limit is killed too.

Real processes, started by the supervisor through ``launch`` as the pool starts workers: each
speaks on its end of the socketpair, spins its main thread, or both; this test reads the other
end and reports each word with ``heard``, as the serving process does. Processes are ended by
PID (the supervisor's ``stop``), and each child also exits when its channel closes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any, Iterator

import pytest

from appliance.fronts.supervisor import Exit, Supervisor
from tests.support.servers import poll_until

# A wait of up to 300 s inside: the pytest timeout sits above it (tests/test_timeouts.py).
pytestmark = pytest.mark.timeout(600)

TIMEOUT_S = 2.0
# The child: speaks every 0.1 s; with SPIN_S, after its first words it computes (its main thread,
# silent) until it has used SPIN_S of CPU, then says "done" and speaks on. Exits when the channel closes.
CHILD = r"""
import os, socket, sys, time

sock = socket.socket(fileno=int(sys.argv[1]))
spin = float(sys.argv[2])
def say(word):
    try:
        sock.sendall(word)
    except OSError:
        sys.exit(0)
say(b"hi;")
if spin:
    start = time.process_time()
    while time.process_time() - start < spin:
        pass
    say(b"done;")
while True:
    say(b"hi;")
    time.sleep(0.1)
"""


class Children:
    """The supervisor's callbacks: what the children said, and how they ended."""

    def __init__(self, spins: list[float]):
        self.spins = spins  # CPU seconds of each launch in turn; the last repeats
        self.launches = 0
        self.said: dict[int, bytes] = {}  # pid -> everything it said
        self.exits: list[Exit] = []
        self.ends: list[socket.socket] = []
        self.sup: Supervisor | None = None

    def launch(self, index: int, child_end: socket.socket) -> Any:
        spin = self.spins[min(self.launches, len(self.spins) - 1)]
        self.launches += 1
        fd = child_end.fileno()
        return subprocess.Popen([sys.executable, "-c", CHILD, str(fd), str(spin)], pass_fds=(fd,))

    def on_start(self, index: int, pid: int, parent_end: socket.socket) -> None:
        self.said[pid] = b""
        self.ends.append(parent_end)
        threading.Thread(target=self.read, args=(index, pid, parent_end), daemon=True).start()

    def read(self, index: int, pid: int, end: socket.socket) -> None:
        while True:
            try:
                data = end.recv(4096)
            except OSError:
                return
            if not data:
                return
            self.said[pid] += data
            assert self.sup is not None
            self.sup.heard(index)

    def on_exit(self, index: int, ended: Exit, restarting: bool) -> None:
        self.exits.append(ended)


@pytest.fixture
def supervise() -> Iterator[Any]:
    made: list[tuple[Supervisor, Children]] = []

    def start(spins: list[float], busy_limit_s: float | None = None) -> tuple[Supervisor, Children]:
        children = Children(spins)
        sup = Supervisor(1, children.launch, children.on_start, children.on_exit, TIMEOUT_S,
                         busy_limit_s=busy_limit_s)
        children.sup = sup
        made.append((sup, children))
        sup.start()
        return sup, children

    yield start
    for sup, children in made:
        sup.halt()
        for end in children.ends:  # the children see their channel close and exit
            end.close()
        sup.stop(30)


def pid_of(sup: Supervisor) -> int:
    proc = sup.children[0].proc
    assert proc is not None
    return proc.pid


def test_a_child_computing_past_the_timeout_is_kept_and_a_stopped_one_is_killed(supervise: Any) -> None:
    # 4 s of CPU without a word: two heartbeat timeouts of silence at least, however loaded the
    # machine (its wall time only grows); the busy limit far past what a loaded machine stretches that to
    sup, children = supervise([2 * TIMEOUT_S, 0.0], busy_limit_s=600)
    busy = pid_of(sup)
    seen_serving = []

    def spoke_again() -> bool:
        assert not children.exits, f"the computing child was killed: {children.exits}"
        seen_serving.append(sup.serving() == [0])
        return b"done;" in children.said.get(busy, b"")

    poll_until(lambda: sup.serving() == [0], 60, "the child's first word")
    poll_until(spoke_again, 300, "the busy child to finish computing and speak again")
    assert children.exits == [] and pid_of(sup) == busy  # never killed for its silence
    assert all(seen_serving), "a computing child stopped counting as serving"

    os.kill(busy, signal.SIGSTOP)  # the same child, now stopped: no word and no CPU
    try:
        poll_until(lambda: children.exits, 60, "the stopped child to be killed")
    finally:
        if not children.exits:
            os.kill(busy, signal.SIGKILL)
    assert children.exits[0].pid == busy and children.exits[0].reason == "heartbeat", children.exits
    poll_until(lambda: pid_of(sup) != busy and sup.serving() == [0], 60, "a new child in its place, heard")


def test_a_child_computing_past_the_busy_limit_is_killed(supervise: Any) -> None:
    sup, children = supervise([3600.0, 0.0], busy_limit_s=2 * TIMEOUT_S)
    busy = pid_of(sup)
    poll_until(lambda: children.exits, 120, "the child computing past the busy limit to be killed")
    assert children.exits[0].pid == busy and children.exits[0].reason == "heartbeat"
