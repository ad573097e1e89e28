"""The README's tiny chat model needs no torch (issue 49): ``scripts/tiny_chat_model.py`` copies
the prebuilt model it ships, and a LiteRT-only service answers the official ``openai`` client
with it, in processes that can find neither TensorFlow nor torch nor litert-torch
(tests/support/litert_only, as in the venv `EXTRAS=tflite,llm scripts/run.sh` makes: the llm
extra reads its tokenizer). Its ``tokenizer.json`` is a real Hugging Face tokenizer that
encodes as its ``vocab.json`` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import ROOT

LITERT_ONLY = {"PYTHONPATH": f"{ROOT / 'tests' / 'support' / 'litert_only'}:{ROOT}"}
PREBUILT = ROOT / "scripts" / "tiny_chat"


def test_the_tiny_chat_model_is_made_and_served_without_torch(start_server: Any, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai", reason="the official openai client (the test extra)")
    made = subprocess.run([sys.executable, str(ROOT / "scripts" / "tiny_chat_model.py"), str(tmp_path / "models")],
                          env={**os.environ, **LITERT_ONLY}, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    version = tmp_path / "models" / "chat" / "1"
    assert (version / "model.tflite").read_bytes() == (PREBUILT / "model.tflite").read_bytes()
    srv = start_server("--models", str(tmp_path / "models"), "--workers", "1", env=LITERT_ONLY)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused")
    answer = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert answer.model == "chat:1" and isinstance(answer.choices[0].message.content, str)
    assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 8
    assert answer.usage.prompt_tokens == len("<user>hi\n<assistant>")  # a character vocabulary: one token each
    # Structured output: llguidance cannot read this tokenizer.json's decoder (a bare Fuse), so the
    # grammar engine gets the tokens' bytes (core/tokenizer.py); it answered 500 before.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    shaped = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    assert isinstance(json.loads(shaped.choices[0].message.content or "")["ok"], bool)
    imported = srv.status()["service"]["imported"]
    assert not {"torch", "tensorflow", "litert_torch"} & set(imported), imported


def test_the_shipped_tokenizer_json_encodes_as_the_vocabulary() -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="Hugging Face tokenizers")
    vocab = json.loads((PREBUILT / "assets" / "vocab.json").read_text())
    tokenizer = tokenizers.Tokenizer.from_file(str(PREBUILT / "assets" / "tokenizer.json"))
    text = '<user>call f {"a": [1, 2.5], "b": "x y"}\n<assistant>'
    ids = tokenizer.encode(text).ids
    assert ids == [vocab.index(c) for c in text] and tokenizer.decode(ids) == text
    assert tokenizer.get_vocab_size() == len(vocab) == 128
