"""TF Serving's REST API (``/v1/models/...``), as tensorflow_serving's HTTP handler answers it.

URL grammar, error texts and status codes follow TF Serving's ``http_rest_api_handler.cc``:
a path under ``/v1/`` that matches neither grammar is ``400 Malformed request: <METHOD> <path>``;
an unknown model or version is ``404 Servable not found for request: ...``; an unknown
signature or label is 400 (INVALID_ARGUMENT in TF Serving). Every error body is
``{"error": "..."}``. The hot path is JSON decode -> numpy -> batcher -> numpy -> JSON.
"""

from __future__ import annotations

import importlib.util
import re
import time
from typing import Any, Callable
from urllib.parse import unquote

import numpy as np
from flask import Blueprint, Response, current_app, request

from runtimes import DEFAULT_SIGNATURE, SignatureInfo

from . import protowire as pw
from . import tfs_json
from .errors import ApplianceError, InvalidArgument, NotFound, PayloadTooLarge, Unimplemented
from .manager import VersionSlot, run_signature

POST_RE = re.compile(r"(?i)/v1/models/([^/:]+)(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?:(classify|regress|predict)")
GET_RE = re.compile(r"(?i)/v1/models(?:/([^/:]+))?(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?(?:/(metadata))?")
CLASSIFY_METHOD = "tensorflow/serving/classify"
REGRESS_METHOD = "tensorflow/serving/regress"
JSON = "application/json"

bp = Blueprint("tfserving", __name__)


