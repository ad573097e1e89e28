"""Print the requirements of pyproject.toml (dependencies and the given extras), one a line.

The image's builder stage (deploy/Containerfile) downloads these as wheels before it copies
the source, so the layer holding them is rebuilt only when pyproject.toml changes. Only the
standard library (tomllib, Python 3.11+): it runs in the builder before anything is installed.

    python3 requirements_from_pyproject.py pyproject.toml tflite[,tf]
"""

from __future__ import annotations

import sys
import tomllib


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"unknown extras {unknown}: pyproject.toml has {sorted(optional)}")
    return list(project["dependencies"]) + [r for e in extras for r in optional[e]]


if __name__ == "__main__":
    extras = [e for e in sys.argv[2].split(",") if e] if len(sys.argv) > 2 else []
    print("\n".join(requirements(sys.argv[1], extras)))
