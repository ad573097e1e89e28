"""Where the suite's time goes, written down by every run and used by the next one.

Each test's setup, call and teardown durations are added up per file (a module fixture's
start lands in its file's first test, its stop in the last) and, at the session's end, written
to ``$EDGE_TEST_ARTIFACTS/durations.txt`` (scripts/test.sh sets it): the files heaviest first
(a file this run did not run keeps its last figure), then this run's slowest tests. Under xdist the controller receives every worker's reports, so one
file covers the whole run.

The next run reads that file back and collects the heaviest files first. A clean checkout
(CI) has no ``test-artifacts/``: ``tests/durations.txt``, a record committed in the tree, is
read under it (a file the local record also has takes the local figure), so CI's first run is
ordered too. Refresh it from a full loaded run with ``python -m tests.support.durations``
(it copies the local record's file lines into the tree). scripts/test.sh
hands whole files to two workers (``--dist loadfile``) in collection order; a 3-minute file
that happens to be collected last keeps one worker busy while the other has nothing left
to do. Longest first is the classic remedy (LPT scheduling). Only the order of files
changes, never which tests run or the order inside a file; without the file (a first run,
another checkout) the order is pytest's own.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

NAME = "durations.txt"
SLOWEST = 40  # tests listed after the files
COMMITTED = Path(__file__).resolve().parents[1] / NAME  # tests/durations.txt: the record a clean checkout has


def artifacts() -> Path | None:
    folder = os.environ.get("EDGE_TEST_ARTIFACTS")
    return Path(folder) if folder else None


class Recorder:
    """Adds up each report's duration per file and per test (a pytest plugin object)."""

    def __init__(self) -> None:
        self.files: dict[str, float] = defaultdict(float)
        self.tests: dict[str, float] = defaultdict(float)
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.files[report.nodeid.split("::")[0]] += report.duration
        self.tests[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        folder = artifacts()
        if folder is None or not self.files:
            return
        folder.mkdir(parents=True, exist_ok=True)
        wall = time.monotonic() - self.started
        lines = [f"# {len(self.tests)} tests, {sum(self.files.values()):.0f} s of test time in {wall:.0f} s of wall time; "
                 f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} at the end",
                 "# seconds  file (setup + call + teardown of all its tests)"]
        files = {**previous(), **self.files}  # a run of some files keeps the others' last figures
        lines += [f"{s:9.1f}  {f}" for f, s in sorted(files.items(), key=lambda kv: -kv[1])]
        lines.append(f"# the {SLOWEST} slowest tests")
        lines += [f"{s:9.1f}  {t}" for t, s in sorted(self.tests.items(), key=lambda kv: -kv[1])[:SLOWEST]]
        (folder / NAME).write_text("\n".join(lines) + "\n")


def previous() -> dict[str, float]:
    """The per-file seconds the last runs wrote: the committed record's, overridden by the local
    one's (empty without either)."""
    folder = artifacts()
    return {**read(COMMITTED), **(read(folder / NAME) if folder else {})}


def read(path: Path) -> dict[str, float]:
    """The per-file seconds of one record (empty if there is none)."""
    if not path.is_file():
        return {}
    seconds: dict[str, float] = {}
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            if "slowest tests" in line:
                break
            continue
        parts = line.split(None, 1)
        if len(parts) == 2:
            try:
                seconds[parts[1]] = float(parts[0])
            except ValueError:
                continue
    return seconds


def commit_record(source: Path, target: Path) -> int:
    """Write ``source``'s file lines (a full run's local record) to ``target`` (the committed
    record), heaviest first, under a header saying where they came from; the number of files."""
    text = source.read_text().splitlines()
    first = text[0] if text and text[0].startswith("# ") else "# (no header)"
    seconds = read(source)
    lines = ["# The per-file seconds of a full run (scripts/test.sh), copied from its test-artifacts/durations.txt",
             "# by `python -m tests.support.durations`; read when a checkout has no local record of its own (CI):",
             "# the files are collected and handed to the workers heaviest first (tests/support/durations.py).",
             "# That run:" + first[1:]]
    lines += [f"{s:9.1f}  {f}" for f, s in sorted(seconds.items(), key=lambda kv: -kv[1])]
    target.write_text("\n".join(lines) + "\n")
    return len(seconds)


def heaviest_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: whole files, the heaviest of the last run first; a file the
    last run did not see keeps its place after them; inside a file nothing moves."""
    seconds = previous()
    if not seconds:
        return
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))
    items.sort(key=lambda item: (-seconds.get(item.nodeid.split("::")[0], 0.0),
                                 first_seen[item.nodeid.split("::")[0]]))


if __name__ == "__main__":
    local = (artifacts() or Path("test-artifacts")) / NAME
    print(f"{commit_record(local, COMMITTED)} files from {local} -> {COMMITTED}")


__all__ = ["COMMITTED", "NAME", "Recorder", "commit_record", "heaviest_first", "previous", "read"]
