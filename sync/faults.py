"""Crash points for the kill -9 tests: ``EDGE_SYNC_FAULT=<point>`` makes the sync code stop
dead at that point (it writes ``<state>/sync/fault-<point>`` and sleeps until killed), so a
test can SIGKILL the service at a known moment. Unset in production: ``point()`` is a no-op.
"""

from __future__ import annotations

import os
import time

POINTS = ("mid_download", "before_commit", "after_commit")
_marker_dir = ""


def configure(state_dir: str) -> None:
    global _marker_dir
    _marker_dir = os.path.join(state_dir, "sync")


def point(name: str) -> None:
    if os.environ.get("EDGE_SYNC_FAULT") != name or not _marker_dir:
        return
    with open(os.path.join(_marker_dir, f"fault-{name}"), "w") as f:
        f.write(str(os.getpid()))
    while True:  # hold here until the test kills the process
        time.sleep(3600)
