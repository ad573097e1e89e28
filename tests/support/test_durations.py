"""tests/support/durations.py: a run's record is read back, and the next run collects the
heaviest files first without moving a test inside its file or dropping one."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from tests.support import durations


def _item(nodeid: str) -> Any:
    return types.SimpleNamespace(nodeid=nodeid)


def _record(tests: dict[str, float]) -> None:
    """A session's reports (one per test here; setup, call and teardown add up alike), then its end."""
    recorder = durations.Recorder()
    for nodeid, seconds in tests.items():
        recorder.pytest_runtest_logreport(types.SimpleNamespace(nodeid=nodeid, duration=seconds))  # type: ignore[arg-type]
    recorder.pytest_sessionfinish(None)  # type: ignore[arg-type]  # the session is not read


def test_the_record_is_read_back_and_orders_whole_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_TEST_ARTIFACTS", str(tmp_path))
    _record({"tests/a.py::one": 1.0, "tests/a.py::two": 2.0, "tests/b.py::one": 40.0,
                           "tests/c.py::one[x::y]": 7.5})
    assert durations.previous() == {"tests/b.py": 40.0, "tests/c.py": 7.5, "tests/a.py": 3.0}
    assert "tests/b.py::one" in (tmp_path / durations.NAME).read_text()  # the slowest tests are listed
    items = [_item(n) for n in ("tests/a.py::one", "tests/new.py::one", "tests/a.py::two", "tests/c.py::one[x::y]",
                                "tests/b.py::one", "tests/new.py::two")]
    durations.heaviest_first(items)
    assert [i.nodeid for i in items] == ["tests/b.py::one", "tests/c.py::one[x::y]", "tests/a.py::one",
                                        "tests/a.py::two", "tests/new.py::one", "tests/new.py::two"]


def test_a_partial_run_keeps_the_other_files_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_TEST_ARTIFACTS", str(tmp_path))
    _record({"tests/a.py::one": 5.0, "tests/b.py::one": 9.0})
    _record({"tests/a.py::one": 12.0})
    assert durations.previous() == {"tests/a.py": 12.0, "tests/b.py": 9.0}


def test_without_a_record_the_order_is_pytests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_TEST_ARTIFACTS", str(tmp_path / "none-yet"))
    items = [_item(n) for n in ("tests/z.py::one", "tests/a.py::one")]
    durations.heaviest_first(items)
    assert [i.nodeid for i in items] == ["tests/z.py::one", "tests/a.py::one"]
