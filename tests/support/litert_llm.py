"""Tiny LLMs converted by litert-torch itself, and a reference greedy decoder for them.

The hand-made models of ``tests/support/genmodel.py`` follow the LiteRT LLM convention as we
read it; these are what the converter really writes. ``build(out)`` builds each
``SPECS`` entry with litert-torch's own model builders (TinyLlama's, Gemma3's decoder)
at a tiny size with random weights (seeded), and converts it with
``litert_torch.generative.utilities.converter.convert_to_tflite`` into
``out/<name>/1/model.tflite``. ``models(tmp)`` caches the result under /tmp keyed by
the specs, the build code and litert-torch's version, like the other test models: a cold build
costs a few seconds of import plus ~10-20 s per model on a 2-core box, a warm one
nothing.

``greedy(path, spec, prompt, n)`` is the reference the server is compared with: it
drives the model's signature runners (``ai_edge_litert.interpreter``) directly, one
stream, and shares no code with the server. It prefills with the window policy the
server documents (chunks of the longest window that fits inside the cache; the last
chunk in the smallest fitting window that holds it; what no window fits goes through
``decode``), because with dynamic int8 the activations are quantized per call, so the
padding of a window changes the numbers: any other split would be a different, not
a wrong, answer.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.cache import ahead_of_tests

VOCAB = 128
LAYERS, HEADS, HEAD_DIM, EMBED, FFN = 2, 2, 16, 32, 64


@dataclass(frozen=True)
class Spec:
    """One converted model: builder, cache length, prefill windows, export options."""

    family: str = "tiny_llama"  # tiny_llama | gemma3
    cache: int = 128
    prefill: tuple[int, ...] = (8, 32)
    decode_batch: int = 1
    mask: bool = False  # the mask as an input (ExportConfig.mask_as_input)
    transposed: bool = False  # KV_LAYOUT_TRANSPOSED: K [B, heads, L, dim], V [B, heads, dim, L]
    quantize: str = "none"  # or dynamic_int8
    seed: int = 0


SPECS: dict[str, Spec] = {
    "lt_plain": Spec(),
    "lt_q8": Spec(quantize="dynamic_int8"),
    "lt_b4": Spec(decode_batch=4),
    # the mask as an input with a shared input_pos: streams of any length aligned in one call
    "lt_b4m": Spec(decode_batch=4, mask=True),
    "lt_b8m": Spec(decode_batch=8, mask=True),
    "lt_mask": Spec(mask=True),
    "lt_t": Spec(transposed=True),  # issue 25 bug b: no mask, so the layout decides the context
    "lt_tmask": Spec(transposed=True, mask=True),
    "lt_c120": Spec(cache=120),  # issue 25 bug a: 120 is no multiple of 32
    "lt_c124": Spec(cache=124),  # no multiple of 8 either: the last positions go through decode
    # K and V both [1, 2, 16, 16]: default (L=2) and transposed (L=16) layouts both fit
    "lt_ambiguous": Spec(cache=16, prefill=(8,), transposed=True),
    # Gemma3 with a decode batch of 4: XNNPACK fails to reshape it inside LiteRT
    "g3_b4": Spec(family="gemma3", prefill=(8,), decode_batch=4),
}
SERVABLE = [n for n in SPECS if n not in ("lt_ambiguous", "g3_b4")]


def digest() -> str:
    """What the models depend on: the specs, the build code, litert-torch's version (the
    reference decoder below may change without a rebuild)."""
    import inspect
    from importlib.metadata import version

    text = repr(SPECS) + inspect.getsource(_config) + inspect.getsource(build_one) + version("litert-torch")
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def models() -> Path:
    """Every model of SPECS, built once and cached (tests/support/cache.py)."""
    from tests.support.cache import built_once

    return built_once(f"litert-llm-{digest()}", build)


@ahead_of_tests("lt_models")  # the fixture's name in the test modules that use these models
def models_ahead() -> Path | None:
    """``models()`` before the first test (converting all of them takes minutes on a busy
    2-core box, more than a test may), or None without litert-torch (those tests skip)."""
    import importlib.util

    return models() if importlib.util.find_spec("litert_torch") else None


def _config(spec: Spec) -> Any:
    if spec.family == "gemma3":
        from litert_torch.generative.examples.gemma3 import decoder

        config = decoder.get_fake_decoder_config_1b()
        config.embedding_dim, config.embedding_scale = EMBED, EMBED ** 0.5
        for block in config.block_configs:
            block.attn_config.num_heads, block.attn_config.head_dim = HEADS, HEAD_DIM
            block.attn_config.sliding_window_size = 64
            block.ff_config.intermediate_size = FFN
    else:
        from litert_torch.generative.examples.tiny_llama import tiny_llama

        config = tiny_llama.get_model_config()
        config.num_layers, config.embedding_dim = LAYERS, EMBED
        attn = config.block_config(0).attn_config
        attn.num_heads, attn.head_dim, attn.num_query_groups = HEADS, HEAD_DIM, HEADS
        config.block_config(0).ff_config.intermediate_size = FFN
    config.vocab_size, config.max_seq_len = VOCAB, max(128, spec.cache)
    return config


def build_one(spec: Spec, version_dir: Path) -> Path:
    """Build the model of ``spec`` with litert-torch's builder classes and convert it."""
    import tempfile

    import torch
    from litert_torch.generative.layers import kv_cache
    from litert_torch.generative.utilities import converter, export_config

    config = _config(spec)
    torch.manual_seed(spec.seed)
    if spec.family == "gemma3":
        from litert_torch.generative.examples.gemma3 import decoder

        model = decoder.Decoder(config, mask_cache_size=0 if spec.mask else spec.cache)
    else:
        from litert_torch.generative.examples.tiny_llama import tiny_llama

        model = tiny_llama.TinyLlama(config, mask_cache_size=0 if spec.mask else spec.cache)
    with torch.no_grad():  # sharper logits than the default init: greedy answers far from ties
        model.lm_head.weight.mul_(8.0)
    model.eval()
    export = export_config.ExportConfig()
    export.decode_batch_size, export.mask_as_input = spec.decode_batch, spec.mask
    if spec.transposed:
        export.kvcache_layout = kv_cache.KV_LAYOUT_TRANSPOSED
    version_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as out:
        path = converter.convert_to_tflite(model, output_path=out, output_name_prefix="tiny",
                                           prefill_seq_len=list(spec.prefill), kv_cache_max_len=spec.cache,
                                           quantize=spec.quantize, export_config=export)
        shutil.move(path, version_dir / "model.tflite")
    return version_dir / "model.tflite"


