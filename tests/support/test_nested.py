"""tests/conftest.py's ``run_once_nested``: where the test that runs others nested is collected,
those others leave this session (reported as deselected) and nothing else does; without it
they stay."""

from __future__ import annotations

import types
from typing import Any

from tests.conftest import NESTING, run_once_nested


def _items(*nodeids: str) -> list[Any]:
    module = types.SimpleNamespace(NESTED=["suite/test_a.py", "suite/test_b.py::test_one"])
    return [types.SimpleNamespace(nodeid=n, module=module) for n in nodeids]


def _config(deselected: list[str]) -> Any:
    return types.SimpleNamespace(hook=types.SimpleNamespace(
        pytest_deselected=lambda items: deselected.extend(i.nodeid for i in items)))


def test_the_nested_tests_run_once_there() -> None:
    items = _items("suite/test_a.py::test_x", "suite/test_a.py::test_y[1]", "suite/test_b.py::test_one",
                   "suite/test_b.py::test_one_more", "suite/test_ab.py::test_x", NESTING)
    deselected: list[str] = []
    run_once_nested(_config(deselected), items)
    assert [i.nodeid for i in items] == ["suite/test_b.py::test_one_more", "suite/test_ab.py::test_x", NESTING]
    assert deselected == ["suite/test_a.py::test_x", "suite/test_a.py::test_y[1]", "suite/test_b.py::test_one"]


def test_without_the_nesting_test_they_run_here() -> None:
    items = _items("suite/test_a.py::test_x", "suite/test_b.py::test_one")
    deselected: list[str] = []
    run_once_nested(_config(deselected), items)
    assert [i.nodeid for i in items] == ["suite/test_a.py::test_x", "suite/test_b.py::test_one"] and deselected == []
