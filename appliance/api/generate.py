"""``POST /v1/models/{m}[/versions/{v}|/labels/{l}]:generate``: token generation over HTTP.

The WSGI handler of the ``POST /v1/...:generate`` mount of the route table
(appliance/api/routes.py; other ``:generate`` paths are TF Serving's, which answers them 400). The request is a JSON object::

    {"input_ids": [ids...]} or {"text": "..."}       (text: the version ships its tokenizer)
    "max_new_tokens": int, "temperature": float (0 = greedy, the default), "top_k": int,
    "top_p": float, "seed": int, "stop": [ids...], "stream": bool

Without ``stream`` the answer is one JSON object (tokens, text, finish reason, counts).
With ``"stream": true`` it is server-sent events: one ``data: {"token": id, "text": ...}``
per token, then ``event: done`` with the finish reason and counts (``event: error`` if the
model failed). A client that disconnects is noticed at the next token written (a whole
answer: at its next token, by the socket) and its stream is cancelled at the next step. Answered
on the front path's event loop (an ``AsyncFamily``): no thread waits or streams. Errors before the first byte are TF Serving's
``{"error": ...}`` with 400 (bad field, named), 404 (unknown model/version) or 503.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable
from urllib.parse import unquote

import orjson

from appliance.core.errors import ApplianceError, InvalidArgument
from appliance.core.generation import Generation
from appliance.core.seams import TokenEvents, TokenStreams
from appliance.core.streams import Params
from appliance.core.token_streams import LocalTokenStreams, TokenRequest
from appliance.core.tokenizer import Detokenizer, Tokenizer
from appliance.api.body import read_raw as _read_body
from appliance.api.body import route_key
from appliance.api.errors import render, render_error, status_line
from appliance.api.kserve.rest import json_object
from appliance.api.families import GENERATE_RE, generate_mount
from appliance.api.mounts import Mount, raw_path
from appliance.api.family import Answer, AsyncFamily, Streamed
from appliance.api.sse import client_gone, off_loop, waiting_gone
from appliance.api import schemas
from appliance.api.schemas import paths as openapi_paths
from appliance.api.schemas.generate import GenerateRequest

if TYPE_CHECKING:
    from wsgiref.types import WSGIEnvironment

    from appliance.core.appliance import Appliance


PATH_RE = GENERATE_RE
FIELDS = schemas.names(GenerateRequest)
JSON = "application/json"
SSE = "text/event-stream"
GONE_POLL_S = 0.25  # at most how often a whole answer looks whether its client went away


class GenerateAPI(AsyncFamily):
    """See module docstring. ``generation`` (the step scheduler) is built on first use. An
    ``AsyncFamily``: answered on the front path's loop, waiting and streaming without a thread
    (appliance/core/token_streams.py)."""

    def __init__(self, core: "Appliance"):
        self.core = core

    @property
    def tokens(self) -> TokenStreams:
        """Token streams on this loop (appliance/core/seams.py ``TokenStreams``)."""
        return LocalTokenStreams(self.generation)

    @property
    def generation(self) -> Generation:
        """The core's one (built on first use; shared with the OpenAI API)."""
        return Generation.of(self.core)

    async def answer(self, environ: WSGIEnvironment) -> Answer | Streamed:
        match = PATH_RE.fullmatch(raw_path(environ).partition("?")[0])
        assert match is not None, "the mount's pattern is PATH_RE"
        started = time.perf_counter()
        name = unquote(match.group(1))
        try:
            plan = await off_loop(lambda: self._plan(environ, match), lambda p: p.handle.release())
            try:
                tokens = await self.tokens.generate(plan.handle, plan.request, waiting_gone(environ))
            except BaseException:
                plan.handle.release()
                raise
        except Exception as exc:  # before the first byte: a plain {"error": ...} answer
            status, headers, body = render_error(exc, "the generate API")
            self.core.metrics.observe_request(name, "generate", status, time.perf_counter() - started)
            return status_line(status), headers, body
        stream = tokens.streams[0]
        if plan.streaming:
            return "200 OK", [("Content-Type", SSE), ("Cache-Control", "no-cache"),
                              ("X-Accel-Buffering", "no")], self._events(tokens, plan.vocab, started)
        try:
            status, headers, body = await self._collect(tokens, plan.vocab, client_gone(environ))
        except BaseException:  # cancelled (a front worker's client went away): the stream stops too
            tokens.abort()
            raise
        self.core.metrics.observe_request(name, "generate", status, time.perf_counter() - started)
        return status_line(status), headers, body

    def _plan(self, environ: WSGIEnvironment, match: re.Match[str]) -> "_Plan":
        """(an executor thread) The handle and what to generate on it."""
        if self.core.manager is None:
            raise ApplianceError("the service is not started")
        name, version, label = unquote(match.group(1)), match.group(2), match.group(3)
        body = _parse(_read_body(environ, self.core.config.server.max_body_bytes))
        handle = self.core.manager.handle(name, int(version) if version else None, unquote(label) if label else None,
                                          route_key(environ))
        try:
            driver, vocab = self.generation.prepare(handle)
            prompt = _prompt(body, vocab, driver.vocab_size)
            params = _params(body, self.core.config.generation)
            context = driver.context_length
            if context is not None and len(prompt) >= context:
                raise InvalidArgument(f"field 'input_ids': the prompt has {len(prompt)} tokens; this model's context "
                                      f"holds {context}, so a prompt may have at most {context - 1}")
            text = body.get("text") if isinstance(body.get("text"), str) else None
        except BaseException:
            handle.release()
            raise
        return _Plan(handle, TokenRequest(prompt, params, name, text=text), vocab, bool(body.get("stream", False)))

    @staticmethod
    async def _collect(tokens: TokenEvents, vocab: Tokenizer | None,
                       gone: Callable[[], bool]) -> tuple[int, list[tuple[str, str]], bytes]:
        stream = tokens.streams[0]
        look_at = time.monotonic() + GONE_POLL_S
        async for _, kind, value in tokens:
            if time.monotonic() >= look_at:  # nothing is written until the end: only the socket says it
                look_at = time.monotonic() + GONE_POLL_S
                if gone():
                    tokens.abort()
            if kind == "done":
                text = "".join(stream.pieces) if stream.text_level else \
                    Detokenizer(vocab, stream.prompt).text(stream.tokens) if vocab else None
                body = orjson.dumps({**value, "tokens": None if stream.text_level else stream.tokens, "text": text})
                return 200, [("Content-Type", JSON), ("Content-Length", str(len(body)))], body
            if kind == "error":  # the model failed mid-way
                return render(500, value)
        return render(500, "the stream ended without its end")

    async def _events(self, tokens: TokenEvents, vocab: Tokenizer | None, started: float) -> AsyncIterator[bytes]:
        """The SSE body (module docstring); closed early (the client went away), the stream is cancelled."""
        stream = tokens.streams[0]
        # the text of each token as it can be shown: a character split across tokens comes whole
        detokenizer = Detokenizer(vocab, stream.prompt) if vocab is not None and not stream.text_level else None
        try:
            async for _, kind, value in tokens:
                if kind == "token":
                    text = detokenizer.feed(value) if detokenizer is not None else None
                    yield b"data: " + orjson.dumps({"token": value, "text": text}) + b"\n\n"
                    continue
                if kind == "text":  # a text-level servable (LiteRT-LM): pieces, no ids
                    yield b"data: " + orjson.dumps({"token": None, "text": value}) + b"\n\n"
                    continue
                rest = detokenizer.flush() if detokenizer is not None else ""
                if rest:  # the end of a character that never completed: shown as U+FFFD, as in the whole text
                    yield b"data: " + orjson.dumps({"token": None, "text": rest}) + b"\n\n"
                status = 200 if kind == "done" else 500
                self.core.metrics.observe_request(stream.model, "generate", status, time.perf_counter() - started)
                payload = value if kind == "done" else {"error": value}
                yield f"event: {'done' if kind == 'done' else 'error'}\ndata: ".encode() + orjson.dumps(payload) + b"\n\n"
        finally:
            if tokens.open:
                tokens.abort()


