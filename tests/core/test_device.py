"""The device's live figures, as /api/status and the status page show them."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import psutil

from appliance.core import device
from tests.support.servers import poll_until


def busy_seconds() -> float:
    t = psutil.cpu_times()
    return t.user + t.system


def test_cpu_use_is_measured_across_threads(tmp_path: Path) -> None:
    """Status requests land on whichever HTTP worker is free: a figure asked for on a thread
    that never asked before still covers the time since the previous request (psutil's own
    cpu_percent(None) keeps a sample per thread and read 0.0 there)."""
    first_asked, done = threading.Event(), threading.Event()

    def first_worker() -> None:  # stays alive, so the next worker is another thread
        device.live_figures(str(tmp_path))
        first_asked.set()
        done.wait(60)

    first = threading.Thread(target=first_worker)
    first.start()
    try:
        assert first_asked.wait(30)
        start = busy_seconds()
        poll_until(lambda: [sum(range(20_000)) for _ in range(50)] and busy_seconds() - start >= 0.1, 60,
                   "the machine to use 0.1 s of CPU")
        out: dict[str, Any] = {}
        second = threading.Thread(target=lambda: out.update(device.live_figures(str(tmp_path))))
        second.start()
        second.join(30)
    finally:
        done.set()
        first.join(30)
    assert isinstance(out["cpu_percent"], float) and 0 < out["cpu_percent"] <= 100, out["cpu_percent"]
