"""tests/support/cache.py's ``skip_busy``: a cache another process is building is skipped (``Busy``),
not waited for, so two workers build the ahead-of-tests caches side by side; a cache a builder
uses inside still waits; once the other process lets go, the cache builds."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

from tests.support import cache
from tests.support.servers import poll_until

# A child that holds a cache's lock until its stdin closes: another worker building it.
HOLD = ("import fcntl, sys\nlock = open(sys.argv[1], 'w')\nfcntl.flock(lock, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\nsys.stdin.read()\n")


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGE_TEST_MODEL_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture
def holder(root: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(root / ".a.lock")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"  # the lock is held from here on
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def _waiting_on(lock: Path) -> bool:
    """Whether some process waits for ``lock`` (a "->" line, a blocked request, in /proc/locks)."""
    inode = f":{lock.stat().st_ino} "
    return any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines())


def _write(folder: Path) -> None:
    (folder / "model").write_text("built")


def test_a_cache_another_process_builds_is_skipped_then_built(root: Path, holder: subprocess.Popen[str]) -> None:
    calls: list[Path] = []
    with cache.skip_busy(), pytest.raises(cache.Busy):
        cache.built_once("a", calls.append)
    assert calls == [] and not (root / "a").exists()
    with cache.skip_busy():  # another cache is free: built at once
        assert (cache.built_once("b", _write) / "model").read_text() == "built"
    assert holder.stdin is not None
    holder.stdin.close()  # the other process lets go (without having built it)
    holder.wait(30)
    with cache.skip_busy():
        assert (cache.built_once("a", _write) / "model").read_text() == "built"


def test_a_cache_used_inside_a_build_is_waited_for(root: Path, holder: subprocess.Popen[str]) -> None:
    inside = threading.Event()
    outcome: list[object] = []

    def outer(folder: Path) -> None:
        inside.set()
        (folder / "inner").write_text((cache.built_once("a", _write) / "model").read_text())

    def run() -> None:
        try:
            with cache.skip_busy():
                outcome.append(cache.built_once("outer", outer))
        except Exception as exc:  # noqa: BLE001 — the assertion below names it
            outcome.append(exc)

    thread = threading.Thread(target=run, name="builds-outer")
    thread.start()
    assert inside.wait(60), "the outer build never started"
    # The inner call waits on the held lock (a blocked flock in /proc/locks), or has given up.
    poll_until(lambda: _waiting_on(root / ".a.lock") or not thread.is_alive(), 60, "the inner build to wait")
    assert holder.stdin is not None
    holder.stdin.close()
    thread.join(60)
    assert not thread.is_alive() and len(outcome) == 1 and isinstance(outcome[0], Path), outcome
    assert (outcome[0] / "inner").read_text() == "built"
