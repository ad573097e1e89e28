"""What apps ask of the OpenAI API beyond text (issue 35), judged by the official ``openai``
client on a model litert-torch converted (``tiny``: tests/api/test_openai.py's, a character
vocabulary that holds JSON's characters): structured outputs validate against their schema
(``jsonschema``), a named tool call's arguments against the function's parameters,
``top_logprobs`` agree with the sampled token, ``n`` choices equal the reference greedy text,
and the errors are OpenAI's (its context-length words, its other paths, ``models.retrieve``)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.api.test_openai import (DEFAULT_CHAT, N, base, client, expected_text, lt_models,  # noqa: F401
                               reference, server)

openai = pytest.importorskip("openai", reason="the official OpenAI client (the test extra)")
jsonschema = pytest.importorskip("jsonschema", reason="validates the structured outputs (the test extra)")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "count", "ok"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}}}
# "chat" (tests/api/test_openai.py): tiny with a Hermes-style template short enough for its 128 positions
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "is it so?"}]


def json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_json_schema_outputs_validate(client: Any, seed: int | None) -> None:
    sampling = {"temperature": 0} if seed is None else {"temperature": 1.2, "seed": seed}
    answer = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60,
                                            response_format=json_format(SCHEMA), **sampling)
    text = answer.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert answer.choices[0].finish_reason == "stop"
    streamed = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=60, stream=True,
                                                   response_format=json_format(SCHEMA), **sampling))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_json_object_parses_and_a_completion_takes_a_schema_too(client: Any) -> None:
    for seed in (1, 2, 3, 4):
        answer = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=100, temperature=1.0,
                                                seed=seed, response_format={"type": "json_object"})
        choice = answer.choices[0]
        if choice.finish_reason == "stop":  # complete: an object
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # max_tokens first: the partial text, as vLLM answers
            assert choice.finish_reason == "length" and choice.message.content.startswith("{")
    whole = client.completions.create(model="tiny", prompt="x=", max_tokens=60, temperature=0,
                                      extra_body={"response_format": json_format(SCHEMA)})
    jsonschema.validate(json.loads(whole.choices[0].text), SCHEMA)


def test_a_schema_the_engine_cannot_take_is_a_400_naming_why(client: Any) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=ASK, response_format=json_format(bad))
    assert refused.value.param == "response_format" and "look-around" in refused.value.message


def test_a_named_tool_call_has_arguments_of_its_schema(client: Any) -> None:
    forced = {"type": "function", "function": {"name": "weather"}}
    answer = client.chat.completions.create(model="chat", messages=ASK, tools=TOOLS, tool_choice=forced,
                                            max_tokens=80, temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # streamed: the deltas add up to the same call
    chunks = list(client.chat.completions.create(model="chat", messages=ASK, tools=TOOLS, tool_choice=forced,
                                                 max_tokens=80, temperature=0, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "weather" and deltas[0].id
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # required: any of the tools, its arguments valid against its own parameters
    required = client.chat.completions.create(model="chat", messages=ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=80, temperature=1.0, seed=5)
    call = required.choices[0].message.tool_calls[0]
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_calls_and_results_go_back_through_the_template(client: Any) -> None:
    """The conversation after a call: the assistant's tool_calls and the tool's result are in
    the prompt (longer by exactly their rendering), not dropped."""
    call = {"id": "call_1", "type": "function", "function": {"name": "time", "arguments": "{\"zone\":\"UTC\"}"}}
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    with_calls = client.chat.completions.create(model="chat", messages=history, max_tokens=1)
    without = client.chat.completions.create(model="chat", messages=ASK, max_tokens=1)
    rendered = '<assistant><tool_call>{"name": "time", "arguments": {"zone": "UTC"}}</tool_call>\n<tool>12:00\n'
    assert with_calls.usage.prompt_tokens == without.usage.prompt_tokens + len(rendered)


def test_top_logprobs_agree_with_the_sampled_token(client: Any, reference: Any) -> None:
    answer = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=N, temperature=0,
                                            logprobs=True, top_logprobs=5)
    content = answer.choices[0].logprobs.content
    assert "".join(e.token for e in content) == answer.choices[0].message.content == \
        expected_text(reference, DEFAULT_CHAT.format(ASK[0]["content"]))
    for entry in content:  # greedy: the sampled token is the most likely one
        assert len(entry.top_logprobs) == 5 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                                 reverse=True)
    sampled = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=N, temperature=1.5, seed=3,
                                             logprobs=True, top_logprobs=20, stream=True)
    entries = [e for c in sampled if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == N and all(len(e.top_logprobs) == 20 for e in entries)
    for e in entries:  # a sampled token is in the top 20 with the same logprob, or below the 20th
        tops = {t.token: t.logprob for t in e.top_logprobs}
        assert tops.get(e.token, e.logprob) == e.logprob and (e.token in tops or e.logprob <= min(tops.values()))
    text = client.completions.create(model="tiny", prompt="the model ", max_tokens=6, temperature=0, logprobs=3)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.token_logprobs) == 6
    assert all(max(top, key=top.get) == token for token, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_n_choices_share_a_prefill_and_each_is_the_reference(client: Any, reference: Any) -> None:
    want = expected_text(reference, "the model ")
    whole = client.completions.create(model="tiny", prompt="the model ", max_tokens=N, temperature=0, n=2)
    assert [c.text for c in whole.choices] == [want, want] and [c.index for c in whole.choices] == [0, 1]
    assert whole.usage.completion_tokens == 2 * N
    streamed = list(client.chat.completions.create(model="tiny", messages=ASK, max_tokens=N, temperature=0, n=3,
                                                   stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in streamed if c.choices and c.choices[0].index == i)
             for i in range(3)]
    assert texts == [expected_text(reference, DEFAULT_CHAT.format(ASK[0]["content"]))] * 3
    sampled = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=1.5, n=4, seed=9)
    assert len({c.text for c in sampled.choices}) > 1  # each choice samples its own


def test_context_errors_are_in_openais_words_and_a_huge_prompt_is_refused_at_once(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny", prompt="x" * 200, max_tokens=1)
    assert long.value.code == "context_length_exceeded"
    assert "This model's maximum context length is 128 tokens. However, your prompt resulted in at least 200 tokens." \
        in long.value.message
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as huge:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "y" * 10_000_000}])
    assert huge.value.code == "context_length_exceeded" and "at least" in huge.value.message
    assert time.monotonic() - started < 15  # not tokenized whole (19.5 s before); generous for a loaded box


def test_other_openai_paths_and_model_retrieval_answer_in_openais_shape(client: Any, server: Any) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="tiny", input="hi")
    assert "not served by this server" in missing.value.message
    assert client.models.retrieve("tiny").id == "tiny" and client.models.retrieve("tiny:1").id == "tiny:1"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("nope")
    assert unknown.value.code == "model_not_found"
    # TF Serving's clients still get TF Serving's model status on the same path
    assert server.get("/v1/models/tiny").json()["model_version_status"][0]["state"] == "AVAILABLE"
    assert "error" in server.get("/v1/models/nope").json()
