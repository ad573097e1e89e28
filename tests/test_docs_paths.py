"""Every repository path the docs, the README, comments and docstrings name exists: a file moved
or removed takes its mentions with it (issue 46 found 13 that pointed nowhere).

Read: README.md, docs/*.md, and every source, script, manifest and README in the tree (a path
in a comment or docstring is what the next reader opens). Not read: bench/RESULTS.md, a dated
record that names files as they were when each figure was measured.

A path is a top-level folder of the repository followed by a file name with its extension
(``appliance/fronts/messages.py``, ``tests/support/servers.py``, ``bench/footprint.py``) or a
folder ending in ``/``; the short forms that leave out ``appliance/`` (``core/batcher.py``,
``transport/grpc/session.py``) are read from inside it. Globs and templates (``*``, ``{``, ``<``)
are not paths."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPS = ("appliance", "runtimes", "sync", "tests", "bench", "scripts", "docs", "deploy", "systemd", "ui")
SHORT = ("core", "fronts", "api", "transport", "service", "parts", "commands", "protos")  # under appliance/
_NOT_AFTER = r"(?<![\w/.\-<>$~{*])"  # a path's own start, not the middle of another path or a template
FULL = re.compile(_NOT_AFTER + r"((?:" + "|".join(TOPS) + r")/[\w.\-/]*[\w/])(?![\w*{<])")
SHORT_FORM = re.compile(_NOT_AFTER + r"((?:" + "|".join(SHORT) + r")/[\w.\-/]*\.(?:py|md|json|toml|sh|js))\b")
ROOT_VAR = re.compile(r"\$\{?ROOT\}?/")
# Files of the service's state directory (``<state>/sync/...``, sync/store.py), not of the repository.
STATE_FILES = {"sync/parked/", "sync/trust.json", "sync/pins.json", "sync/served.json", "sync/withdrawn.json",
               "sync/report-sequence.json"}
NOT_READ = {"RESULTS.md", Path(__file__).name}  # the dated record; this file's own examples of missing paths
SUFFIXES = ("*.py", "*.pyi", "*.sh", "*.md", "*.toml", "*.yaml", "*.yml", "*.js", "*.html", "*.container", "*.service")


def sources() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md"))]
    for top in TOPS:
        if top == "docs":
            continue
        for suffix in SUFFIXES:
            files += [p for p in sorted((ROOT / top).rglob(suffix)) if p.name not in NOT_READ]
    return files


def _names_a_file(path: str) -> bool:
    """Whether ``path`` is meant as a file or folder (a name with an extension, or ending in
    ``/``), not a module path or prose such as "appliance/core"."""
    return path.endswith("/") or "." in path.rsplit("/", 1)[-1]


def missing_paths() -> list[str]:
    out = []
    for source in sources():
        text = ROOT_VAR.sub(" ", source.read_text(errors="replace"))  # a script's "$ROOT/tests/x.py" names tests/x.py
        for pattern, base in ((FULL, ROOT), (SHORT_FORM, ROOT / "appliance")):
            for match in pattern.finditer(text):
                path = match.group(1).rstrip(".")
                if not _names_a_file(path) or path in STATE_FILES or (base / path).exists():
                    continue
                line = text.count("\n", 0, match.start()) + 1
                out.append(f"{source.relative_to(ROOT)}:{line} names {path}")
    return out


def test_every_path_named_in_docs_and_comments_exists() -> None:
    missing = missing_paths()
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_the_check_finds_a_missing_path(tmp_path: Path) -> None:
    """The patterns catch the forms the docs use (else the test above could not fail)."""
    text = ("see appliance/fronts/nowhere.py, `tests/fronts/gone_test.py`, (bench/none.py) and core/absent.py;"
            " not appliance/core, <state>/sync/x.json, tests/*/test_x.py")
    found = {m.group(1) for m in FULL.finditer(text) if _names_a_file(m.group(1))}
    found |= {m.group(1) for m in SHORT_FORM.finditer(text)}
    assert found == {"appliance/fronts/nowhere.py", "tests/fronts/gone_test.py", "bench/none.py", "core/absent.py"}
