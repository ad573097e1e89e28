"""The OpenAI-compatible API (appliance/api/openai.py), judged by the official ``openai``
Python client pointed at the real ``appliance serve``.

Models: ``tiny``, a model litert-torch converted (``tests/litert_llm.py``, ``lt_plain``)
given a character vocabulary here (``assets/vocab.json``: token i is ``chr(i)``, so any
ASCII text encodes); ``bundle``, a ``.litertlm`` bundle built in the test from the
transposed-cache conversion (``tests/test_litertlm.py``'s builder, a word-level tokenizer
where token i is the word ``t<i>``) with its own ``assets/chat_template.jinja``; ``mlp``,
a TFLite model that cannot generate. Answers are compared with the reference greedy
decoder on LiteRT's signature runners.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import requests

from tests import litert_llm

openai = pytest.importorskip("openai", reason="the official OpenAI client (the test extra)")
pytest.importorskip("litert_torch", reason="litert-torch converts the models (the test extra)")

N = 12
# what DEFAULT_CHAT_TEMPLATE (appliance/core/generation.py) makes of one user message
DEFAULT_CHAT = "<|user|>\n{}\n<|assistant|>\n"
BUNDLE_TEMPLATE = "{% for m in messages %}{{ m.content }}{% if not loop.last %} {% endif %}{% endfor %}"
WORDS = [5, 17, 42, 99, 3, 64, 8, 120, 77, 31]


@pytest.fixture(scope="module")
def lt_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return litert_llm.models(tmp_path_factory.mktemp("litert-llm-build"))


@pytest.fixture(scope="module")
def base(lt_models: Path, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("openai")
    tiny = root / "models" / "tiny" / "1"
    (tiny / "assets").mkdir(parents=True)
    shutil.copy(lt_models / "lt_plain" / "1" / "model.tflite", tiny / "model.tflite")
    (tiny / "assets" / "vocab.json").write_text(json.dumps([chr(i) for i in range(litert_llm.VOCAB)]))
    shutil.copytree(models_dir / "keras_mlp_tflite", root / "models" / "mlp")
    try:
        from tests.test_litertlm import bundle  # skips here without LiteRT-LM
    except BaseException:  # pytest's Skipped is no Exception
        return root / "models"
    version = bundle(lt_models, "lt_t", root / "build")
    target = root / "models" / "bundle" / "1"
    shutil.copytree(version, target)
    (target / "assets").mkdir()
    (target / "assets" / "chat_template.jinja").write_text(BUNDLE_TEMPLATE)
    return root / "models"


@pytest.fixture(scope="module")
def server(module_server: Any, base: Path) -> Any:
    return module_server("--models", str(base))


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(lt_models: Path) -> Any:
    decoders: dict[str, Any] = {}

    def greedy(model: str, prompt: list[int], n: int = N) -> list[int]:
        if model not in decoders:
            decoders[model] = litert_llm.Reference(lt_models / model / "1" / "model.tflite", litert_llm.SPECS[model])
        return decoders[model].greedy(prompt, n)  # type: ignore[no-any-return]

    return greedy


def expected_text(reference: Any, prompt: str, n: int = N) -> str:
    return "".join(chr(t) for t in reference("lt_plain", [ord(c) for c in prompt], n))


def needs_bundle(base: Path) -> None:
    if not (base / "bundle").exists():
        pytest.skip("LiteRT-LM's engine (litert-lm-api, the test extra) builds and runs the bundle")


# -- a converted model with a vocabulary -------------------------------------------------------
def test_a_streamed_chat_completion_is_the_reference_answer(client: Any, reference: Any) -> None:
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello there"}], stream=True, temperature=0,
        max_tokens=N, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text(reference, DEFAULT_CHAT.format("hello there"))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    prompt_tokens = len(DEFAULT_CHAT.format("hello there"))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt_tokens, N, prompt_tokens + N)


def test_a_chat_completion_without_streaming_has_usage(client: Any, reference: Any) -> None:
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            temperature=0, max_tokens=5)
    assert answer.object == "chat.completion" and answer.model == "tiny"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected_text(reference, DEFAULT_CHAT.format("hi"), 5)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 5 and answer.usage.prompt_tokens == len(DEFAULT_CHAT.format("hi"))
    assert answer.system_fingerprint == "tiny-v1"  # the version that answered


def test_a_completion_streamed_and_not(client: Any, reference: Any) -> None:
    want = expected_text(reference, "the model ")
    streamed = list(client.completions.create(model="tiny", prompt="the model ", max_tokens=N, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(model="tiny/versions/1", prompt="the model ", max_tokens=N, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text == want
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (10, N, 10 + N)


def test_stop_strings_cut_the_answer(client: Any, reference: Any) -> None:
    want = expected_text(reference, "the model ")
    stop = want[4:6]
    cut = want[:want.find(stop)]
    whole = client.completions.create(model="tiny", prompt="the model ", max_tokens=N, temperature=0,
                                      stop=[stop, "never-seen"])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == want.find(stop) + len(stop)  # the stop string's tokens count
    streamed = list(client.completions.create(model="tiny", prompt="the model ", max_tokens=N, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_seed_makes_sampling_reproducible(client: Any) -> None:
    def sample() -> str:
        return client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=0.9, top_p=0.95,
                                         seed=7).choices[0].text  # type: ignore[no-any-return]

    assert sample() == sample()


def test_errors_are_openais(client: Any, server: Any) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert missing.value.status_code == 404 and missing.value.code == "model_not_found"
    assert missing.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as two:
        client.completions.create(model="tiny", prompt="x", n=2)
    assert two.value.param == "n"
    with pytest.raises(openai.BadRequestError) as hot:
        client.completions.create(model="tiny", prompt="x", temperature=5)
    assert hot.value.param == "temperature" and hot.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as cannot:
        client.completions.create(model="mlp", prompt="x")
    assert cannot.value.param == "model"
    with pytest.raises(openai.BadRequestError) as penalty:
        client.completions.create(model="tiny", prompt="x", presence_penalty=1.5)
    assert penalty.value.param == "presence_penalty"
    r = server.post("/v1/chat/completions", b"{not json")
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = server.post("/v1/completions", {"model": "tiny", "prompt": "x" * 200, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert server.get("/v1/chat/completions").status_code == 405


def test_models_lists_what_generates_and_tf_serving_keeps_its_paths(client: Any, server: Any, base: Path) -> None:
    listed = client.models.list()
    ids = {m.id for m in listed.data}
    assert "tiny" in ids and "mlp" not in ids
    assert ("bundle" in ids) == (base / "bundle").exists()
    assert all(m.object == "model" and m.owned_by == "edge-appliance" for m in listed.data)
    status = server.get("/v1/models/tiny")
    assert status.status_code == 200
    assert status.json()["model_version_status"][0]["state"] == "AVAILABLE"
    assert server.get("/v1/models/mlp/metadata").json()["model_spec"]["name"] == "mlp"


# -- a LiteRT-LM bundle -------------------------------------------------------------------------
def words(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def test_a_bundle_streams_the_reference_answer(client: Any, reference: Any, base: Path) -> None:
    needs_bundle(base)
    from tests.test_litertlm import START

    want = reference("lt_t", [START, *WORDS], 10)
    prompt = " ".join(f"t{i}" for i in WORDS)
    chunks = list(client.completions.create(model="bundle", prompt=prompt, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert words("".join(c.choices[0].text for c in chunks if c.choices)) == want
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(WORDS) + 1  # LiteRT-LM's start token counts
    # chat through the version's own template: the messages' words joined by spaces
    chat = list(client.chat.completions.create(
        model="bundle", temperature=0, max_tokens=10, stream=True,
        messages=[{"role": "system", "content": " ".join(f"t{i}" for i in WORDS[:4])},
                  {"role": "user", "content": " ".join(f"t{i}" for i in WORDS[4:])}]))
    assert words("".join(c.choices[0].delta.content or "" for c in chat if c.choices)) == want
    whole = client.chat.completions.create(model="bundle", temperature=0, max_tokens=10,
                                           messages=[{"role": "user", "content": prompt}], stop=f"t{want[3]}")
    assert words(whole.choices[0].message.content) == want[:3] and whole.choices[0].finish_reason == "stop"


def test_a_bundle_answers_generate_with_text(server: Any, reference: Any, base: Path) -> None:
    needs_bundle(base)
    from tests.test_litertlm import START

    prompt = " ".join(f"t{i}" for i in WORDS)
    r = server.post("/v1/models/bundle:generate", {"text": prompt, "max_new_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert words(body["text"]) == reference("lt_t", [START, *WORDS], 6)
    assert body["tokens"] is None and body["completion_tokens"] == 6 and body["finish_reason"] == "length"
    with server.post("/v1/models/bundle:generate", {"text": prompt, "max_new_tokens": 3, "stream": True},
                     stream=True) as streamed:
        events = [line for line in streamed.iter_lines() if line.startswith(b"data: ")]
    pieces = [json.loads(e[6:]) for e in events[:-1]]
    assert all(p["token"] is None for p in pieces)
    assert words("".join(p["text"] for p in pieces)) == reference("lt_t", [START, *WORDS], 3)
    assert server.status()["models"]["bundle"]["versions"][0]["decision"]["chosen"] == "litertlm"
    r = requests.post(server.url + "/v1/models/bundle:generate", json={"text": prompt, "stop": [3]}, timeout=30)
    assert r.status_code == 400 and "stop" in r.json()["error"]
