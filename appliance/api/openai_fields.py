"""The fields of an OpenAI chat, completion or embeddings request, read and checked
(appliance/api/openai.py).

``read(raw, path)`` -> the body (a dict) checked against its declaration
(appliance/api/schemas/openai.py: every field, its type and its bounds, the same declaration
/openapi.json is written from); ``params``, ``messages``, ``prompt``, ``stops``, ``choices``,
``top_logprobs`` read one concern each, checking only what needs more than the body (the
model's vocabulary, the context left, one field against another), raising ``FieldError``
(a 400 naming OpenAI's ``param``). Pure functions, no state.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import orjson

from appliance.api import schemas
from appliance.api.kserve.rest import json_object
from appliance.api.schemas import FieldError
from appliance.api.schemas.openai import (MAX_CHOICES, MAX_COMPLETION_LOGPROBS, MAX_LOGIT_BIAS, MAX_STOPS,
                                          ChatRequest, CompletionRequest, EmbeddingRequest)
from appliance.core.errors import NotFound
from appliance.core.streams import Params

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
MODEL_RE = re.compile(r"([^/:]+)(?::([^/:]+))?")  # name[:version|:label] (openai.py's docstring)
# What a backend that samples by itself (a LiteRT-LM bundle) cannot do: refused by name there
PROCESSORS = ("presence_penalty", "frequency_penalty", "logit_bias", "min_p", "repetition_penalty")
DECLARED: dict[str, type[msgspec.Struct]] = {CHAT: ChatRequest, COMPLETIONS: CompletionRequest,
                                             EMBEDDINGS: EmbeddingRequest}


class ModelNotFound(NotFound):
    """A 404 for a model id that names no loaded model, version or label (OpenAI's code)."""

    param, code = "model", "model_not_found"


def read(raw: bytes, path: str) -> dict[str, Any]:
    """The body of a request to ``path``, checked against its declaration (module docstring)."""
    body = json_object(raw, "request")
    schemas.check(body, DECLARED[path], _unrecognized)
    return body


def _unrecognized(key: str) -> str:
    return f"Unrecognized request argument supplied: {key}"  # OpenAI's words


def model_id(model: str) -> tuple[str, int | None, str | None]:
    match = MODEL_RE.fullmatch(model)
    if match is None:
        raise FieldError(f"field 'model': {model!r} is not '<name>', '<name>:<version>' or '<name>:<label>'",
                         "model")
    name, tag = match.groups()
    if tag is None:
        return name, None, None
    return (name, int(tag), None) if tag.isascii() and tag.isdigit() else (name, None, tag)


def choices(body: dict[str, Any]) -> int:
    return body.get("n") or 1  # 1..MAX_CHOICES: declared


def top_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """None: no logprobs; k >= 0: the sampled token's logprob and the k best (types and
    bounds declared: chat's logprobs is a bool, completions' a count up to 5)."""
    asked = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if top is not None and not asked:
            raise FieldError("field 'top_logprobs' needs logprobs: true", "top_logprobs")
        return (top or 0) if asked else None
    return None if asked is None or asked is False else int(asked)


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (Hugging Face's convention): role,
    content text, and an assistant's ``tool_calls`` (arguments as objects) or a tool
    result's ``tool_call_id`` and ``name`` kept. Their shape is declared (``Message``)."""
    out = []
    for i, message in enumerate(body["messages"]):
        kept: dict[str, Any] = {"role": message["role"], "content": _content(message.get("content"))}
        if message.get("tool_calls"):
            kept["tool_calls"] = [_tool_call(call, i) for call in message["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                kept[key] = message[key]
        out.append(kept)
    return out


def _tool_call(call: dict[str, Any], i: int) -> dict[str, Any]:
    function = call["function"]
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments or "{}")
        except orjson.JSONDecodeError as exc:
            raise FieldError(f"field 'messages': message {i}'s tool call arguments are not JSON: {exc}",
                             "messages") from exc
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _content(content: str | list[dict[str, str]] | None) -> str:
    """A string, or text parts joined (declared: ``TextPart``, this server's models take text)."""
    return "".join(part["text"] for part in content) if isinstance(content, list) else content or ""


def prompt(body: dict[str, Any]) -> str:
    given = body["prompt"]  # declared: a non-empty string, or a list of exactly one
    return given[0] if isinstance(given, list) else str(given)


def stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")  # declared: a string or up to MAX_STOPS of them
    return [] if stop is None else [stop] if isinstance(stop, str) else list(stop)


def _number(body: dict[str, Any], name: str, default: Any, kind: type) -> Any:
    """A declared number (its type and bounds checked by ``read``), or its default."""
    value = body.get(name)
    return default if value is None else kind(value)


def params(body: dict[str, Any], config: Any, chat: bool, stop_ids: frozenset[int] = frozenset(),
           room: int | None = None, vocab_size: int = 1 << 31) -> Params:
    """The request's sampling parameters. ``room``: the context left after the prompt, the
    default and the cap of ``max_tokens`` (OpenAI's and vLLM's rule: an answer may use the rest
    of the context); None where the backend says no context (then generation's limits apply)."""
    field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    limit = max(room, 1) if room is not None else config.max_new_tokens_limit
    asked = _number(body, field, None, int)
    seed = _number(body, "seed", None, int)
    top_k = _number(body, "top_k", 0, int)
    return Params(max_new_tokens=min(asked, limit) if asked is not None else
                  (limit if room is not None else config.default_max_new_tokens),
                  temperature=_number(body, "temperature", 1.0, float),
                  top_p=_number(body, "top_p", 1.0, float), top_k=max(top_k, 0),  # -1: off (vLLM's)
                  seed=None if seed is None else seed % (1 << 63),  # numpy's generators take no negative seed
                  stop=stop_ids, logprobs=top_logprobs(body, chat),
                  presence_penalty=_number(body, "presence_penalty", 0.0, float),
                  frequency_penalty=_number(body, "frequency_penalty", 0.0, float),
                  repetition_penalty=_number(body, "repetition_penalty", 1.0, float),
                  min_p=_number(body, "min_p", 0.0, float), logit_bias=logit_bias(body, vocab_size))


def logit_bias(body: dict[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: {"<token id>": bias from -100 to 100} (declared); each id must
    be inside this model's vocabulary."""
    given: dict[str, float] = body.get("logit_bias") or {}
    for key in given:
        if int(key) >= vocab_size:
            raise FieldError(f"field 'logit_bias': {key!r} is not a token id of this model (0..{vocab_size - 1})",
                             "logit_bias")
    return tuple((int(key), float(bias)) for key, bias in given.items())


def processors_asked(body: dict[str, Any]) -> str | None:
    """The first logit processor the request turns on (for a backend that has none), else None."""
    off = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "min_p": 0, "repetition_penalty": 1}
    return next((f for f in PROCESSORS if body.get(f) is not None and body[f] != off[f]), None)


__all__ = ["CHAT", "COMPLETIONS", "DECLARED", "EMBEDDINGS", "FieldError", "MAX_CHOICES", "MAX_COMPLETION_LOGPROBS",
           "MAX_LOGIT_BIAS", "MAX_STOPS", "ModelNotFound", "choices", "logit_bias", "messages",
           "model_id", "params", "processors_asked", "prompt", "read", "stops", "top_logprobs"]
