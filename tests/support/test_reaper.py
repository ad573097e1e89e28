"""The session's end check: a process the suite started that outlives its owner (handed to
init, as a server's child is when the server is killed) is found by its mark, ended, and the
session fails naming it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.support import reaper
from tests.support.servers import ROOT, poll_until

# Starts a grandchild that sleeps, prints its PID and exits at once: the grandchild is orphaned.
ORPHAN = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], "
          "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)")


def _alive(pid: int) -> bool:
    return pid in reaper.survivors(os.environ[reaper.VARIABLE].split(",")[-1])


def test_an_orphan_is_found_by_its_mark_and_ended() -> None:
    mark = os.environ[reaper.VARIABLE].split(",")[-1]  # this session's own (tests/conftest.py)
    pid = int(subprocess.run([sys.executable, "-c", ORPHAN], capture_output=True, text=True, check=True,
                             timeout=60).stdout)
    try:
        assert "time.sleep(600)" in reaper.survivors(mark)[pid]
        assert os.getpid() not in reaper.survivors(mark)  # never the session itself
    finally:
        reaper.end([pid])
    assert not _alive(pid)


def test_a_session_that_leaves_one_running_fails_and_ends_it(tmp_path: Path) -> None:
    (tmp_path / "test_leaves.py").write_text(textwrap.dedent(f"""
        import subprocess, sys
        def test_leaves_an_orphan():
            pid = subprocess.run([sys.executable, "-c", {ORPHAN!r}], capture_output=True, text=True).stdout
            open({str(tmp_path / "pid")!r}, "w").write(pid)
        """))
    nested = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                             "--rootdir", str(tmp_path), str(tmp_path / "test_leaves.py")],
                            cwd=ROOT, capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    pid = int((tmp_path / "pid").read_text())
    poll_until(lambda: not _alive(pid), 30, f"the orphan {pid} to be gone")
    assert nested.returncode != 0, nested.stdout[-3000:]
    assert "still running at its end" in nested.stdout and str(pid) in nested.stdout, nested.stdout[-3000:]
    assert re.search(r"1 passed.* 1 error", nested.stdout), nested.stdout[-3000:]
