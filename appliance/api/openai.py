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
(OpenAI's ``models.retrieve``) is answered here too, on the same path: an id with a ``:``, or
any id an OpenAI client asks for (its ``X-Stainless-Lang`` header), is an OpenAI model object;
a plain name is TF Serving's model status, its bytes as TF Serving's own handler writes them
(``V1API``, awaited here, so a TF Serving client sees no change).

**Model ids**: ``name`` (what an unversioned TF Serving request gets: the serving version,
routed as such during a rollout), ``name:<version>`` (digits) or ``name:<label>``. ``:``
is outside TF Serving's model and label alphabet (``[^/:]+``), so an id never clashes
with a name, and it is the tag form LLM users know (``llama3:8b``). An answer's ``model``
is the id of the version that answered, ``name:<version>`` (OpenAI too answers an alias
with the snapshot that ran). ``GET /v1/models`` lists every id that can generate now, and
the encoders ``/v1/embeddings`` serves.

A request takes ``max_tokens`` (``max_completion_tokens`` too, for chat; default and cap:
the rest of the context), ``temperature`` (OpenAI's default 1; 0 is greedy), ``top_p``,
``stop`` (a string or up to 4), ``seed``, ``n`` (up to 8), ``stream`` and
``stream_options.include_usage``, the logit processors (``presence_penalty``,
``frequency_penalty``, ``logit_bias``; vLLM's ``top_k``, ``min_p``, ``repetition_penalty``:
appliance/core/sampling.py); ``user`` is ignored, and fields this server cannot honour are
refused unless they hold their default. Errors are OpenAI's ``{"error":
{"message", "type", "param", "code"}}`` with the status of our error classes
(appliance/core/errors.py), like every other API; while streaming, one ``data:
{"error": ...}`` event, then ``data: [DONE]``. The layers in front of every API (the HTTP
server's limits, auth, gzip bodies) answer in the service's ``{"error": "..."}`` shape,
which OpenAI's clients map to the same exception classes by status.

Text: a token-level version needs its tokenizer (``tokenizer.json``, ``tokenizer.model`` or
``assets/vocab.json``: appliance/core/tokenizer.py); a LiteRT-LM bundle has its own. Chat
messages become one prompt through the version's chat template, stop strings are cut here
(appliance/core/text.py); the stream then ends at its next step.
Every path is answered on the front path's event loop (``OpenAIAPI.answer``: an
``AsyncFamily``, appliance/api/family.py; in a front worker forwarded to the serving process and
awaited, appliance/fronts/app.py): a completion waits for a stream in its model's queue and
streams without holding a thread (appliance/core/token_streams.py); an embedding's model run
is awaited as a ``:predict``'s is; parsing, tokenizing and listing the versions run on the
loop's executor. Thread-safety: none needed, every request has its own objects.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable
from urllib.parse import unquote

import orjson

from appliance.api import openai_fields as fields
from appliance.api.body import read_raw, route_key
from appliance.api.errors import as_error, status_line, wsgi_answer
from appliance.api.openai_answer import Answer
from appliance.api.openai_fields import CHAT, FieldError, ModelNotFound
from appliance.api.openai_tools import Tools, read_tools, response_grammar
from appliance.api.schemas import paths as openapi_paths
from appliance.api import openai_embeddings as embeddings
from appliance.api.mounts import INFERENCE, Mount, raw_path
from appliance.api.families import EMBEDDINGS, MODELS, completion_mounts, openai_mounts
from appliance.api.family import Answer as FamilyAnswer
from appliance.api.family import AsyncFamily, Streamed
from appliance.api.sse import client_gone, off_loop, waiting_gone
from appliance.core.request_context import of_environ
from appliance.core.seams import TokenStreams
from appliance.core.token_streams import LocalTokenStreams, TokenRequest
from appliance.core.errors import ApplianceError, InvalidArgument, MethodNotAllowed, NotFound
from appliance.core.generation import Generation
from appliance.core.json_types import JSONValue
from appliance.core.tokenizer import load as load_tokenizer

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

    from appliance.core.appliance import Appliance
    from appliance.core.handle import Handle
    from appliance.core.manager import Manager
    import numpy as np
    from runtimes import SignatureInfo

JSON = "application/json"
OWNER = "edge-appliance"
SSE = "text/event-stream"
NOT_SERVED = openapi_paths.NOT_SERVED  # OpenAI's other API families: OpenAI's 404 (not TF Serving's 400)
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
         429: "rate_limit_error"}
