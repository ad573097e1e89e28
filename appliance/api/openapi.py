"""The OpenAPI description served at /openapi.json.

Request bodies (and the answers that have a declared shape) are msgspec Structs
(appliance/api/schemas/), the same declarations that check requests; their JSON Schemas
are ``components/schemas`` here. The paths and their statuses are written here and in
each API family's module (``OPENAPI_PATHS``); the answers TF Serving defines (model
status, metadata, predict results) are written below as TF Serving's REST doc gives them.

Every path the service answers is here, each with every status it can answer and the
body that comes with it; tests/api/test_openapi_contract.py runs schemathesis against a live
server to keep it so. API families (appliance/api/families.py ``API_MOUNTS``) describe their own
paths: a layer module that exports ``OPENAPI_PATHS`` has them merged in, with the
statuses every layer's requests can get from outside it (authentication, overload).
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util

from appliance.api import schemas
from appliance.api.families import API_MOUNTS
from appliance.api.schemas import generate as generate_bodies
from appliance.api.schemas import kserve as kserve_bodies
from appliance.api.schemas import openai as openai_bodies
from appliance.api.schemas import tfserving as tfserving_bodies
from appliance.core.json_types import JSONArray, JSONObject
from appliance.core.problems import KIND_ORDER

JSON = "application/json"
_ERROR_SCHEMA: JSONObject = {"$ref": "#/components/schemas/Error"}


def _error(description: str) -> JSONObject:
    return {"description": description, "content": {JSON: {"schema": _ERROR_SCHEMA}}}


def _ok(schema: JSONObject, description: str = "ok", media: str = JSON) -> JSONObject:
    return {"description": description, "content": {media: {"schema": schema}}}


# What a request can get before its handler runs: appliance/api/auth.py (401 no or wrong token,
# 403 admin endpoints off, 503 a token file that cannot be read) and appliance/transport/http/server.py
# (503 shed under overload, 408 a request slower than its deadline, 413 a body over the limit).
GUARDS: JSONObject = {
    "401": _error("a token is required for this scope and none or a wrong one was given"),
    "403": _error("admin endpoints are off: no admin token is configured"),
    "408": _error("the request was not received within limits.header_timeout_s / request_timeout_s"),
    "413": _error("request body over server.max_body_bytes"),
    "503": _error("overloaded (Retry-After), a model not available yet, or a token file that cannot be read"),
}
PROBE_GUARDS = ("408",)  # /healthz and /readyz: always open and never shed
_MODEL: JSONObject = {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
_VERSION: JSONObject = {"name": "version", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0}}
_LABEL: JSONObject = {"name": "label", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
_BAD = _error("malformed request, unknown signature or label, wrong dtype or shape, over a [limits] value")
_MISSING = _error("no such model or version")
_INFERENCE = {
    "predict": ("PredictRequest", "PredictResponse"),
    "classify": ("ExamplesRequest", "ClassifyResponse"),
    "regress": ("ExamplesRequest", "RegressResponse"),
}


def _operation(summary: str, responses: JSONObject, params: JSONArray | None = None,
               body: JSONObject | None = None, guards: tuple[str, ...] = tuple(GUARDS)) -> JSONObject:
    op: JSONObject = {"summary": summary, "responses": {**{k: GUARDS[k] for k in guards}, **responses}}
    if params:
        op["parameters"] = params
    if body is not None:
        op["requestBody"] = body
    return op


def _json_body(schema: str, required: bool = True) -> JSONObject:
    return {"required": required, "content": {JSON: {"schema": {"$ref": schemas.REF.format(name=schema)}}}}


def _tf_serving_paths() -> JSONObject:
    paths: JSONObject = {}
    variants: tuple[tuple[str, JSONArray], ...] = (("", [_MODEL]), ("/versions/{version}", [_MODEL, _VERSION]),
                                                   ("/labels/{label}", [_MODEL, _LABEL]))
    for suffix, params in variants:
        base = "/v1/models/{model}" + suffix
        paths[base] = {"get": _operation("TF Serving model version status", {
            "200": _ok({"$ref": "#/components/schemas/ModelStatus"}), "400": _BAD, "404": _MISSING}, params)}
        paths[base + "/metadata"] = {"get": _operation("TF Serving signature defs", {
            "200": _ok({"$ref": "#/components/schemas/ModelMetadata"}), "400": _BAD, "404": _MISSING}, params)}
        for verb, (request, response) in _INFERENCE.items():
            paths[f"{base}:{verb}"] = {"post": _operation(f"TF Serving {verb} (gzip bodies accepted)", {
                "200": _ok({"$ref": f"#/components/schemas/{response}"}), "400": _BAD, "404": _MISSING,
                "429": _error("the model's batch queue is full (Retry-After)"),
                "501": _error("this install cannot run the request (names the extra to install)"),
            }, params, _json_body(request))}
    return paths


def _service_paths() -> JSONObject:
    admin_body: JSONObject = {"required": False, "content": {JSON: {"schema": {"$ref": "#/components/schemas/RollbackRequest"}}}}
    conflict = _error("refused in the device's current state (no bucket, version not on disk, config refused)")
    paths: JSONObject = {
        "/healthz": {"get": _operation("alive", {"200": _ok({"$ref": "#/components/schemas/Health"})},
                                       guards=PROBE_GUARDS)},
        "/readyz": {"get": _operation("every model has an available version (503 if not)", {
            "200": _ok({"$ref": "#/components/schemas/Ready"}),
            "503": _ok({"$ref": "#/components/schemas/Ready"}, "not ready: which models, which problems")},
            guards=PROBE_GUARDS)},
        "/api/status": {"get": _operation("problems first, then the device, service tree, models, backend decisions, "
                                          "events (secrets redacted)",
                                          {"200": _ok({"$ref": "#/components/schemas/Status"})})},
        "/openapi.json": {"get": _operation("this description", {"200": _ok({"type": "object"})})},
        "/monitoring/prometheus/metrics": {"get": _operation("Prometheus text format", {
            "200": _ok({"type": "string"}, media="text/plain")})},
        "/api/reload": {"post": _operation("admin: re-read the config file and apply it (as SIGHUP)", {
            "200": _ok({"type": "object", "properties": {"reloaded": {"type": "boolean"}}, "required": ["reloaded"]}),
            "409": conflict, "504": _error("the reload did not finish in time")})},
        "/api/sync": {"post": _operation("admin: poll the bucket now and wait for that poll", {
            "200": _ok({"type": "object"}), "409": conflict})},
        "/api/models/{model}/rollback": {"post": _operation(
            "admin: pin a model to a version kept on disk ({\"clear\": true} unpins)", {
                "200": _ok({"type": "object", "required": ["model", "pinned"]}), "400": _BAD,
                "404": _error("no such resource (a model name the path cannot hold)"), "409": conflict},
            [_MODEL], admin_body)},
        "/api/models/{model}/rollout/{action}": {"post": _operation(
            "admin: promote or abort the model's rollout candidate now (appliance/core/rollout.py)", {
                "200": _ok({"type": "object", "required": ["model"]}),
                "404": _error("no such action (promote, abort) or rollouts are off"),
                "409": _error("the model has no rollout candidate")},
            [_MODEL, {"name": "action", "in": "path", "required": True,
                      "schema": {"type": "string", "enum": ["promote", "abort"]}}])},
    }
    if importlib.util.find_spec("ui") is not None:
        paths["/"] = {"get": _operation("the status page", {"200": _ok({"type": "string"}, media="text/html")})}
    return paths


def _layer_paths() -> JSONObject:
    """``OPENAPI_PATHS`` of the API layer modules this install has, with the guards added."""
    merged: JSONObject = {}
    for layer in API_MOUNTS:
        module_name = layer.partition(":")[0]
        if importlib.util.find_spec(module_name) is None:
            continue
        layer_paths: JSONObject = getattr(importlib.import_module(module_name), "OPENAPI_PATHS", {})
        for path, item in layer_paths.items():
            item = copy.deepcopy(item)
            for op in item.values() if isinstance(item, dict) else ():
                responses = op.get("responses") if isinstance(op, dict) else None
                if isinstance(op, dict) and isinstance(responses, dict):
                    guards = PROBE_GUARDS if "/health/" in path else tuple(GUARDS)
                    op["responses"] = {**{k: GUARDS[k] for k in guards}, **responses}
            merged[path] = item
    return merged


@functools.lru_cache(maxsize=4)
def spec(version: str) -> JSONObject:
    paths = {**_tf_serving_paths(), **_service_paths(), **_layer_paths()}
    return {
        "openapi": "3.1.0",  # JSON Schema 2020-12: what the layers write (exclusiveMinimum: 0)
        "info": {"title": "edge-appliance", "version": version,
                 "description": "TensorFlow Serving's REST API, plus health, status, metrics, admin "
                                "endpoints and the API layers this install has (KServe v2, ...). "
                                "Errors are {\"error\": \"...\"}."},
        "paths": paths,
        "components": {"schemas": {**SCHEMAS, **schemas.components(DECLARED)},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


# every declared body; a path refers to one as #/components/schemas/<its class name>
DECLARED = (*openai_bodies.REQUESTS, *openai_bodies.ANSWERS, generate_bodies.GenerateRequest,
            generate_bodies.Generated, generate_bodies.GenerateError, tfserving_bodies.PredictRequest, tfserving_bodies.ExamplesRequest,
            kserve_bodies.InferRequest)
_TENSOR_INFO: JSONObject = {"type": "object", "required": ["dtype", "tensor_shape", "name"], "properties": {
    "dtype": {"type": "string"}, "name": {"type": "string"},
    "tensor_shape": {"type": "object", "required": ["dim", "unknown_rank"], "properties": {
        "dim": {"type": "array", "items": {"type": "object", "required": ["size"], "properties": {
            "size": {"type": "string"}, "name": {"type": "string"}}}},
        "unknown_rank": {"type": "boolean"}}}}}
SCHEMAS: JSONObject = {
    "Error": {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]},
    "PredictResponse": {"type": "object", "minProperties": 1, "maxProperties": 1,
                        "properties": {"predictions": {}, "outputs": {}}, "additionalProperties": False},
    "ClassifyResponse": {"type": "object", "required": ["results"], "properties": {"results": {
        "type": "array", "items": {"type": "array", "items": {
            "type": "array", "minItems": 2, "maxItems": 2, "items": {}}}}}},
    "RegressResponse": {"type": "object", "required": ["results"], "properties": {"results": {"type": "array"}}},
    "ModelStatus": {"type": "object", "required": ["model_version_status"], "properties": {
        "model_version_status": {"type": "array", "items": {
            "type": "object", "required": ["version", "state", "status"], "properties": {
                "version": {"type": "string"},
                "state": {"type": "string", "enum": ["UNKNOWN", "START", "LOADING", "AVAILABLE", "UNLOADING", "END"]},
                "status": {"type": "object", "required": ["error_code", "error_message"], "properties": {
                    "error_code": {"type": "string"}, "error_message": {"type": "string"}}}}}}}},
    "ModelMetadata": {"type": "object", "required": ["model_spec", "metadata"], "properties": {
        "model_spec": {"type": "object", "required": ["name", "version"], "properties": {
            "name": {"type": "string"}, "signature_name": {"type": "string"}, "version": {"type": "string"}}},
        "metadata": {"type": "object", "required": ["signature_def"], "properties": {
            "signature_def": {"type": "object", "required": ["signature_def"], "properties": {
                "signature_def": {"type": "object", "additionalProperties": {
                    "type": "object", "required": ["inputs", "outputs", "method_name"], "properties": {
                        "inputs": {"type": "object", "additionalProperties": _TENSOR_INFO},
                        "outputs": {"type": "object", "additionalProperties": _TENSOR_INFO},
                        "method_name": {"type": "string"}}}}}}}}}},
    "Health": {"type": "object", "required": ["status", "version"], "properties": {
        "status": {"type": "string", "enum": ["alive"]}, "version": {"type": "string"}}},
    "Ready": {"type": "object", "required": ["ready"], "properties": {
        "ready": {"type": "boolean"}, "models": {"type": "object"},
        "problems": {"type": "array", "items": {"type": "string"}}}},
    "Status": {"type": "object", "required": ["service", "problems", "device", "models", "events"], "properties": {
        "problems": {"type": "array", "items": {"$ref": "#/components/schemas/Problem"}},
        "footprint": {"type": "object", "properties": {
            "processes": {"type": "integer"}, "rss_bytes": {"type": "integer"},
            "pss_bytes": {"type": ["integer", "null"]}, "cpu_percent": {"type": ["number", "null"]}}}}},
    # appliance/core/problems.py: every state an operator must act on.
    "Problem": {"type": "object", "required": ["kind", "message", "severity"], "properties": {
        "kind": {"type": "string", "enum": list(KIND_ORDER)},
        "message": {"type": "string"}, "severity": {"type": "string", "enum": ["error", "warning"]},
        "model": {"type": "string"}, "version": {"type": "integer"}, "part": {"type": "string"},
        "error_code": {"type": "string"}, "since": {"type": "number", "description": "epoch seconds"}}},
    # appliance/parts/sync_loop.py's rollback reads these two by hand (parts/, outside the API's bodies)
    "RollbackRequest": {"type": "object", "properties": {
        "version": {"type": "integer", "minimum": 0}, "clear": {"type": "boolean"}}},
}
