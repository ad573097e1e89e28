"""What the grammar engine (llguidance) costs a LiteRT-only device: its install size, and the
memory (RSS) a process gains importing it and holding one vocabulary's table, one compiled JSON
schema and a matcher, for a character vocabulary (128 tokens, the test models') and a 32,000-token
one (a Llama-2-sized vocabulary of made-up byte strings); then the time of one step's mask.

    .venv/bin/python -m bench.grammar_footprint
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before the heavy imports
    print(__doc__)
    raise SystemExit(0)


import importlib.metadata
import os
import sys
import time
from pathlib import Path

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "count"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "count": {"type": "integer"}}}


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def installed_mb(dist: str) -> float:
    files = importlib.metadata.distribution(dist).files or []
    return sum(os.path.getsize(f.locate()) for f in files if os.path.isfile(f.locate())) / 1e6


def main() -> int:
    import numpy as np  # a LiteRT-only device has numpy already: not counted

    from appliance.core.constraints import Constraint, Grammar, TokenTable
    from appliance.core.text import Vocabulary

    base = rss_mb()
    import llguidance  # noqa: F401

    print(f"llguidance {importlib.metadata.version('llguidance')}: {installed_mb('llguidance'):.1f} MB installed; "
          f"import +{rss_mb() - base:.1f} MB RSS")
    rng = np.random.default_rng(0)
    for size in (128, 32000):
        tokens = [chr(i) for i in range(128)] + ["".join(map(chr, rng.integers(97, 123, rng.integers(2, 8))))
                                                  for _ in range(size - 128)]
        before = rss_mb()
        table = TokenTable.of(Vocabulary(tokens))
        grammar = Grammar.json_schema(SCHEMA, "bench").check(table)
        constraint = Constraint(grammar, table)
        started = time.perf_counter()
        for _ in range(200):
            constraint.allowed()
        mask_us = (time.perf_counter() - started) / 200 * 1e6
        print(f"vocabulary {size:6d}: table + schema + matcher +{rss_mb() - before:.1f} MB RSS; "
              f"a step's mask {mask_us:.0f} us")
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
