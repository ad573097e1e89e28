"""Every benchmark still starts: ``python bench/<name>.py --help`` exits 0 with its usage, without running
the benchmark (each stops before its heavy imports). A bench that no longer imports (a name it
takes from the package moved) fails here instead of in the hands of the next person who
measures something. Figures themselves are never asserted: they live in bench/RESULTS.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHES = sorted(p.name for p in (ROOT / "bench").glob("*.py") if p.name != "__init__.py")
START_S = 120  # an interpreter and a bench's argument parser on a loaded 2-core box: never near this


def test_every_bench_is_listed() -> None:
    assert "cores_bench.py" in BENCHES and "v2_bench.py" in BENCHES and len(BENCHES) > 20


@pytest.mark.parametrize("name", BENCHES)
def test_bench_help_exits_0(name: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run([sys.executable, f"bench/{name}", "--help"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=START_S)  # run() kills the child when the bound passes
    except subprocess.TimeoutExpired:
        pytest.fail(f"bench/{name} --help still ran after {START_S} s: it runs the bench instead of its usage")
    assert done.returncode == 0, f"bench/{name} --help exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert done.stdout.strip(), f"bench/{name} --help printed no usage"
