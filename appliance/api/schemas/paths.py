"""The /openapi.json paths of the OpenAI API and ``:generate``, their bodies by reference to
the declared Structs (``components``: appliance/api/openapi.py writes them all)."""

from __future__ import annotations

import msgspec

from appliance.api.schemas import ref
from appliance.core.json_types import JSONArray, JSONObject, JSONValue
from appliance.api.schemas.generate import GenerateError, GenerateRequest, Generated
from appliance.api.schemas.openai import (ChatCompletion, ChatRequest, CompletionRequest, EmbeddingList,
                                          EmbeddingRequest, ModelList, OpenAIError, TextCompletion)

JSON, SSE = "application/json", "text/event-stream"
# OpenAI's other API families: answered with OpenAI's 404, never TF Serving's "Malformed request"
NOT_SERVED = ("/v1/responses", "/v1/audio", "/v1/images", "/v1/files", "/v1/moderations", "/v1/batches",
              "/v1/assistants", "/v1/threads", "/v1/fine_tuning", "/v1/uploads", "/v1/vector_stores",
              "/v1/realtime", "/v1/conversations")
_MODEL: JSONObject = {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
_VERSION: JSONObject = {"name": "version", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0}}
_LABEL: JSONObject = {"name": "label", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}


def body(kind: type[msgspec.Struct]) -> JSONObject:
    return {"required": True, "content": {JSON: {"schema": ref(kind)}}}


def answer(description: str, kind: type[msgspec.Struct] | None = None, stream: bool = False) -> JSONObject:
    """A response: ``kind``'s JSON (an object when None), and server-sent events if ``stream``."""
    content: JSONObject = {JSON: {"schema": ref(kind) if kind is not None else {"type": "object"}}}
    if stream:
        content[SSE] = {"schema": {"type": "string"}}
    return {"description": description, "content": content}


def openai() -> JSONObject:
    errors: dict[str, JSONValue] = {code: answer("OpenAI's error object (or the service's {\"error\": \"...\"} from the HTTP server's "
                           "limits and the gzip layer)", OpenAIError) for code in ("400", "404", "413", "503")}

    def post(summary: str, kind: type[msgspec.Struct], done: JSONObject) -> JSONObject:
        return {"post": {"summary": summary, "requestBody": body(kind), "responses": {"200": done, **errors}}}

    said = "the completion (JSON), or server-sent events ending with data: [DONE]"
    return {
        "/v1/chat/completions": post("OpenAI chat completion (the version's chat template), streamed with "
                                     "stream=true", ChatRequest, answer(said, ChatCompletion, stream=True)),
        "/v1/completions": post("OpenAI text completion, streamed with stream=true", CompletionRequest,
                                answer(said, TextCompletion, stream=True)),
        "/v1/embeddings": post("OpenAI embeddings of an encoder version", EmbeddingRequest,
                               answer("the embeddings in OpenAI's list shape", EmbeddingList)),
        **{family: {"post": {"summary": "an OpenAI API family this server does not serve (any method, any path "
                                        "below it): OpenAI's 404", "responses": {"404": errors["404"]}}}
           for family in NOT_SERVED},
        "/v1/models": {"get": {"summary": "the model ids that generate now, in OpenAI's list shape (TF Serving "
                                          "answers this path 400 'Missing model name')",
                               "responses": {"200": answer("the list", ModelList)}}},
    }


def generate() -> JSONObject:
    error = answer("error", GenerateError)
    out: JSONObject = {}
    variants: tuple[tuple[str, JSONArray], ...] = (("", [_MODEL]), ("/versions/{version}", [_MODEL, _VERSION]),
                                                   ("/labels/{label}", [_MODEL, _LABEL]))
    for suffix, params in variants:
        out["/v1/models/{model}" + suffix + ":generate"] = {"post": {
            "summary": "Generate tokens; step-batched with other streams of the version. "
                       "stream=true: server-sent events, one per token, then event 'done'",
            "parameters": params, "requestBody": body(GenerateRequest),
            "responses": {"200": answer("the generated tokens", Generated, stream=True),
                          **{code: error for code in ("400", "404", "413", "503")}}}}
    return out


__all__ = ["answer", "body", "generate", "openai"]
