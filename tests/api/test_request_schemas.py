"""/openapi.json against the service it describes: every route the app mounts is described,
and every field a request body declares (appliance/api/schemas/) is taken by the live server,
each with a wrong type refused (a 400 naming it where the refusal is ours), and a field not
declared refused where the declaration says so (``additionalProperties: false``) and taken
where it does not (TF Serving and KServe v2 ignore unknown keys, as their servers do).

The wrong value of a field is the first of ``WRONG`` the served schema itself says is
invalid (jsonschema, with the served components), so the test follows the declarations."""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import jsonschema
import pytest
from flask import Flask

from appliance.api import openapi, schemas
from appliance.api.app import create_app, routes_of
from appliance.core.config import Config
from appliance.parts import sync_loop
from appliance.version import __version__
from tests.support.servers import ROOT

SPEC = openapi.spec(__version__)
ONE_MESSAGE = [{"role": "user", "content": "x"}]
SAMPLES = {"model": "m", "version": "1", "label": "l", "action": "promote"}  # path parameters
NOT_DESCRIBED = ("/static/<path:filename>", "/ui/static/<path:filename>")  # files of the page, no API
WRONG = ({"wrong": ["type"]}, "wrong-type", 12345, 0.5, True, [["wrong"]])
PREBUILT = ROOT / "scripts" / "tiny_chat"  # the README's tiny chat model: token-level, a chat template
# Its tokenizer.json (a "Fuse" decoder) is one llguidance cannot read yet, so response_format
# json and a forced tool call answer 500 with it: values that need no grammar here (the
# grammars are tests/api/test_openai_structured.py's, on a model whose tokenizer it reads).


# -- every route is described ------------------------------------------------------------------
@pytest.fixture
def app(tmp_path: Path) -> Iterator[Flask]:
    app = create_app(Config(state_dir=str(tmp_path / "state")))
    sync_loop._register_routes(SimpleNamespace(app=app), None, None)  # what attach() adds, without a bucket
    yield app
    app.extensions["appliance"].db.close()


def _operations() -> list[tuple[str, str]]:
    """(method, a concrete path) of every described operation."""
    out = []
    for path, item in SPEC["paths"].items():
        for name, value in SAMPLES.items():
            path = path.replace("{" + name + "}", value)
        out += [(method.upper(), path) for method in item if method in ("get", "post", "put", "delete")]
    return out


def test_every_flask_route_is_described_with_its_methods(app: Flask) -> None:
    for entry in routes_of(app).entries():
        if entry.kind != "route" or entry.path in NOT_DESCRIBED:
            continue
        path = entry.path.replace("<", "{").replace(">", "}")
        assert path in SPEC["paths"], f"{entry.path} is mounted but not in /openapi.json"
        described = {m.upper() for m in SPEC["paths"][path]}
        assert set(entry.methods) - {"HEAD"} <= described, (entry.path, entry.methods)


def test_every_mount_answers_a_described_operation(app: Flask) -> None:
    operations = _operations()
    for mount in routes_of(app).mounts:
        assert any(mount.matches(method, path) for method, path in operations), \
            f"mount {mount.name} ({mount.prefix}*{mount.suffix}) answers nothing /openapi.json describes"


def test_declared_components_do_not_shadow_the_written_ones() -> None:
    declared = schemas.components(openapi.DECLARED)
    assert not set(declared) & set(openapi.SCHEMAS)
    for kind in openapi.DECLARED:
        assert SPEC["components"]["schemas"][kind.__name__] == declared[kind.__name__]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": ONE_MESSAGE}, "model", "field 'model' is required and must be the name of a model"),
    ({"model": "m", "messages": ONE_MESSAGE, "n": 9}, "n", "field 'n' must be an integer from 1 to 8 (Expected `int`"),
    ({"model": "m", "messages": [{"content": "x"}]}, "messages", "missing required field `role` - at `$.messages[0]`"),
    ({"model": "m", "messages": [{"role": "u", "content": [{"type": "image_url"}]}]}, "messages", "text only"),
    ({"model": "m", "messages": ONE_MESSAGE, "stream_options": {"x": 1}}, "stream_options", "takes only include_usage"),
    ({"model": "m", "messages": ONE_MESSAGE, "logit_bias": {"x": 1}}, "logit_bias", "token ids to biases"),
    ({"model": "m", "messages": ONE_MESSAGE, "best_of": 2}, "best_of", "compare their logprobs"),
    ({"model": "m", "messages": ONE_MESSAGE, "top_k": 1.5}, "top_k", "got `float`"),
    ({"model": "m", "messages": ONE_MESSAGE, "frequency_penalty": "1"}, "frequency_penalty", "got `str`"),
    ({"model": "m", "messages": ONE_MESSAGE, "stream": 1}, "stream", "must be true or false"),
    ({"model": "m", "messages": ONE_MESSAGE, "nope": 1}, "nope", "Unrecognized request argument supplied: nope"),
])
def test_a_refusal_names_the_field_and_says_what_it_must_be(body: dict[str, Any], param: str, words: str) -> None:
    from appliance.api.schemas.openai import ChatRequest

    with pytest.raises(schemas.FieldError) as refused:
        schemas.check(body, ChatRequest, lambda key: f"Unrecognized request argument supplied: {key}")
    assert refused.value.param == param and words in refused.value.message, refused.value.message


