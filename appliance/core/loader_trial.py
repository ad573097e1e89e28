"""Running a version's trial (appliance/core/loader_child.py) where it cannot hurt the service.

``run_in_child(request, limits, cancel)`` starts ``python -m appliance.core.loader_child``,
hands it the request and watches it until it answers:

- **memory**: the child's resident memory, read every 20 ms from ``/proc/<pid>/statm``, may
  grow by at most ``limits.memory_bytes`` past what its runtimes took at import (the child
  reports that figure first); past it the child is killed. Inside, the child also sets
  ``RLIMIT_AS`` so that most runaway allocations fail cleanly in the library first.
- **time**: ``limits.timeout_s`` (``load_deadline_s``: in proportion to the version's size,
  at most ``runtime.load_timeout_s``), then it is killed.
- **the service stopping**: ``cancel`` set, it is killed.
- **crashes**: a signal or a non-zero exit becomes a failed verdict naming the signal and the
  last words the child wrote on stderr.

Whatever happens, the answer is a verdict (``ok``; ``code`` and ``reason`` when not), never
an exception, and the child is reaped before this returns. ``memory_budget`` gives the
default limit: 80 % of the memory available when the trial starts, as the service's cgroup sees
it when that is less than the host's (a container's or a unit's limit: appliance/core/cgroup.py).
The child's ``oom_score_adj`` is raised to the most, so that should the kernel's OOM killer act
anyway (a runaway allocation between two reads), the trial is what it ends, not the serving process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO, Any, Mapping

import psutil

from appliance.core.cgroup import TRIAL_OOM_SCORE, available_bytes, raise_oom_score

WATCH_S = 0.02
MB = 1 << 20
AUTO_SHARE = 0.8  # of the memory available when a trial starts, when no limit is configured
# Signals a crash ends with (SIGKILL is the kernel's OOM killer's, or ours: said apart).
CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE}


@dataclass(frozen=True)
class Limits:
    memory_bytes: int
    timeout_s: float


def memory_budget(configured_mb: int) -> int:
    """Bytes a trial may grow by: ``runtime.load_memory_mb``, or 80 % of what is available
    (the host's figure, or the cgroup's when it has less left)."""
    if configured_mb > 0:
        return configured_mb * MB
    return int(available_bytes(psutil.virtual_memory().available) * AUTO_SHARE)


def load_deadline_s(version_dir: str, runtime: Any) -> float:
    """Seconds a trial of ``version_dir`` may take: ``runtime.load_timeout_base_s`` plus
    ``load_timeout_s_per_mb`` for each MB of its files, at most ``load_timeout_s`` (all of it
    when per-MB is 0)."""
    if runtime.load_timeout_s_per_mb <= 0:
        return float(runtime.load_timeout_s)
    scaled = runtime.load_timeout_base_s + runtime.load_timeout_s_per_mb * directory_bytes(version_dir) / MB
    return float(min(runtime.load_timeout_s, scaled))


def directory_bytes(path: str) -> int:
    """The bytes of the files under ``path`` (links not followed; what cannot be read counts 0)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


TRIAL = [sys.executable, "-m", "appliance.core.loader_child"]


