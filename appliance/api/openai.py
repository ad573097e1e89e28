"""The OpenAI-compatible API: ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models``. Protocol only: prompts, sampling and streams are the core's
(appliance/core/generation.py), reached through the same handle as ``:generate``, so
versions, labels, hot-swap, drain, rollout routing and judging, limits and metrics are
the same, and the same route table and auth scope (``inference``) guard it.

Paths beside TF Serving's ``/v1`` (its ``http_rest_api_util.cc``: predict
``(?i)/v1/models/([^/:]+)(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?:(classify|regress|predict)``,
status and metadata ``(?i)/v1/models(?:/([^/:]+))?(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?(?:\/(metadata))?``):
``/v1/chat/completions`` and ``/v1/completions`` match neither, so TF Serving answers them
400 "Malformed request"; ``GET /v1/models`` matches the status pattern with no name, and
TF Serving answers it 400 "Missing model name in request.". No TF Serving client can use
those answers, so this API takes exactly those three paths. ``GET /v1/models/{id}``
(OpenAI's ``models.retrieve``) is not served: for a plain name it *is* TF Serving's model
status, which stays TF Serving's.

**Model ids**: ``name`` (what an unversioned TF Serving request gets: the serving version,
routed as such during a rollout), ``name:<version>`` (digits) or ``name:<label>``. ``:``
is outside TF Serving's model and label alphabet (``[^/:]+``), so an id never clashes
with a name, and it is the tag form LLM users know (``llama3:8b``). An answer's ``model``
is the id of the version that answered, ``name:<version>`` (OpenAI too answers an alias
with the snapshot that ran). ``GET /v1/models`` lists every id that can generate now.

A request takes ``max_tokens`` (``max_completion_tokens`` too, for chat; default
``generation.default_max_new_tokens``), ``temperature`` (OpenAI's default 1; 0 is
greedy), ``top_p``, ``stop`` (a string or up to 4), ``seed``, ``n`` (1 only), ``stream``
and ``stream_options.include_usage``; ``user`` is ignored, and fields this server cannot
honour are refused unless they hold their default. Errors are OpenAI's ``{"error":
{"message", "type", "param", "code"}}`` with the status of our error classes
(appliance/core/errors.py), like every other API; while streaming, one ``data:
{"error": ...}`` event, then ``data: [DONE]``. The layers in front of every API (the HTTP
server's limits, auth, gzip bodies) answer in the service's ``{"error": "..."}`` shape,
which OpenAI's clients map to the same exception classes by status.

Text: a token-level version needs ``assets/vocab.json``; a LiteRT-LM bundle has its own
tokenizer. Chat messages become one prompt through the version's chat template, stop
strings are cut here (appliance/core/text.py); the stream then ends at its next step.
Thread-safety: none needed, every request has its own objects.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import orjson

from appliance.api.body import read_raw, route_key
from appliance.api.errors import as_error, status_line, wsgi_answer
from appliance.api.kserve.rest import json_object
from appliance.api.mounts import INFERENCE, Mount, raw_path
from appliance.api.sse import StreamBody
from appliance.core.errors import ApplianceError, InvalidArgument, MethodNotAllowed, NotFound
from appliance.core.generation import Generation, Params, Stream
from appliance.core.text import StopText

if TYPE_CHECKING:
    from appliance.core.appliance import Appliance

JSON = "application/json"
OWNER = "edge-appliance"
SSE = "text/event-stream"
CHAT, COMPLETIONS, MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
MODEL_RE = re.compile(r"([^/:]+)(?::([^/:]+))?")  # name[:version|:label] (module docstring)
MAX_STOPS = 4  # OpenAI's limit
COMMON = ("model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream", "stream_options", "user")
FIELDS = {CHAT: COMMON + ("messages", "max_completion_tokens"), COMPLETIONS: COMMON + ("prompt",)}
# Fields this server cannot honour: accepted only with OpenAI's default value (None is also fine).
DEFAULTS: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (False,), "top_logprobs": (0,),
    "logit_bias": ({},), "echo": (False,), "best_of": (1,), "suffix": ("",), "tools": ([],),
    "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False), "store": (False,),
    "metadata": ({},), "service_tier": ("auto", "default"), "response_format": ({"type": "text"},)}
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
         429: "rate_limit_error"}
FIELD_RE = re.compile(r"field '([^']+)'")


class FieldError(InvalidArgument):
    """A 400 naming the request field (OpenAI's ``param``) and, where OpenAI has one, a ``code``."""

    def __init__(self, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class ModelNotFound(NotFound):
    """A 404 for a model id that names no loaded model, version or label (OpenAI's code)."""

    param, code = "model", "model_not_found"


def error_body(exc: BaseException) -> tuple[ApplianceError, bytes]:
    """(our error, OpenAI's error object) for an exception, by its class (appliance/api/errors.py)."""
    error = as_error(exc, "the OpenAI API")
    param = getattr(error, "param", None)
    if param is None and error.http_status == 400:
        found = FIELD_RE.search(error.message)
        param = found.group(1) if found else None
    code = getattr(error, "code", None)
    kind = TYPES.get(error.http_status, "server_error")
    body = {"error": {"message": error.message, "type": kind, "param": param, "code": code}}
    return error, orjson.dumps(body)


def render(exc: BaseException) -> tuple[int, list[tuple[str, str]], bytes]:
    """An error answer in OpenAI's shape, with appliance/api/errors.py's status and Retry-After."""
    error, body = error_body(exc)
    headers = [("Content-Type", JSON), ("Content-Length", str(len(body)))]
    if error.retry_after:
        headers.append(("Retry-After", str(max(1, math.ceil(error.retry_after)))))
    return error.http_status, headers, body


class OpenAIAPI:
    """The three paths (module docstring); a WSGI app per path family, one core."""

    def __init__(self, core: "Appliance"):
        self.core = core

    @property
    def generation(self) -> Generation:
        return Generation.of(self.core)

    # -- GET /v1/models ----------------------------------------------------------------------
    def models(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        try:
            body = orjson.dumps({"object": "list", "data": self._generative_models()})
        except Exception as exc:
            return wsgi_answer(start_response, render(exc), method)
        return wsgi_answer(start_response, (200, [("Content-Type", JSON), ("Content-Length", str(len(body)))], body),
                           method)

    def _generative_models(self) -> list[dict[str, Any]]:
        """Every id that can generate now (module docstring), as OpenAI's model objects."""
        manager = self.core.manager
        if manager is None:
            raise ApplianceError("the service is not started")
        out = []
        for name, model in manager.snapshot().items():
            since = {v["version"]: v["available_since"] for v in model["versions"] if v["state"] == "AVAILABLE"}
            ready = [v for v in sorted(since) if self._generates(name, v)]
            serving = model["serving_version"]
            ids = ([(name, serving)] if serving in ready else []) + [(f"{name}:{v}", v) for v in ready] + \
                [(f"{name}:{label}", v) for label, v in sorted(model["labels"].items()) if v in ready]
            out += [{"id": id_, "object": "model", "created": int(since[v] or 0), "owned_by": OWNER}
                    for id_, v in ids]
        return out

    def _generates(self, name: str, version: int) -> bool:
        try:
            handle = self.core.manager.handle(name, version, judged=False)  # type: ignore[union-attr]
        except ApplianceError:  # unloaded meanwhile
            return False
        with handle:
            return self.generation.can_generate(handle)

    # -- POST /v1/chat/completions, /v1/completions --------------------------------------------
    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = raw_path(environ).partition("?")[0]
        api = "chat_completions" if path == CHAT else "completions"
        started = time.perf_counter()
        name = ""
        try:
            if environ.get("REQUEST_METHOD") != "POST":
                raise MethodNotAllowed(f"{path} takes POST")
            body = _parse(read_raw(environ, self.core.config.server.max_body_bytes), path)
            name = _model(body["model"])[0]
            run = self._start(environ, body, path == CHAT)
        except Exception as exc:  # before the first byte
            status, headers, out = render(exc)
            self.core.metrics.observe_request(name, api, status, time.perf_counter() - started)
            start_response(status_line(status), headers)
            return [out]
        if run.streaming:
            start_response("200 OK", [("Content-Type", SSE), ("Cache-Control", "no-cache"),
                                      ("X-Accel-Buffering", "no")])
            return _EventStream(self, run, api, started)
        status, headers, out = self._collect(run)
        self.core.metrics.observe_request(run.stream.model, api, status, time.perf_counter() - started)
        start_response(status_line(status), headers)
        return [out]

    def _start(self, environ: dict[str, Any], body: dict[str, Any], chat: bool) -> "_Run":
        manager = self.core.manager
        if manager is None:
            raise ApplianceError("the service is not started")
        name, version, label = _model(body["model"])
        params = _params(body, self.core.config.generation, chat)
        try:
            handle = manager.handle(name, version, label, route_key(environ))
        except (NotFound, InvalidArgument) as exc:  # an unknown name, version or label
            raise ModelNotFound(f"The model '{body['model']}' does not exist ({exc.message}); GET /v1/models "
                                "lists the models that generate") from exc
        try:
            return self._stream(handle, body, chat, params)
        except BaseException:
            handle.release()
            raise

    def _stream(self, handle: Any, body: dict[str, Any], chat: bool, params: Params) -> "_Run":
        where = "messages" if chat else "prompt"
        try:
            driver, vocab = self.generation.prepare(handle)
        except InvalidArgument as exc:
            raise FieldError(f"model '{body['model']}': {exc.message}", "model") from exc
        if vocab is None:
            raise FieldError(f"model '{body['model']}' generates token ids only: its version ships no "
                             "tokenizer vocabulary (assets/vocab.json), and this API speaks text", "model")
        text = self.generation.chat_template(handle).render(_messages(body)) if chat else _prompt(body)
        try:
            prompt = vocab.encode(text)
        except InvalidArgument as exc:
            raise FieldError(f"field '{where}': {exc.message}", where) from exc
        if not prompt:
            raise FieldError(f"field '{where}': the prompt is empty", where)
        context = driver.context_length
        if context is not None and len(prompt) >= context:
            raise FieldError(f"the prompt has {len(prompt)} tokens; this model's context holds {context}, so a "
                             f"prompt may have at most {context - 1}", where, "context_length_exceeded")
        stream = self.generation.start(prompt, params, handle, handle.model, text=text)
        overhead = getattr(driver.servable, "prompt_overhead", 0) if stream.text_level else 0
        return _Run(stream, vocab, body, chat, len(prompt) + overhead)

    @staticmethod
    def _collect(run: "_Run") -> tuple[int, list[tuple[str, str]], bytes]:
        text = []
        for piece in run.pieces():
            text.append(piece)
        if run.error is not None:
            return render(ApplianceError(f"the model failed while generating: {run.error}"))
        body = orjson.dumps(run.completion("".join(text)))
        return 200, [("Content-Type", JSON), ("Content-Length", str(len(body)))], body


class _Run:
    """One request's stream seen as OpenAI text: pieces with stop strings cut, then the
    finish reason and usage."""

    def __init__(self, stream: Stream, vocab: Any, body: dict[str, Any], chat: bool, prompt_tokens: int):
        self.stream, self.vocab, self.chat = stream, vocab, chat
        self.streaming = bool(body.get("stream", False))
        self.include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        self.stop = StopText(_stops(body))
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.answered_by = f"{stream.model}:{stream.version}"  # the id of the version that answered
        self.prompt_tokens, self.completion_tokens = prompt_tokens, 0
        self.finish_reason: str | None = None
        self.error: str | None = None

    def pieces(self) -> Iterator[str]:
        """Text as it may be shown; ends with ``finish_reason`` (or ``error``) set."""
        while True:
            kind, value = self.stream.events.get()
            if kind in ("token", "text"):
                self.completion_tokens += 1
                text, stopped = self.stop.feed(self.vocab.decode(value) if kind == "token" else value)
                if text:
                    yield text
                if stopped:
                    self.stream.cancel("stop")  # ended at its next step; its handle released there
                    self.finish_reason = "stop"
                    return
                continue
            held = self.stop.flush()
            if held:
                yield held
            if kind == "error":
                self.error = str(value)
            else:
                self.finish_reason = "stop" if value["finish_reason"] == "stop" else "length"
            return

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.answered_by}

    def completion(self, text: str) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                      "logprobs": None, "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": self.usage()}

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else \
                ({"content": text} if text is not None else {})
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return _event({**self._head(kind), "choices": [choice], **({"usage": None} if self.include_usage else {})})

    def usage_chunk(self) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return _event({**self._head(kind), "choices": [], "usage": self.usage()})


def _event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class _EventStream(StreamBody):
    """The SSE body (OpenAI's: ``data:`` chunks, then ``data: [DONE]``)."""

    def __init__(self, api: OpenAIAPI, run: _Run, name: str, started: float):
        self.api, self.run, self.name, self.started = api, run, name, started
        super().__init__(run.stream)

    def events(self) -> Iterator[bytes]:
        run = self.run
        if run.chat:
            yield run.chunk(None, role=True)
        for piece in run.pieces():
            yield run.chunk(piece)
        self.finished = True
        status = 200
        if run.error is not None:
            error, body = error_body(ApplianceError(f"the model failed while generating: {run.error}"))
            status = error.http_status
            yield b"data: " + body + b"\n\n"
        else:
            yield run.chunk(None, run.finish_reason)
            if run.include_usage:
                yield run.usage_chunk()
        self.api.core.metrics.observe_request(run.stream.model, self.name, status, time.perf_counter() - self.started)
        yield b"data: [DONE]\n\n"


# -- request fields ---------------------------------------------------------------------------
def _parse(raw: bytes, path: str) -> dict[str, Any]:
    body = json_object(raw, "request")
    for key, value in body.items():
        if key in FIELDS[path]:
            continue
        if key not in DEFAULTS:
            raise FieldError(f"Unrecognized request argument supplied: {key}", key)
        if value is not None and value not in DEFAULTS[key]:
            raise FieldError(f"field '{key}' is not supported by this server (only its default "
                             f"{DEFAULTS[key][0]!r})", key)
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise FieldError("field 'model' is required: the name of a model that generates (GET /v1/models)", "model")
    if body.get("n") is not None and (type(body["n"]) is not int or body["n"] != 1):
        raise FieldError("field 'n': this server generates one choice per request (n = 1)", "n")
    if "stream" in body and not isinstance(body["stream"], (bool, type(None))):
        raise FieldError("field 'stream' must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise FieldError("field 'stream_options' takes only include_usage", "stream_options")
    return body


def _model(model: str) -> tuple[str, int | None, str | None]:
    match = MODEL_RE.fullmatch(model)
    if match is None:
        raise FieldError(f"field 'model': {model!r} is not '<name>', '<name>:<version>' or '<name>:<label>'",
                         "model")
    name, tag = match.groups()
    if tag is None:
        return name, None, None
    return (name, int(tag), None) if tag.isascii() and tag.isdigit() else (name, None, tag)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FieldError("field 'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise FieldError(f"field 'messages': message {i} needs a 'role'", "messages")
        out.append({"role": message["role"], "content": _content(message.get("content"), i)})
    return out


def _content(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):  # content parts: text only
        parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)  # type: ignore[arg-type]
    raise FieldError(f"field 'messages': message {i}'s content must be a string or text parts "
                     "(this model takes text only)", "messages")


def _prompt(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise FieldError("field 'prompt' must be a non-empty string (one prompt per request)", "prompt")
    return prompt


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise FieldError(f"field 'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    return stops


def _number(body: dict[str, Any], name: str, default: Any, kind: type, low: float, high: float) -> Any:
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not low <= value <= high:
        raise FieldError(f"field '{name}' must be {'a number' if kind is float else 'an integer'} "
                         f"from {low:g} to {high:g}, got {value!r}", name)
    return kind(value)


def _params(body: dict[str, Any], config: Any, chat: bool) -> Params:
    _stops(body)
    limit = config.max_new_tokens_limit
    field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    seed = _number(body, "seed", None, int, -(1 << 63), (1 << 63) - 1)
    return Params(max_new_tokens=_number(body, field, config.default_max_new_tokens, int, 1, limit),
                  temperature=_number(body, "temperature", 1.0, float, 0, 2),
                  top_p=_number(body, "top_p", 1.0, float, 1e-9, 1),
                  seed=None if seed is None else seed % (1 << 63))  # numpy's generators take no negative seed


# -- the route table's mounts and /openapi.json ------------------------------------------------
def _openapi_paths() -> dict[str, Any]:
    openai_error = {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}
    # the layers in front of every API (HTTP limits, gzip bodies) answer the service's plain shape
    error = {"description": "OpenAI's error object (or the service's {\"error\": \"...\"} from the HTTP "
                            "server's limits and the gzip layer)", "content": {JSON: {"schema": {
                                "type": "object", "required": ["error"], "properties": {
                                    "error": {"anyOf": [openai_error, {"type": "string"}]}}}}}}
    stop = {"oneOf": [{"type": "string"}, {"type": "array", "maxItems": MAX_STOPS, "items": {"type": "string"}}]}
    common = {"model": {"type": "string", "description": "name, name:<version> or name:<label>"},
              "max_tokens": {"type": "integer", "minimum": 1},
              "temperature": {"type": "number", "minimum": 0, "maximum": 2},
              "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "stop": stop,
              "seed": {"type": "integer"}, "n": {"type": "integer", "enum": [1]}, "stream": {"type": "boolean"},
              "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
              "user": {"type": "string"}}
    message = {"type": "object", "required": ["role"], "properties": {"role": {"type": "string"},
                                                                         "content": {"type": "string"}}}
    model = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
        "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
        "owned_by": {"type": "string"}}}
    answer = {"description": "the completion (JSON), or server-sent events ending with data: [DONE]", "content": {
        JSON: {"schema": {"type": "object"}}, SSE: {"schema": {"type": "string"}}}}
    errors = {code: error for code in ("400", "404", "413", "503")}

    def post(summary: str, required: str, extra: dict[str, Any]) -> dict[str, Any]:
        schema = {"type": "object", "required": ["model", required], "properties": {**common, **extra}}
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {JSON: {"schema": schema}}},
                         "responses": {"200": answer, **errors}}}

    return {
        CHAT: post("OpenAI chat completion (the version's chat template), streamed with stream=true", "messages",
                   {"messages": {"type": "array", "minItems": 1, "items": message},
                    "max_completion_tokens": {"type": "integer", "minimum": 1}}),
        COMPLETIONS: post("OpenAI text completion, streamed with stream=true", "prompt", {"prompt": {"type": "string"}}),
        MODELS: {"get": {"summary": "the model ids that generate now, in OpenAI's list shape (TF Serving "
                                    "answers this path 400 'Missing model name')", "responses": {"200": {
            "description": "the list", "content": {JSON: {"schema": {
                "type": "object", "required": ["object", "data"], "properties": {
                    "object": {"const": "list"}, "data": {"type": "array", "items": model}}}}}}}}},
    }


OPENAPI_PATHS: dict[str, Any] = _openapi_paths()


def mounts(core: "Appliance") -> list[Mount]:
    """The three paths, ahead of TF Serving's ``/v1`` (module docstring). Specific prefixes,
    so a ``:predict`` pays no pattern of these."""
    api = OpenAIAPI(core)
    return [Mount("openai", "/v1/chat/", INFERENCE, api, pattern=re.compile(re.escape(CHAT)),
                  summary="OpenAI chat completions"),
            Mount("openai", "/v1/completions/", INFERENCE, api, pattern=re.compile(re.escape(COMPLETIONS)),
                  summary="OpenAI completions"),
            Mount("openai-models", "/v1/models/", INFERENCE, api.models, methods=frozenset({"GET", "HEAD"}),
                  pattern=re.compile(re.escape(MODELS)), summary="OpenAI model list")]


__all__ = ["OPENAPI_PATHS", "OpenAIAPI", "error_body", "mounts", "render"]