# -- every declared field is taken, a wrong type refused ---------------------------------------
MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}, "strict": False}}
SAMPLING = {"max_tokens": 2, "temperature": 0.5, "top_p": 0.9, "stop": ["zz"], "seed": 3, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}, "user": "u", "response_format": {"type": "text"},
            "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"5": 1.5}, "top_k": 5, "min_p": 0.1,
            "repetition_penalty": 1.1, "echo": False, "best_of": 1, "suffix": "", "store": False, "metadata": {},
            "service_tier": "auto"}
# one body per API: its path, the base body, a valid value of every declared field, the
# fields a value needs beside it, and the statuses that mean "taken" (404: the body passed
# its checks and the model was looked up)
CASES: dict[str, dict[str, Any]] = {
    "ChatRequest": {"path": "/v1/chat/completions",
                    "base": {"model": "chat", "messages": MESSAGES, "max_tokens": 2},
                    "values": {**SAMPLING, "model": "chat:1", "messages": [
                        {"role": "system", "content": [{"type": "text", "text": "b"}]},
                        {"role": "user", "content": "w", "name": "a"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                        {"role": "tool", "content": "s", "tool_call_id": "c"}],
                        "max_completion_tokens": 2, "logprobs": True, "top_logprobs": 2, "tools": [TOOL],
                        "tool_choice": "auto", "parallel_tool_calls": True},
                    "needs": {"top_logprobs": {"logprobs": True}, "tool_choice": {"tools": [TOOL]}},
                    "taken": (200,)},
    "CompletionRequest": {"path": "/v1/completions", "base": {"model": "chat", "prompt": "hi", "max_tokens": 2},
                          "values": {**SAMPLING, "model": "chat:1", "prompt": ["hello"], "logprobs": 2},
                          "needs": {}, "taken": (200,)},
    "EmbeddingRequest": {"path": "/v1/embeddings", "base": {"model": "no-encoder", "input": "hi"},
                         "values": {"model": "other", "input": ["a", "b"], "encoding_format": "base64",
                                    "dimensions": 8, "user": "u"}, "needs": {}, "taken": (404,)},
    "GenerateRequest": {"path": "/v1/models/chat:generate", "base": {"input_ids": [5, 6], "max_new_tokens": 2},
                        "values": {"input_ids": [7], "text": "hi", "max_new_tokens": 1, "temperature": 0.5,
                                   "top_k": 3, "top_p": 0.9, "seed": 1, "stop": [9], "stream": True},
                        "needs": {}, "drop": {"text": "input_ids"}, "taken": (200,)},
    "PredictRequest": {"path": "/v1/models/half_plus_two:predict", "base": {"instances": [1.0, 2.0]},
                       "values": {"signature_name": "serving_default", "instances": [3.0],
                                  "inputs": {"x": [1.0]}}, "needs": {}, "drop": {"inputs": "instances"},
                       "taken": (200,)},
    "ExamplesRequest": {"path": "/v1/models/half_plus_two:regress",
                        "base": {"signature_name": "regress_x_to_y", "examples": [{"x": 2.0}]},
                        "values": {"signature_name": "regress_x_to_y", "examples": [{"x": 1.0}],
                                   "context": {"x2": 3.0}}, "needs": {}, "taken": (200,)},
}


@pytest.fixture(scope="module")
def server(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    models = tmp_path_factory.mktemp("schema-models")
    shutil.copytree(PREBUILT, models / "chat" / "1")
    config = tmp_path_factory.mktemp("schema-config") / "appliance.toml"
    entries = [("chat", models / "chat"), ("half_plus_two", models_dir / "half_plus_two"),
               ("keras_mlp_tflite", models_dir / "keras_mlp_tflite")]
    config.write_text("[discovery]\nenabled = false\n" + "".join(
        f'[[models]]\nname = "{name}"\nbase_path = "{path}"\n' for name, path in entries))
    return module_server("--config", str(config), timeout=180)


def _schema(name: str) -> dict[str, Any]:
    return SPEC["components"]["schemas"][name]  # type: ignore[no-any-return]  # the spec is JSON


def _valid(name: str, body: dict[str, Any]) -> bool:
    root = {"$ref": schemas.REF.format(name=name), "components": SPEC["components"]}
    return jsonschema.Draft202012Validator(root).is_valid(body)


def _wrong(name: str, body: dict[str, Any], field: str) -> Any:
    """The first of WRONG the served schema refuses for ``field`` (None: it takes them all)."""
    return next((w for w in WRONG if not _valid(name, {**body, field: w})), None)


def _infer_case(server: Any) -> dict[str, Any]:
    output = server.get("/v2/models/keras_mlp_tflite").json()["outputs"][0]["name"]
    x = {"name": "x", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}
    return {"path": "/v2/models/keras_mlp_tflite/infer", "base": {"inputs": [x]},
            "values": {"inputs": [{**x, "parameters": {}}], "id": "r1", "parameters": {"binary_data_output": False},
                       "outputs": [{"name": output, "parameters": {"binary_data": False}}]},
            "needs": {}, "taken": (200,)}


def _post(server: Any, case: dict[str, Any], body: dict[str, Any]) -> Any:
    return server.post(case["path"], body, headers={"Content-Type": "application/json"}, timeout=120)


def _named(answer: Any, field: str) -> bool:
    error = answer.json()["error"]
    return error.get("param") == field if isinstance(error, dict) else f"'{field}'" in error


def _answer_is_described(case: dict[str, Any], answer: Any) -> None:
    """A JSON answer is valid against the schema /openapi.json gives it (the declared answers)."""
    if not answer.headers.get("Content-Type", "").startswith("application/json"):
        return  # server-sent events: described as text
    template = next(t for t in SPEC["paths"] if re.fullmatch(re.sub(r"\{\w+\}", "[^/:]+", t), case["path"]))
    responses = SPEC["paths"][template]["post"]["responses"]
    schema = responses[str(answer.status_code)]["content"]["application/json"]["schema"]
    root = {**schema, "components": SPEC["components"]}
    jsonschema.validate(answer.json(), root, cls=jsonschema.Draft202012Validator)


@pytest.mark.parametrize("name", [*CASES, "InferRequest"])
def test_every_declared_field_is_taken_and_a_wrong_type_refused(server: Any, name: str) -> None:
    case = CASES[name] if name != "InferRequest" else _infer_case(server)
    declared = set(_schema(name)["properties"])
    assert set(case["values"]) == declared, f"{name}: a value for each declared field ({declared})"
    for field, value in case["values"].items():
        body = {**copy.deepcopy(case["base"]), **case["needs"].get(field, {}), field: value}
        body.pop(case.get("drop", {}).get(field, ""), None)
        assert _valid(name, body), (name, field, body)
        taken = _post(server, case, body)
        assert taken.status_code in case["taken"], (name, field, taken.status_code, taken.text[:400])
        _answer_is_described(case, taken)
        wrong = _wrong(name, body, field)
        if wrong is None:  # declared as any JSON value (a tensor's data, TF Serving's inputs)
            continue
        refused = _post(server, case, {**body, field: wrong})
        assert refused.status_code == 400, (name, field, wrong, refused.status_code, refused.text[:400])
        if not name.endswith(("PredictRequest", "ExamplesRequest")):  # TF Serving's own words name no field
            assert _named(refused, field), (name, field, refused.text[:400])


@pytest.mark.parametrize("name", [*CASES, "InferRequest"])
def test_an_undeclared_field_is_refused_where_the_schema_says_so(server: Any, name: str) -> None:
    case = CASES[name] if name != "InferRequest" else _infer_case(server)
    closed = _schema(name).get("additionalProperties") is False
    answer = _post(server, case, {**case["base"], "not_a_declared_field": 1})
    assert closed == (answer.status_code == 400), (name, answer.status_code, answer.text[:300])
    if closed:
        assert _named(answer, "not_a_declared_field"), answer.text
    else:
        assert answer.status_code in case["taken"], answer.text[:300]
    assert server.get("/healthz").status_code == 200  # and the service keeps serving
