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


def test_a_session_ended_by_sigterm_still_stops_its_servers(tmp_path: Path) -> None:
    """`kill PID` of a pytest run (a CI's cancel, `timeout`) tears its fixtures down as Ctrl-C
    does: the server a fixture started is stopped, not orphaned (issue 49's 891 MiB for 30 min)."""
    (tmp_path / "test_killed.py").write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time, pytest
        @pytest.fixture
        def child():
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            open({str(tmp_path / "pid")!r}, "w").write(str(proc.pid))
            yield
            proc.terminate()
            proc.wait(30)
        def test_runs_until_killed(child):
            time.sleep(600)
        """))
    nested = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                               "--rootdir", str(tmp_path), str(tmp_path / "test_killed.py")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        pid = int(poll_until(lambda: (tmp_path / "pid").read_text() if (tmp_path / "pid").exists() else None,
                             120, "the nested test's child to start"))
        nested.terminate()  # SIGTERM, by PID
        out, _ = nested.communicate(timeout=120)
    finally:
        if nested.poll() is None:
            nested.kill()
            nested.wait(30)
    poll_until(lambda: not _alive(pid), 30, f"the fixture's child {pid} to be stopped")
    assert "KeyboardInterrupt" in out or "signal 15" in out, out[-3000:]
