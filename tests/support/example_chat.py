"""A tiny chat model that answers openai-python's ``parsing*.py`` examples as a real model would.

The examples ask ``gpt-4o`` a math question under a pydantic ``response_format`` and two
questions with tools offered and ``tool_choice`` left to the model (``auto``), then read
``message.parsed`` / ``tool_calls[0].function.parsed_arguments``. Random weights answer the first
with strings that seldom close (``LengthFinishReasonError``) and never decide to call a tool, so
this model is *trained* (a few hundred Adam steps of litert-torch's own TinyLlama in torch, on
the three conversations rendered by the version's own chat template, as the server renders
them) to answer with one JSON document, one call of ``Query`` and two calls of ``get_weather``,
then its end token; then converted by litert-torch (decode batch 1, 1,024 positions) like every
other test model. Its tokenizer is scripts/tiny_chat_model.py's Hugging Face ``tokenizer.json``
(a character vocabulary: token i is chr(i)), with ``generation_config.json`` naming chr(3) as
end of text, and the same Hermes-style chat template. The answers are decided here, the
protocol, parsing and streaming are the server's and the client's.

Built once and cached (tests/support/cache.py), keyed by this file and litert-torch's version.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

VOCAB, CACHE, EOS = 128, 1024, 3
LAYERS, EMBED, HEADS, FFN = 2, 64, 4, 256
STEPS = 200  # the loss is under 0.02 after 100 (0.7 s a step on a loaded 2-core box)

MATH = [{"role": "system", "content": "You are a helpful math tutor."},
        {"role": "user", "content": "solve 8x + 31 = 2"}]
QUERY = [{"role": "system", "content": "You are a helpful assistant. The current date is August 6, 2024. You help users "
                                       "query for the data they are looking for by calling the query function."},
         {"role": "user", "content": "look up all my orders in november of last year that were fulfilled but not "
                                     "delivered on time"}]
WEATHER = [{"role": "user", "content": "What's the weather like in SF and New York?"}]


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}  # all the template reads of a tool


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _call(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def conversations() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]]:
    """(messages, tools, the answer to train) of each example."""
    math = {"steps": [{"explanation": "Subtract 31 from both sides.", "output": "8x = -29"},
                      {"explanation": "Divide both sides by 8.", "output": "x = -29/8"}], "final_answer": "x = -29/8"}
    query = {"table_name": "orders", "columns": ["id", "status"],
             "conditions": [{"column": "ordered_at", "operator": ">=", "value": "2023-11-01"},
                            {"column": "delivered_at", "operator": ">", "value": {"column_name": "expected_delivery_date"}}],
             "order_by": "asc"}
    return [(MATH, None, _compact(math)),
            (QUERY, [_tool("Query")], _call("Query", query)),
            (WEATHER, [_tool("get_weather")], _call("get_weather", {"city": "San Francisco", "country": "US"})
             + _call("get_weather", {"city": "New York", "country": "US"}))]


def _template() -> str:
    import sys

    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from scripts.tiny_chat_model import TEMPLATE

    return TEMPLATE


def sequences() -> list[tuple[list[int], int]]:
    """(prompt + answer + EOS as ids, where the answer starts) of each conversation, the prompt
    rendered by the server's own ChatTemplate."""
    from appliance.core.text import ChatTemplate

    template = ChatTemplate(_template(), "example_chat")
    out = []
    for messages, tools, answer in conversations():
        prompt = template.render(messages, tools)
        ids = [ord(c) for c in prompt + answer] + [EOS]
        assert max(ids) < VOCAB, "the character vocabulary holds ASCII only"
        out.append((ids, len(prompt)))
    return out


def _model() -> Any:
    from litert_torch.generative.examples.tiny_llama import tiny_llama

    config = tiny_llama.get_model_config()
    config.num_layers, config.embedding_dim = LAYERS, EMBED
    attn = config.block_config(0).attn_config
    attn.num_heads, attn.head_dim, attn.num_query_groups = HEADS, EMBED // HEADS, HEADS
    config.block_config(0).ff_config.intermediate_size = FFN
    config.vocab_size, config.max_seq_len = VOCAB, CACHE
    return tiny_llama.TinyLlama(config, mask_cache_size=CACHE), config


def _logits(model: Any, config: Any, ids: Any) -> Any:
    """litert-torch's decoder forward (model_builder.DecoderOnlyModel) without its KV cache,
    whose update is a custom op with no gradient: attention over the sequence itself, under the
    model's own causal mask. [n, vocab]."""
    import torch

    n = ids.shape[1]
    pos = torch.arange(n, dtype=torch.int)
    attn = config.block_config(0).attn_config
    rope = config.build_rope(pos, int(attn.rotary_percentage * attn.head_dim), attn.rotary_base)
    mask = model.mask_cache[:, :, :n, :n]
    x = model.tok_embedding(ids)
    for block in model.transformer_blocks:
        x = block(x, rope, mask, pos, None, None)
    return model.lm_head(model.final_norm(x))[0]


def train(model: Any, config: Any, steps: int = STEPS) -> float:
    """Adam on the answers' tokens (the prompts are context only); the last step's mean loss."""
    import torch

    data = [(torch.tensor([ids], dtype=torch.int), start) for ids, start in sequences()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other on a busy box
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        losses = [torch.nn.functional.cross_entropy(_logits(model, config, ids[:, :-1])[start - 1:],
                                                    ids[0, start:].long()) for ids, start in data]
        loss = torch.stack(losses).mean()
        loss.backward()
        optimizer.step()
    torch.set_num_threads(threads)
    model.eval()
    return float(loss.detach())


def build(out: Path) -> None:
    """``out/1/``: the trained model converted, and its assets (module docstring)."""
    import torch
    from litert_torch.generative.utilities import converter, export_config

    from scripts.tiny_chat_model import write_tokenizer

    torch.manual_seed(0)
    model, config = _model()
    final = train(model, config)
    assert final < 0.02, f"the example answers were not learnt (loss {final:.3f})"
    # Sharper still: the examples sample at temperature 1 (their default) and the tests read exact
    # text. Logits x10 raise the odds against the learnt token to the 10th power: a token learnt at
    # p = 0.9 (odds 1:9 against) is then missed once in ~3e9 draws, where x3 left ~1 in 730 (a flake).
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
    version = out / "1"
    version.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = converter.convert_to_tflite(model, output_path=tmp, output_name_prefix="example", prefill_seq_len=[8, 32, 128],
                                           kv_cache_max_len=CACHE, quantize="none",
                                           export_config=export_config.ExportConfig())
        shutil.move(path, version / "model.tflite")
    assets = version / "assets"
    assets.mkdir()
    write_tokenizer([chr(i) for i in range(VOCAB)], assets / "tokenizer.json")
    (assets / "chat_template.jinja").write_text(_template())
    (assets / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))


def digest() -> str:
    from importlib.metadata import version

    return hashlib.sha256(Path(__file__).read_bytes() + version("litert-torch").encode()).hexdigest()[:12]


def version_dir() -> Path:
    """The built version (``<cache>/example-chat-<digest>/1``), built once."""
    from tests.support.cache import built_once

    return built_once(f"example-chat-{digest()}", build) / "1"


__all__ = ["conversations", "sequences", "version_dir"]
