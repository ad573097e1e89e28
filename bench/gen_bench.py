"""Token generation: total tokens/s and time to first token at 1, 4 and 16 concurrent
streams, with step batching on and off (``[generation] step_batching``).

Off, every stream gets its own decode call per step (what serving the streams one step
call each costs); on, the streams of a version share one call per step (up to the decode
batch: 4 rows for the LiteRT export, ``max_batch_size`` for the dynamic ``generate_step``).
The models are ``tests/support/genmodel.py``'s (a 2-layer character transformer, d=32) or, by name,
models litert-torch really converted (``tests/support/litert_llm.py``: ``lt_b4`` has a decode batch
of 4 sharing one position, ``lt_plain`` litert-torch's default batch 1); the server is the
real ``appliance serve`` on a loopback port, the clients are threads reading SSE.

    .venv/bin/python -m bench.gen_bench [--seconds 4] [--models gen_savedmodel,gen_tflite,lt_b4]
    .venv/bin/python -m bench.gen_bench --issue35 [--seconds 4]

``--issue35``: litert-torch conversions of the same weights with decode batch 1 (``lt_plain``),
4 with the mask as an input (``lt_b4m``: streams aligned in one call) and 4 without
(``lt_b4``), at 1/4/8 streams of mixed prompt lengths; then ``/v1/completions`` with a JSON
schema (llguidance's mask every step) against free text at 1 and 8 streams, and the time to
first token with each.

``--issue45``: litert-torch conversions of one 4-layer d=256 TinyLlama with a 512-position cache
(tests/support/litert_dual.py): ``d256_b1`` (decode batch 1 only), ``d256_dual`` (a batch-4
decode with a batch-1 one beside it: each step on whichever its load measured cheaper) and
``d256_b4`` (batch 4 only, how issue 45 found batching losing), each against ``d256_b1`` at
1/4/8/16 streams of mixed prompt lengths, paired as ``--issue35``'s.

Target (issue 10): at 16 streams, step batching >= 3x the total tokens/s of batching off.
Target (issue 45): ``d256_dual`` >= 1.0x ``d256_b1`` at every level, TTFT at 1 stream within 10 %.
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

from tests.support import genmodel, litert_llm
from tests.support.servers import launch, model_copy

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


def clients(streams: int, seconds: float, one: Any) -> dict[str, float]:
    """``streams`` clients, each starting a new stream (``one(i)`` -> (tokens, seconds to the
    first)) as soon as its last one ends, for ``seconds``."""
    tokens, ttfts, lock, shed = [0], [], threading.Lock(), [0]
    deadline = time.perf_counter() + seconds

    def client(i: int) -> None:
        while time.perf_counter() < deadline:
            try:
                n, ttft = one(i)
            except requests.HTTPError as exc:  # shed by the loaded box's HTTP server: counted, not fatal
                if exc.response is None or exc.response.status_code != 503:
                    raise
                shed[0] += 1
                continue
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
            "streams_done": len(ttfts), "shed_503": shed[0]}


def level(url: str, model: str, streams: int, seconds: float) -> dict[str, float]:
    return clients(streams, seconds, lambda i: one_stream(url, prompt_body(model, i)))


def run(models: list[str], seconds: float, work: Path) -> list[dict[str, Any]]:
    built = work / "models"
    converted = [m for m in models if m in litert_llm.SPECS]
    if len(converted) < len(models):
        genmodel.build(built)
    if converted:  # built once, cached under /tmp like the test suite's
        cache = litert_llm.models()
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


# -- issue 35: batch-1 against batch-4 (mask) conversions, mixed prompt lengths; JSON schemas --------
MIXED_LEVELS = (1, 4, 8)
MIXED_LENGTHS = (3, 9, 17, 30, 6, 41, 12, 24)  # prompt lengths of the clients, in turn: never aligned by chance
SAME_WEIGHTS = ("lt_plain", "lt_b4m", "lt_b4")  # one seed, one config: decode batch 1, 4 with the mask, 4 without
# 24 digits: the answer is always 49 characters, so constrained and free streams both run to max_tokens
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 24, "maxItems": 24}
SCHEMA_TOKENS = 48


def mixed_level(url: str, streams: int, seconds: float) -> dict[str, float]:
    """``level`` with prompts of MIXED_LENGTHS: the clients' streams sit at different positions."""
    turns = iter(range(1 << 30))

    def one(i: int) -> tuple[int, float]:
        length = MIXED_LENGTHS[(i + next(turns)) % len(MIXED_LENGTHS)]
        return one_stream(url, {"input_ids": litert_llm.prompt(length, seed=i)})

    return clients(streams, seconds, one)


