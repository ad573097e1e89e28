"""The layers of docs/architecture.md hold in the code: no upward import, no import cycle, no
module reaching for another module's ``_private`` name.

Read from the source with ``ast`` (nothing is imported), so the test sees every import,
also those inside functions. The layers, lowest first:

    runtimes, sync, appliance.protos   libraries of their own (numpy, boto3, protobuf ...)
    appliance.transport                the standard library and protocol libraries only
    appliance.core                     runtimes, protos
    appliance.api                      core, protos, ui (the page's blueprint)
    appliance.parts                    core, api, sync
    appliance.fronts                   api, transport, core (the front workers, one feature)
    appliance.service                  fronts, parts, api, transport, core, sync (its load-time checks)
    appliance.commands, appliance.cli  everything
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("appliance", "runtimes", "sync", "ui")

# layer -> the layers it may import (besides itself); a module belongs to the longest prefix
ALLOWED: dict[str, set[str]] = {
    "runtimes": set(),
    "sync": set(),
    "ui": set(),
    "appliance.protos": set(),
    "appliance.transport": set(),
    "appliance.core": {"runtimes", "appliance.protos"},
    "appliance.api": {"appliance.core", "appliance.protos", "runtimes", "ui"},
    "appliance.parts": {"appliance.core", "appliance.api", "appliance.protos", "sync", "runtimes"},
    "appliance.fronts": {"appliance.api", "appliance.transport", "appliance.core", "appliance.protos", "runtimes"},
    "appliance.service": {"appliance.fronts", "appliance.parts", "appliance.api", "appliance.transport",
                          "appliance.core", "appliance.protos", "runtimes", "ui", "sync"},
    "appliance.commands": {"*"},
    "appliance.cli": {"*"},
    "appliance": {"*"},  # the package face: __version__, and lazy re-exports inside __getattr__
}
# ``from appliance.version import __version__`` is the one name every layer may take from the face.
FACE_NAMES = {"__version__"}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = modules()


def layer_of(module: str) -> str:
    best = ""
    for layer in ALLOWED:
        if (module == layer or module.startswith(layer + ".")) and len(layer) > len(best):
            best = layer
    return best


def imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [alias.name for alias in node.names]
            # ``from pkg import submodule`` imports the submodule
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            out += [(s, [], node.lineno) for s in subs]
            rest = [n for n in names if f"{base}.{n}" not in MODULES]
            if rest or not subs:
                out.append((base, rest, node.lineno))
    return out


def ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def test_every_module_has_a_layer() -> None:
    assert [m for m in MODULES if not layer_of(m)] == []


def test_no_layer_imports_one_above_it() -> None:
    wrong = []
    for name, path in MODULES.items():
        mine = layer_of(name)
        allowed = ALLOWED[mine]
        for target, names, line in imports(name, path):
            if not ours(target) or "*" in allowed:
                continue
            theirs = layer_of(target)
            if theirs == mine or theirs in allowed or theirs == "appliance.version":
                continue
            if theirs == "appliance" and set(names) <= FACE_NAMES:
                continue
            wrong.append(f"{path.relative_to(ROOT)}:{line} ({mine}) imports {target} ({theirs})")
    assert wrong == []


def test_no_module_imports_another_modules_private_names() -> None:
    wrong = []
    for name, path in MODULES.items():
        for target, names, line in imports(name, path):
            if not ours(target) or target == name:
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            private += [target] if any(p.startswith("_") and not p.startswith("__") for p in target.split(".")) else []
            if private:
                wrong.append(f"{path.relative_to(ROOT)}:{line} takes {private} from {target}")
    assert wrong == []


def test_no_import_cycles_between_modules() -> None:
    """Module-level imports only (an import inside a function runs later and cannot deadlock
    start-up); TYPE_CHECKING blocks are not imports at run time."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        top_lines = {n.lineno for n in top}
        graph[name] = {t for t, _, line in imports(name, path) if line in top_lines and t in MODULES and t != name}
        # a package's own __init__ is imported by its children: that edge is not a cycle
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert cycles == []


@pytest.mark.parametrize("layer", ["appliance.transport", "sync", "runtimes"])
def test_the_lower_libraries_import_nothing_of_the_service(layer: str) -> None:
    names = [m for m in MODULES if layer_of(m) == layer]
    assert names, f"no modules found for {layer}"
    leaks = [f"{m} imports {t}" for m in names for t, _, _ in imports(m, MODULES[m])
             if ours(t) and layer_of(t) not in (layer, *ALLOWED[layer])]
    assert leaks == []


def test_the_checks_see_an_upward_import(tmp_path: Path) -> None:
    """The walker itself works: a core module importing the api layer is reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("from appliance.api.app import create_app\nfrom appliance.core.manager import _mtime\n")
    found = imports("appliance.core.probe", probe)
    assert ("appliance.api.app", ["create_app"], 1) in found
    assert layer_of("appliance.api.app") not in ALLOWED["appliance.core"]
    assert ("appliance.core.manager", ["_mtime"], 2) in found
