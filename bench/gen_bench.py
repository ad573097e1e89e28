"""Token generation: total tokens/s and time to first token at 1, 4 and 16 concurrent
streams, with step batching on and off (``[generation] step_batching``).

Off, every stream gets its own decode call per step (what serving the streams one step
call each costs); on, the streams of a version share one call per step (up to the decode
batch: 4 rows for the LiteRT export, ``max_batch_size`` for the dynamic ``generate_step``).
The models are ``tests/genmodel.py``'s (a 2-layer character transformer, d=32) or, by name,
models litert-torch really converted (``tests/litert_llm.py``: ``lt_b4`` has a decode batch
of 4 sharing one position, ``lt_plain`` litert-torch's default batch 1); the server is the
real ``appliance serve`` on a loopback port, the clients are threads reading SSE.

    .venv/bin/python -m bench.gen_bench [--seconds 4] [--models gen_savedmodel,gen_tflite,lt_b4]

Target (issue 10): at 16 streams, step batching >= 3x the total tokens/s of batching off.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

from tests import genmodel, litert_llm
from tests.conftest import launch, model_copy

LEVELS = (1, 4, 16)
NEW_TOKENS = 48


def prompt_body(model: str, i: int) -> dict[str, Any]:
    """The i-th client's prompt: genmodel's texts, or token ids for a converted model (which
    ships no vocabulary); converted prompts have one length, so a shared-position decode
    batch can run the streams that started together in one call."""
    if model in litert_llm.SPECS:
        return {"input_ids": litert_llm.prompt(12, seed=i % 4)}
    return {"text": genmodel.PROMPTS[i % len(genmodel.PROMPTS)]}


def one_stream(url: str, prompt: dict[str, Any]) -> tuple[int, float]:
    """(tokens received, seconds to the first token) of one streamed request."""
    started = time.perf_counter()
    first, count = 0.0, 0
    body = json.dumps({**prompt, "max_new_tokens": NEW_TOKENS, "stream": True})
    with requests.post(url, data=body, stream=True, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {\"token\""):
                count += 1
                if count == 1:
                    first = time.perf_counter() - started
    return count, first


def level(url: str, model: str, streams: int, seconds: float) -> dict[str, float]:
    """``streams`` clients, each starting a new stream as soon as its last one ends."""
    tokens, ttfts, lock = [0], [], threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(i: int) -> None:
        while time.perf_counter() < deadline:
            n, ttft = one_stream(url, prompt_body(model, i))
            with lock:
                tokens[0] += n
                ttfts.append(ttft)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return {"tokens_per_s": tokens[0] / wall, "ttft_p50_ms": statistics.median(ttfts) * 1000,
            "ttft_p90_ms": statistics.quantiles(ttfts, n=10)[-1] * 1000 if len(ttfts) > 1 else ttfts[0] * 1000,
            "streams_done": len(ttfts)}


def run(models: list[str], seconds: float, work: Path) -> list[dict[str, Any]]:
    built = work / "models"
    converted = [m for m in models if m in litert_llm.SPECS]
    if len(converted) < len(models):
        genmodel.build(built)
    if converted:  # built once, cached under /tmp like the test suite's
        cache = litert_llm.models(work / "litert-llm-build")
        for name in converted:
            shutil.copytree(cache / name, built / name)
    rows = []
    for batching in (True, False):
        config = work / f"gen-{batching}.toml"
        config.write_text(f"[generation]\nstep_batching = {'true' if batching else 'false'}\nmax_streams = 64\n")
        base = model_copy(built, work / f"base-{batching}", *models)
        server = launch(["--models", str(base), "--config", str(config)], work)
        try:
            for model in models:
                url = f"{server.url}/v1/models/{model}:generate"
                one_stream(url, prompt_body(model, 0))  # first call: graph/allocation warm-up
                for streams in LEVELS:
                    row = {"model": model, "step_batching": batching, "streams": streams,
                           **level(url, model, streams, seconds)}
                    rows.append(row)
                    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}),
                          flush=True)
        finally:
            server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gen_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="duration of each level")
    ap.add_argument("--models", default="gen_savedmodel,gen_tflite")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(a.models.split(","), a.seconds, Path(tmp))
    print("\nmodel           streams  on tok/s  off tok/s  ratio  TTFT p50 on/off (ms)")
    for model in a.models.split(","):
        for streams in LEVELS:
            on = next(r for r in rows if r["model"] == model and r["streams"] == streams and r["step_batching"])
            off = next(r for r in rows
                       if r["model"] == model and r["streams"] == streams and not r["step_batching"])
            print(f"{model:15s} {streams:7d} {on['tokens_per_s']:9.0f} {off['tokens_per_s']:10.0f} "
                  f"{on['tokens_per_s'] / off['tokens_per_s']:6.2f}  {on['ttft_p50_ms']:.1f} / {off['ttft_p50_ms']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
