"""The OpenAPI description served at /openapi.json (hand-written: the API is TF Serving's)."""

from __future__ import annotations

from typing import Any

_ERROR = {"description": "error", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_MODEL = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
_VERSION = {"name": "version", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0}}
_LABEL = {"name": "label", "in": "path", "required": True, "schema": {"type": "string"}}


def _inference(verb: str, params: list[dict[str, Any]]) -> dict[str, Any]:
    schema = "PredictRequest" if verb == "predict" else "ExamplesRequest"
    return {"post": {
        "summary": f"TF Serving {verb}",
        "parameters": params,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {"200": {"description": "result", "content": {"application/json": {"schema": {"type": "object"}}}},
                      "400": _ERROR, "404": _ERROR, "413": _ERROR, "503": _ERROR},
    }}


def _get(summary: str, params: list[dict[str, Any]]) -> dict[str, Any]:
    return {"get": {"summary": summary, "parameters": params,
                    "responses": {"200": {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}},
                                  "400": _ERROR, "404": _ERROR}}}


def spec(version: str) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for suffix, params in (("", [_MODEL]), ("/versions/{version}", [_MODEL, _VERSION]), ("/labels/{label}", [_MODEL, _LABEL])):
        base = "/v1/models/{model}" + suffix
        paths[base] = _get("model version status", params)
        paths[base + "/metadata"] = _get("signature defs", params)
        for verb in ("predict", "classify", "regress"):
            paths[f"{base}:{verb}"] = _inference(verb, params)
    for path, summary in (("/healthz", "alive"), ("/readyz", "every model has an available version (503 if not)"),
                          ("/api/status", "device, backend decision, models, events"),
                          ("/monitoring/prometheus/metrics", "Prometheus text format")):
        paths[path] = _get(summary, [])
    return {
        "openapi": "3.0.3",
        "info": {"title": "edge-appliance", "version": version,
                 "description": "TensorFlow Serving's REST API, plus health, status and metrics."},
        "paths": paths,
        "components": {"schemas": {
            "Error": {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]},
            "PredictRequest": {"type": "object", "properties": {
                "signature_name": {"type": "string"}, "instances": {"type": "array"}, "inputs": {}}},
            "ExamplesRequest": {"type": "object", "properties": {
                "signature_name": {"type": "string"}, "context": {"type": "object"},
                "examples": {"type": "array", "items": {"type": "object"}}}, "required": ["examples"]},
        }},
    }