@dataclass(frozen=True)
class _Plan:
    handle: Any
    request: TokenRequest
    vocab: Tokenizer | None
    streaming: bool


def _parse(raw: bytes) -> dict[str, Any]:
    """The body, checked against its declaration (appliance/api/schemas/generate.py)."""
    body = json_object(raw, "generate request")
    schemas.check(body, GenerateRequest, _unknown)
    return body


def _unknown(key: str) -> str:
    return f"unknown field {key!r}; a generate request takes {', '.join(FIELDS)}"


def _ids(value: Any, name: str, vocab_size: int, allow_empty: bool) -> list[int]:
    if not isinstance(value, list) or (not value and not allow_empty) or \
            not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InvalidArgument(f"field '{name}' must be a {'' if allow_empty else 'non-empty '}list of token ids")
    bad = [v for v in value if not 0 <= v < vocab_size]
    if bad:
        raise InvalidArgument(f"field '{name}': token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})")
    return list(value)


def _prompt(body: dict[str, Any], vocab: Tokenizer | None, vocab_size: int) -> list[int]:
    if ("input_ids" in body) == ("text" in body):
        raise InvalidArgument("field 'input_ids' or field 'text' is required (exactly one of them)")
    if "input_ids" in body:
        return _ids(body["input_ids"], "input_ids", vocab_size, allow_empty=False)
    if vocab is None:
        raise InvalidArgument("field 'text' needs a tokenizer, and this version ships none (tokenizer.json, "
                              "tokenizer.model or assets/vocab.json); send 'input_ids'")
    if not isinstance(body["text"], str) or not body["text"]:
        raise InvalidArgument("field 'text' must be a non-empty string")
    return vocab.encode(body["text"])


def _number(body: dict[str, Any], name: str, default: Any, kind: type, low: float, high: float) -> Any:
    value = body.get(name, default)
    if value is None and default is None:
        return None
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not low <= value <= high:
        raise InvalidArgument(f"field '{name}' must be {'a number' if kind is float else 'an integer'} "
                              f"from {low:g} to {high:g}, got {value!r}")
    return kind(value)


def _params(body: dict[str, Any], config: Any) -> Params:
    stop = body.get("stop", [])
    if not isinstance(stop, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in stop):
        raise InvalidArgument("field 'stop' must be a list of token ids")
    return Params(
        max_new_tokens=_number(body, "max_new_tokens", config.default_max_new_tokens, int, 1,
                               config.max_new_tokens_limit),
        temperature=_number(body, "temperature", 0.0, float, 0, 100),
        top_k=_number(body, "top_k", 0, int, 0, 1 << 31),
        top_p=_number(body, "top_p", 1.0, float, 1e-9, 1),
        seed=_number(body, "seed", None, int, 0, (1 << 63) - 1),
        stop=frozenset(stop))


OPENAPI_PATHS: dict[str, Any] = openapi_paths.generate()  # the body: appliance/api/schemas/generate.py


def mounts(core: "Appliance") -> list[Mount]:
    """``POST /v1/models/{m}[/versions/{v}|/labels/{l}]:generate``, ahead of TF Serving's ``/v1``."""
    return [generate_mount(GenerateAPI(core))]

__all__ = ["GenerateAPI", "OPENAPI_PATHS", "mounts"]
