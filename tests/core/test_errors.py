"""appliance/core/errors.py's docstring draws the error tree; the drawing is the classes.

Each class line of the tree is ``<branches> Name  <http_status>  <grpc_code>  text``; lines
holding only branches and text continue the one above. The test rebuilds the tree from the
indentation and compares it, class by class, with the real hierarchy and attributes, so a
new class, a moved one or a changed status cannot leave the drawing behind.
"""

from __future__ import annotations

import re

import pytest

from appliance.core import errors

LINE = re.compile(r"^(?P<branch>(?:│   |    )*(?:├── |└── )?)(?P<name>[A-Z]\w*)"
                  r"\s+(?P<http>\d{3})\s+(?P<grpc>[A-Z_]+)\s")
CONTINUATION = re.compile(r"^[│ ]+\S")


def drawn() -> list[tuple[str, str | None, int, str, bool]]:
    """(class, parent, http_status, grpc_code, drawn as its parent's last child) per tree line."""
    doc = errors.__doc__ or ""
    block = doc.split("\n\n")[1]  # the paragraph after the summary line
    rows: list[tuple[str, str | None, int, str, bool]] = []
    parents: list[str] = []
    for raw in block.splitlines():
        line = raw[4:]  # the docstring's own indentation
        match = LINE.match(line)
        if match is None:
            assert CONTINUATION.match(line), f"neither a class nor a continuation line: {raw!r}"
            continue
        depth = len(match["branch"]) // 4
        assert depth <= len(parents), f"{match['name']} is drawn below no parent"
        del parents[depth:]
        rows.append((match["name"], parents[-1] if parents else None, int(match["http"]), match["grpc"],
                     match["branch"].endswith("└── ")))
        parents.append(match["name"])
    return rows


def real() -> list[type[errors.ApplianceError]]:
    out: list[type[errors.ApplianceError]] = []

    def walk(cls: type[errors.ApplianceError]) -> None:
        out.append(cls)
        for sub in cls.__subclasses__():
            if sub.__module__ == errors.__name__:
                walk(sub)

    walk(errors.ApplianceError)
    return out


def test_the_tree_names_every_class_once_under_its_real_parent() -> None:
    rows = drawn()
    names = [name for name, *_ in rows]
    assert len(names) == len(set(names)), names
    want = {cls.__name__: cls.__bases__[0].__name__ if cls is not errors.ApplianceError else None for cls in real()}
    assert {name: parent for name, parent, *_ in rows} == want


def test_the_tree_shows_each_classs_http_status_and_grpc_code() -> None:
    for name, _, http, grpc, _ in drawn():
        cls = getattr(errors, name)
        assert (http, grpc) == (cls.http_status, cls.grpc_code), name


def test_the_branches_are_drawn_right() -> None:
    """└── for the last child of a parent, ├── for the others: the drawing reads as a tree."""
    rows = drawn()
    for i, (name, parent, _, _, last) in enumerate(rows):
        if parent is None:
            continue
        later_siblings = [r for r in rows[i + 1:] if r[1] == parent]
        assert last == (not later_siblings), f"{name}: drawn {'└──' if last else '├──'}"


def test_the_check_sees_a_class_missing_from_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parser is not vacuous: drop a line from the drawing and the comparison fails."""
    doc = errors.__doc__ or ""
    line = next(l for l in doc.splitlines() if "QueueFull" in l)
    monkeypatch.setattr(errors, "__doc__", doc.replace(line + "\n", ""))
    assert "QueueFull" not in [name for name, *_ in drawn()]
    with pytest.raises(AssertionError):
        test_the_tree_names_every_class_once_under_its_real_parent()
