"""TF Serving's REST API (``/v1/models/...``), as tensorflow_serving's HTTP handler answers it.

URL grammar, error texts and status codes follow TF Serving's ``http_rest_api_handler.cc``:
a path under ``/v1/`` that matches neither grammar is ``400 Malformed request: <METHOD> <path>``;
an unknown model or version is ``404 Servable not found for request: ...``; an unknown
signature or label is 400 (INVALID_ARGUMENT in TF Serving). Every error body is
``{"error": "..."}``. The hot path is JSON decode -> numpy -> batcher -> numpy -> JSON.
Bodies may be gzip (appliance/api/body.py); ``[limits]`` bound their nesting, values and
rows (appliance/api/tfserving/json_format.py), each refusal a 400 that names the limit.
"""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Awaitable, Callable
from urllib.parse import unquote

import numpy as np

from runtimes import DEFAULT_SIGNATURE, SignatureInfo, TensorSpec

from appliance.api.body import read_body, route_key
from appliance.api.json_arrays import Parsed, ParsedObject
from appliance.api.errors import render_error, status_line
from appliance.api.family import Answer, AsyncFamily
from appliance.api.mounts import INFERENCE, Mount, raw_path
from appliance.api.tfserving import json_format as tfs_json
from appliance.api.tfserving.json_tensor_errors import format_error
from appliance.protos.tfserving import wire as pw
from appliance.api.tfserving import service
from appliance.api.tfserving.service import classification_outputs, regression_values
from appliance.core.config import LimitsConfig
from appliance.core.errors import ApplianceError, InvalidArgument, NotFound, Unavailable
from appliance.core.json_types import JSONObject
from appliance.core.request_context import NO_CONTEXT, RequestContext, of_environ
from appliance.core.seams import HandleSource, ModelStates, RouteKey, ServingCore

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

    from appliance.core.appliance import Appliance

POST_RE = re.compile(r"(?i)/v1/models/([^/:]+)(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?:(classify|regress|predict)")
GET_RE = re.compile(r"(?i)/v1/models(?:/([^/:]+))?(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?(?:/(metadata))?")
JSON = "application/json"


class V1API(AsyncFamily):
    """The ``/v1`` mount (appliance/api/routes.py): TF Serving's REST API.

    The inference path is the hot path: skipping Flask's request context, routing and
    response objects halves the Python work per request. ``answer`` is the whole API
    (appliance/api/family.py): (method, raw path, body) -> (status, JSON bytes, headers);
    errors are appliance/api/errors.py ``render_error``'s. ``states`` answers model status
    (the serving process's manager; a front worker forwards those requests and has none).
    """

    def __init__(self, core: ServingCore, states: ModelStates | None = None):
        self.core, self.states = core, states

    async def answer(self, environ: WSGIEnvironment) -> Answer:
        status, body, headers = await self._respond(environ)
        return status_line(status), headers or [("Content-Type", JSON), ("Content-Length", str(len(body)))], body

    async def _respond(self, environ: WSGIEnvironment) -> tuple[int, bytes, list[tuple[str, str]]]:
        method = environ.get("REQUEST_METHOD", "GET")
        path = raw_path(environ)
        verb, name, started = "", "", time.perf_counter()
        try:
            if method == "POST":
                match = POST_RE.fullmatch(path)
                if match is None or match.group(4) not in VERBS:
                    raise InvalidArgument(f"Malformed request: {method} {path}")
                verb, name = match.group(4), match.group(1)
                model, version, label = _parse(match)
                name = model
                raw = read_body(environ, self.core.config.server.max_body_bytes)
                limits = self.core.config.limits
                body = await VERBS[verb](self.core.handles, _parse_object(raw, limits), model, version, label,
                                         raw, limits, route_key(environ), of_environ(environ))
                self.core.metrics.observe_request(name, verb, 200, time.perf_counter() - started)
                return 200, body, []
            match = GET_RE.fullmatch(path) if method == "GET" else None
            if match is None:
                raise InvalidArgument(f"Malformed request: {method} {path}")
            model, version, label = _parse(match)
            if match.group(4) == "metadata":
                return 200, await _metadata(self.core.handles, model, version, label), []
            return 200, _status(self._states(), model, version, label), []
        except Exception as exc:  # every failure becomes {"error": ...}; never a stack trace
            status, headers, body = render_error(exc, "the TF Serving REST API")
            if verb:  # counted under the error's canonical code, as TF Serving labels it
                code = exc.grpc_code if isinstance(exc, ApplianceError) else status
                self.core.metrics.observe_request(name, verb, code, time.perf_counter() - started)
            return status, body, headers

    def _states(self) -> ModelStates:
        if self.states is None:  # a front worker: model status is the serving process's to answer
            raise Unavailable("model status is answered by the serving process")
        return self.states


