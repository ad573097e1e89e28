"""The /openapi.json paths of the OpenAI API and ``:generate``, their bodies by reference to
the declared Structs (``components``: appliance/api/openapi.py writes them all)."""

from __future__ import annotations

from typing import Any

import msgspec

from appliance.api.schemas import ref
from appliance.api.schemas.generate import GenerateError, GenerateRequest, Generated
from appliance.api.schemas.openai import (ChatCompletion, ChatRequest, CompletionRequest, EmbeddingList,
                                          EmbeddingRequest, ModelList, OpenAIError, TextCompletion)

JSON, SSE = "application/json", "text/event-stream"
# OpenAI's other API families: answered with OpenAI's 404, never TF Serving's "Malformed request"
NOT_SERVED = ("/v1/responses", "/v1/audio", "/v1/images", "/v1/files", "/v1/moderations", "/v1/batches",
              "/v1/assistants", "/v1/threads", "/v1/fine_tuning", "/v1/uploads", "/v1/vector_stores",
              "/v1/realtime", "/v1/conversations")
_MODEL = {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
_VERSION = {"name": "version", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0}}
_LABEL = {"name": "label", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}


def body(kind: type[msgspec.Struct]) -> dict[str, Any]:
    return {"required": True, "content": {JSON: {"schema": ref(kind)}}}


def answer(description: str, kind: type[msgspec.Struct] | None = None, stream: bool = False) -> dict[str, Any]:
    """A response: ``kind``'s JSON (an object when None), and server-sent events if ``stream``."""
    content: dict[str, Any] = {JSON: {"schema": ref(kind) if kind is not None else {"type": "object"}}}
    if stream:
        content[SSE] = {"schema": {"type": "string"}}
    return {"description": description, "content": content}


def openai() -> dict[str, Any]:
    errors = {code: answer("OpenAI's error object (or the service's {\"error\": \"...\"} from the HTTP server's "
                           "limits and the gzip layer)", OpenAIError) for code in ("400", "404", "413", "503")}

    def post(summary: str, kind: type[msgspec.Struct], done: dict[str, Any]) -> dict[str, Any]:
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


def generate() -> dict[str, Any]:
    error = answer("error", GenerateError)
    out = {}
    for suffix, params in (("", [_MODEL]), ("/versions/{version}", [_MODEL, _VERSION]),
                           ("/labels/{label}", [_MODEL, _LABEL])):
        out["/v1/models/{model}" + suffix + ":generate"] = {"post": {
            "summary": "Generate tokens; step-batched with other streams of the version. "
                       "stream=true: server-sent events, one per token, then event 'done'",
            "parameters": params, "requestBody": body(GenerateRequest),
            "responses": {"200": answer("the generated tokens", Generated, stream=True),
                          **{code: error for code in ("400", "404", "413", "503")}}}}
    return out


__all__ = ["answer", "body", "generate", "openai"]
