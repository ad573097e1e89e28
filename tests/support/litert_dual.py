"""litert-torch conversions with two decode signatures: a batched one and a batch-1 one.

A version that runs several streams per decode call (a decode batch B > 1) pays for all B rows
every call, so one stream alone runs slower than on a batch-1 conversion of the same weights
(bench/RESULTS.md, issue 35). litert-torch's ``convert_to_tflite`` writes one ``decode`` of one
batch; these models carry both, from one converter run, sharing their weights: ``decode``
(batch 1, litert-torch's default, what any runtime of the convention calls) and ``decode_<B>``
(batch B, one shared ``input_pos``), both with the mask as an input, so the server can run
each step on whichever is cheaper for the streams at hand (runtimes/generative.py).

``SPECS``: ``dual_tiny`` at tests/support/litert_llm.py's tiny size (the tests), and the
issue-45 bench models at 4 layers, d=256, a 512-position cache: ``d256_b1`` (batch-1 only,
the baseline), ``d256_b4`` (a decode batch of 4 only: how the issue measured step batching
losing) and ``d256_dual`` (both). Same seed, same weights in each family. Built once and
cached (tests/support/cache.py) under a name keyed by this file and litert-torch's version.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support import litert_llm


@dataclass(frozen=True)
class Dual:
    layers: int = litert_llm.LAYERS
    embed: int = litert_llm.EMBED
    heads: int = litert_llm.HEADS
    ffn: int = litert_llm.FFN
    cache: int = 128
    prefill: tuple[int, ...] = (8, 32)
    batches: tuple[int, ...] = (1, 4)  # decode batches: 1 is ``decode``, B > 1 ``decode_<B>`` (or ``decode`` alone)
    seed: int = 0


SPECS: dict[str, Dual] = {
    "dual_tiny": Dual(),
    "d256_b1": Dual(layers=4, embed=256, heads=4, ffn=1024, cache=512, prefill=(8, 32, 128), batches=(1,)),
    "d256_b4": Dual(layers=4, embed=256, heads=4, ffn=1024, cache=512, prefill=(8, 32, 128), batches=(4,)),
    "d256_dual": Dual(layers=4, embed=256, heads=4, ffn=1024, cache=512, prefill=(8, 32, 128), batches=(1, 4)),
}
TEST_MODELS = ("dual_tiny",)
BENCH_MODELS = ("d256_b1", "d256_b4", "d256_dual")


def _config(spec: Dual) -> Any:
    from litert_torch.generative.examples.tiny_llama import tiny_llama

    config = tiny_llama.get_model_config()
    config.num_layers, config.embedding_dim = spec.layers, spec.embed
    attn = config.block_config(0).attn_config
    attn.num_heads, attn.head_dim, attn.num_query_groups = spec.heads, spec.embed // spec.heads, spec.heads
    config.block_config(0).ff_config.intermediate_size = spec.ffn
    config.vocab_size, config.max_seq_len = litert_llm.VOCAB, max(128, spec.cache)
    return config


def _decode_sample(batch: int, spec: Dual, config: Any, layout: Any) -> dict[str, Any]:
    """litert-torch's own decode sample inputs (converter._add_signatures), at ``batch``."""
    import torch
    from litert_torch.generative.layers import kv_cache as kv_utils
    from litert_torch.generative.utilities import converter

    return {"tokens": torch.zeros((batch, 1), dtype=torch.int), "input_pos": torch.tensor([0], dtype=torch.int),
            "kv_cache": kv_utils.KVCache.from_model_config(spec.cache, config, batch_size=batch, kv_layout=layout),
            "mask": converter._build_mask(1, spec.cache, config.causal_mask_value)}


def build_one(spec: Dual, version_dir: Path) -> None:
    """Prefill and decode signatures as ``convert_to_tflite`` adds them (mask as an input), plus
    a decode signature per extra batch, in one converter run (the weights are shared)."""
    import torch
    from litert_torch._convert import interface
    from litert_torch.generative.examples.tiny_llama import tiny_llama
    from litert_torch.generative.utilities import converter, export_config

    config = _config(spec)
    torch.manual_seed(spec.seed)
    model = tiny_llama.TinyLlama(config, mask_cache_size=0)
    with torch.no_grad():  # sharp logits, as litert_llm's: greedy answers far from ties
        model.lm_head.weight.mul_(8.0)
    model.eval()
    first, *more = spec.batches
    export = export_config.ExportConfig()
    export.decode_batch_size, export.mask_as_input = first, True
    conv = interface.Converter()
    converter._add_signatures(conv, model, list(spec.prefill), spec.cache, None, 0, config, [None], export)
    for batch in more:
        batched = export_config.ExportConfig()
        batched.decode_batch_size, batched.mask_as_input = batch, True
        module = converter.ExportableModule(model, export_config=batched).eval()
        conv.add_signature(f"decode_{batch}", module,
                           sample_kwargs=_decode_sample(batch, spec, config, batched.kvcache_layout))
    edge = conv.convert(quant_config=converter.get_quant_recipe_from_flag("none", config))
    version_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as out:
        edge.export(str(Path(out) / "model.tflite"))
        shutil.move(str(Path(out) / "model.tflite"), version_dir / "model.tflite")


def digest() -> str:
    from importlib.metadata import version

    return hashlib.sha256(Path(__file__).read_bytes() + version("litert-torch").encode()).hexdigest()[:12]


def models(names: tuple[str, ...] = TEST_MODELS) -> Path:
    """``<cache>/<name>/1/model.tflite`` for each of ``names``, built once."""
    from tests.support.cache import built_once

    def build(out: Path) -> None:
        for name in names:
            build_one(SPECS[name], out / name / "1")

    return built_once(f"litert-dual-{'-'.join(names)}-{digest()}", build)


__all__ = ["BENCH_MODELS", "SPECS", "TEST_MODELS", "build_one", "models"]