def mounts(core: "Appliance") -> list[Mount]:
    """TF Serving's ``/v1``, as its dispatcher takes it: every path under ``/v1/`` (raw)."""
    return [Mount("tfserving", "/v1/", INFERENCE, V1API(core, core.states), summary="TF Serving REST API")]


def _parse(match: re.Match[str]) -> tuple[str, int | None, str | None]:
    name, version, label = match.group(1), match.group(2), match.group(3)
    if not name:
        raise InvalidArgument("Missing model name in request.")
    parsed_version = None
    if version is not None:
        parsed_version = int(version)
        if parsed_version >= 1 << 63:
            raise InvalidArgument(f"Failed to convert version: {version} to numeric.")
    return unquote(name), parsed_version, unquote(label) if label is not None else None


# --- GET ----------------------------------------------------------------------------------
def _status(states: ModelStates, name: str, version: int | None, label: str | None) -> bytes:
    slots = states.version_states(name, version, label)
    if not slots:
        raise NotFound(f"Could not find any versions of model {name}")
    statuses = [{
        "version": str(s.version),
        "state": s.state.value,
        "status": {"error_code": (s.error_code or "UNKNOWN") if s.error else "OK", "error_message": s.error},
    } for s in slots]
    return tfs_json.dumps({"model_version_status": statuses})


def _tensor_info(spec: TensorSpec) -> JSONObject:
    enum = pw.ENUM_OF.get(spec.dtype, 0)
    shape: JSONObject = ({"dim": [], "unknown_rank": True} if spec.shape is None else
             {"dim": [{"size": str(d), "name": ""} for d in spec.shape], "unknown_rank": False})
    return {"dtype": pw.DTYPE_NAMES.get(enum, "DT_INVALID"), "tensor_shape": shape, "name": spec.tensor_name or spec.name}


def signature_def_json(sig: SignatureInfo) -> JSONObject:
    inputs: JSONObject = {k: _tensor_info(v) for k, v in sig.inputs.items()}
    outputs: JSONObject = {k: _tensor_info(v) for k, v in sig.outputs.items()}
    return {
        "inputs": inputs,
        "outputs": outputs,
        "method_name": sig.method_name,
        "defaults": {},
    }


async def _metadata(handles: HandleSource, name: str, version: int | None, label: str | None) -> bytes:
    with await handles.handle(name, version, label) as handle:
        sigs = {k: signature_def_json(v) for k, v in handle.signatures.items()}
        body = {
            "model_spec": {"name": name, "signature_name": "", "version": str(handle.version)},
            "metadata": {"signature_def": {"signature_def": sigs}},
        }
    return tfs_json.dumps(body)


# --- POST ---------------------------------------------------------------------------------
def _parse_object(data: bytes, limits: LimitsConfig) -> ParsedObject:
    body = tfs_json.loads(data, limits)
    if not isinstance(body, dict):
        raise InvalidArgument(format_error(tfs_json.as_lists(body), "Is not object"))  # util/json_tensor.cc ParseJson
    return body


def _signature_name(body: ParsedObject) -> str:
    name = body.get("signature_name", "")
    if not isinstance(name, str):  # util/json_tensor.cc FormatSignatureError
        raise InvalidArgument(format_error(tfs_json.as_lists(body), "not formatted correctly. 'signature_name' key must be a string "
                                                 "value."))
    return name or DEFAULT_SIGNATURE


