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


@pytest.fixture(autouse=True)
def no_committed_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tree's tests/durations.txt stays out of these tests unless one puts a record there."""
    monkeypatch.setattr(durations, "COMMITTED", tmp_path / "committed" / durations.NAME)


def test_the_record_is_read_back_and_orders_whole_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_TEST_ARTIFACTS", str(tmp_path))
    _record({"suite/a.py::one": 1.0, "suite/a.py::two": 2.0, "suite/b.py::one": 40.0,
                           "suite/c.py::one[x::y]": 7.5})
    assert durations.previous() == {"suite/b.py": 40.0, "suite/c.py": 7.5, "suite/a.py": 3.0}
    assert "suite/b.py::one" in (tmp_path / durations.NAME).read_text()  # the slowest tests are listed
    items = [_item(n) for n in ("suite/a.py::one", "suite/new.py::one", "suite/a.py::two", "suite/c.py::one[x::y]",
                                "suite/b.py::one", "suite/new.py::two")]
    durations.heaviest_first(items)
    assert [i.nodeid for i in items] == ["suite/b.py::one", "suite/c.py::one[x::y]", "suite/a.py::one",
                                        "suite/a.py::two", "suite/new.py::one", "suite/new.py::two"]


def test_a_partial_run_keeps_the_other_files_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_TEST_ARTIFACTS", str(tmp_path))
    _record({"suite/a.py::one": 5.0, "suite/b.py::one": 9.0})
    _record({"suite/a.py::one": 12.0})
    assert durations.previous() == {"suite/a.py": 12.0, "suite/b.py": 9.0}


def test_without_a_record_the_order_is_pytests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_TEST_ARTIFACTS", str(tmp_path / "none-yet"))
    items = [_item(n) for n in ("suite/z.py::one", "suite/a.py::one")]
    durations.heaviest_first(items)
    assert [i.nodeid for i in items] == ["suite/z.py::one", "suite/a.py::one"]


def test_a_clean_checkout_orders_by_the_committed_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI has no test-artifacts/: the record committed in the tree orders its run; a local record,
    once written, overrides the figures it has and keeps the committed ones it lacks."""
    monkeypatch.setenv("EDGE_TEST_ARTIFACTS", str(tmp_path / "local"))
    _record({"suite/a.py::one": 3.0, "suite/b.py::one": 50.0, "suite/c.py::one": 1.0})
    durations.COMMITTED.parent.mkdir()
    assert durations.commit_record(tmp_path / "local" / durations.NAME, durations.COMMITTED) == 3
    assert "# That run: 3 tests" in durations.COMMITTED.read_text()
    (tmp_path / "local" / durations.NAME).unlink()  # a clean checkout: only the committed record
    items = [_item(n) for n in ("suite/a.py::one", "suite/c.py::one", "suite/b.py::one")]
    durations.heaviest_first(items)
    assert [i.nodeid for i in items] == ["suite/b.py::one", "suite/a.py::one", "suite/c.py::one"]
    _record({"suite/c.py::one": 90.0})  # this machine's own run
    assert durations.previous() == {"suite/c.py": 90.0, "suite/b.py": 50.0, "suite/a.py": 3.0}


def test_the_tree_has_a_committed_record() -> None:
    """tests/durations.txt is there and names the suite's files (a clean checkout's order)."""
    committed = durations.read(Path(durations.__file__).resolve().parents[1] / durations.NAME)
    assert len(committed) > 50 and all(name.startswith("tests/") for name in committed)
    assert any(name.startswith("tests/api/test_tfs_suite") for name in committed)
