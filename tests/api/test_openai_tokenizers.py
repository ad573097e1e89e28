"""Real tokenizers through the OpenAI API: a litert-torch conversion shipping a byte-level BPE
``tokenizer.json`` of 100k+ tokens, and the same model shipping a SentencePiece
``tokenizer.model`` (tests/support/real_tokenizers.py, trained by the libraries themselves),
served by the real ``appliance serve`` and judged by the official ``openai`` client.

What must hold, for prompts with accents, CJK and emoji, streamed and not: the usage counts
equal the tokenizer's own count of the prompt and the generated ids (``:generate`` gives
those ids for the same greedy prompt); the text equals the tokenizer's decode of them; a
streamed answer's pieces join to the same text, none of them a broken character (a random
model picks byte tokens that split characters, which a per-token decode shows as U+FFFD).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from tests.support import real_tokenizers
from tests.support.servers import Server, launch

# Waits of up to 300 s inside (a server, a model built first): the pytest timeout sits above
# them (tests/test_timeouts.py).
pytestmark = pytest.mark.timeout(600)

openai = pytest.importorskip("openai", reason="the official OpenAI client (the test extra)")
pytest.importorskip("litert_torch", reason="litert-torch converts the model (the test extra)")
tokenizers = pytest.importorskip("tokenizers", reason="Hugging Face tokenizers reads tokenizer.json")
sentencepiece = pytest.importorskip("sentencepiece", reason="sentencepiece reads tokenizer.model")

PROMPTS = ("Café crème à la façon de Zoë", "東京の天気は晴れです、北京也是", "ship it 🚀🌍 ✨👍🏽 now", "naïve 日本 😀 mix")
N = 24


@pytest.fixture(scope="module")
def versions() -> Path:
    return real_tokenizers.versions()


@pytest.fixture(scope="module")
def server(versions: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = launch(["--models", str(versions)], tmp_path_factory.mktemp("tok"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[Any]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield c
    c.close()


class Reference:
    """The tokenizer of a version, read by its own library (not the server's code)."""

    def __init__(self, versions: Path, model: str):
        assets = versions / model / "1" / "assets"
        if model == "tok_bpe":
            hf = tokenizers.Tokenizer.from_file(str(assets / "tokenizer.json"))
            self.encode = lambda text, special=True: hf.encode(text, add_special_tokens=special).ids
            self.decode = lambda ids: hf.decode(ids, skip_special_tokens=True)
        else:
            sp = sentencepiece.SentencePieceProcessor(model_file=str(assets / "tokenizer.model"))

            def encode(text: str, special: bool = True) -> list[int]:
                # Hugging Face's Llama tokenizer: BOS first, and a "<s>" the template writes is that token
                ids = [sp.bos_id()] if special else []
                if text.startswith("<s>"):
                    ids, text = ids + [sp.bos_id()], text[len("<s>"):]
                return ids + sp.encode(text)

            self.encode, self.decode = encode, sp.decode

    def text_after(self, prompt: list[int], ids: list[int]) -> str:
        """What ``ids`` add to the text of ``prompt`` (the space a SentencePiece word starts with kept)."""
        return self.decode(prompt + ids)[len(self.decode(prompt)):]


def generated(server: Server, model: str, prompt: list[int]) -> list[int]:
    r = requests.post(f"{server.url}/v1/models/{model}:generate", json={"input_ids": prompt, "max_new_tokens": N},
                      timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]  # type: ignore[no-any-return]


def test_the_tokenizers_are_what_the_issue_asks(versions: Path) -> None:
    bpe = tokenizers.Tokenizer.from_file(str(versions / "tok_bpe" / "1" / "assets" / "tokenizer.json"))
    assert bpe.get_vocab_size() >= 100_000
    assert "ByteLevel" in bpe.to_str()
    sp = sentencepiece.SentencePieceProcessor(model_file=str(versions / "tok_spm" / "1" / "assets" / "tokenizer.model"))
    assert sp.get_piece_size() == real_tokenizers.SPM_SIZE


@pytest.mark.parametrize("model", ["tok_bpe", "tok_spm"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_completions_count_and_decode_as_the_tokenizer(client: Any, server: Server, versions: Path, model: str,
                                                       prompt: str) -> None:
    ref = Reference(versions, model)
    ids = ref.encode(prompt)
    want = generated(server, model, ids)
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0)
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == len(want)
    assert whole.choices[0].text == ref.text_after(ids, want)
    pieces = [c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}) if c.choices]
    assert "".join(pieces) == whole.choices[0].text
    shown = [p for p in pieces if p]
    # no character cut between pieces (the last may end in one the length limit cut)
    assert not any(p.endswith("\ufffd") for p in shown[:-1]), shown


@pytest.mark.parametrize("model", ["tok_bpe", "tok_spm"])
def test_chat_prompts_go_through_the_template_and_count_as_the_tokenizer(client: Any, server: Server,
                                                                          versions: Path, model: str) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    ref = Reference(versions, model)
    template = real_tokenizers.CHATML if model == "tok_bpe" else real_tokenizers.LLAMA2
    messages = [{"role": "user", "content": PROMPTS[2] + " " + PROMPTS[1]}]
    text = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template).render(
        messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>", tools=None)
    ids = ref.encode(text, special=False)  # the template writes its own BOS
    want = generated(server, model, ids)
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=N, temperature=0)
    assert answer.usage.prompt_tokens == len(ids)
    assert answer.usage.completion_tokens == len(want)
    assert answer.choices[0].message.content == ref.text_after(ids, want)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=messages, max_tokens=N, temperature=0, stream=True) if c.choices)
    assert streamed == answer.choices[0].message.content


def test_a_special_token_in_the_text_is_that_token(server: Server, versions: Path) -> None:
    bpe = tokenizers.Tokenizer.from_file(str(versions / "tok_bpe" / "1" / "assets" / "tokenizer.json"))
    end = bpe.token_to_id("<|im_end|>")
    r = requests.post(f"{server.url}/v1/models/tok_bpe:generate", json={"text": "a<|im_end|>b", "max_new_tokens": 1},
                      timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["prompt_tokens"] == len(bpe.encode("a<|im_end|>b").ids) and end in bpe.encode("a<|im_end|>b").ids


def test_logprob_bytes_are_the_tokens_own(client: Any, server: Server, versions: Path) -> None:
    ref = Reference(versions, "tok_bpe")
    answer = client.chat.completions.create(model="tok_bpe", messages=[{"role": "user", "content": PROMPTS[1]}],
                                            max_tokens=8, temperature=0, logprobs=True)
    entries = answer.choices[0].logprobs.content
    raw = b"".join(bytes(e.bytes) for e in entries)
    assert raw.decode("utf-8", errors="replace") == answer.choices[0].message.content
    assert len(entries) == answer.usage.completion_tokens