def openai_stream(url: str, schema: dict[str, Any] | None, i: int) -> tuple[int, float]:
    """(completion tokens, seconds to the first text) of one streamed /v1/completions."""
    body: dict[str, Any] = {"model": "lt_plain", "prompt": f"item {i}: ", "max_tokens": SCHEMA_TOKENS,
                            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "digits", "schema": schema}}
    started, first, tokens = time.perf_counter(), 0.0, 0
    with requests.post(url, json=body, stream=True, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if not first and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - started
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, first


def schema_level(url: str, schema: dict[str, Any] | None, streams: int, seconds: float) -> dict[str, float]:
    return clients(streams, seconds, lambda i: openai_stream(url, schema, i))


def paired(a: Any, b: Any, rounds: int, seconds: float) -> tuple[float, float, float, float, float]:
    """``a`` and ``b`` (each: seconds -> a level's row) in alternating turns, ``rounds`` times:
    (median tok/s of a, of b, median of the per-round ratios b/a, TTFT p50 of a, of b). On a
    shared, loaded box the load drifts over a minute; a ratio of neighbouring turns does not."""
    ra, rb = [], []
    for i in range(rounds):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        x, y = first(seconds), second(seconds)
        ra.append(x if first is a else y)
        rb.append(y if first is a else x)
    med = statistics.median
    return (med(r["tokens_per_s"] for r in ra), med(r["tokens_per_s"] for r in rb),
            med(y["tokens_per_s"] / x["tokens_per_s"] for x, y in zip(ra, rb)),
            med(r["ttft_p50_ms"] for r in ra), med(r["ttft_p50_ms"] for r in rb))


def issue35(seconds: float, work: Path, rounds: int = 5) -> None:
    """Both issue-35 tables from one server, in one window, as paired ratios (``paired``)."""
    cache = litert_llm.models()
    base = work / "models"
    for name in SAME_WEIGHTS:
        shutil.copytree(cache / name, base / name)
    (base / "lt_plain" / "1" / "assets").mkdir()
    (base / "lt_plain" / "1" / "assets" / "vocab.json").write_text(json.dumps([chr(i) for i in range(128)]))
    config = work / "gen.toml"
    config.write_text("[generation]\nmax_streams = 64\n")
    server = launch(["--models", str(base), "--config", str(config)], work)
    try:
        url = {m: f"{server.url}/v1/models/{m}:generate" for m in SAME_WEIGHTS}
        for model in SAME_WEIGHTS:
            one_stream(url[model], prompt_body(model, 0))  # warm-up
        print(f"\nstreams  batch-1 tok/s  batch-4 tok/s  ratio  TTFT p50 b1 / b4 (ms)   (mixed prompt lengths, "
              f"48 new tokens, {rounds} paired rounds of {seconds} s)")
        for other in ("lt_b4m", "lt_b4"):
            for streams in MIXED_LEVELS:
                got = paired(lambda t: mixed_level(url["lt_plain"], streams, t),
                             lambda t, o=other: mixed_level(url[o], streams, t), rounds, seconds)
                print(f"{other:7s} {streams:2d} {got[0]:12.0f} {got[1]:14.0f} {got[2]:6.2f}  {got[3]:.1f} / {got[4]:.1f}",
                      flush=True)
        completions = f"{server.url}/v1/completions"
        openai_stream(completions, DIGITS, 0)  # the grammar engine's first use
        print("\nstreams  free tok/s  schema tok/s  ratio  TTFT p50 free / schema (ms)   (lt_plain, /v1/completions)")
        for streams in (1, 8):
            got = paired(lambda t: schema_level(completions, None, streams, t),
                         lambda t: schema_level(completions, DIGITS, streams, t), rounds, seconds)
            print(f"{streams:7d} {got[0]:11.0f} {got[1]:13.0f} {got[2]:6.2f}  {got[3]:.1f} / {got[4]:.1f}", flush=True)
    finally:
        server.stop()


# -- issue 45: a batch-1 decode beside the batched one, chosen per step by measured cost ---------------
ISSUE45_LEVELS = (1, 4, 8, 16)


def issue45(seconds: float, work: Path, rounds: int = 5) -> None:
    """Both batched conversions against the batch-1 one, paired (``paired``), one server."""
    import os

    from tests.support import litert_dual

    cache = litert_dual.models(litert_dual.BENCH_MODELS)
    base = work / "models"
    for name in litert_dual.BENCH_MODELS:
        shutil.copytree(cache / name, base / name)
    config = work / "gen.toml"
    config.write_text("[generation]\nmax_streams = 64\n")
    print(f"load average before: {os.getloadavg()}", flush=True)
    server = launch(["--models", str(base), "--config", str(config)], work)
    try:
        url = {m: f"{server.url}/v1/models/{m}:generate" for m in litert_dual.BENCH_MODELS}
        for model in litert_dual.BENCH_MODELS:
            one_stream(url[model], {"input_ids": litert_llm.prompt(12)})  # warm-up
        for version in server.status()["generation"].get("versions", []):
            print(f"{version['model']}: decode ms {version.get('decode_ms')}, batched from "
                  f"{version.get('batched_from')}", flush=True)
        print(f"\nmodel      streams  batch-1 tok/s  model tok/s  ratio  TTFT p50 b1 / model (ms)   (mixed prompt "
              f"lengths, {NEW_TOKENS} new tokens, {rounds} paired rounds of {seconds} s)")
        for other in ("d256_dual", "d256_b4"):
            for streams in ISSUE45_LEVELS:
                got = paired(lambda t: mixed_level(url["d256_b1"], streams, t),
                             lambda t, o=other: mixed_level(url[o], streams, t), rounds, seconds)
                print(f"{other:9s} {streams:7d} {got[0]:14.0f} {got[1]:12.0f} {got[2]:6.2f}  "
                      f"{got[3]:.1f} / {got[4]:.1f}", flush=True)
        print("\nTTFT at one stream, paired per request (alternating b1/model, same prompt, "
              f"{TTFT_PAIRS} pairs):", flush=True)
        for name in ("d256_dual", "d256_b4"):
            b1, model, ratio = ttft_paired(url["d256_b1"], url[name], TTFT_PAIRS)
            print(f"{name:9s}  p50 b1 {b1:.1f} ms  model {model:.1f} ms  median of per-pair ratios {ratio:.3f}",
                  flush=True)
    finally:
        server.stop()
    print(f"load average after: {os.getloadavg()}", flush=True)


TTFT_PAIRS = 80


def ttft_paired(url_a: str, url_b: str, pairs: int) -> tuple[float, float, float]:
    """(TTFT p50 of a, of b, median of the per-pair ratios b/a), one stream at a time, the two
    asked alternately (the order flipped every pair) with the same prompt. A 2.5 s turn's TTFT
    p50 rests on the ~30 first tokens of that turn and moved +-15 % between runs of identical
    calls; neighbouring requests see the same load."""
    times: tuple[list[float], list[float]] = ([], [])
    for i in range(pairs):
        body = {"input_ids": litert_llm.prompt(MIXED_LENGTHS[i % len(MIXED_LENGTHS)], seed=i)}
        for which in ((0, 1) if i % 2 else (1, 0)):
            times[which].append(one_stream((url_a, url_b)[which], body)[1] * 1000)
    med = statistics.median
    return med(times[0]), med(times[1]), med(b / a for a, b in zip(*times))


def issue45_steps(rounds: int = 6, steps: int = 24) -> None:
    """The same comparison without the server, HTTP or threads: the drivers stepped in process,
    CPU seconds per generated token (a busy box adds waiting, which wall time counts and CPU time
    mostly does not). ``n`` streams at one position: the batch-1 conversion one call per stream,
    the dual one by its measured plan, and the dual one forced onto its batch-4 call."""
    import time

    from runtimes import generative
    from runtimes.tflite import TFLiteBackend
    from tests.support import litert_dual

    cache = litert_dual.models(litert_dual.BENCH_MODELS)
    opts = {"num_threads": 1, "pool_size": 1}
    b1, dual = (generative.detect(TFLiteBackend().load(str(cache / m / "1"), opts)) for m in ("d256_b1", "d256_dual"))
    assert isinstance(b1, generative.LiteRTLLM) and isinstance(dual, generative.LiteRTLLM)
    b1.warm_up()
    dual.warm_up()
    plan = dual.plan.batched_from
    print(f"dual: decode ms {dual.plan.describe()}")

    def per_token(driver: Any, n: int, batched_from: int) -> float:
        driver.plan.batched_from = batched_from
        lanes = [driver.new_slots(driver.batch_size or 1) for _ in range(0, n, driver.batch_size or 1)]
        width = driver.batch_size or 1
        for i in range(n):
            driver.prefill(lanes[i // width], i % width, litert_llm.prompt(12, seed=i))
        started = time.process_time()
        for step in range(steps):
            for j, slots in enumerate(lanes):
                rows = list(range(min(width, n - j * width)))
                driver.decode(slots, rows, [5] * len(rows), [11 + step] * len(rows), [0] * len(rows) if driver.aligned else None)
        return (time.process_time() - started) * 1000 / (steps * n)

    print("streams  batch-1 CPU ms/token  dual (plan)  dual (batch 4 forced)   median of", rounds, "alternating rounds")
    for n in ISSUE45_LEVELS:
        got: dict[str, list[float]] = {"b1": [], "plan": [], "b4": []}
        for _ in range(rounds):
            got["b1"].append(per_token(b1, n, 1))
            got["plan"].append(per_token(dual, n, plan))
            got["b4"].append(per_token(dual, n, 1))
        med = {k: statistics.median(v) for k, v in got.items()}
        print(f"{n:7d} {med['b1']:21.2f} {med['plan']:12.2f} {med['b4']:22.2f}", flush=True)
    dual.plan.batched_from = plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gen_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="duration of each level")
    ap.add_argument("--models", default="gen_savedmodel,gen_tflite")
    ap.add_argument("--issue35", action="store_true", help="batch-1 vs batch-4 (mask) conversions of the same "
                    "weights at 1/4/8 mixed-length streams, and JSON-schema against free streams at 1 and 8")
    ap.add_argument("--issue45", action="store_true", help="a batch-4 conversion with a batch-1 decode beside it "
                    "(and one without) against batch 1 only, 4 layers d=256 cache 512, at 1/4/8/16 streams")
    ap.add_argument("--issue45-steps", action="store_true", help="--issue45's models stepped in process (no server): "
                    "CPU ms per token at 1/4/8/16 streams, batch 1 against the dual conversion's plan and forced batch 4")
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds (--issue35, --issue45)")
    a = ap.parse_args(argv)
    if a.issue45_steps:
        issue45_steps(a.rounds)
        return 0
    if a.issue45:
        with tempfile.TemporaryDirectory() as tmp:
            issue45(a.seconds, Path(tmp), a.rounds)
        return 0
    if a.issue35:
        with tempfile.TemporaryDirectory() as tmp:
            issue35(a.seconds, Path(tmp), a.rounds)
        return 0
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
