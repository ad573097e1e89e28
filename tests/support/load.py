"""Deadlines that stretch with the machine's load.

A wait that passes in 40 s on a quiet 2-core box takes 160 s when other work keeps the load
average at 8: the same test, four times fewer CPU seconds per second. ``scaled(seconds)`` is
``seconds`` times ``factor()``: the load average (the larger of the 1- and 5-minute figures,
so a burst that just ended still counts) per core, at least 1 (a quiet machine keeps the
written figure) and at most ``CAP`` (a runaway machine still ends a test).
``$EDGE_TEST_TIME_SCALE`` sets the factor outright (CI that knows its box).

The suite's waits (``poll_until``, ``Server.wait_for``), its pytest timeouts (tests/conftest.py)
and the long subprocesses scale alike, so a pytest timeout written above the waits it wraps
stays above them under any load. Deadlines only: nothing here is a timed assertion.
"""

from __future__ import annotations

import os

CAP = 8.0


def factor() -> float:
    """How much slower than a quiet machine this one runs now (module docstring)."""
    fixed = os.environ.get("EDGE_TEST_TIME_SCALE")
    if fixed:
        return max(1.0, float(fixed))
    try:
        one, five, _ = os.getloadavg()
    except OSError:  # no load average on this platform: the written figures stand
        return 1.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(CAP, max(1.0, max(one, five) / cores))


def scaled(seconds: float) -> float:
    """``seconds`` stretched by the load (``factor()``)."""
    return seconds * factor()


def describe() -> str:
    """The load and the factor, for a timeout's message and the session's header."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return f"time scale x{factor():.1f}"
    return f"load average {one:.1f}/{five:.1f}/{fifteen:.1f} on {os.cpu_count()} cores: time scale x{factor():.1f}"


__all__ = ["CAP", "describe", "factor", "scaled"]