def json_response(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(body, status=status, mimetype=JSON, headers=headers)


def error_response(exc: ApplianceError) -> Response:
    headers = {"Retry-After": str(int(exc.retry_after))} if exc.retry_after else None
    return json_response(tfs_json.dumps({"error": exc.message}), exc.http_status, headers)


def _appliance() -> Any:
    return current_app.extensions["appliance"]


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


def _raw_path() -> str:
    """The path as TF Serving matches it: undecoded, with the query string attached."""
    raw = request.environ.get("RAW_URI") or request.environ.get("REQUEST_URI")
    if raw:
        return raw
    query = request.query_string.decode("latin-1")
    return request.path + (f"?{query}" if query else "")


@bp.route("/v1/", defaults={"rest": ""}, methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"])
@bp.route("/v1/<path:rest>", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"])
def v1(rest: str) -> Response:
    path = _raw_path()
    malformed = InvalidArgument(f"Malformed request: {request.method} {path}")
    if request.method == "POST":
        match = POST_RE.fullmatch(path)
        if match is None or match.group(4) not in ("predict", "classify", "regress"):
            raise malformed
        return _inference(match)
    if request.method == "GET":
        match = GET_RE.fullmatch(path)
        if match is None:
            raise malformed
        name, version, label = _parse(match)
        if match.group(4) == "metadata":
            return _metadata(name, version, label)
        return _status(name, version, label)
    raise malformed


# --- GET ----------------------------------------------------------------------------------
def _status(name: str, version: int | None, label: str | None) -> Response:
    manager = _appliance().manager
    try:
        slots = manager.version_states(name, version, label)
    except NotFound as exc:
        if "label" in exc.message:
            raise InvalidArgument(exc.message) from exc
        raise
    if not slots:
        raise NotFound(f"Could not find any versions of model {name}")
    statuses = [{
        "version": str(s.version),
        "state": s.state.value,
        "status": {"error_code": "UNKNOWN" if s.error else "OK", "error_message": s.error},
    } for s in slots]
    return json_response(tfs_json.dumps({"model_version_status": statuses}))


def _tensor_info(spec: Any) -> dict[str, Any]:
    enum = pw.ENUM_OF.get(spec.dtype, 0)
    shape = ({"dim": [], "unknown_rank": True} if spec.shape is None else
             {"dim": [{"size": str(d), "name": ""} for d in spec.shape], "unknown_rank": False})
    return {"dtype": pw.DTYPE_NAMES.get(enum, "DT_INVALID"), "tensor_shape": shape, "name": spec.tensor_name or spec.name}


def signature_def_json(sig: SignatureInfo) -> dict[str, Any]:
    return {
        "inputs": {k: _tensor_info(v) for k, v in sig.inputs.items()},
        "outputs": {k: _tensor_info(v) for k, v in sig.outputs.items()},
        "method_name": sig.method_name,
        "defaults": {},
    }


def _metadata(name: str, version: int | None, label: str | None) -> Response:
    with _handle(name, version, label) as slot:
        sigs = {k: signature_def_json(v) for k, v in slot.servable.signatures.items()}
        body = {
            "model_spec": {"name": name, "signature_name": "", "version": str(slot.version)},
            "metadata": {"signature_def": {"signature_def": sigs}},
        }
    return json_response(tfs_json.dumps(body))


def _handle(name: str, version: int | None, label: str | None) -> Any:
    try:
        return _appliance().manager.handle(name, version, label)
    except NotFound as exc:
        if exc.message.startswith("Unrecognized servable version label"):
            raise InvalidArgument(exc.message) from exc
        raise


# --- POST ---------------------------------------------------------------------------------
def _read_json() -> Any:
    limit = _appliance().config.server.max_body_bytes
    length = request.content_length
    if length is not None and length > limit:
        raise PayloadTooLarge(f"request body of {length} bytes is over the limit of {limit} bytes (server.max_body_bytes)")
    body = tfs_json.loads(request.get_data(cache=False))
    if not isinstance(body, dict):
        raise InvalidArgument("JSON Value: the request body Is not object")
    return body


def _inference(match: re.Match[str]) -> Response:
    started = time.perf_counter()
    app = _appliance()
    verb = match.group(4)
    name = match.group(1)
    status = 500
    try:
        model, version, label = _parse(match)
        name = model
        body = _read_json()
        response = VERBS[verb](body, model, version, label)
        status = 200
        return response
    except ApplianceError as exc:
        status = exc.http_status
        raise
    finally:
        app.metrics.observe_request(name, verb, status, time.perf_counter() - started)


def _signature_name(body: dict[str, Any]) -> str:
    name = body.get("signature_name", "")
    if not isinstance(name, str):
        raise InvalidArgument("JSON Value: not formatted correctly. 'signature_name' key must be a string value.")
    return name or DEFAULT_SIGNATURE


def _predict(body: dict[str, Any], name: str, version: int | None, label: str | None) -> Response:
    signature_name = _signature_name(body)
    if "instances" in body and not body["instances"] and isinstance(body["instances"], list):
        raise InvalidArgument("JSON Value: No values in 'instances' array")
    with _handle(name, version, label) as slot:
        signature = _signature(slot, signature_name, f'Serving signature name: "{signature_name}" not found in signature def')
        inputs, row_format = tfs_json.decode_predict(body, signature)
        outputs = _run(slot, signature, inputs)
    return json_response(tfs_json.encode_predict(outputs, row_format))


def _signature(slot: VersionSlot, name: str, missing: str) -> SignatureInfo:
    sig = slot.servable.signatures.get(name) if slot.servable is not None else None
    if sig is None:
        raise InvalidArgument(missing)
    return sig


def _run(slot: VersionSlot, signature: SignatureInfo, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Inputs that fit the declared shapes join a batch. Others run alone: TensorFlow, like
    TF Serving, is the judge there (an Identity such as half_plus_two's ``x`` takes any
    shape); LiteRT's shapes are real, so a mismatch is refused here with the reason."""
    problems = [p for k, arr in inputs.items() if (p := tfs_json.shape_error(arr, signature.inputs[k], f"input {k!r}"))]
    if problems and getattr(slot.servable, "backend", "") == "tflite":
        raise InvalidArgument(problems[0])
    return run_signature(slot, signature.name, inputs, batch=not problems)


def _examples(body: dict[str, Any], method: str) -> np.ndarray:
    examples = body.get("examples")
    if examples is None:
        raise InvalidArgument(f"JSON Value: When method is {method}, key 'examples' is expected and was not found")
    if not isinstance(examples, list):
        raise InvalidArgument("JSON Value: Expecting 'examples' value to be an list/array")
    if not examples:
        raise InvalidArgument("JSON Value: 'examples' value is an empty array")
    context = body.get("context")
    for item in [context] * (context is not None) + examples:
        if not isinstance(item, dict):
            raise InvalidArgument(f"Example must be JSON object but got JSON {type(item).__name__}")
    try:
        ctx = pw.encode_example(_decode_features(context)) if context is not None else b""
        serialized = [ctx + pw.encode_example(_decode_features(e)) for e in examples]
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    return np.array(serialized, dtype=object)


def _decode_features(example: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in example.items():
        values = value if isinstance(value, list) else [value]
        decoded = []
        for v in values:
            if isinstance(v, dict) and set(v) == {"b64"}:
                v = tfs_json._b64(v, f"feature {key}")
            elif v is None or isinstance(v, (dict, list)):
                raise ValueError(f"Feature: {key} has element with unexpected JSON type: {type(v).__name__}")
            decoded.append(v)
        out[key] = decoded
    return out


def _classify_regress(body: dict[str, Any], name: str, version: int | None, label: str | None, method: str) -> Response:
    signature_name = _signature_name(body)
    serialized = _examples(body, method)
    with _handle(name, version, label) as slot:
        if slot.servable is not None and getattr(slot.servable, "backend", "") == "tflite":
            hint = ("pin runtime.backend = \"tf-cpu\" for this model" if importlib.util.find_spec("tensorflow")
                    else "install the TensorFlow extra: pip install 'edge-appliance[tf]'")
            raise Unimplemented(f":{method} feeds serialized tf.Example protos, which needs a TensorFlow backend, "
                                f"but {name} version {slot.version} is served by tflite; {hint}")
        signature = _signature(slot, signature_name, f"No signature was found with the name: {signature_name}")
        if "inputs" not in signature.inputs or len(signature.inputs) != 1:
            kind = "classification" if method == "classify" else "regression"
            raise InvalidArgument(f"No {kind} inputs found in SignatureDef: {signature.name}")
        outputs = _run(slot, signature, {"inputs": serialized})
    return json_response(tfs_json.dumps({"results": _results(method, signature, outputs, len(serialized))}))


def _results(method: str, signature: SignatureInfo, outputs: dict[str, np.ndarray], n: int) -> Any:
    if method == "regress":
        if "outputs" not in outputs:
            raise InvalidArgument(f"No regression outputs found in SignatureDef: {signature.name}")
        values = outputs["outputs"]
        if values.ndim == 2 and values.shape[1] == 1:
            values = values[:, 0]
        if values.ndim != 1 or values.shape[0] != n:
            raise InvalidArgument("Expected output Tensor shape to be either [batch_size] or [batch_size, 1] "
                                  f"but got {list(outputs['outputs'].shape)}")
        return values.astype(np.float32)
    classes, scores = outputs.get("classes"), outputs.get("scores")
    if classes is None and scores is None:
        raise InvalidArgument('Expected classification signature outputs to contain at least one of "classes" or "scores".')
    ref = scores if scores is not None else classes
    if ref.ndim != 2 or ref.shape[0] != n:
        raise InvalidArgument(f"Expected Tensor shape: [batch_size num_classes] but got {list(ref.shape)}")
    results = []
    for i in range(n):
        row = []
        for j in range(ref.shape[1]):
            text = classes[i, j] if classes is not None else b""
            label = text.decode(errors="replace") if isinstance(text, bytes) else str(text)
            row.append([label, float(scores[i, j]) if scores is not None else 0.0])
        results.append(row)
    return results


VERBS: dict[str, Callable[..., Response]] = {
    "predict": _predict,
    "classify": lambda body, n, v, l: _classify_regress(body, n, v, l, "classify"),
    "regress": lambda body, n, v, l: _classify_regress(body, n, v, l, "regress"),
}
