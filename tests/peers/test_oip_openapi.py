"""Every answer of the v2 API, from the live service, against the Open Inference Protocol's own
OpenAPI file (kserve/open-inference-protocol ``specification/protocol/open_inference_rest.yaml``,
vendored unchanged in tests/peers/oip/ with its Apache-2.0 LICENSE).

Twelve answers: the health trio, model ready (with and without a version), server metadata,
model metadata (with and without a version), inference (with and without a version), and the
error bodies of a bad request, an unknown model's metadata and an unknown model's inference.

How an answer is judged (``judge``): the operation is found in the file by its path template
(the file writes a path parameter as ``${NAME}``; the version segment is optional, as the
protocol's ``inference_rest.md`` says); an answer whose status the operation declares is
validated, by jsonschema, against the schema the file declares for it; an error answer whose
status is not declared (404 for an unknown model: the protocol says "an HTTP error status
(typically 400)") against the operation's declared error schema, or, for model metadata, whose
operation declares none, the file's ``metadata_model_error_response``. The health answers are
declared with no body in the file; their bodies are those of ``inference_rest.md`` (below,
``HEALTH``): KServe's clients read them. Every answer is also checked to carry only fields the
schema names (the file's schemas allow others; a server's extra field is drift a client may
trip on), and every request sent is validated against ``inference_request`` first.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import requests
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

SPEC_PATH = Path(__file__).parent / "oip" / "open_inference_rest.yaml"
SPEC: dict[str, Any] = yaml.safe_load(SPEC_PATH.read_text())
SPEC_URI = "urn:oip:open_inference_rest.yaml"
REGISTRY = Registry().with_resource(SPEC_URI, Resource(contents=SPEC, specification=DRAFT7))
MODEL = "keras_mlp"
pytestmark = pytest.mark.timeout(900)  # above the module's server start and model load (300 s each)
X = [round(0.01 * i, 2) for i in range(64)]

# inference_rest.md's health objects ($live_server_response, $ready_server_response,
# $ready_model_response). The md writes the ready body as {"live": $bool}, a slip: KServe's server
# answers {"ready": ...} and its InferenceRESTClient.is_server_ready reads ["ready"].
HEALTH: dict[str, dict[str, Any]] = {
    "/v2/health/live": {"type": "object", "properties": {"live": {"type": "boolean"}}, "required": ["live"]},
    "/v2/health/ready": {"type": "object", "properties": {"ready": {"type": "boolean"}}, "required": ["ready"]},
    "/v2/models/${MODEL_NAME}/versions/${MODEL_VERSION}/ready": {
        "type": "object", "properties": {"name": {"type": "string"}, "ready": {"type": "boolean"}},
        "required": ["name", "ready"]},
}


def template_regex(template: str) -> re.Pattern[str]:
    """The file's path template as a regex: ``${NAME}`` one segment, the version segment optional."""
    pattern = re.escape(template.rstrip("/"))
    pattern = pattern.replace(re.escape("/versions/${MODEL_VERSION}"), "(?:/versions/[^/]+)?")
    pattern = re.sub(re.escape(re.escape("${")) + r"[A-Z_]+" + re.escape(re.escape("}")), "[^/]+", pattern)
    return re.compile(pattern + "/?")


def operation_for(path: str, method: str) -> tuple[str, dict[str, Any]]:
    matches = [(t, item[method]) for t, item in SPEC["paths"].items()
               if method in item and template_regex(t).fullmatch(path)]
    assert len(matches) == 1, f"{method.upper()} {path}: operations in the file that match: {[t for t, _ in matches]}"
    return matches[0]


def schema_ref(name: str) -> dict[str, Any]:
    return {"$ref": f"{SPEC_URI}#/components/schemas/{name}"}


