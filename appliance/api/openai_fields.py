"""The fields of an OpenAI chat or completion request, read and checked (appliance/api/openai.py).

``read(raw, path)`` -> the body (a dict) after the field checks; ``params``, ``messages``,
``prompt``, ``stops``, ``choices``, ``top_logprobs`` read one concern each, raising
``FieldError`` (a 400 naming OpenAI's ``param``). Pure functions, no state.
"""

from __future__ import annotations

import math
import re
from typing import Any

import orjson

from appliance.api.kserve.rest import json_object
from appliance.core.errors import InvalidArgument, NotFound
from appliance.core.streams import Params
from appliance.core.sampling import MAX_TOP_LOGPROBS

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MODEL_RE = re.compile(r"([^/:]+)(?::([^/:]+))?")  # name[:version|:label] (openai.py's docstring)
MAX_STOPS = 4  # OpenAI's limit
MAX_CHOICES = 8  # n: each choice is a stream (and a cache row) of its own
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions logprobs
COMMON = ("model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream", "stream_options", "user",
          "response_format", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
          # vLLM's, llama.cpp's and Ollama's extensions (the openai client's extra_body)
          "top_k", "min_p", "repetition_penalty")
# What a backend that samples by itself (a LiteRT-LM bundle) cannot do: refused by name there
PROCESSORS = ("presence_penalty", "frequency_penalty", "logit_bias", "min_p", "repetition_penalty")
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
FIELDS = {CHAT: COMMON + ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                          "parallel_tool_calls"),
          COMPLETIONS: COMMON + ("prompt",)}
# Fields this server cannot honour: accepted only with OpenAI's default value (None is also fine).
DEFAULTS: dict[str, tuple[Any, ...]] = {
    "echo": (False,),
    "best_of": (1,), "suffix": ("",), "store": (False,), "metadata": ({},), "service_tier": ("auto", "default")}
WHY_NOT = {"best_of": "best_of (ranking several samples by their log-probability) is not built here; ask for n "
                      "choices and compare their logprobs"}


