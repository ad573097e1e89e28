"""Real tokenizer files for the tests, trained by the libraries that read them, and a litert-torch
conversion large enough to use them.

* ``bpe``: a byte-level BPE ``tokenizer.json`` of ``BPE_SIZE`` (100k+) tokens, trained by Hugging
  Face ``tokenizers``' own ``BpeTrainer`` on a generated multilingual corpus (Latin with
  accents, CJK, Cyrillic, kana, emoji): the kind Llama 3, Qwen and DeepSeek ship. ChatML
  special tokens; ``tokenizer_config.json`` names ``<|im_end|>`` as EOS and carries a ChatML
  chat template (Hermes' ``<tool_call>`` for tools); ``generation_config.json`` adds
  ``<|endoftext|>`` as a second EOS, as Qwen's does.
* ``spm``: a SentencePiece ``tokenizer.model`` (BPE with byte fallback) trained by
  ``sentencepiece``'s own trainer on a small corpus, Llama 2's ``<s>``/``</s>`` and BOS added.

``versions()`` builds both into ``<cache>/<name>/1/`` beside one ``model.tflite``: litert-torch's
TinyLlama builder (tests/support/litert_llm.py's tiny size) with a ``BPE_SIZE`` vocabulary and
random weights, converted by litert-torch. Cached like the other test models (tests/support/
cache.py), keyed by this file's source and litert-torch's version.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

BPE_SIZE = 100_352
SPM_SIZE = 4_000
CHATML = ("{% if tools %}<|im_start|>system\nCall a function by answering <tool_call>{\"name\": <name>, "
          "\"arguments\": <arguments>}</tool_call>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
          "<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n"
          "{{ message.content or '' }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA2 = ("{{ bos_token }}{% for message in messages %}{% if message.role == 'user' %}[INST] {{ message.content }} "
          "[/INST]{% else %} {{ message.content }} {{ eos_token }}{% endif %}{% endfor %}")
SCRIPTS = ("abcdefghijklmnopqrstuvwxyzéèêàçñöüßåøABCDEFGH",
           "".join(chr(c) for c in range(0x4E00, 0x4E00 + 3000)),
           "".join(chr(c) for c in range(0x0430, 0x0450)),
           "".join(chr(c) for c in range(0x3041, 0x3097)),
           "".join(chr(c) for c in range(0x1F600, 0x1F650)) + "🚀🌍✨👍🏽")


def corpus(lines: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)

    def word() -> str:
        letters = rng.choice(SCRIPTS)
        return "".join(rng.choice(letters) for _ in range(rng.randint(2, 7)))

    return [" ".join(word() for _ in range(12)) for _ in range(lines)]


def build_bpe(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_SIZE, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(40_000), trainer)
    assert tok.get_vocab_size() == BPE_SIZE, tok.get_vocab_size()
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    _json(out / "tokenizer_config.json", {"eos_token": "<|im_end|>", "bos_token": None, "chat_template": CHATML,
                                          "tokenizer_class": "PreTrainedTokenizerFast"})
    _json(out / "generation_config.json", {"eos_token_id": [tok.token_to_id("<|im_end|>"),
                                                            tok.token_to_id("<|endoftext|>")]})


def build_spm(out: Path) -> None:
    import sentencepiece

    out.mkdir(parents=True, exist_ok=True)
    text = out / "corpus.txt"
    text.write_text("\n".join(corpus(6_000, seed=1)), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.Train(
        input=str(text), model_prefix=str(out / "tokenizer"), vocab_size=SPM_SIZE, model_type="bpe",
        byte_fallback=True, character_coverage=0.9995, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
        minloglevel=2, num_threads=2)
    text.unlink()
    (out / "tokenizer.vocab").unlink()
    _json(out / "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                                          "chat_template": LLAMA2, "tokenizer_class": "LlamaTokenizer"})


def _json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value), encoding="utf-8")


def build_model(version_dir: Path) -> None:
    """litert-torch's TinyLlama at litert_llm's tiny size, with a BPE_SIZE vocabulary, converted."""
    import tempfile

    import torch
    from litert_torch.generative.examples.tiny_llama import tiny_llama
    from litert_torch.generative.utilities import converter, export_config

    from tests.support.litert_llm import Spec, _config

    spec = Spec()
    config = _config(spec)
    config.vocab_size = BPE_SIZE
    torch.manual_seed(0)
    model = tiny_llama.TinyLlama(config, mask_cache_size=spec.cache)
    with torch.no_grad():  # sharp logits: greedy answers far from ties
        model.lm_head.weight.mul_(8.0)
    model.eval()
    version_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as out:
        path = converter.convert_to_tflite(model, output_path=out, output_name_prefix="tok",
                                           prefill_seq_len=list(spec.prefill), kv_cache_max_len=spec.cache,
                                           quantize="none", export_config=export_config.ExportConfig())
        shutil.move(path, version_dir / "model.tflite")


def build(out: Path) -> None:
    build_model(out / "tok_bpe" / "1")
    build_bpe(out / "tok_bpe" / "1" / "assets")
    (out / "tok_spm" / "1").mkdir(parents=True)
    shutil.copy(out / "tok_bpe" / "1" / "model.tflite", out / "tok_spm" / "1" / "model.tflite")
    build_spm(out / "tok_spm" / "1" / "assets")


def digest() -> str:
    from importlib.metadata import version

    source = Path(__file__).read_bytes() + version("litert-torch").encode() + version("tokenizers").encode()
    return hashlib.sha256(source).hexdigest()[:12]


def versions() -> Path:
    """``<cache>/tok_bpe/1`` and ``<cache>/tok_spm/1`` (module docstring), built once."""
    from tests.support.cache import built_once

    return built_once(f"real-tokenizers-{digest()}", build)


__all__ = ["BPE_SIZE", "SPM_SIZE", "build", "versions"]
