"""The OpenAI-compatible API (appliance/api/openai.py), judged by the official ``openai``
Python client pointed at the real ``appliance serve``.

Models: ``tiny``, a model litert-torch converted (``tests/support/litert_llm.py``, ``lt_plain``)
given a character vocabulary here (``assets/vocab.json``: token i is ``chr(i)``, so any
ASCII text encodes), label ``stable`` -> 1; ``bundle``, a ``.litertlm`` bundle built in
the test from the transposed-cache conversion (``tests/runtimes/test_litertlm.py``'s builder, a
word-level tokenizer where token i is the word ``t<i>``) with its own
``assets/chat_template.jinja``; ``mlp``, a TFLite model that cannot generate. Answers are
compared with the reference greedy decoder on LiteRT's signature runners.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import requests

from tests.support import litert_llm
from tests.support.servers import model_copy
from tests.api.test_generate import StreamChain, gen_models  # noqa: F401  (the session fixture, for the swap test)

openai = pytest.importorskip("openai", reason="the official OpenAI client (the test extra)")
pytest.importorskip("litert_torch", reason="litert-torch converts the models (the test extra)")

N = 12
# what DEFAULT_CHAT_TEMPLATE (appliance/core/text.py) makes of one user message
DEFAULT_CHAT = "<|user|>\n{}\n<|assistant|>\n"
BUNDLE_TEMPLATE = "{% for m in messages %}{{ m.content }}{% if not loop.last %} {% endif %}{% endfor %}"
WORDS = [5, 17, 42, 99, 3, 64, 8, 120, 77, 31]
START = 1  # the bundle's start token (tests/runtimes/test_litertlm.py)
# A chat template in Hermes' tool-call convention, short enough for a 128-token context:
# the tools by name, the calls as <tool_call>{...}</tool_call>, results as "tool" messages.
TOOLS_TEMPLATE = ("{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ '\\n' }}{% endif %}"
                  "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
                  "<tool_call>{\"name\": {{ c.function.name | tojson }}, \"arguments\": "
                  "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}<assistant>")
BUNDLE_SKIP = "LiteRT-LM's engine (litert-lm-api, the test extra) builds and runs the bundle"


@pytest.fixture(scope="module")
def lt_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return litert_llm.models()


def make_bundle(lt_models: Path, build: Path, target: Path) -> bool:
    """The bundle version at ``target``; False where LiteRT-LM is not installed."""
    try:
        from tests.runtimes.test_litertlm import bundle  # skips (at import) without LiteRT-LM
    except BaseException:  # pytest's Skipped is no Exception
        return False
    version = bundle(lt_models, "lt_t", build)
    shutil.copytree(version, target)
    (target / "assets").mkdir()
    (target / "assets" / "chat_template.jinja").write_text(BUNDLE_TEMPLATE)
    return True


@pytest.fixture(scope="module")
def base(lt_models: Path, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("openai")
    tiny_version(lt_models, root / "models" / "tiny" / "1")
    chat = tiny_version(lt_models, root / "models" / "chat" / "1")  # tiny with a compact Hermes-style template
    (chat / "assets" / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    shutil.copytree(models_dir / "keras_mlp_tflite", root / "models" / "mlp")
    make_bundle(lt_models, root / "build", root / "models" / "bundle" / "1")
    return root / "models"


@pytest.fixture(scope="module")
def server(module_server: Any, base: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = tmp_path_factory.mktemp("openai-config") / "appliance.toml"
    models = "".join(f'[[models]]\nname = "{m.name}"\nbase_path = "{m}"\n' +
                     ('labels = { stable = 1 }\n' if m.name == "tiny" else "") for m in sorted(base.iterdir()))
    config.write_text(f"poll_interval_s = 0.2\n{models}")
    return module_server("--config", str(config))


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
        pytest.skip(BUNDLE_SKIP)


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
    assert {c.model for c in chunks} == {"tiny:1"}  # the version that answered
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    prompt_tokens = len(DEFAULT_CHAT.format("hello there"))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt_tokens, N, prompt_tokens + N)


def test_a_chat_completion_without_streaming_has_usage(client: Any, reference: Any) -> None:
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            temperature=0, max_tokens=5)
    assert answer.object == "chat.completion" and answer.model == "tiny:1"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == expected_text(reference, DEFAULT_CHAT.format("hi"), 5)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 5 and answer.usage.prompt_tokens == len(DEFAULT_CHAT.format("hi"))


def test_a_completion_streamed_and_not_by_every_model_id(client: Any, reference: Any) -> None:
    want = expected_text(reference, "the model ")
    streamed = list(client.completions.create(model="tiny", prompt="the model ", max_tokens=N, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "length"
    for model in ("tiny:1", "tiny:stable"):  # a version, a label
        whole = client.completions.create(model=model, prompt="the model ", max_tokens=N, temperature=0)
        assert whole.object == "text_completion" and whole.choices[0].text == want, model
        assert whole.model == "tiny:1"
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == \
            (10, N, 10 + N)


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
    def sample(seed: int) -> str:
        return client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=1.5, top_p=0.95,
                                         seed=seed).choices[0].text  # type: ignore[no-any-return]

    first = [sample(seed) for seed in (1, 2, 3, 4)]
    assert [sample(seed) for seed in (1, 2, 3, 4)] == first  # same seed, same text
    assert len(set(first)) > 1  # and the seed is what decides: these four seeds sample differently


def test_errors_are_openais(client: Any, server: Any) -> None:
    chat = [{"role": "user", "content": "x"}]
    for model in ("nope", "tiny:7", "tiny:nolabel"):  # no such model, version, label
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model=model, messages=chat)
        assert missing.value.code == "model_not_found" and missing.value.param == "model", model
        assert missing.value.type == "invalid_request_error"
    for kwargs, param in (({"n": 99}, "n"), ({"best_of": 3}, "best_of"), ({"logprobs": 9}, "logprobs"), ({"temperature": 5}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
                          ({"presence_penalty": 2.5}, "presence_penalty"), ({"model": "mlp"}, "model"),
                          ({"model": "tiny/versions/1"}, "model"), ({"stop": ["a"] * 5}, "stop"),
                          ({"prompt": ""}, "prompt"), ({"prompt": "\u00e9"}, "prompt")):
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(**{"model": "tiny", "prompt": "x", **kwargs})
        assert bad.value.param == param and bad.value.type == "invalid_request_error", kwargs
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="mlp", prompt="x")
    assert "cannot generate" in refused.value.message
    r = server.post("/v1/chat/completions", b"{not json")
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = server.post("/v1/completions", {"model": "tiny", "prompt": "x" * 200, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert server.get("/v1/chat/completions").status_code == 405
    # the service keeps serving after every refusal
    assert client.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=0).choices[0].text


def test_models_lists_what_generates_and_tf_serving_keeps_its_paths(client: Any, server: Any, base: Path) -> None:
    listed = client.models.list()
    ids = {m.id for m in listed.data}
    bundle = {"bundle", "bundle:1"} if (base / "bundle").exists() else set()
    assert ids == {"tiny", "tiny:1", "tiny:stable", "chat", "chat:1"} | bundle  # mlp cannot generate
    assert all(m.object == "model" and m.owned_by == "edge-appliance" and m.created > 0 for m in listed.data)
    assert requests.head(server.url + "/v1/models", timeout=30).status_code == 200
    # every TF Serving path stays TF Serving's: model status, metadata, a POST to /v1/models
    status = server.get("/v1/models/tiny")
    assert status.status_code == 200
    assert status.json()["model_version_status"][0]["state"] == "AVAILABLE"
    assert server.get("/v1/models/mlp/metadata").json()["model_spec"]["name"] == "mlp"
    assert server.post("/v1/models", b"{}").json()["error"].startswith("Malformed request")


def test_requests_are_counted_per_api(client: Any, server: Any) -> None:
    client.completions.create(model="tiny", prompt="a", max_tokens=1)
    metrics = server.get("/monitoring/prometheus/metrics").text
    for api in ("completions", "chat_completions"):
        assert f'API="{api}",entrypoint="REST",model_name="tiny",status="OK"' in metrics, api
    assert 'edge_appliance_generation_tokens_total{model_name="tiny"}' in metrics


def test_a_hot_swap_mid_stream_finishes_on_the_old_version(start_server: Any, gen_models: Path,  # noqa: F811
                                                            tmp_path: Path) -> None:
    """Streams of genmodel's slow model keep version 1 across the swap: each finishes on the
    version it started on, unbroken, and version 1 drains until its streams end. A stream's
    length against the new version's trial depends on the machine, so streams are chained
    until the swap is seen (tests/api/test_generate.py ``StreamChain``), each starting the next a
    quarter of the way in."""
    base = model_copy(gen_models, tmp_path, "gen_slow")
    srv = start_server("--models", str(base), "--poll-interval", "0.2")
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def stream(next_one: Callable[[], None]) -> list[Any]:
        chunks = []
        for chunk in c.completions.create(model="gen_slow", prompt="the model ", max_tokens=40, temperature=0,
                                          stream=True):
            chunks.append(chunk)
            if len(chunks) == 10:
                next_one()
        return chunks

    def versions() -> dict[int, str]:
        return {v["version"]: v["state"] for v in srv.status()["models"]["gen_slow"]["versions"]}

    def swapped() -> bool:
        if not chain.running():
            chain.start()
        now = versions()
        return now.get(2) == "AVAILABLE" and now.get(1) == "UNLOADING"  # held by one of our streams

    chain = StreamChain(stream)
    try:
        old = c.completions.create(model="gen_slow", prompt="the model ", max_tokens=40, temperature=0)
        chain.start()  # the first stream is under way before v2 appears
        shutil.copytree(gen_models / "gen_slow_v2" / "2", base / "gen_slow" / "2")  # a new version appears
        srv.wait_for(swapped, 120, "version 2 to serve while version 1 drains (held by a stream)")
        new = c.completions.create(model="gen_slow", prompt="the model ", max_tokens=5, temperature=0)
    finally:
        chain.stop(120)
        c.close()
    assert len(chain.results) == len(chain.threads)  # every stream answered
    assert all(len({ch.model for ch in chunks}) == 1 for chunks in chain.results)  # each on one version
    on_v1 = [chunks for chunks in chain.results if chunks[0].model == "gen_slow:1"]
    assert on_v1 and new.model == "gen_slow:2"
    for chunks in on_v1:
        assert "".join(ch.choices[0].text for ch in chunks) == old.choices[0].text  # unbroken, on version 1
    srv.wait_for(lambda: versions().get(1) == "END", 30, "version 1 to unload once its streams ended")


def tiny_version(lt_models: Path, version_dir: Path) -> Path:
    """lt_plain with the character vocabulary (the module docstring's ``tiny``)."""
    (version_dir / "assets").mkdir(parents=True)
    shutil.copy(lt_models / "lt_plain" / "1" / "model.tflite", version_dir / "model.tflite")
    (version_dir / "assets" / "vocab.json").write_text(json.dumps([chr(i) for i in range(litert_llm.VOCAB)]))
    return version_dir


def test_a_canary_rollout_is_decided_by_openai_traffic(start_server: Any, lt_models: Path, tmp_path: Path) -> None:
    """The judge counts streams' outcomes (Handle.report): OpenAI traffic alone promotes an
    equal candidate, and both versions answered while it was judged."""
    from tests.core.test_rollout import decisions, write_config

    base = tmp_path / "models"
    tiny_version(lt_models, base / "chat" / "1")
    config = write_config(tmp_path, base, {"chat": ("same", "canary")}, min_requests=10, p99_ratio=50.0)
    srv = start_server("--config", str(config))
    os.rename(tiny_version(lt_models, tmp_path / "stage"), base / "chat" / "2")  # as sync commits it
    srv.wait_for(lambda: srv.status()["models"]["chat"].get("candidate_version") == 2, 120,
                 "the candidate loaded next to version 1")
    answered: set[str] = set()
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        def decided() -> bool:
            answer = c.completions.create(model="chat", prompt="the model ", max_tokens=3, temperature=0)
            answered.add(answer.model)
            return "chat" in decisions(srv)

        srv.wait_for(decided, 120, "a rollout decision from OpenAI completions alone")
    decision = decisions(srv)["chat"]
    assert decision["action"] == "promote" and "all gates held" in decision["reason"], decision
    assert answered == {"chat:1", "chat:2"}
    srv.wait_for(lambda: srv.status()["models"]["chat"]["serving_version"] == 2, 30, "version 2 to serve")


# -- a LiteRT-LM bundle -------------------------------------------------------------------------
def words(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def test_a_bundle_streams_the_reference_answer(client: Any, reference: Any, base: Path) -> None:
    needs_bundle(base)
    want = reference("lt_t", [START, *WORDS], 10)
    prompt = " ".join(f"t{i}" for i in WORDS)
    chunks = list(client.completions.create(model="bundle", prompt=prompt, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert words("".join(c.choices[0].text for c in chunks if c.choices)) == want
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(WORDS) + 1  # LiteRT-LM's start token counts
    assert {c.model for c in chunks} == {"bundle:1"}
    # chat through the version's own template: the messages' words joined by spaces
    chat = list(client.chat.completions.create(
        model="bundle", temperature=0, max_tokens=10, stream=True,
        messages=[{"role": "system", "content": " ".join(f"t{i}" for i in WORDS[:4])},
                  {"role": "user", "content": " ".join(f"t{i}" for i in WORDS[4:])}]))
    assert words("".join(c.choices[0].delta.content or "" for c in chat if c.choices)) == want
    whole = client.chat.completions.create(model="bundle", temperature=0, max_tokens=10,
                                           messages=[{"role": "user", "content": prompt}], stop=f"t{want[3]}")
    assert words(whole.choices[0].message.content) == want[:3] and whole.choices[0].finish_reason == "stop"


def test_a_bundle_samples_reproducibly_with_a_seed(client: Any, base: Path) -> None:
    needs_bundle(base)
    prompt = " ".join(f"t{i}" for i in WORDS)

    def sample(seed: int) -> str:
        return client.completions.create(model="bundle", prompt=prompt, max_tokens=8, temperature=1.5,
                                         seed=seed).choices[0].text  # type: ignore[no-any-return]

    first = [sample(seed) for seed in (1, 2, 3, 4)]
    assert [sample(seed) for seed in (1, 2, 3, 4)] == first
    assert len(set(first)) > 1


def test_a_bundle_samples_afresh_without_a_seed_and_per_choice(client: Any, base: Path) -> None:
    """The engine's own default seed is fixed: temperature 1 gave the same text every time and
    n=4 four copies of one answer (issue 45)."""
    needs_bundle(base)
    prompt = " ".join(f"t{i}" for i in WORDS)
    kw: dict[str, Any] = {"model": "bundle", "prompt": prompt, "max_tokens": 8, "temperature": 1.5}
    unseeded = {client.completions.create(**kw).choices[0].text for _ in range(3)}
    assert len(unseeded) > 1
    choices = client.completions.create(n=4, seed=5, **kw).choices
    assert len({c.text for c in choices}) > 1
    with pytest.raises(openai.BadRequestError) as refused:  # a bundle samples by itself: no penalties
        client.completions.create(presence_penalty=0.5, **kw)
    assert refused.value.param == "presence_penalty"


def test_a_bundle_answers_generate_with_text(server: Any, reference: Any, base: Path) -> None:
    needs_bundle(base)
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
    assert json.loads(events[-1][6:])["finish_reason"] == "length"
    assert server.status()["models"]["bundle"]["versions"][0]["decision"]["chosen"] == "litertlm"
    r = server.post("/v1/models/bundle:generate", {"text": prompt, "stop": [3]})
    assert r.status_code == 400 and "stop" in r.json()["error"]


def test_a_new_bundle_version_swaps_in_and_the_old_one_unloads(server: Any, client: Any, base: Path) -> None:
    needs_bundle(base)
    prompt = " ".join(f"t{i}" for i in WORDS)
    before = client.completions.create(model="bundle", prompt=prompt, max_tokens=5, temperature=0)
    shutil.copytree(base / "bundle" / "1", base / "bundle" / "2")

    def versions() -> dict[int, str]:
        return {v["version"]: v["state"] for v in server.status()["models"]["bundle"]["versions"]}

    server.wait_for(lambda: versions().get(2) == "AVAILABLE" and versions().get(1) in (None, "END"), 120,
                    "bundle version 2 to serve and version 1 to unload")
    after = client.completions.create(model="bundle", prompt=prompt, max_tokens=5, temperature=0)
    assert (before.model, after.model) == ("bundle:1", "bundle:2")
    assert after.choices[0].text == before.choices[0].text  # the same bundle, the same answer
    assert {m.id for m in client.models.list().data} >= {"bundle", "bundle:2"}


def test_concurrent_requests_to_a_bundle_all_answer(client: Any, reference: Any, server: Any, base: Path) -> None:
    """LiteRT-LM's engine is not thread-safe: four streams and their tokenizing at once used to
    abort the whole service ("double free or corruption"); each now waits its turn."""
    needs_bundle(base)
    from concurrent.futures import ThreadPoolExecutor

    prompt = " ".join(f"t{i}" for i in WORDS)
    want = reference("lt_t", [START, *WORDS], 8)

    def ask(i: int) -> list[int]:
        if i % 2:
            chunks = client.completions.create(model="bundle", prompt=prompt, max_tokens=8, temperature=0, stream=True)
            return words("".join(c.choices[0].text for c in chunks))
        return words(client.completions.create(model="bundle", prompt=prompt, max_tokens=8,
                                               temperature=0).choices[0].text)

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, range(12)))
    assert answers == [want] * 12
    assert server.get("/healthz").status_code == 200
