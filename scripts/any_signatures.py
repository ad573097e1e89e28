"""How many function signatures take or return ``Any`` (issue 46's measure of typing debt).

    python3 scripts/any_signatures.py [ROOT] [--by-package] [--list]

Counts every ``def`` and ``async def`` under appliance/, runtimes/ and sync/ (generated protobuf
modules excluded); a signature counts when ``Any`` appears in any parameter's annotation or in
the return annotation (``Any``, ``typing.Any``, or inside a string annotation).

The issue allows ``Any`` "only where a value really is arbitrary JSON": a signature whose every
``Any`` is the value type of a JSON object (``dict[str, Any]``, ``Mapping[str, Any]``) is also
counted apart, so the figure that has to fall (``Any`` that is not a JSON document) is printed
beside the whole one. A string annotation counts as other ``Any``.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import Counter
from pathlib import Path

PACKAGES = ("appliance", "runtimes", "sync")


def _mentions_any(node: ast.expr | None) -> bool:
    if node is None:
        return False
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "Any":
            return True
        if isinstance(sub, ast.Attribute) and sub.attr == "Any":
            return True
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and re.search(r"\bAny\b", sub.value):
            return True
    return False


_JSON_OBJECTS = frozenset({"dict", "Dict", "Mapping", "MutableMapping"})


def _json_only(node: ast.expr | None) -> bool:
    """Whether every ``Any`` in ``node`` is the value type of a ``dict[str, Any]``-like object."""
    if node is None:
        return True
    allowed: set[int] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Tuple) and len(sub.slice.elts) == 2:
            name = sub.value.attr if isinstance(sub.value, ast.Attribute) else getattr(sub.value, "id", "")
            key, value = sub.slice.elts
            if name in _JSON_OBJECTS and isinstance(key, ast.Name) and key.id == "str":
                allowed.add(id(value))
    for sub in ast.walk(node):
        is_any = (isinstance(sub, ast.Name) and sub.id == "Any") or (isinstance(sub, ast.Attribute) and sub.attr == "Any")
        if is_any and id(sub) not in allowed:
            return False
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and re.search(r"\bAny\b", sub.value):
            return False
    return True


def signatures(root: Path) -> list[tuple[str, str, bool]]:
    """(module path, function name, whether its signature mentions Any) for every function."""
    return [(path, name, uses) for path, name, uses, _ in classified(root)]


def classified(root: Path) -> list[tuple[str, str, bool, bool]]:
    """``signatures`` with a fourth field: whether its only ``Any`` are JSON objects' values."""
    out = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = node.args
                    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *([a.vararg] if a.vararg else []),
                              *([a.kwarg] if a.kwarg else [])]
                    notes = [p.annotation for p in params] + [node.returns]
                    uses = any(_mentions_any(n) for n in notes)
                    json_only = uses and all(_json_only(n) for n in notes)
                    out.append((str(path.relative_to(root)), node.name, uses, json_only))
    return out


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    root = Path(args[0] if args else Path(__file__).resolve().parent.parent)
    rows = classified(root)
    found = [(path, name, uses) for path, name, uses, _ in rows]
    total, with_any = len(found), sum(1 for *_, uses in found if uses)
    json_only = sum(1 for *_, json in rows if json)
    print(f"{root}: {with_any} of {total} function signatures take or return Any ({100 * with_any / total:.1f} %); "
          f"{json_only} of them only as JSON objects' values (dict[str, Any]); other Any: {with_any - json_only} "
          f"({100 * (with_any - json_only) / total:.1f} %)")
    if "--by-package" in sys.argv:
        totals, anys = Counter(), Counter()
        for path, _, uses in found:
            key = "/".join(Path(path).parts[:2]) if path.startswith("appliance/") else Path(path).parts[0]
            totals[key] += 1
            anys[key] += uses
        for key in sorted(totals):
            print(f"  {key:24} {anys[key]:4} of {totals[key]:4} ({100 * anys[key] / totals[key]:.0f} %)")
    if "--list" in sys.argv:
        for path, name, uses in found:
            if uses:
                print(f"  {path} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