async def _predict(handles: HandleSource, body: ParsedObject, name: str, version: int | None, label: str | None,
                   raw: bytes | None = None, limits: LimitsConfig = tfs_json.DEFAULT_LIMITS,
                   route_key: RouteKey | None = None, context: RequestContext = NO_CONTEXT) -> bytes:
    signature_name = _signature_name(body)
    with await handles.handle(name, version, label, route_key) as handle:
        signature = handle.signature(signature_name, f'Serving signature name: "{signature_name}" not found in signature def')
        inputs, row_format = tfs_json.decode_predict(body, signature, raw, limits)
        outputs = await handle.run(signature.name, inputs, context)
    return tfs_json.encode_predict(outputs, row_format)


def _examples(body: ParsedObject, method: str, limits: LimitsConfig) -> np.ndarray:
    examples = body.get("examples")
    if examples is None:
        raise InvalidArgument(f"JSON Value: When method is {method}, key 'examples' is expected and was not found")
    if not isinstance(examples, list):
        raise InvalidArgument("JSON Value: Expecting 'examples' value to be an list/array")
    if not examples:
        raise InvalidArgument("JSON Value: 'examples' value is an empty array")
    tfs_json.check_rows(len(examples), "examples", limits)
    context = body.get("context")
    objects: list[ParsedObject] = []
    for item in [context] * (context is not None) + examples:
        if not isinstance(item, dict):
            raise InvalidArgument(f"Example must be JSON object but got JSON {type(item).__name__}")
        objects.append(item)
    if context is not None:
        context_object, *rows = objects
    else:
        context_object, rows = None, objects
    try:
        ctx = pw.encode_example(_decode_features(context_object)) if context_object is not None else b""
        serialized = [ctx + pw.encode_example(_decode_features(e)) for e in rows]
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    return np.array(serialized, dtype=object)


def _decode_features(example: ParsedObject) -> dict[str, list[object]]:
    out = {}
    for key, value in example.items():
        if isinstance(value, np.ndarray):  # a big numeric feature (json_arrays.py): its values
            value = value.ravel().tolist()
        values = value if isinstance(value, list) else [value]
        decoded: list[object] = []
        for v in values:
            if isinstance(v, dict) and set(v) == {"b64"}:
                decoded.append(tfs_json.b64_decode(v, f"feature {key}"))
                continue
            if v is None or isinstance(v, (dict, list)):
                raise ValueError(f"Feature: {key} has element with unexpected JSON type: {type(v).__name__}")
            decoded.append(v)
        out[key] = decoded
    return out


async def _classify_regress(handles: HandleSource, body: ParsedObject, name: str, version: int | None,
                            label: str | None, method: str, limits: LimitsConfig, route_key: RouteKey | None,
                            context: RequestContext) -> bytes:
    signature_name = _signature_name(body)
    serialized = _examples(body, method, limits)
    _, signature, outputs = await service.run_examples(handles, serialized, name, version, label,
                                                       signature_name, method, route_key, context)
    return tfs_json.dumps({"results": _results(method, signature, outputs, len(serialized))})


def _results(method: str, signature: SignatureInfo, outputs: dict[str, np.ndarray], n: int) -> object:
    if method == "regress":  # NaN and infinities as TF Serving writes them (its REST doc, "JSON conformance")
        return tfs_json.numbers_json(regression_values(signature, outputs, n))
    classes, scores, ref = classification_outputs(outputs, n)
    results = []
    for i in range(n):
        row = []
        for j in range(ref.shape[1]):
            text = classes[i, j] if classes is not None else b""
            label = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
            score = float(scores[i, j]) if scores is not None else 0.0
            row.append([label, score if np.isfinite(score) else tfs_json.numbers_json(np.array(score))])
        results.append(row)
    return results


VERBS: dict[str, Callable[..., Awaitable[bytes]]] = {
    "predict": _predict,
    "classify": lambda m, body, n, v, l, raw, limits, key, context: _classify_regress(m, body, n, v, l, "classify",
                                                                                    limits, key, context),
    "regress": lambda m, body, n, v, l, raw, limits, key, context: _classify_regress(m, body, n, v, l, "regress",
                                                                                   limits, key, context),
}