FIELD_RE = re.compile(r"field '([^']+)'")
# A bundle's tokenizer is not ours to bound: a prompt is counted on its first
# context x PREFIX_CHARS_PER_TOKEN characters first, so a huge prompt is refused without
# tokenizing all of it (no tokenizer's token holds more characters on average).
PREFIX_CHARS_PER_TOKEN = 32


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


def _json(obj: JSONValue) -> FamilyAnswer:
    body = orjson.dumps(obj)
    return "200 OK", [("Content-Type", JSON), ("Content-Length", str(len(body)))], body


@dataclass(frozen=True)
class _Plan:
    """A completion request made ready to generate: its handle, what to generate, how to read it."""

    handle: "Handle"
    request: TokenRequest
    vocab: Any
    prompt_tokens: int
    tools: Tools | None


class OpenAIAPI(AsyncFamily):
    """The paths (module docstring): completions an ``AsyncFamily`` (on the front path's loop),
    the rest WSGI apps; one core."""

    def __init__(self, core: "Appliance"):
        self.core = core

    @property
    def tokens(self) -> TokenStreams:
        """Token streams on this loop (appliance/core/seams.py ``TokenStreams``)."""
        return LocalTokenStreams(self.generation)

    @property
    def generation(self) -> Generation:
        return Generation.of(self.core)

    # -- GET /v1/models, GET /v1/models/{name:tag} -----------------------------------------------
    async def _models(self, environ: WSGIEnvironment, path: str) -> FamilyAnswer:
        """(the front path's loop) The list, or one id; a plain name is TF Serving's model status
        (``V1API``'s answer, on this loop: in one process and, forwarded by a front worker, in the
        serving process alike). The versions are looked at on the loop's executor (a first look
        may load a tokenizer)."""
        if path != MODELS and ":" not in path and not environ.get("HTTP_X_STAINLESS_LANG"):
            return await self._tf_serving(environ)
        try:
            listed = await off_loop(self._generative_models)
            if path == MODELS:
                return _json({"object": "list", "data": listed})
            wanted = unquote(path[len(MODELS) + 1:])
            found = next((m for m in listed if isinstance(m, dict) and m["id"] == wanted), None)
            if found is None and not environ.get("HTTP_X_STAINLESS_LANG"):
                return await self._tf_serving(environ)  # a TF Serving client's model status
            if found is None:
                raise ModelNotFound(f"The model '{wanted}' does not exist; GET /v1/models lists the models that "
                                    "generate")
            return _json(found)
        except Exception as exc:
            status, headers, body = render(exc)
            return status_line(status), headers, body

    async def _tf_serving(self, environ: WSGIEnvironment) -> FamilyAnswer:
        from appliance.api.tfserving.rest import V1API  # TF Serving's own answer, as before

        return await V1API(self.core, self.core.states).answer(environ)

    def _generative_models(self) -> list[JSONValue]:
        """Every id that can generate *text* now (module docstring), as OpenAI's model objects."""
        manager = self.core.manager
        if manager is None:
            raise ApplianceError("the service is not started")
        out: list[JSONValue] = []
        for name, model in manager.snapshot().items():
            since = {v["version"]: v["available_since"] for v in model["versions"] if v["state"] == "AVAILABLE"}
            ready = [v for v in sorted(since) if self._speaks_text(name, v)]
            serving = model["serving_version"]
            ids = ([(name, serving)] if serving in ready else []) + [(f"{name}:{v}", v) for v in ready] + \
                [(f"{name}:{label}", v) for label, v in sorted(model["labels"].items()) if v in ready]
            out += [{"id": id_, "object": "model", "created": int(since[v] or 0), "owned_by": OWNER}
                    for id_, v in ids]
        return out

    def _speaks_text(self, name: str, version: int) -> bool:
        """It generates and has a tokenizer (a version without one generates ids only, which
        :generate serves), or it is an encoder ``/v1/embeddings`` serves."""
        manager = self.core.manager
        if manager is None:
            return False
        try:
            handle = manager.handle(name, version, judged=False)
        except ApplianceError:  # unloaded meanwhile
            return False
        with handle:
            try:
                return self.generation.prepare(handle)[1] is not None
            except InvalidArgument:
                return embeddings.serves(handle)

    # -- POST /v1/chat/completions, /v1/completions --------------------------------------------
    async def answer(self, environ: WSGIEnvironment) -> FamilyAnswer | Streamed:
        """(the front path's loop) The request whole, or its SSE chunks: tokenizing, templates and
        grammars run on the loop's executor, the wait for a stream and the stream itself on the
        loop (appliance/core/token_streams.py): no thread is held while it waits or streams."""
        path = raw_path(environ).partition("?")[0]
        if path == EMBEDDINGS:
            return await self._embeddings(environ)
        if path == MODELS or path.startswith(MODELS + "/"):
            return await self._models(environ, path)
        api = "chat_completions" if path == CHAT else "completions"
        started = time.perf_counter()
        name = ""
        try:
            if environ.get("REQUEST_METHOD") != "POST":
                raise MethodNotAllowed(f"{path} takes POST")
            body = await off_loop(lambda: fields.read(read_raw(environ, self.core.config.server.max_body_bytes), path))
            name = fields.model_id(body["model"])[0]
            answer = await self._start(environ, body, path == CHAT)
        except Exception as exc:  # before the first byte
            status, headers, out = render(exc)
            self.core.metrics.observe_request(name, api, status, time.perf_counter() - started)
            return status_line(status), headers, out
        if answer.streaming:
            return "200 OK", [("Content-Type", SSE), ("Cache-Control", "no-cache"),
                              ("X-Accel-Buffering", "no")], self._events(answer, api, started)
        status, headers, out = await self._collect(answer)
        self.core.metrics.observe_request(name, api, status, time.perf_counter() - started)
        return status_line(status), headers, out

    async def _start(self, environ: dict[str, Any], body: dict[str, Any], chat: bool) -> Answer:
        manager = self.core.manager
        if manager is None:
            raise ApplianceError("the service is not started")
        plan = await off_loop(lambda: self._plan(manager, environ, body, chat), lambda p: p.handle.release())
        try:
            tokens = await self.tokens.generate(plan.handle, plan.request, waiting_gone(environ))
        except BaseException:
            plan.handle.release()
            raise
        return Answer(tokens, plan.vocab, body, chat, plan.prompt_tokens, fields.stops(body), plan.tools,
                      client_gone(environ))

    def _plan(self, manager: "Manager", environ: dict[str, Any], body: dict[str, Any], chat: bool) -> "_Plan":
        """(an executor thread) The handle and what to generate on it."""
        handle = _handle(manager, environ, body["model"])
        try:
            return self._stream(handle, body, chat)
        except BaseException:
            handle.release()
            raise

    def _stream(self, handle: "Handle", body: dict[str, Any], chat: bool) -> "_Plan":
        where = "messages" if chat else "prompt"
        try:
            driver, vocab = self.generation.prepare(handle)
        except InvalidArgument as exc:
            raise FieldError(f"model '{body['model']}': {exc.message}", "model") from exc
        if vocab is None:
            raise FieldError(f"model '{body['model']}' generates token ids only: its version ships no tokenizer "
                             "(tokenizer.json, tokenizer.model or assets/vocab.json), and this API speaks text",
                             "model")
        tools: Tools | None = None
        if chat:
            template = self.generation.chat_template(handle)
            tools = read_tools(body, template.source)
            text = template.render(fields.messages(body), tools.tools if tools else None)
        else:
            text = fields.prompt(body)
        prompt = self._tokens(vocab, text, driver, where, chat)
        grammar = response_grammar(body) or (tools.grammar() if tools else None)
        stop_ids: frozenset[int] = getattr(vocab, "stop_ids", frozenset())  # EOS and generation_config's
        text_level = not hasattr(vocab, "eos_id")
        context = driver.context_length
        room = context - len(prompt) if context is not None else None  # a bundle's counts its start token
        params = fields.params(body, self.core.config.generation, chat, stop_ids, room, driver.vocab_size)
        asked = fields.processors_asked(body) if text_level else None
        if asked is not None:
            raise FieldError(f"field '{asked}': model '{body['model']}' is a LiteRT-LM bundle, which samples by "
                             "itself (temperature, top_p, top_k and seed only)", asked)
        if text_level and (grammar is not None or params.logprobs is not None):
            raise FieldError(f"model '{body['model']}' is a LiteRT-LM bundle, which decodes by itself: "
                             "response_format, forced tool calls and logprobs need a token-level model",
                             "response_format" if grammar is not None else "logprobs")
        if grammar is not None:
            grammar.check(self.generation.token_table(handle))
        request = TokenRequest(prompt, params, handle.model, text=text, n=fields.choices(body), grammar=grammar)
        overhead = getattr(driver.servable, "prompt_overhead", 0) if text_level else 0
        return _Plan(handle, request, vocab, len(prompt) + overhead, tools)

    @staticmethod
    def _tokens(vocab: Any, text: str, driver: Any, where: str, chat: bool) -> list[int]:
        """The prompt's tokens; a prompt over the context is refused before it is all
        tokenized (a 10 MB prompt took 19.5 s to refuse), in OpenAI's words. A chat prompt's
        template writes its own BOS, so the tokenizer adds none there (vLLM's rule)."""
        context = driver.context_length
        if context is not None:
            fewest = vocab.fewest_tokens(text) if hasattr(vocab, "fewest_tokens") else \
                len(vocab.encode(text[:context * PREFIX_CHARS_PER_TOKEN]))
            if fewest >= context:
                raise _too_long(context, fewest, where, at_least=True)
        try:
            prompt = vocab.encode(text, special=not chat)
        except InvalidArgument as exc:
            raise FieldError(f"field '{where}': {exc.message}", where) from exc
        if not prompt:
            raise FieldError(f"field '{where}': the prompt is empty", where)
        if max(prompt) >= driver.vocab_size:  # a tokenizer larger than the model's embedding table
            raise FieldError(f"field '{where}': token {max(prompt)} of the prompt is outside this model's vocabulary "
                             f"of {driver.vocab_size}: its tokenizer does not fit the model", where)
        if context is not None and len(prompt) >= context:
            raise _too_long(context, len(prompt), where)
        return prompt  # type: ignore[no-any-return]  # the tokenizer (the version's own) is typed Any; a list of ids

    @staticmethod
    async def _collect(answer: Answer) -> tuple[int, list[tuple[str, str]], bytes]:
        try:
            whole = await answer.completion()
        except BaseException:  # cancelled (a front worker's client went away): the streams stop too
            answer.cancel()
            raise
        if answer.error is not None:
            return render(ApplianceError(f"the model failed while generating: {answer.error}"))
        body = orjson.dumps(whole)
        return 200, [("Content-Type", JSON), ("Content-Length", str(len(body)))], body

    async def _events(self, answer: Answer, api: str, started: float) -> AsyncIterator[bytes]:
        """The SSE body (OpenAI's: ``data:`` chunks, then ``data: [DONE]``); closed early (the
        client went away), its streams are cancelled."""
        try:
            async for chunk in answer.chunks():
                yield chunk
            status = 200
            if answer.error is not None:
                error, body = error_body(ApplianceError(f"the model failed while generating: {answer.error}"))
                status = error.http_status
                yield b"data: " + body + b"\n\n"
            self.core.metrics.observe_request(answer.streams[0].model, api, status, time.perf_counter() - started)
            yield b"data: [DONE]\n\n"
        finally:
            if answer.tokens.open:
                answer.cancel()

    # -- POST /v1/embeddings ------------------------------------------------------------------
    async def _embeddings(self, environ: WSGIEnvironment) -> FamilyAnswer:
        """(the front path's loop) Parsing and tokenizing on the loop's executor, the model run
        awaited on the loop (the handle's coroutine, as a ``:predict``'s): no thread waits."""
        started, name = time.perf_counter(), ""
        try:
            if environ.get("REQUEST_METHOD") != "POST":
                raise MethodNotAllowed(f"{EMBEDDINGS} takes POST")
            body = await off_loop(lambda: fields.read(read_raw(environ, self.core.config.server.max_body_bytes),
                                                      EMBEDDINGS))
            name = fields.model_id(body["model"])[0]
            out = await self._embed(environ, body)
        except Exception as exc:
            status, headers, data = render(exc)
            self.core.metrics.observe_request(name, "embeddings", status, time.perf_counter() - started)
            return status_line(status), headers, data
        self.core.metrics.observe_request(name, "embeddings", 200, time.perf_counter() - started)
        return "200 OK", [("Content-Type", JSON), ("Content-Length", str(len(out)))], out

    async def _embed(self, environ: dict[str, Any], body: dict[str, Any]) -> bytes:
        """The answer's JSON (encoded off the loop: a batch of vectors is milliseconds of work)."""
        manager = self.core.manager
        if manager is None:
            raise ApplianceError("the service is not started")
        handle, sig, feeds, tokens = await off_loop(lambda: self._embed_feeds(manager, environ, body),
                                                    lambda planned: planned[0].release())
        with handle:
            outputs = await handle.run(sig.name, feeds, of_environ(environ))
            return await off_loop(lambda: orjson.dumps(embeddings.answer(
                body, embeddings.vectors(outputs, body["model"]), f"{handle.model}:{handle.version}", tokens)))

    @staticmethod
    def _embed_feeds(manager: "Manager", environ: dict[str, Any],
                     body: dict[str, Any]) -> "tuple[Handle, SignatureInfo, dict[str, np.ndarray], int]":
        """(an executor thread) The handle, its embedding signature, the feeds and the token count."""
        handle = _handle(manager, environ, body["model"])
        try:
            sig = embeddings.signature(handle, body["model"])
            feeds, tokens = embeddings.feeds(sig, embeddings.inputs(body), load_tokenizer(handle.path), body["model"])
        except BaseException:
            handle.release()
            raise
        return handle, sig, feeds, tokens

    # -- what this server does not serve, in OpenAI's words -------------------------------------
    def not_served(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = raw_path(environ).partition("?")[0]
        error = NotFound(f"{environ.get('REQUEST_METHOD', 'GET')} {path} is not served by this server; it answers "
                         "/v1/chat/completions, /v1/completions, /v1/embeddings and /v1/models")
        return wsgi_answer(start_response, render(error), environ.get("REQUEST_METHOD", "GET"))


def _handle(manager: "Manager", environ: WSGIEnvironment, model: str) -> "Handle":
    """The manager's handle of the version an OpenAI model id names (routed like any request)."""
    name, version, label = fields.model_id(model)
    try:
        return manager.handle(name, version, label, route_key(environ))
    except (NotFound, InvalidArgument) as exc:  # an unknown name, version or label
        raise ModelNotFound(f"The model '{model}' does not exist ({exc.message}); GET /v1/models lists the models "
                            "that generate") from exc


def _too_long(context: int, tokens: int, where: str, at_least: bool = False) -> FieldError:
    """OpenAI's own words (what LiteLLM and other clients match to raise their
    ContextWindowExceededError), with code context_length_exceeded."""
    said = f"at least {tokens}" if at_least else str(tokens)
    what = "messages" if where == "messages" else "prompt"
    return FieldError(f"This model's maximum context length is {context} tokens. However, your {what} resulted in "
                      f"{said} tokens. Please reduce the length of the {what}.", where, "context_length_exceeded")


# -- the route table's mounts and /openapi.json (bodies declared in appliance/api/schemas/openai.py)
OPENAPI_PATHS: dict[str, Any] = openapi_paths.openai()


def mounts(core: "Appliance") -> list[Mount]:
    """The paths, ahead of TF Serving's ``/v1`` (module docstring). Specific prefixes, so a
    ``:predict`` pays no pattern of these."""
    api = OpenAIAPI(core)
    gone = "|".join(re.escape(p) for p in NOT_SERVED)
    return [*completion_mounts(api), *openai_mounts(OpenAIAPI(core), OpenAIAPI(core)),
            *[Mount("openai-not-served", p + "/", INFERENCE, api.not_served, pattern=re.compile(f"(?:{gone})(?:/.*)?"),
                    summary="OpenAI API families this server does not serve (OpenAI's error)") for p in NOT_SERVED]]


__all__ = ["OPENAPI_PATHS", "OpenAIAPI", "error_body", "mounts", "render"]