class FieldError(InvalidArgument):
    """A 400 naming the request field (OpenAI's ``param``) and, where OpenAI has one, a ``code``."""

    def __init__(self, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class ModelNotFound(NotFound):
    """A 404 for a model id that names no loaded model, version or label (OpenAI's code)."""

    param, code = "model", "model_not_found"


def read(raw: bytes, path: str) -> dict[str, Any]:
    body = json_object(raw, "request")
    for key, value in body.items():
        if key in FIELDS[path]:
            continue
        if key not in DEFAULTS:
            raise FieldError(f"Unrecognized request argument supplied: {key}", key)
        if value is not None and value not in DEFAULTS[key]:
            why = WHY_NOT.get(key, f"only its default {DEFAULTS[key][0]!r}")
            raise FieldError(f"field '{key}' is not supported by this server ({why})", key)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise FieldError("field 'model' is required: the name of a model that generates (GET /v1/models)", "model")
    if "stream" in body and not isinstance(body["stream"], (bool, type(None))):
        raise FieldError("field 'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise FieldError("field 'stream_options' takes only include_usage", "stream_options")
    return body


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
    n = body.get("n")
    if n is None:
        return 1
    if type(n) is not int or not 1 <= n <= MAX_CHOICES:
        raise FieldError(f"field 'n' must be an integer from 1 to {MAX_CHOICES}", "n")
    return n


def top_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """None: no logprobs; k >= 0: the sampled token's logprob and the k best."""
    asked = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if asked not in (None, True, False):
            raise FieldError("field 'logprobs' must be true or false", "logprobs")
        if top is not None and (type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise FieldError(f"field 'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs")
        if top is not None and not asked:
            raise FieldError("field 'top_logprobs' needs logprobs: true", "top_logprobs")
        return (top or 0) if asked else None
    if asked is None or asked is False:
        return None
    if type(asked) is not int or not 0 <= asked <= MAX_COMPLETION_LOGPROBS:
        raise FieldError(f"field 'logprobs' must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}", "logprobs")
    return asked


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (Hugging Face's convention): role,
    content text, and an assistant's ``tool_calls`` (arguments as objects) or a tool
    result's ``tool_call_id`` and ``name`` kept."""
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise FieldError("field 'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(given):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise FieldError(f"field 'messages': message {i} needs a 'role'", "messages")
        kept: dict[str, Any] = {"role": message["role"], "content": _content(message.get("content"), i)}
        if message.get("tool_calls"):
            kept["tool_calls"] = [_tool_call(call, i) for call in _list(message["tool_calls"], i)]
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                kept[key] = message[key]
        out.append(kept)
    return out


def _list(value: Any, i: int) -> list[Any]:
    if not isinstance(value, list):
        raise FieldError(f"field 'messages': message {i}'s tool_calls must be a list", "messages")
    return value


def _tool_call(call: Any, i: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise FieldError(f"field 'messages': message {i} has a tool call without function.name", "messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments or "{}")
        except orjson.JSONDecodeError as exc:
            raise FieldError(f"field 'messages': message {i}'s tool call arguments are not JSON: {exc}",
                             "messages") from exc
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _content(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # content parts: text only
        parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)  # type: ignore[arg-type]  # all str: checked on the line above (mypy does not narrow a list by all())
    raise FieldError(f"field 'messages': message {i}'s content must be a string or text parts "
                     "(this model takes text only)", "messages")


def prompt(body: dict[str, Any]) -> str:
    given = body.get("prompt")
    if isinstance(given, list) and len(given) == 1 and isinstance(given[0], str):
        given = given[0]
    if not isinstance(given, str) or not given:
        raise FieldError("field 'prompt' must be a non-empty string (one prompt per request)", "prompt")
    return given


def stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    out = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(out, list) or not all(isinstance(s, str) for s in out) or len(out) > MAX_STOPS:
        raise FieldError(f"field 'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return out


def _number(body: dict[str, Any], name: str, default: Any, kind: type, low: float, high: float) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not low <= value <= high:
        raise FieldError(f"field '{name}' must be {'a number' if kind is float else 'an integer'} "
                         f"from {low:g} to {high:g}, got {value!r}", name)
    return kind(value)


def params(body: dict[str, Any], config: Any, chat: bool, stop_ids: frozenset[int] = frozenset(),
           room: int | None = None, vocab_size: int = 1 << 31) -> Params:
    """The request's sampling parameters. ``room``: the context left after the prompt, the
    default and the cap of ``max_tokens`` (OpenAI's and vLLM's rule: an answer may use the rest
    of the context); None where the backend says no context (then generation's limits apply)."""
    stops(body)
    field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    limit = max(room, 1) if room is not None else config.max_new_tokens_limit
    asked = _number(body, field, None, int, 1, 1 << 62)
    seed = _number(body, "seed", None, int, -(1 << 63), (1 << 63) - 1)
    top_k = _number(body, "top_k", 0, int, -1, 1 << 31)
    return Params(max_new_tokens=min(asked, limit) if asked is not None else
                  (limit if room is not None else config.default_max_new_tokens),
                  temperature=_number(body, "temperature", 1.0, float, 0, 2),
                  top_p=_number(body, "top_p", 1.0, float, 1e-9, 1), top_k=max(top_k, 0),  # -1: off (vLLM's)
                  seed=None if seed is None else seed % (1 << 63),  # numpy's generators take no negative seed
                  stop=stop_ids, logprobs=top_logprobs(body, chat),
                  presence_penalty=_number(body, "presence_penalty", 0.0, float, -2, 2),
                  frequency_penalty=_number(body, "frequency_penalty", 0.0, float, -2, 2),
                  repetition_penalty=_number(body, "repetition_penalty", 1.0, float, 1e-6, 100),
                  min_p=_number(body, "min_p", 0.0, float, 0, 1), logit_bias=logit_bias(body, vocab_size))


def logit_bias(body: dict[str, Any], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: {"<token id>": bias from -100 to 100}."""
    given = body.get("logit_bias")
    if given is None:
        return ()
    if not isinstance(given, dict) or len(given) > MAX_LOGIT_BIAS:
        raise FieldError(f"field 'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids to biases",
                         "logit_bias")
    out = []
    for key, bias in given.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise FieldError(f"field 'logit_bias': {key!r} is not a token id of this model (0..{vocab_size - 1})",
                             "logit_bias")
        ok = isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias)
        if not ok or not -100 <= bias <= 100:
            raise FieldError(f"field 'logit_bias': the bias of token {key} must be a number from -100 to 100",
                             "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def processors_asked(body: dict[str, Any]) -> str | None:
    """The first logit processor the request turns on (for a backend that has none), else None."""
    off = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "min_p": 0, "repetition_penalty": 1}
    return next((f for f in PROCESSORS if body.get(f) is not None and body[f] != off[f]), None)


__all__ = ["CHAT", "COMPLETIONS", "FieldError", "MAX_STOPS", "ModelNotFound", "choices", "logit_bias", "messages",
           "model_id", "params", "processors_asked", "prompt", "read", "stops", "top_logprobs"]
