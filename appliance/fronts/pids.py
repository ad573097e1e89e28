"""A process named by a pidfd (Linux 5.3 and later), not by its pid: signalled, watched and
reaped without the race a bare pid has (a pid its parent reaped may name another process at
once), whether this process is its parent or not.

The front workers' processes use it both ways (appliance/fronts/zygote.py): the serving process
holds a pidfd on every worker the zygote forked, so it can kill one and see it end even after
the zygote, their parent, is gone; and each worker holds one on the serving process, so it
exits when that one does, whoever its own parent is by then.

``open_pidfd`` is None where the kernel or the platform has no pidfds: callers fall back to the
parent-only ways (the zygote kills and reports its children; a worker watches its parent).

Thread-safety: ``kill``, ``ended``, ``reap`` and ``close`` from any thread (the descriptor is
closed under a lock, so no call ever reaches a number the kernel has given to another file).
"""

from __future__ import annotations

import os
import select
import signal
import threading


def open_pidfd(pid: int) -> "PidFd | None":
    """A pidfd on ``pid``; None when there are no pidfds here or ``pid`` is gone."""
    try:
        return PidFd(os.pidfd_open(pid))
    except (AttributeError, OSError):  # no os.pidfd_open (not Linux), ENOSYS (kernel < 5.3), ESRCH
        return None


class PidFd:
    """One process, by its pidfd (module docstring). Owns ``fd``."""

    def __init__(self, fd: int):
        self.fd = fd
        self._lock = threading.Lock()

    def kill(self) -> None:
        """SIGKILL, when it still runs."""
        with self._lock:
            if self.fd < 0:
                return
            try:
                signal.pidfd_send_signal(self.fd, signal.SIGKILL)
            except ProcessLookupError:  # ended already (a zombie is past signals too)
                pass

    def ended(self, timeout: float | None = 0.0) -> bool:
        """Whether it has exited (a zombie counts), waiting up to ``timeout`` (None: forever)."""
        fd = self.fd
        if fd < 0:
            return True
        try:
            return bool(select.select([fd], [], [], timeout)[0])
        except (OSError, ValueError):  # closed meanwhile: only ``close`` does that, once it ended
            return True

    def reap(self) -> int | None:
        """Its exit status as ``Popen.returncode`` has it (negative for a signal) when this
        process is its parent (its own child, or one handed to it as the subreaper) and it has
        ended; None otherwise (another parent reaps it)."""
        with self._lock:
            if self.fd < 0:
                return None
            try:
                result = os.waitid(os.P_PIDFD, self.fd, os.WEXITED | os.WNOHANG)
            except (ChildProcessError, AttributeError, OSError):
                return None
        if result is None:
            return None
        return result.si_status if result.si_code == os.CLD_EXITED else -result.si_status

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Have the orphans among this process's descendants handed to it rather than to init
    (``PR_SET_CHILD_SUBREAPER``): the serving process, so that the workers of a zygote that died
    become its children and ``PidFd.reap`` reads how each one ends. False where not possible."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):  # no libc prctl: not Linux
        return False
