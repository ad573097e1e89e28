"""The LiteRT-LM backend (``runtimes/litertlm.py``) on a bundle built here: a model
litert-torch converted (``tests/support/litert_llm.py``, the transposed KV cache LiteRT-LM
needs), a word-level Hugging Face tokenizer made in the test, packed by litert-torch's
own ``litertlm_builder``. Nothing is downloaded. LiteRT-LM's greedy answer must equal the
reference decoder's on the same model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.support import litert_llm

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
    return litert_llm.models()


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


STRESS = """
import sys, threading
from runtimes.litertlm import LiteRTLMBackend, Request
servable = LiteRTLMBackend().load(sys.argv[1], {"cache_dir": sys.argv[2]})
prompt = " ".join(f"t{i}" for i in [5, 17, 42, 99, 3, 64, 8, 120, 77, 31])
answers, errors, streams_left = [], [], [3]

def stream(i):
    try:
        for k in range(int(sys.argv[3])):
            pieces = servable.generate(Request(prompt, max_new_tokens=12))
            text = []
            for n, piece in enumerate(pieces):
                text.append(piece)
                if i == 1 and k % 3 == 0 and n == 4:  # a client that goes away mid-stream
                    pieces.close()
                    break
            else:
                answers.append("".join(text))
    except Exception as exc:
        errors.append(repr(exc))
    streams_left[0] -= 1

def tokenizer():  # what the API does for each new request while other streams decode
    while streams_left[0] > 0:
        servable.tokenize(prompt)
        servable.detokenize([5, 17, 42])

threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)] + \
    [threading.Thread(target=tokenizer) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
servable.close()
print("ANSWERS", len(answers), len(set(answers)), errors)
"""


def test_concurrent_streams_and_tokenizing_on_one_bundle_do_not_crash(lt_models: Path, tmp_path: Path) -> None:
    """LiteRT-LM 0.18.1 aborts the process ("double free or corruption") when a tokenize runs
    while another thread's session decodes; the servable lends each engine to one call at a
    time. Run in a child: before the fix the crash would take pytest with it."""
    import subprocess
    import sys

    version = bundle(lt_models, "lt_t", tmp_path)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", STRESS, str(version), str(tmp_path / "cache"), "15"], cwd=root,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"the process died ({done.returncode}): {done.stderr[-2000:]}"
    line = next(x for x in done.stdout.splitlines() if x.startswith("ANSWERS"))
    count, distinct, errors = line.split(" ", 3)[1:]
    assert errors == "[]" and int(count) > 0 and distinct == "1", line  # greedy: every whole answer the same
