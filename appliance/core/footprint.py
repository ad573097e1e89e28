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

    def __init__(self, root_pid: int | None = None):
        self.root_pid = root_pid or os.getpid()
        self._lock = threading.Lock()
        self._cpu: dict[tuple[int, float], float] = {}  # (pid, create time) -> cpu seconds at the last sample
        self._at = 0.0  # monotonic time of the last sample
        self._wall = 0.0  # its wall-clock time (process creation times are wall-clock)

    def sample(self, roles: dict[int, str] | None = None) -> dict[str, Any]:
        """The tree's figures and one row per process (``roles``: pid -> what it is)."""
        found = [self._process(p, roles or {}) for p in tree(psutil.Process(self.root_pid))]
        rows = [r for r in found if r is not None]
        cpu = self._cpu_percent({(r["pid"], r.pop("_created")): r.pop("_cpu_s") for r in rows})
        cores = os.cpu_count() or 1
        return {
            "processes": len(rows),
            "rss_bytes": sum(r.get("rss_bytes") or 0 for r in rows),
            "pss_bytes": sum(r["pss_bytes"] for r in rows) if all("pss_bytes" in r for r in rows) else None,
            "cpu_percent": cpu,  # of one core
            "cpu_percent_of_machine": round(cpu / cores, 1) if cpu is not None else None,
            "cpu_cores": cores,
            "per_process": rows,
        }

    def _process(self, proc: psutil.Process, roles: dict[int, str]) -> dict[str, Any] | None:
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                row: dict[str, Any] = {"pid": proc.pid, "role": roles.get(proc.pid) or _role(proc, self.root_pid),
                                       "_created": proc.create_time(), "_cpu_s": times.user + times.system}
                memory = smaps_rollup(proc.pid) or {"rss_bytes": proc.memory_info().rss}
        except psutil.Error:  # exited meanwhile, or not ours to read
            return None
        return {**row, **memory}

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
    if proc.pid == root_pid:
        return "serving"
    try:
        cmdline = " ".join(proc.cmdline()[1:4])
    except psutil.Error:
        cmdline = ""
    return "front worker" if "fronts.worker" in cmdline else "child"
