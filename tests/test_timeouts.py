"""No pytest timeout is shorter than a wait it wraps.

A test whose pytest timeout (its ``@pytest.mark.timeout``, its module's ``pytestmark``, else the
ini's) is shorter than a subprocess or a wait written inside it is killed by pytest while the
thing it waits for would still have finished in time: on a busy machine that is a failure
the code under test never caused (issue 49: a 1200 s nested pytest under a 300 s timeout).
This reads every test module's source: each literal ``timeout=N`` (or ``scaled(N)``) and each
``poll_until(pred, N)`` / ``wait_for(pred, N)`` inside a function must be below that function's
pytest timeout. Both sides stretch alike with the load (tests/support/load.py), so the
comparison of the written figures is the one that holds.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from tests.support import load

TESTS = Path(__file__).parent
DEFAULT = float(tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["timeout"])
WAITS = {"poll_until", "wait_for"}  # (predicate, timeout, ...)


def _number(node: ast.AST) -> float | None:
    """A literal number, or the literal inside ``scaled(N)``."""
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "scaled" and node.args:
        node = node.args[0]
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    return None


def _marker_timeout(node: ast.AST) -> float | None:
    """N of a ``pytest.mark.timeout(N)`` anywhere in ``node`` (a decorator or a pytestmark)."""
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "timeout" and call.args:
            return _number(call.args[0])
    return None


def _module_timeout(tree: ast.Module) -> float:
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in stmt.targets):
            return _marker_timeout(stmt.value) or DEFAULT
    return DEFAULT


def _waits(function: ast.AST) -> list[tuple[int, float]]:
    """(line, seconds) of every literal timeout inside ``function``."""
    found = []
    for call in ast.walk(function):
        if not isinstance(call, ast.Call):
            continue
        name = getattr(call.func, "attr", getattr(call.func, "id", ""))
        unit = 1000 if name == "wait_for" and not call.args else 1  # Playwright's locator.wait_for: ms
        for keyword in call.keywords:
            if keyword.arg == "timeout" and (value := _number(keyword.value)) is not None:
                found.append((call.lineno, value / unit))
        if name in WAITS and len(call.args) >= 2 and (value := _number(call.args[1])) is not None:
            found.append((call.lineno, value))
    return found


def _is_test_or_fixture(function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A helper (neither) runs inside whichever of its module's tests calls it: its waits need
    only fit the module's longest timeout."""
    return function.name.startswith("test") or any("fixture" in ast.unparse(d) for d in function.decorator_list)


def too_long(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    module = _module_timeout(tree)
    functions = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    own = {f: next((t for d in f.decorator_list if (t := _marker_timeout(d))), None) for f in functions}
    longest = max([module, *(t for t in own.values() if t)])
    problems = []
    for function in functions:
        limit = own[function] or (module if _is_test_or_fixture(function) else longest)
        problems += [f"{path.name}:{line}: {seconds:g} s inside {function.name} "
                     f"(pytest timeout {limit:g} s)" for line, seconds in _waits(function) if seconds >= limit]
    return problems


def test_no_wait_outlasts_the_pytest_timeout_around_it() -> None:
    problems = [f"{path.parent.relative_to(TESTS)}/{p}" for path in sorted(TESTS.rglob("*.py")) for p in too_long(path)]
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_long_subprocess_under_a_short_timeout(tmp_path: Path) -> None:
    """The defect issue 49 found, written small: the check must see it."""
    bad = tmp_path / "test_probe.py"
    bad.write_text("import subprocess, pytest\n"
                       "@pytest.mark.timeout(60)\n"
                   "def test_x():\n    subprocess.run(['true'], timeout=scaled(120))\n"
                   "def test_y(srv):\n    srv.wait_for(lambda: 1, 400, 'x')\n")
    assert [p.split(": ", 1)[1] for p in too_long(bad)] == ["120 s inside test_x (pytest timeout 60 s)",
                                                             f"400 s inside test_y (pytest timeout {DEFAULT:g} s)"]


def test_timeouts_stretch_with_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_TEST_TIME_SCALE", "4")
    assert load.scaled(300) == 1200
    monkeypatch.setenv("EDGE_TEST_TIME_SCALE", "0.5")  # never shorter than written
    assert load.scaled(300) == 300
    monkeypatch.delenv("EDGE_TEST_TIME_SCALE")
    assert 1 <= load.factor() <= load.CAP