def anchored(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema of the file, its ``#/...`` reference made absolute (resolved within the file)."""
    ref = schema.get("$ref", "")
    return {"$ref": SPEC_URI + ref} if ref.startswith("#") else dict(schema)


def response_schema(template: str, operation: dict[str, Any], status: int) -> dict[str, Any]:
    """The schema the file gives this answer (module docstring)."""
    responses = operation["responses"]
    declared = responses.get(str(status))
    if declared is not None and "content" in declared:
        return anchored(declared["content"]["application/json"]["schema"])
    if declared is not None:
        return HEALTH[template]
    assert 400 <= status < 500, f"status {status} is neither declared by the file nor an error status"
    if "400" in responses:
        return anchored(responses["400"]["content"]["application/json"]["schema"])
    return schema_ref("metadata_model_error_response")


def named_fields(schema: dict[str, Any]) -> set[str]:
    if "$ref" in schema:
        schema = REGISTRY.resolver().lookup(schema["$ref"]).contents
    return set(schema.get("properties", {}))


def judge(resp: requests.Response, path: str, method: str) -> dict[str, Any]:
    template, operation = operation_for(path, method)
    assert resp.headers["Content-Type"].split(";")[0] == "application/json", resp.headers
    body = resp.json()
    schema = response_schema(template, operation, resp.status_code)
    jsonschema.Draft7Validator(schema, registry=REGISTRY).validate(body)
    extra = set(body) - named_fields(schema)
    assert not extra, f"{method.upper()} {path} answered fields the protocol does not name: {sorted(extra)}"
    return dict(body)


def request_body(**extra: Any) -> dict[str, Any]:
    body = {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": X}], **extra}
    jsonschema.Draft7Validator(schema_ref("inference_request"), registry=REGISTRY).validate(body)
    return body


@pytest.fixture(scope="module")
def server(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    models = tmp_path_factory.mktemp("oip-models")
    shutil.copytree(models_dir / MODEL, models / MODEL)
    srv = module_server("--models", str(models), timeout=300)
    srv.wait_for(lambda: srv.get(f"/v2/models/{MODEL}/ready").status_code == 200, 300, f"{MODEL} ready")
    return srv


GETS = {
    "server live": ("/v2/health/live", 200, {"live": True}),
    "server ready": ("/v2/health/ready", 200, {"ready": True}),
    "model ready": (f"/v2/models/{MODEL}/versions/1/ready", 200, {"name": MODEL, "ready": True}),
    "model ready, no version": (f"/v2/models/{MODEL}/ready", 200, {"name": MODEL, "ready": True}),
    "server metadata": ("/v2", 200, {}),
    "model metadata": (f"/v2/models/{MODEL}/versions/1", 200, {"name": MODEL, "platform": "tensorflow_savedmodel"}),
    "model metadata, no version": (f"/v2/models/{MODEL}", 200, {"name": MODEL, "versions": ["1"]}),
    "model metadata error (unknown model)": ("/v2/models/no_such_model", 404, {}),
}


@pytest.mark.parametrize("name", list(GETS))
def test_get_answers_fit_the_protocol(server: Any, name: str) -> None:
    path, status, fields = GETS[name]
    resp = server.get(path)
    assert resp.status_code == status, f"{path}: {resp.status_code} {resp.text[:300]}"
    body = judge(resp, path, "get")
    assert {k: body[k] for k in fields} == fields, body


def test_inference_fits_the_protocol(server: Any) -> None:
    path = f"/v2/models/{MODEL}/versions/1/infer"
    resp = server.post(path, request_body(id="42", outputs=[{"name": "probs"}]))
    assert resp.status_code == 200, resp.text[:300]
    body = judge(resp, path, "post")
    assert (body["model_name"], body["id"], body["outputs"][0]["shape"]) == (MODEL, "42", [1, 10]), body


def test_inference_without_a_version_fits_the_protocol(server: Any) -> None:
    path = f"/v2/models/{MODEL}/infer"
    resp = server.post(path, request_body())
    assert resp.status_code == 200, resp.text[:300]
    assert judge(resp, path, "post")["model_version"] == "1"


def test_a_bad_request_answers_the_protocols_error_body(server: Any) -> None:
    path = f"/v2/models/{MODEL}/infer"
    body = request_body()
    body["inputs"][0]["datatype"] = "FP33"
    resp = server.post(path, body)
    assert resp.status_code == 400, resp.text[:300]
    assert "FP33" in judge(resp, path, "post")["error"]


def test_an_unknown_models_inference_answers_the_protocols_error_body(server: Any) -> None:
    path = "/v2/models/no_such_model/infer"
    resp = server.post(path, request_body())
    assert resp.status_code == 404, resp.text[:300]
    assert "no_such_model" in judge(resp, path, "post")["error"]


def test_the_judge_fails_an_answer_that_breaks_the_file() -> None:
    """The judge itself can fail: a metadata answer without ``extensions`` and a health body
    with a field the protocol does not name are both refused."""
    bad = requests.Response()
    bad.status_code, bad.headers["Content-Type"] = 200, "application/json"
    bad._content = b'{"name": "x", "version": "1"}'
    with pytest.raises(jsonschema.ValidationError, match="extensions"):
        judge(bad, "/v2", "get")
    bad._content = b'{"live": true, "uptime": 3}'
    with pytest.raises(AssertionError, match="uptime"):
        judge(bad, "/v2/health/live", "get")
