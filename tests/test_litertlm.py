"""The LiteRT-LM backend (``runtimes/litertlm.py``) on a bundle built here: a model
litert-torch converted (``tests/litert_llm.py``, the transposed KV cache LiteRT-LM
needs), a word-level Hugging Face tokenizer made in the test, packed by litert-torch's
own ``litertlm_builder``. Nothing is downloaded. LiteRT-LM's greedy answer must equal the
reference decoder's on the same model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import litert_llm

pytest.importorskip("litert_lm", reason="LiteRT-LM's engine (litert-lm-api, the test extra)")
pytest.importorskip("litert_torch", reason="litert-torch converts the model and packs the bundle")

START = 1


def bundle(models: Path, model: str, out: Path) -> Path:
    from litert_torch.generative.utilities import litertlm_builder
    from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers

    # token i is the word "t<i>"; id 0 doubles as the unknown word
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, litert_llm.VOCAB)}}
    tokenizer = Tokenizer(tok_models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    work = out / "work"
    work.mkdir(parents=True)
    tokenizer.save(str(work / "tokenizer.json"))
    shutil.copy(models / model / "1" / "model.tflite", work / "tiny.tflite")
    version = out / model / "1"
    version.mkdir(parents=True)
    litertlm_builder.build_litertlm(tflite_model_path=str(work / "tiny.tflite"), workdir=str(work),
                                    output_path=str(version), context_length=litert_llm.SPECS[model].cache,
                                    hf_tokenizer_model_path=str(work / "tokenizer.json"),
                                    start_token_id=START, stop_token_ids=[litert_llm.VOCAB + 1])
    return version


@pytest.fixture(scope="module")
def lt_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return litert_llm.models(tmp_path_factory.mktemp("litert-llm-build"))


def test_a_bundle_generates_the_reference_tokens(lt_models: Path, tmp_path: Path) -> None:
    from runtimes.litertlm import LiteRTLMBackend, Request

    backend = LiteRTLMBackend()
    assert backend.probe({}).available
    version = bundle(lt_models, "lt_t", tmp_path)
    servable = backend.load(str(version), {"cache_dir": str(tmp_path)})
    try:
        assert servable.describe()["context_length"] == 128
        prompt = [5, 17, 42, 99, 3, 64, 8, 120, 77, 31]
        assert servable.tokenize(" ".join(f"t{i}" for i in prompt)) == prompt
        text = "".join(servable.generate(Request(" ".join(f"t{i}" for i in prompt), max_new_tokens=10)))
        tokens = [int(word[1:]) for word in text.split()]
        reference = litert_llm.Reference(lt_models / "lt_t" / "1" / "model.tflite", litert_llm.SPECS["lt_t"])
        assert tokens == reference.greedy([START, *prompt], 10)  # LiteRT-LM puts the start token first
    finally:
        servable.close()


def test_a_bundle_with_the_default_kv_layout_is_refused_at_load(lt_models: Path, tmp_path: Path) -> None:
    """LiteRT-LM itself loads it, then refuses every prompt ('4 >= 2': it reads the head
    count as the context); the backend refuses it at load with the reason instead."""
    from runtimes import LoadFailure
    from runtimes.litertlm import LiteRTLMBackend

    version = bundle(lt_models, "lt_plain", tmp_path)
    with pytest.raises(LoadFailure) as refused:
        LiteRTLMBackend().load(str(version), {"cache_dir": str(tmp_path)})
    assert "KV_LAYOUT_TRANSPOSED" in str(refused.value)
