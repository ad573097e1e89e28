"""The Open Inference Protocol (KServe v2) over HTTP, with Triton's binary tensor extension.

``V2API`` is the WSGI handler of the ``/v2...`` mounts of the route table
(appliance/api/routes.py): it parses JSON or binary-tensor bodies into the numpy of
``V2Service`` (appliance/api/kserve/service.py, shared with the gRPC face) and renders its
answers.

Status codes follow Triton: 400 for a bad request, 404 for an unknown model or version,
503 while a model is loading or its queue is full, 413 over ``server.max_body_bytes``;
every error body is ``{"error": "..."}``. Health endpoints answer the protocol's bodies
(``{"live": true}``, ``{"ready": true}``, ``{"name": "m", "ready": true}``): 200 for true,
400 for false (KServe: "a 4xx status code indicates false").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload
from urllib.parse import unquote

import orjson

from appliance.api import tensor_limits
from appliance.api import json_arrays
from appliance.api.json_arrays import Parsed, ParsedObject
from appliance.api.kserve import classification, codec
from appliance.api.kserve import shared_memory as shm
from appliance.core.config import LimitsConfig
from appliance.core.errors import ApplianceError, InvalidArgument, MethodNotAllowed, NotFound
from appliance.core.json_types import JSONArray, JSONObject
from appliance.core.request_context import of_environ
from appliance.core.shared_memory import Slice
from appliance.core.shared_memory import SharedMemory
from appliance.api.kserve.service import InferResult, Requested, Tensor, V2Service
from appliance.api.body import read_raw as _read_body
from appliance.api.body import route_key
from appliance.api.errors import render_error, status_line
from appliance.api.family import Answer, AsyncFamily
from appliance.api.kserve.extensions import V2Extensions
from appliance.api.mounts import ADMIN, INFERENCE, OPEN, Mount, raw_path
from appliance.api.schemas import ref
from appliance.api.schemas import kserve as bodies

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIEnvironment

    from appliance.core.appliance import Appliance

JSON = "application/json"
OCTETS = "application/octet-stream"
HEADER_LENGTH = "Inference-Header-Content-Length"
_DUMP = orjson.OPT_SERIALIZE_NUMPY
# JSON values a v2 request may carry besides tensor data: each input's name, datatype and
# shape, outputs, parameters. Generous (a thousand values cost nothing to parse): the exact
# check is on the declared shapes, once the header is parsed.
ENVELOPE_VALUES = 1024


REPOSITORY = ("index", "load", "unload")

# --- the REST face ------------------------------------------------------------------------------
Response = tuple[int, bytes, list[tuple[str, str]]]
_EMPTY: list[tuple[str, str]] = []


class V2API(AsyncFamily):
    """The ``/v2`` mounts (appliance/api/routes.py).

    Like ``rest.V1API`` it bypasses Flask: ``answer`` maps (method, path, body) to (status,
    headers, body bytes) with no request objects in between (appliance/api/family.py); errors
    are appliance/api/errors.py ``render_error``'s.
    """

    def __init__(self, service: V2Service, extensions: V2Extensions | None = None):
        """``extensions``: statistics, model configuration and repository, which only the
        serving process answers (a front worker's ``V2API`` has none: they are forwarded)."""
        self.core, self.service, self.extensions = service.core, service, extensions

    async def answer(self, environ: WSGIEnvironment) -> Answer:
        status, body, headers = await self._respond(environ)
        if status >= 400:  # the renderer's headers are complete
            return status_line(status), headers, body
        if not any(k == "Content-Type" for k, _ in headers):
            headers = [("Content-Type", JSON), *headers]
        return status_line(status), [*headers, ("Content-Length", str(len(body)))], body

    async def _respond(self, environ: WSGIEnvironment) -> Response:
        caller = shm.CALLER.set(environ.get("REMOTE_ADDR"))  # who may use shared memory: this host only
        try:
            return await self._respond_to(environ)
        finally:
            shm.CALLER.reset(caller)

    async def _respond_to(self, environ: WSGIEnvironment) -> Response:
        method = environ.get("REQUEST_METHOD", "GET")
        path = raw_path(environ).partition("?")[0]
        try:
            route, model, version = _route(path)
            if isinstance(version, str):  # shared memory's endpoints: model is the region's name, version its action
                body = _read_body(environ, self.core.config.server.max_body_bytes) if method == "POST" else b""
                return shm.answer(self.service.regions, route, model, version, method, body)
            if route == "infer":
                return await self._infer(environ, method, model, version)
            if route in REPOSITORY:
                return await self._repository(environ, method, path, route, model)
            if method != "GET":
                raise MethodNotAllowed(f"method {method} not allowed on {path}")
            return await self._get(route, model, version)
        except Exception as exc:  # every failure is {"error": ...}; never a stack trace
            status, headers, body = render_error(exc, "the v2 API")
            return status, body, headers

    async def _get(self, route: str, model: str, version: int | None) -> Response:
        service = self.service
        if route == "server":
            return 200, orjson.dumps(service.server_metadata()), _EMPTY
        if route in ("live", "ready"):
            ok = service.live() if route == "live" else service.ready()
            return _health(ok, {route: ok})
        if route == "model_ready":
            ok = service.model_ready(model, version)
            return _health(ok, {"name": model, "ready": ok})
        if route == "stats":
            return 200, orjson.dumps(self._extensions().statistics(model, version)), _EMPTY
        if route == "config":
            return 200, orjson.dumps(await self._extensions().config(model, version)), _EMPTY
        return 200, orjson.dumps(await service.model_metadata(model, version)), _EMPTY

    async def _repository(self, environ: WSGIEnvironment, method: str, path: str, route: str, model: str) -> Response:
        """Triton's model repository extension: POST only, an optional JSON body."""
        if method != "POST":
            raise MethodNotAllowed(f"method {method} not allowed on {path}; use POST")
        raw = _read_body(environ, self.core.config.server.max_body_bytes)
        body: JSONObject = json_object(raw, "repository request") if raw.strip() else {}
        extensions = self._extensions()
        if route == "index":
            ready = body.get("ready", False)
            if not isinstance(ready, bool):
                raise InvalidArgument("'ready' must be true or false")
            return 200, orjson.dumps(extensions.index(ready)), _EMPTY
        parameters = _parameters(body.get("parameters"), f"{route} of '{model}'")
        await (extensions.load(model, parameters) if route == "load" else extensions.unload(model, parameters))
        return 200, b"", _EMPTY

    def _extensions(self) -> V2Extensions:
        if self.extensions is None:  # a front worker forwards these; never reached there
            raise NotFound("this endpoint is answered by the serving process")
        return self.extensions

    async def _infer(self, environ: WSGIEnvironment, method: str, model: str, version: int | None) -> Response:
        if method != "POST":
            raise MethodNotAllowed(f"method {method} not allowed on /v2/models/{model}/infer; use POST")
        started = time.perf_counter()
        status: int | str = 200  # then the error's canonical code, as TF Serving's metrics label it
        try:
            body = _read_body(environ, self.core.config.server.max_body_bytes)
            if _raw_binary(environ.get("HTTP_INFERENCE_HEADER_CONTENT_LENGTH"), environ.get("HTTP_CONTENT_ENCODING")):
                tensor = await self.service.raw_input(model, version, body)
                result = await self.service.infer(model, version, [tensor], None, {}, True, route_key(environ),
                                                  of_environ(environ))
                return render_infer_response(result, None)
            request = parse_infer_request(body, environ.get("HTTP_INFERENCE_HEADER_CONTENT_LENGTH"),
                                          environ.get("HTTP_CONTENT_ENCODING"), self.core.config.limits,
                                          self.service.regions)
            result = await self.service.infer(model, version, request.inputs, request.outputs, request.parameters,
                                              request.binary_default, route_key(environ), of_environ(environ))
            return render_infer_response(result, request.id)
        except Exception as exc:
            status = exc.grpc_code if isinstance(exc, ApplianceError) else "INTERNAL"
            raise
        finally:
            self.core.metrics.observe_request(model, "v2_infer", status, time.perf_counter() - started)


def _raw_binary(header_length: str | None, encoding: str | None) -> bool:
    """Triton's raw binary request: ``Inference-Header-Content-Length: 0``, the whole body the
    model's one input (its outputs answered in binary)."""
    return header_length is not None and header_length.strip() == "0" and not (
        encoding and encoding.strip().lower() not in ("identity", ""))


def _health(ok: bool, body: JSONObject) -> Response:
    """The protocol's health body (``{"live": true}``, ``{"ready": ...}``, ``{"name": ..,
    "ready": ..}``), 200 for true and 400 for false as Triton answers: a client may read
    either the status or the body. A 400's headers are complete (``answer``), so set here."""
    data = orjson.dumps(body)
    if ok:
        return 200, data, _EMPTY
    return 400, data, [("Content-Type", JSON), ("Content-Length", str(len(data)))]


def mounts(core: "Appliance") -> list[Mount]:
    """``/v2...`` (raw path), inference; its health probes open (they carry no secrets)."""
    api = V2API(V2Service.serving(core), V2Extensions(core))
    return [Mount("kserve", "/v2/", INFERENCE, api, summary="KServe v2 REST API"),
            Mount("kserve-model-control", "/v2/repository/models/",
                  INFERENCE if core.config.kserve.model_control_scope == INFERENCE else ADMIN, api,
                  summary="Triton's model load and unload: [kserve] model_control_scope (admin by default)"),
            Mount("kserve-health", "/v2/health/", OPEN, api, summary="KServe v2 health probes")]


def _route(path: str) -> tuple[str, str, int | str | None]:
    """(route, model, version) of a /v2 path; NotFound for anything the protocol lacks. The
    shared-memory endpoints are (kind, region name, action) (appliance/api/kserve/shared_memory.py): the
    only ones whose third item is a string."""
    parts = path.split("/")[2:]  # "", "v2", ...
    if parts in ([], [""]):
        return "server", "", None
    region = shm.route(parts)
    if region is not None:
        return region
    if parts[0] == "health" and len(parts) == 2 and parts[1] in ("live", "ready"):
        return parts[1], "", None
    if parts == ["models", "stats"]:  # every model's statistics (Triton reads it so too)
        return "stats", "", None
    if parts[0] == "repository":
        if parts[1:] == ["index"]:
            return "index", "", None
        if len(parts) == 4 and parts[1] == "models" and parts[2] and parts[3] in ("load", "unload"):
            return parts[3], unquote(parts[2]), None
    if parts[0] == "models" and len(parts) >= 2 and parts[1]:
        model, rest = unquote(parts[1]), parts[2:]
        version = None
        if rest[:1] == ["versions"] and len(rest) >= 2:
            version, rest = parse_version(rest[1]), rest[2:]
        if rest == []:
            return "model", model, version
        if rest in (["ready"], ["infer"]):
            return ("model_ready" if rest == ["ready"] else "infer"), model, version
        if rest in (["stats"], ["config"]):
            return rest[0], model, version
    raise NotFound(f"no such endpoint in the v2 protocol: {path}")


def parse_version(text: str) -> int:
    if not text.isdigit() or int(text) >= 1 << 63:
        raise InvalidArgument(f"model version must be a non-negative integer, got {unquote(text)!r}")
    return int(text)


# --- request and response bodies --------------------------------------------------------------
@dataclass
class InferRequest:
    id: str | None
    inputs: list[Tensor]
    outputs: list[Requested] | None
    parameters: dict[str, Parsed]
    binary_default: bool


def parse_infer_request(body: bytes, header_length: str | None, encoding: str | None, limits: LimitsConfig,
                        regions: SharedMemory | None = None) -> InferRequest:
    """An infer request body: JSON alone, or (binary extension) a JSON header then tensor bytes,
    or inputs read from shared memory (``regions``). ``limits.max_tensor_elements`` is
    checked on the JSON's bytes before it is parsed, then on the shapes the inputs declare
    before any tensor is built."""
    if encoding and encoding.strip().lower() not in ("identity", ""):
        raise InvalidArgument(f"Content-Encoding {encoding!r} is not supported; send the body uncompressed")
    length = codec.header_length(header_length, len(body))
    text = body if length is None else body[:length]
    tensor_limits.check_body_values(text, limits, ENVELOPE_VALUES)
    try:
        header = json_object(text, arrays=True)
    except InvalidArgument as exc:
        if length is None and b'"binary_data_size"' in body:  # binary tensors, but no header length
            raise InvalidArgument(f"{exc.message}; the request sets binary_data_size but has no {HEADER_LENGTH} "
                                  "header saying where the JSON ends") from None
        raise
    parameters = _parameters(header.get("parameters"), "request")
    binary = codec.BinaryBody(body, length) if length is not None else None
    declared = [_declared(item, i, regions) for i, item in enumerate(_list(header, "inputs", required=True))]
    codec.check_declared_elements([(d.name, d.shape) for d in declared], limits)
    inputs = [_input(d, binary, regions) for d in declared]
    if binary is not None:
        binary.finish()
    outputs = [_requested(item, i, regions) for i, item in enumerate(_list(header, "outputs"))] or None
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidArgument("'id' must be a string")
    binary_default = parameters.get("binary_data_output", False)
    if not isinstance(binary_default, bool):
        raise InvalidArgument("parameter 'binary_data_output' must be true or false")
    return InferRequest(request_id, inputs, outputs, parameters, binary_default)


@overload
def json_object(data: bytes, what: str = ..., arrays: Literal[False] = ...) -> JSONObject: ...


@overload
def json_object(data: bytes, what: str = ..., *, arrays: Literal[True]) -> ParsedObject: ...


def json_object(data: bytes, what: str = "inference request", arrays: bool = False) -> JSONObject | ParsedObject:
    """A JSON object body (v2 and :generate), or a 400 that says what is wrong with it.
    ``arrays``: big numeric arrays come as numpy (appliance/api/json_arrays.py; the tensors'
    ``data``), else everything is Python values."""
    if not data.strip():
        raise InvalidArgument(f"the request body is empty; expected an {what} JSON object")
    value = json_arrays.loads(data) if arrays else None
    if value is None:
        try:
            value = orjson.loads(data)  # JSON values only (no numpy): the JSONObject of the overload
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(f"the request is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"the {what} must be a JSON object")
    return value


def _list(header: ParsedObject, key: str, required: bool = False) -> list[Parsed]:
    value = header.get(key)
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise InvalidArgument(f"'{key}' must be a non-empty list of objects" if required
                              else f"'{key}' must be a list of objects")
    return value


def _parameters(value: object, where: str) -> dict[str, Parsed]:
    """A body's ``parameters`` (an object of JSON values; whatever the body held there, checked)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: 'parameters' must be an object")
    return value


@dataclass
class _Declared:
    """An input as its JSON object declares it, checked before any of its data is read."""

    item: ParsedObject
    name: str
    datatype: str
    shape: tuple[int, ...]
    binary_size: int | None  # None: its elements are in "data" or in shared memory
    region: Slice | None = None  # the shared-memory bytes that hold it (appliance/api/kserve/shared_memory.py)


def _declared(item: Parsed, index: int, regions: SharedMemory | None = None) -> _Declared:
    name = item.get("name") if isinstance(item, dict) else None
    if not isinstance(item, dict) or not isinstance(name, str):
        raise InvalidArgument(f"inputs[{index}] must be an object with a string 'name'")
    where = f"input '{name}'"
    datatype = item.get("datatype")
    dtype = codec.dtype_of(datatype, where)
    assert isinstance(datatype, str)  # dtype_of refuses anything but a datatype's name
    shape = codec.check_shape(item.get("shape"), where)
    codec.check_overflow(shape, dtype, datatype, where)
    params = _parameters(item.get("parameters"), where)
    size = codec.binary_size(params, where)
    sources = [k for k, on in (("'data'", "data" in item), ("parameters.binary_data_size", size is not None),
                               (f"parameters.{shm.REGION}", shm.REGION in params)) if on]
    if len(sources) != 1:
        sets = {0: "neither", 2: "both " + " and ".join(sources), 3: "all three"}[len(sources)]
        raise InvalidArgument(f"{where} must set exactly one of 'data', parameters.binary_data_size and "
                              f"parameters.{shm.REGION}, but sets {sets}")
    region = shm.named_slice(regions, params, where) if shm.REGION in params else None
    return _Declared(item, name, datatype, shape, size, region)


def _input(declared: _Declared, binary: codec.BinaryBody | None, regions: SharedMemory | None = None) -> Tensor:
    name, datatype, shape, size = declared.name, declared.datatype, declared.shape, declared.binary_size
    where = f"input '{name}'"
    if declared.region is not None:
        return Tensor(name, shm.read_input(regions, declared.region, datatype, shape), datatype)
    if size is None:
        return Tensor(name, codec.from_json(declared.item["data"], datatype, shape, where), datatype)
    if binary is None:
        raise InvalidArgument(f"{where} has binary_data_size but the request has no {HEADER_LENGTH} header "
                              "saying where the JSON ends")
    codec.check_binary_size(size, datatype, shape, where)  # before reading: a wrong size never reads on
    return Tensor(name, codec.from_raw(binary.take(size, where), datatype, shape, where), datatype)


def _requested(item: Parsed, index: int, regions: SharedMemory | None = None) -> Requested:
    name = item.get("name") if isinstance(item, dict) else None
    if not isinstance(item, dict) or not isinstance(name, str):
        raise InvalidArgument(f"outputs[{index}] must be an object with a string 'name'")
    where = f"output '{name}'"
    params = _parameters(item.get("parameters"), where)
    classes = classification.count(params.get("classification", 0), where)
    binary = params.get("binary_data")
    if binary is not None and not isinstance(binary, bool):
        raise InvalidArgument(f"{where}: parameter 'binary_data' must be true or false")
    region = shm.named_slice(regions, params, where)
    if region is not None and binary:
        raise InvalidArgument(f"{where}: Output can't set both '{shm.REGION}' and 'binary_data'")
    return Requested(name, binary, region, classes)


def render_infer_response(result: InferResult, request_id: str | None) -> Response:
    outputs, chunks = [], []
    for tensor, binary in result.outputs:
        entry: dict[str, object] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.array.shape)}
        if tensor.name in result.shared:  # in the app's region already: described, never sent
            pass
        elif binary:
            raw = codec.to_raw(tensor.array)
            entry["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            entry["data"] = codec.to_json(tensor.array, tensor.name)
        outputs.append(entry)
    header: dict[str, object] = {"model_name": result.model, "model_version": str(result.version)}
    if request_id is not None:
        header["id"] = request_id
    header["outputs"] = outputs
    if not chunks:
        return 200, orjson.dumps(header, option=_DUMP), _EMPTY
    body, length = codec.join_binary(header, chunks)
    return 200, body, [("Content-Type", OCTETS), (HEADER_LENGTH, str(length))]


# --- OpenAPI -------------------------------------------------------------------------------------
def _openapi_paths() -> JSONObject:
    error_schema: JSONObject = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
    error: JSONObject = {"description": "error", "content": {JSON: {"schema": error_schema}}}
    model: JSONObject = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
    version: JSONObject = {"name": "version", "in": "path", "required": True,
                           "schema": {"type": "integer", "minimum": 0}}
    def health(key: str, named: bool = False) -> JSONObject:
        props: JSONObject = ({"name": {"type": "string"}, key: {"type": "boolean"}} if named
                             else {key: {"type": "boolean"}})
        schema: JSONObject = {"type": "object", "properties": props, "required": list(props)}
        failed: JSONObject = {"anyOf": [schema, error_schema]}  # false, or a bad request
        return {"200": {"description": "true", "content": {JSON: {"schema": schema}}},
                "400": {"description": "false (or a bad request: an error)", "content": {JSON: {"schema": failed}}}}
    json_ok: JSONObject = {"description": "ok", "content": {JSON: {"schema": {"type": "object"}}}}
    paths: JSONObject = {
        "/v2": {"get": {"summary": "KServe v2 server metadata (name, version, extensions)",
                        "responses": {"200": json_ok}}},
        "/v2/health/live": {"get": {"summary": "KServe v2 server live", "responses": health("live")}},
        "/v2/health/ready": {"get": {"summary": "KServe v2 server ready: every model has a version available",
                                     "responses": health("ready")}},
    }
    variants: tuple[tuple[str, JSONArray], ...] = (("", [model]), ("/versions/{version}", [model, version]))
    for suffix, params in variants:
        base = "/v2/models/{model}" + suffix
        paths[base] = {"get": {"summary": "KServe v2 model metadata (inputs/outputs with datatype and shape)",
                               "parameters": params, "responses": {"200": json_ok, "400": error, "404": error}}}
        paths[base + "/ready"] = {"get": {"summary": "KServe v2 model ready", "parameters": params,
                                          "responses": {**health("ready", True), "404": error}}}
        paths[base + "/infer"] = {"post": {
            "summary": "KServe v2 inference; Triton's binary tensor extension with Inference-Header-Content-Length",
            "parameters": [*params, {"name": HEADER_LENGTH, "in": "header", "required": False,
                                     "schema": {"type": "integer", "minimum": 1},
                                     "description": "size of the JSON header when binary tensors follow it"}],
            "requestBody": {"required": True, "content": {
                JSON: {"schema": ref(bodies.InferRequest)},  # declared in appliance/api/schemas/kserve.py
                OCTETS: {"schema": {"type": "string", "format": "binary"}}}},
            "responses": {"200": {"description": "outputs", "content": {
                JSON: {"schema": {"type": "object"}}, OCTETS: {"schema": {"type": "string", "format": "binary"}}}},
                "400": error, "404": error, "413": error, "503": error}}}
        paths[base + "/stats"] = {"get": {"summary": "Triton's statistics extension: the version's counts and durations",
                                          "parameters": params, "responses": {"200": json_ok, "400": error, "404": error, "503": error}}}
        paths[base + "/config"] = {"get": {"summary": "Triton's model configuration, derived from the signature and "
                                                      "batching", "parameters": params,
                                           "responses": {"200": json_ok, "400": error, "404": error, "503": error}}}
    paths["/v2/models/stats"] = {"get": {"summary": "Triton's statistics extension: every loaded version",
                                         "responses": {"200": json_ok}}}
    paths["/v2/repository/index"] = {"post": {"summary": "Triton's model repository index",
                                              "responses": {"200": {"description": "models", "content": {
                                                  JSON: {"schema": {"type": "array"}}}}}}}
    for verb in ("load", "unload"):
        paths[f"/v2/repository/models/{{model}}/{verb}"] = {"post": {
            "summary": f"Triton's explicit model control: {verb} (admin unless [kserve] model_control_scope)",
            "parameters": [model], "responses": {"200": {"description": "done (empty body)"}, "400": error,
                                                 "403": error}}}
    paths.update(shm.OPENAPI_PATHS)
    return paths


OPENAPI_PATHS: JSONObject = _openapi_paths()

__all__ = ["OPENAPI_PATHS", "V2API", "V2Service", "Tensor", "Requested", "InferResult",
           "parse_infer_request", "render_infer_response"]
