"""Memory and CPU of the whole service: the serving process and every process under it
(front workers, a version loaded in a child), not the serving process alone nor the
machine.

Memory per process comes from ``/proc/<pid>/smaps_rollup`` (Linux 4.14+): RSS counts a
page shared by several processes in each of them, PSS divides it among them, so the PSS
of the tree is what the service really costs (bench/RESULTS.md judges memory the same
way). Where smaps_rollup cannot be read (another user's process, not Linux), psutil's RSS
stands in and PSS is left out.

CPU is the tree's own: the user+system time its processes used since the previous sample,
over the wall time between the samples, in percent of one core (``top``'s convention: a
busy 2-core service shows 200 %) and of all cores. A process that exited between two
samples takes its last interval with it.

Reading smaps_rollup walks every mapping of a process: about 18 ms of kernel time for a
serving process holding TensorFlow (bench/RESULTS.md, "/api/status"). So the list of
processes and their memory are re-read at most every ``MEMORY_EVERY_S`` (``memory_at`` says
when), while the CPU figure (one /proc/<pid>/stat read each) is fresh at every call.

``TreeSampler.sample()`` is thread-safe (a status request may come from any thread); the
first call has no CPU figure yet (None).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import psutil

KIB = 1024
MEMORY_EVERY_S = 10.0  # the tree and its memory are re-read at most this often (module docstring)


def smaps_rollup(pid: int) -> dict[str, int]:
    """``Rss`` and ``Pss`` (bytes) of ``pid`` from /proc/<pid>/smaps_rollup; {} when unreadable."""
    wanted = {"Rss:": "rss_bytes", "Pss:": "pss_bytes"}
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
            for line in f:
                key, _, rest = line.partition(b" ")
                name = wanted.get(key.decode(errors="replace"))
                if name:
                    out[name] = int(rest.split()[0]) * KIB
    except (OSError, ValueError, IndexError):
        return {}
    return out


def tree(root: psutil.Process | None = None) -> list[psutil.Process]:
    """``root`` (this process by default) and all its descendants alive now."""
    root = root or psutil.Process()
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return [root]


class TreeSampler:
    """Samples the tree's memory and CPU; remembers CPU times between calls."""

    def __init__(self, root_pid: int | None = None, memory_every_s: float = MEMORY_EVERY_S):
        self.root_pid = root_pid or os.getpid()
        self.memory_every_s = memory_every_s
        self._lock = threading.Lock()
        self._rows: list[tuple[psutil.Process, dict[str, Any]]] = []  # the tree, each with its memory
        self._memory_at = 0.0  # wall-clock time _rows were read
        self._cpu: dict[tuple[int, float], float] = {}  # (pid, create time) -> cpu seconds at the last sample
        self._at = 0.0  # monotonic time of the last sample
        self._wall = 0.0  # its wall-clock time (process creation times are wall-clock)

    def sample(self, roles: dict[int, str] | None = None) -> dict[str, Any]:
        """The tree's figures and one row per process (``roles``: pid -> what it is)."""
        rows, cpu_now = [], {}
        for proc, memory in self._tree(roles or {}):
            try:
                times = proc.cpu_times()
            except psutil.Error:  # exited since the tree was read
                continue
            rows.append(dict(memory))
            cpu_now[(proc.pid, memory["_created"])] = times.user + times.system
        for row in rows:
            row.pop("_created")
        cpu = self._cpu_percent(cpu_now)
        cores = os.cpu_count() or 1
        return {
            "processes": len(rows),
            "rss_bytes": sum(r.get("rss_bytes") or 0 for r in rows),
            "pss_bytes": sum(r["pss_bytes"] for r in rows) if all("pss_bytes" in r for r in rows) else None,
            "cpu_percent": cpu,  # of one core
            "cpu_percent_of_machine": round(cpu / cores, 1) if cpu is not None else None,
            "cpu_cores": cores,
            "per_process": rows,
            "memory_at": self._memory_at,
        }

    def _tree(self, roles: dict[int, str]) -> list[tuple[psutil.Process, dict[str, Any]]]:
        """The processes and their memory, re-read when older than ``memory_every_s``."""
        with self._lock:
            if time.time() - self._memory_at < self.memory_every_s and self._rows:
                return list(self._rows)
        found = [(p, self._memory(p, roles)) for p in tree(psutil.Process(self.root_pid))]
        rows = [(p, m) for p, m in found if m is not None]
        with self._lock:
            self._rows, self._memory_at = rows, time.time()
        return rows

    def _memory(self, proc: psutil.Process, roles: dict[int, str]) -> dict[str, Any] | None:
        try:
            role = roles.get(proc.pid) or _role(proc, self.root_pid)
            memory = smaps_rollup(proc.pid) or {"rss_bytes": proc.memory_info().rss}
            return {"pid": proc.pid, "role": role, "_created": proc.create_time(), **memory}
        except psutil.Error:  # exited meanwhile, or not ours to read
            return None

    def _cpu_percent(self, now_cpu: dict[tuple[int, float], float]) -> float | None:
        """Percent of one core the tree used since the previous sample (None on the first)."""
        now, wall = time.monotonic(), time.time()
        with self._lock:
            last, last_at, last_wall = self._cpu, self._at, self._wall
            self._cpu, self._at, self._wall = now_cpu, now, wall
        if not last_at or now <= last_at:
            return None
        used = 0.0
        for key, cpu in now_cpu.items():
            if key in last:
                used += max(0.0, cpu - last[key])
            elif key[1] >= last_wall:  # born since the last sample: all its time is in this interval
                used += cpu
        return round(100 * used / (now - last_at), 1)


def _role(proc: psutil.Process, root_pid: int) -> str:
    """What a process of the tree is, where the caller's ``roles`` did not say: the front
    workers' zygote is a fork of the serving process (same command line, its direct child;
    appliance/fronts/zygote.py), a worker started as a fresh interpreter runs
    ``appliance.fronts.worker``, a version's trial ``appliance.core.loader_child``."""
    if proc.pid == root_pid:
        return "serving"
    try:
        cmdline = proc.cmdline()
        if proc.ppid() == root_pid and cmdline == psutil.Process(root_pid).cmdline():
            return "zygote"
    except psutil.Error:
        cmdline = []
    words = " ".join(cmdline[1:4])
    if "fronts.worker" in words:
        return "front worker"
    return "version trial" if "loader_child" in words else "child"