def run_in_child(request: Mapping[str, Any], limits: Limits, cancel: threading.Event,
                 command: list[str] | None = None) -> dict[str, Any]:
    """The child's verdict on the version (see the module docstring); never raises for
    anything the child does. ``command``: the child to run (the trial; tests pass their own)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(command or TRIAL, stdin=subprocess.PIPE,
                                    stdout=out, stderr=err, env=_child_env(), close_fds=True)
        except OSError as exc:  # no process to run it in: the version cannot be tried, so it does not serve
            return {"ok": False, "code": "INTERNAL", "reason": f"the trial process could not start: {exc}"}
        raise_oom_score(proc.pid, TRIAL_OOM_SCORE)  # before it reads its request: it loads nothing yet
        try:
            assert proc.stdin is not None
            body = {**request, "parent": os.getpid(), "memory_bytes": limits.memory_bytes}
            proc.stdin.write(json.dumps(body, default=str).encode())
            proc.stdin.close()
        except OSError:  # it died before reading: the verdict below says how
            pass
        stopped = _watch(proc, out, limits, cancel)
        return _verdict(proc.returncode, _text(out), _text(err, 64 << 10), stopped, limits)


def _child_env() -> dict[str, str]:
    """The service's environment, with the package importable from where it runs, malloc held
    to two arenas (each thread's 64 MB arena reservation would count against RLIMIT_AS) and
    TensorFlow's info lines off."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _watch(proc: subprocess.Popen[bytes], out: IO[bytes], limits: Limits,
           cancel: threading.Event) -> tuple[str, str] | None:
    """Wait for the child; (code, why) when it had to be stopped."""
    deadline = time.monotonic() + limits.timeout_s
    baseline: int | None = None
    while True:
        try:
            proc.wait(timeout=WATCH_S)
            return None
        except subprocess.TimeoutExpired:
            pass
        baseline = baseline if baseline is not None else _baseline(out)
        grown = _resident(proc.pid) - baseline if baseline is not None else 0
        if grown > limits.memory_bytes:
            return _stop(proc, "RESOURCE_EXHAUSTED", f"grew by {grown // MB} MB, past the load memory limit of "
                         f"{limits.memory_bytes // MB} MB (runtime.load_memory_mb), and was stopped")
        if time.monotonic() > deadline:
            return _stop(proc, "DEADLINE_EXCEEDED", f"was still running after {limits.timeout_s:g} s "
                         "(runtime.load_timeout_base_s + load_timeout_s_per_mb x its size, at most "
                         "load_timeout_s) and was stopped")
        if cancel.is_set():
            return _stop(proc, "CANCELLED", "was stopped: the service is stopping")


def _stop(proc: subprocess.Popen[bytes], code: str, why: str) -> tuple[str, str]:
    proc.kill()
    proc.wait()
    return code, why


def _baseline(out: IO[bytes]) -> int | None:
    """The child's resident bytes once its runtimes were imported (its first line), or None yet."""
    first = _text(out).split("\n", 1)
    if len(first) < 2:
        return None
    try:
        return int(json.loads(first[0])["resident_bytes"])
    except (ValueError, KeyError, TypeError):
        return None


def _resident(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):  # it has just exited
        return 0


def _text(f: IO[bytes], tail: int = 4 << 20) -> str:
    """The file's content (its last ``tail`` bytes), read without moving the child's offset."""
    size = os.fstat(f.fileno()).st_size
    return os.pread(f.fileno(), tail, max(0, size - tail)).decode("utf-8", "replace")


def _verdict(returncode: int | None, out: str, err: str, stopped: tuple[str, str] | None,
             limits: Limits) -> dict[str, Any]:
    if stopped is not None:
        code, why = stopped
        return {"ok": False, "code": code, "reason": f"the trial load {why}", "stderr": _last_words(err)}
    lines = [line for line in out.splitlines() if line.strip()]
    verdict = _parsed(lines[-1]) if len(lines) >= 2 else None
    if returncode == 0 and verdict is not None:
        return verdict
    code, why = _crash(returncode, limits)
    words = _last_words(err)
    return {"ok": False, "code": code, "reason": f"the trial load {why}" + (f": {words}" if words else ""),
            "stderr": words}


def _parsed(line: str) -> dict[str, Any] | None:
    try:
        doc = json.loads(line)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and "ok" in doc else None


def _crash(returncode: int | None, limits: Limits) -> tuple[str, str]:
    if returncode is not None and returncode < 0:
        sig = signal.Signals(-returncode)
        if sig == signal.SIGKILL:  # not ours (ours is reported as stopped): the kernel's OOM killer
            return "RESOURCE_EXHAUSTED", (f"was killed with SIGKILL (out of memory: the kernel's OOM killer; "
                                          f"the load memory limit was {limits.memory_bytes // MB} MB)")
        kind = "crashed" if sig in CRASH_SIGNALS else "was ended"
        return "INTERNAL", f"{kind} with {sig.name}"
    return "INTERNAL", f"ended with exit status {returncode} and no verdict"


def _last_words(err: str, keep: int = 3) -> str:
    """The child's last stderr lines that say something (not TensorFlow's info chatter)."""
    lines = [line.strip() for line in err.splitlines()
             if line.strip() and not line.startswith(("I0000", "W0000", "INFO:", "WARNING: All log"))]
    return " | ".join(lines[-keep:])[-600:]


__all__ = ["Limits", "directory_bytes", "load_deadline_s", "memory_budget", "run_in_child"]
