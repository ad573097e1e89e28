"""A version's tokenizer files read by their own libraries (appliance/core/tokenizer.py), and
the incremental detokenizer, on small tokenizers trained here by those libraries (a byte-level
BPE by Hugging Face tokenizers' BpeTrainer, a SentencePiece BPE with byte fallback)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from appliance.core import tokenizer as T
from tests.support import real_tokenizers

tokenizers = pytest.importorskip("tokenizers", reason="Hugging Face tokenizers reads tokenizer.json")
pytest.importorskip("sentencepiece", reason="sentencepiece reads tokenizer.model")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    version = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(real_tokenizers.corpus(1500), trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(version / "tokenizer.json"))  # at the version's root, as a Hugging Face checkout has it
    (version / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (version / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return version


@pytest.fixture(scope="module")
def spm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    version = tmp_path_factory.mktemp("spm")
    real_tokenizers.build_spm(version / "assets")
    return version


def random_ids(tok: Any, rng: random.Random) -> list[int]:
    return [rng.randrange(3, tok.size) for _ in range(rng.randint(1, 30))]


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_streamed_pieces_join_to_the_decode_and_never_cut_a_character(which: str, request: Any) -> None:
    tok = T.load(str(request.getfixturevalue(which)))
    assert tok is not None
    rng = random.Random(3)
    prompt = tok.encode("héllo 東京 🚀")
    for _ in range(300):
        ids = random_ids(tok, rng)
        detok = T.Detokenizer(tok, prompt)
        pieces = [detok.feed(i) for i in ids]
        rest = detok.flush()
        assert "".join(pieces) + rest == tok.decode_all(prompt + ids)[len(tok.decode_all(prompt)):]
        assert not any(p.endswith("\ufffd") for p in pieces if p), pieces  # only the end may hold half a character
    naive = {tok.decode(i) for i in range(tok.size)}
    assert any(t.endswith("\ufffd") for t in naive)  # what a per-token decode shows: the reason for all this


def test_special_tokens_and_eos_as_hugging_face_reads_them(bpe: Path, spm: Path) -> None:
    hf = T.load(str(bpe))
    assert isinstance(hf, T.HFTokenizer)
    assert hf.eos_id == 2 and hf.stop_ids == {0, 2} and hf.special_ids == {0, 1, 2}
    assert 2 in hf.encode("a<|im_end|>b") and "im_end" not in hf.decode_all(hf.encode("a<|im_end|>b"))
    sp = T.load(str(spm))
    assert isinstance(sp, T.SentencePieceTokenizer)
    ids = sp.encode("a</s>b")
    assert ids[0] == sp.bos_id == 1 and 2 in ids and sp.decode_all(ids) == "ab"
    assert sp.encode("x", special=False)[0] != 1  # a chat prompt: the template writes its own BOS
    assert b"".join(sp.token_bytes(i) for i in sp.encode("東京", special=False)) == " 東京".encode()


def test_the_grammar_engine_reads_the_same_tokenizer(bpe: Path, spm: Path) -> None:
    pytest.importorskip("llguidance")
    from appliance.core.constraints import Constraint, Grammar, TokenTable

    for version in (bpe, spm):
        tok = T.load(str(version))
        table = TokenTable.of(tok)
        assert table.model_vocab == tok.size
        grammar = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                      "x").check(table)
        allowed = Constraint(grammar, table).allowed()
        assert allowed.shape == (tok.size,)
        assert {tok.decode(int(i)) for i in allowed.nonzero()[0]} == {"{"}  # compact JSON: only "{" starts it


def test_a_broken_file_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "assets").mkdir()
    (tmp_path / "assets" / "tokenizer.json").write_text("{not json")
    with pytest.raises(T.InvalidArgument, match="tokenizer.json"):
        T.check(str(tmp_path))


def test_added_tokens_only_the_config_lists_are_added(bpe: Path, tmp_path: Path) -> None:
    """Hugging Face's fast tokenizer adds tokenizer_config's added tokens that tokenizer.json lacks."""
    (tmp_path / "tokenizer.json").write_text((bpe / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>", "added_tokens_decoder": {
        "2000": {"content": "<|eot|>", "special": True}}}))
    tok = T.load(str(tmp_path))
    assert tok is not None and tok.size == 2001 and tok.eos_id == 2000 and 2000 in tok.special_ids
    assert tok.encode("a<|eot|>b")[1] == 2000 and tok.decode_all(tok.encode("a<|eot|>b")) == "ab"


def test_a_decoder_the_grammar_engine_cannot_classify_still_constrains() -> None:
    """scripts/tiny_chat's tokenizer.json (a character vocabulary with the ``Fuse`` decoder, which
    llguidance cannot classify: every response_format was a 500): the grammar's vocabulary comes
    from the tokens' bytes, and a JSON document in it is walked to its end token by token."""
    from appliance.core.constraints import Constraint, Grammar, TokenTable

    vocab = T.load(str(Path(__file__).resolve().parents[2] / "scripts" / "tiny_chat"))
    assert isinstance(vocab, T.HFTokenizer) and '"decoder":{"type":"Fuse"' in vocab.json.replace(" ", "")
    table = TokenTable.of(vocab)
    grammar = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                   "additionalProperties": False}, "test").check(table)
    constraint = Constraint(grammar, table)
    for token in vocab.encode('{"a":42}', special=False):
        assert constraint.allowed()[token], chr(token)
        constraint.advance(token)
    assert not constraint.allowed()[ord("x")] and (constraint.finished or constraint.stop_allowed())
