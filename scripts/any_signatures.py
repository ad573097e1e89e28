"""How many function signatures take or return ``Any`` (issue 46's measure of typing debt).

    python3 scripts/any_signatures.py [ROOT] [--by-package] [--list]

Counts every ``def`` and ``async def`` under appliance/, runtimes/ and sync/ (generated protobuf
modules excluded); a signature counts when ``Any`` appears in any parameter's annotation or in
the return annotation (``Any``, ``typing.Any``, or inside a string annotation).
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


def signatures(root: Path) -> list[tuple[str, str, bool]]:
    """(module path, function name, whether its signature mentions Any) for every function."""
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
                    uses = any(_mentions_any(p.annotation) for p in params) or _mentions_any(node.returns)
                    out.append((str(path.relative_to(root)), node.name, uses))
    return out


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    root = Path(args[0] if args else Path(__file__).resolve().parent.parent)
    found = signatures(root)
    total, with_any = len(found), sum(1 for *_, uses in found if uses)
    print(f"{root}: {with_any} of {total} function signatures take or return Any ({100 * with_any / total:.1f} %)")
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
