"""CPU per message of the channel between front workers and the serving process, in memory.

    PYTHONPATH=. .venv/bin/python bench/channel_cost.py [--compare OTHER_CHECKOUT] [-n 20000]

A ``Run`` request carrying the bench MLP's input (1 x 64 float32) and the bench CNN's (1 x 96 x
96 x 3 float32, 110 kB) and its ``Ran`` answer, each encoded as a worker's or the serving
process's channel encodes it, joined as one loop turn's write is, and read back as the other
end reads it (the frame fed through the receiving side's reader, as a socket delivers it:
64 kB reads), ``-n`` times; the thread's CPU per round trip. ``--compare``: another checkout
(before issue 46: msgpack with positional lists, arrays packed inside the message), measured
in a process of its own, alternating with this one, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"mlp": (1, 64), "cnn": (1, 96, 96, 3)}
READ = 64 * 1024  # what one socket read delivers at most


def _typed(arr: np.ndarray) -> Callable[[], object]:
    """A round trip through this tree's channel (msgspec structs, arrays out of band)."""
    from appliance.fronts import messages as m
    from appliance.transport.channel import Codec, Reader, frame_parts

    serving, worker = Reader(Codec(m.ToServing)), Reader(Codec(m.ToWorker))

    def feed(reader: Any, data: bytes) -> list[Any]:
        out, pos = [], 0
        while pos < len(data):
            target = reader.buffer()
            n = min(len(target), READ, len(data) - pos)
            target[:n] = data[pos:pos + n]
            pos += n
            out += reader.filled(n)
        return out

    def trip() -> object:
        (run,) = feed(serving, b"".join(frame_parts(m.Run(1, "mlp", None, None, {}, "serving_default", {"x": arr}, 1))))
        (ran,) = feed(worker, b"".join(frame_parts(m.Ran(1, 1, {"y": run.inputs["x"]}))))
        return ran
    return trip


def _positional(arr: np.ndarray) -> Callable[[], object]:
    """A round trip through a checkout before issue 46 (msgpack, positional payloads)."""
    from appliance.transport.channel import Frames, frame_parts  # type: ignore[attr-defined]  # the old tree's names

    serving, worker = Frames(), Frames()

    def feed(frames: Any, data: bytes) -> list[Any]:
        out: list[Any] = []
        for pos in range(0, len(data), READ):
            out += frames.feed(data[pos:pos + READ])
        return out

    def trip() -> object:
        request = ("run", 1, ["mlp", None, None, {}, "serving_default", {"x": arr}, 1])
        (run,) = feed(serving, b"".join(frame_parts(request)))
        (ran,) = feed(worker, b"".join(frame_parts(("done", 1, [1, {"y": run[2][5]["x"]}]))))
        return ran
    return trip


def measure(n: int) -> dict[str, float]:
    from appliance.transport import channel

    typed = hasattr(channel, "Codec")
    out = {}
    for model, shape in SHAPES.items():
        arr = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        trip = (_typed if typed else _positional)(arr)
        for _ in range(min(n, 1000)):
            trip()
        started = time.thread_time()
        for _ in range(n):
            trip()
        out[model] = round(1e6 * (time.thread_time() - started) / n, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", default="", help="another checkout, measured beside this one")
    ap.add_argument("-n", type=int, default=20000, help="round trips per model")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.n)))
        return 0
    trees = {"this": ROOT, **({"other": Path(args.compare).resolve()} if args.compare else {})}
    for r in range(args.rounds):
        for name, tree in (trees.items() if r % 2 == 0 else reversed(list(trees.items()))):
            env = {**os.environ, "PYTHONPATH": str(tree)}
            done = subprocess.run([sys.executable, str(ROOT / "bench" / "channel_cost.py"), "--child", "-n", str(args.n)],
                                  env=env, cwd=tree, capture_output=True, text=True, check=True)
            figures = json.loads(done.stdout)
            print(f"round {r + 1} {name:5} ({tree}): " + ", ".join(f"{k} {v} us" for k, v in figures.items())
                  + " of CPU per Run + answer round trip")
    return 0


if __name__ == "__main__":
    sys.exit(main())