def build(out: Path, names: list[str] | None = None) -> None:
    for name in names or list(SPECS):
        build_one(SPECS[name], out / name / "1")


# --------------------------------------------------------------------------
# the reference decoder: the model's signature runners, one stream, greedy
# --------------------------------------------------------------------------
def windows(spec: Spec, start: int, remaining: int) -> tuple[int, int] | None:
    """(window, tokens) of the next prefill call at ``start``; None: decode the rest."""
    fits = [w for w in spec.prefill if start + w <= spec.cache]
    if not fits:
        return None
    take = min(remaining, max(fits))
    return min(w for w in fits if w >= take), take


class Reference:
    """Greedy decoding straight on ``ai_edge_litert``'s signature runners."""

    def __init__(self, path: Path, spec: Spec):
        from ai_edge_litert.interpreter import Interpreter

        self.spec = spec
        self.interp = Interpreter(model_path=str(path))
        self.runners = {k: self.interp.get_signature_runner(k) for k in self.interp.get_signature_list()}
        details = self.runners["decode"].get_input_details()
        self.kv = {n: d for n, d in details.items() if n.startswith("kv_cache_")}

    def _mask(self, rows: int, positions: np.ndarray) -> np.ndarray:
        keys = np.arange(self.spec.cache)
        allowed = keys[None, :] <= positions[:, None]
        mask = np.where(allowed, 0.0, float("-inf")).astype(np.float32)[None, None]  # [1, 1, q, L]
        return np.repeat(mask, rows, axis=0)

    def _decode(self, cache: dict[str, np.ndarray], token: int, pos: int) -> np.ndarray:
        batch = self.spec.decode_batch
        tokens = np.zeros([batch, 1], np.int32)
        tokens[0, 0] = token
        feeds = {"tokens": tokens, "input_pos": np.array([pos], np.int32), **cache}
        if self.spec.mask:
            feeds["mask"] = self._mask(batch, np.array([pos]))
        out = self.runners["decode"](**feeds)
        cache.update({n: np.array(out[n]) for n in self.kv})
        return np.array(out["logits"])[0, -1]

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """Up to ``n`` tokens after ``prompt``; fewer when the cache ends first."""
        spec = self.spec
        cache = {name: np.zeros(d["shape"], d["dtype"]) for name, d in self.kv.items()}
        context, start = prompt[:-1], 0
        while start < len(context):
            step = windows(spec, start, len(context) - start)
            if step is None:  # no window fits: the rest of the prompt one token at a time
                for pos in range(start, len(context)):
                    self._decode(cache, context[pos], pos)
                break
            window, take = step
            chunk = context[start:start + take]
            feeds = {"tokens": np.array([chunk + [0] * (window - take)], np.int32),
                     "input_pos": np.arange(start, start + window, dtype=np.int32),
                     **{k: v[:1] for k, v in cache.items()}}
            if spec.mask:
                feeds["mask"] = self._mask(1, np.arange(start, start + window))
            out = self.runners[f"prefill_{window}"](**feeds)
            for name in self.kv:
                cache[name][:1] = out[name]
            start += take
        answer, token = [], prompt[-1]
        for pos in range(len(prompt) - 1, spec.cache):
            token = int(np.argmax(self._decode(cache, token, pos)))
            answer.append(token)
            if len(answer) == n:
                break
        return answer


def prompt(length: int, seed: int = 1) -> list[int]:
    """A reproducible prompt of ``length`` token ids (1..VOCAB-1)."""
    return [int(t) for t in np.random.default_rng(seed + length).integers(1, VOCAB, length)]


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.support.litert_llm OUT_DIR [NAME ...]``: build into OUT_DIR (nowhere else)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.support.litert_llm",
                                     description="Convert tiny LLMs with litert-torch into OUT_DIR/<name>/1/model.tflite.")
    parser.add_argument("out_dir", type=Path, help="the folder to build into (made if missing)")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"which models (default: all of {', '.join(SPECS)})")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in SPECS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(SPECS)}")
    build(args.out_dir, args.names or None)
    print(f"built into {args.out_dir}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
