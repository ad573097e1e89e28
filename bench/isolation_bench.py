"""What serving a LiteRT-LM bundle from a child process would cost (issue 35, isolation).

Measures, on the tiny test bundle (tests/runtimes/test_litertlm.py's builder): the tokens/s of one
stream decoded in this process, and the same stream's pieces sent from a child process over a
pipe (one message per piece, what a child-served bundle adds to every token); the memory a
child holding the bundle costs (its PSS: the interpreter, numpy, LiteRT-LM, the engine), against
the memory the engine adds in-process (RSS before and after the load).

    PYTHONPATH=. .venv/bin/python -m bench.isolation_bench
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before the heavy imports
    print(__doc__)
    raise SystemExit(0)


import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOKENS = 100
ROUNDS = 15


def _rss_kb(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _pss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def _load(version: str) -> Any:
    from runtimes.litertlm import LiteRTLMBackend

    return LiteRTLMBackend().load(version, {})


def _stream(servable: Any) -> int:
    from runtimes.litertlm import Request

    return sum(1 for _ in servable.generate(Request("t5 t17 t42", TOKENS)))


def _child(version: str, conn: Any) -> None:
    """A child serving the bundle: each request's pieces sent one message each."""
    from runtimes.litertlm import Request

    servable = _load(version)
    conn.send("ready")
    while conn.recv() == "go":
        for piece in servable.generate(Request("t5 t17 t42", TOKENS)):
            conn.send(piece)
        conn.send(None)
    servable.close()


def _through_child(conn: Any) -> int:
    conn.send("go")
    count = 0
    while conn.recv() is not None:
        count += 1
    return count


def main() -> int:
    from tests.support import litert_llm
    from tests.runtimes.test_litertlm import bundle

    work = Path(tempfile.mkdtemp())
    version = str(bundle(litert_llm.models(), "lt_t", work / "bundle"))
    before = _rss_kb()
    servable = _load(version)
    engine_kb = _rss_kb() - before
    parent, child_end = mp.Pipe()
    child = mp.get_context("spawn").Process(target=_child, args=(version, child_end), daemon=True)
    child.start()
    assert parent.recv() == "ready"
    here, there = [], []
    for _ in range(ROUNDS):  # alternating, so the box's load drifts over both alike
        started = time.perf_counter()
        n = _stream(servable)
        here.append(n / (time.perf_counter() - started))
        started = time.perf_counter()
        n = _through_child(parent)
        there.append(n / (time.perf_counter() - started))
    child_pss = _pss_kb(child.pid)
    parent.send("stop")
    child.join(30)
    servable.close()
    print(f"load average {os.getloadavg()[0]:.1f}; {TOKENS} tokens a stream, {ROUNDS} alternating rounds")
    print(f"in process:   {statistics.median(here):7.0f} tok/s (median)")
    print(f"from a child: {statistics.median(there):7.0f} tok/s (median), ratio "
          f"{statistics.median(t / h for t, h in zip(there, here)):.2f}")
    print(f"memory: the engine in process +{engine_kb / 1024:.1f} MB RSS; a child holding it {child_pss / 1024:.1f} MB PSS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
