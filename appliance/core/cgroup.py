"""Memory as the process's cgroup sees it, and who the kernel's OOM killer picks first.

A container (``--memory``), a systemd unit (``MemoryMax=``) or a Kubernetes pod's limit puts the
service in a memory cgroup smaller than the host: the host's available memory (what
``psutil.virtual_memory()`` says) is then a promise the kernel will not keep, and the cgroup's
OOM killer ends whichever process of the group scores highest, the serving process included.
So every memory budget starts from ``available_bytes()``: the smaller of the host's available
memory and what the cgroup has left (its limit less its usage, page cache that can be dropped
not counted as used), the limit being the smallest of the process's own cgroup and its
ancestors' (a parent's limit binds its children):

- cgroup v2: ``memory.max`` and ``memory.current`` of the path in ``/proc/self/cgroup``'s
  ``0::`` line, under the unified mount (``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified`` on a
  hybrid host);
- cgroup v1: ``memory.limit_in_bytes`` and ``memory.usage_in_bytes`` of the ``memory``
  controller's path, under ``/sys/fs/cgroup/memory``.

Inside a container with its own cgroup namespace the path reads ``/`` and the mount is the
container's group itself: the walk starts and ends there. Any file missing or unreadable means
no limit known from there (the host's figure stands), never an error.

``raise_oom_score(pid, score)`` writes ``/proc/<pid>/oom_score_adj`` (raising needs no
privilege), as container runtimes and systemd's ``OOMScoreAdjust=`` do: a version's trial
(``TRIAL_OOM_SCORE``) and the front workers (``WORKER_OOM_SCORE``) go before the serving
process, which keeps the models that serve.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("appliance.memory")

ROOT = "/sys/fs/cgroup"
UNLIMITED = 1 << 60  # v1 writes "no limit" as 2^63 rounded down to a page; anything past this is none
TRIAL_OOM_SCORE = 1000  # the most the kernel takes: a trial is always the first to go
WORKER_OOM_SCORE = 500  # a worker (or the zygote) before the serving process, after a trial


def limit_bytes() -> int | None:
    """The smallest memory limit on the way from this process's cgroup to the root; None: none."""
    found = [limit for limit, _ in _groups()]
    limits = [n for n in found if n is not None]
    return min(limits) if limits else None


def available_bytes(host_available: int) -> int:
    """``host_available`` (the host's figure), or less: what the tightest cgroup has left."""
    best = host_available
    for limit, used in _groups():
        if limit is not None and used is not None:
            best = min(best, max(0, limit - used))
    return best


def total_bytes(host_total: int) -> int:
    """``host_total``, or the cgroup's limit when smaller."""
    limit = limit_bytes()
    return min(host_total, limit) if limit is not None else host_total


def raise_oom_score(pid: int, score: int) -> bool:
    """Make ``pid`` (ours) the OOM killer's earlier choice; True when written."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write(str(score))
        return True
    except OSError as exc:  # it has exited, or /proc is read-only: the kernel's own order stands
        log.debug("oom_score_adj of %d not set: %s", pid, exc)
        return False


def _groups() -> list[tuple[int | None, int | None]]:
    """(limit, usage) of each memory cgroup from this process's up to the mount's root."""
    v2, v1 = _own_paths()
    out: list[tuple[int | None, int | None]] = []
    for mount, path, limit_file, usage_file in _places(v2, v1):
        for directory in _ancestors(mount, path):
            limit = _number(os.path.join(directory, limit_file))
            if limit is not None:
                out.append((limit, _usage(directory, usage_file)))
    return out


def _places(v2: str | None, v1: str | None) -> list[tuple[str, str, str, str]]:
    places = []
    if v2 is not None:
        for mount in (ROOT, os.path.join(ROOT, "unified")):
            if os.path.exists(os.path.join(mount, "cgroup.controllers")):
                places.append((mount, v2, "memory.max", "memory.current"))
                break
    if v1 is not None and os.path.isdir(os.path.join(ROOT, "memory")):
        places.append((os.path.join(ROOT, "memory"), v1, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    return places


def _own_paths() -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and v1 ``memory`` path (``/proc/self/cgroup``)."""
    v2 = v1 = None
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _ancestors(mount: str, path: str) -> list[str]:
    """The directories of ``path`` and its parents under ``mount`` that exist (own first)."""
    parts = [p for p in path.split("/") if p and p != ".."]
    dirs = [os.path.join(mount, *parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if os.path.isdir(d)]


def _number(path: str) -> int | None:
    """A limit file's value; None for "max", a v1 unlimited figure, or no file."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None  # "max"
    value = int(text)
    return value if value < UNLIMITED else None


def _usage(directory: str, usage_file: str) -> int | None:
    """The group's usage less the page cache the kernel drops before it kills (inactive files)."""
    used = _number(os.path.join(directory, usage_file))
    if used is None:
        return None
    inactive = 0
    try:
        with open(os.path.join(directory, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in ("inactive_file", "total_inactive_file"):
                    inactive = max(inactive, int(value))
    except (OSError, ValueError):
        pass
    return max(0, used - inactive)


__all__ = ["TRIAL_OOM_SCORE", "WORKER_OOM_SCORE", "available_bytes", "limit_bytes", "raise_oom_score",
           "total_bytes"]
