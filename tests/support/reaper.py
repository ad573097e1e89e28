"""Every process a test session starts carries its mark, and none outlives the session.

``claim()`` (tests/conftest.py, at configure) adds this pytest process's own mark to
``$EDGE_TEST_OWNERS`` (comma-separated: a pytest run inside a test adds its own beside its
parent's). Children inherit the environment, and so do theirs: a server's front workers, a
SeaweedFS volume server, a chromium renderer, all carry it, even once their parent died
and the kernel handed them to init, where no ``children()`` walk finds them.

``survivors(mark)`` lists the processes still running with the mark (read from
``/proc/<pid>/environ``: the environment they were started with; only this user's
processes are readable, and only those can be ours). ``end(pids)`` stops them by PID:
SIGTERM, then SIGKILL for what has not exited after a grace period.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

VARIABLE = "EDGE_TEST_OWNERS"


def claim() -> str:
    """Mark this process's future children with a mark of its own; returns the mark."""
    mark = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    inherited = os.environ.get(VARIABLE)
    os.environ[VARIABLE] = f"{inherited},{mark}" if inherited else mark
    return mark


def _marks(pid: int) -> list[str]:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return []
    prefix = VARIABLE.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace").split(",")
    return []


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie holds no memory: its parent has only not reaped it yet


def _own_helper(pid: int, command: str) -> bool:
    """multiprocessing's resource tracker, started by this process (a test's SharedMemory): it
    lives as long as this interpreter and ends with it, so it is no leak of the session's."""
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return False
    return parent == os.getpid() and "multiprocessing.resource_tracker" in command


def survivors(mark: str) -> dict[int, str]:
    """{pid: command line} of every running process but this one (and its own resource
    tracker) that carries ``mark``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            pid = int(entry.name)
            if mark in _marks(pid) and _running(pid):
                command = _command(pid)
                if not _own_helper(pid, command):
                    found[pid] = command
    return found


def end(pids: list[int], grace: float = 10) -> None:
    """SIGTERM each PID, then SIGKILL what still runs after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_running(p) for p in pids):
            time.sleep(0.1)


__all__ = ["VARIABLE", "claim", "end", "survivors"]
