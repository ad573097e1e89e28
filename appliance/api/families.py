"""The API families of the REST app, each a module whose ``mounts(core)`` returns the path
families it answers itself (appliance/api/mounts.py): TF Serving's REST API, KServe v2, token
generation and the OpenAI-compatible API beside it (which takes the /v1 paths TF Serving
answers 400). A module may also hold ``OPENAPI_PATHS``, merged into ``/openapi.json``.
Rollouts are the core's: every family's handle is routed and judged there
(appliance/core/rollout.py). A family whose module this install lacks is skipped.
"""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING

from appliance.api.mounts import INFERENCE, Mount, WSGIApp

if TYPE_CHECKING:
    from appliance.core.appliance import Appliance

API_MOUNTS = ("appliance.api.tfserving.rest:mounts", "appliance.api.kserve.rest:mounts",
              "appliance.api.generate:mounts", "appliance.api.openai:mounts")


# The token-stream paths, here so a front worker can mount them without importing their families
GENERATE_RE = re.compile(r"(?i)/v1/models/([^/:]+)(?:(?:/versions/(\d+))|(?:/labels/([^/:]+)))?:generate")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
EMBEDDINGS, MODELS = "/v1/embeddings", "/v1/models"


def generate_mount(handler: WSGIApp) -> Mount:
    """``POST /v1/models/{m}[/versions/{v}|/labels/{l}]:generate``, ahead of TF Serving's ``/v1``."""
    return Mount("generate", "/v1/", INFERENCE, handler, methods=frozenset({"POST"}), suffix=":generate",
                 pattern=GENERATE_RE, summary="token generation")


def completion_mounts(handler: WSGIApp) -> list[Mount]:
    """OpenAI's ``/v1/chat/completions`` and ``/v1/completions``."""
    return [Mount("openai", "/v1/chat/", INFERENCE, handler, pattern=re.compile(re.escape(CHAT)),
                  summary="OpenAI chat completions"),
            Mount("openai", "/v1/completions/", INFERENCE, handler, pattern=re.compile(re.escape(COMPLETIONS)),
                  summary="OpenAI completions")]


def openai_mounts(embeddings: WSGIApp, models: WSGIApp) -> list[Mount]:
    """OpenAI's ``/v1/embeddings`` and ``GET /v1/models[/{id}]`` (a plain name there: TF Serving's
    model status, for its clients, unless an OpenAI client asks: appliance/api/openai.py). The
    handlers may be one family answering both by path; two objects let the route table name a
    request's mount by its handler. Every ``/v1/models/{id}``, a plain name too, is the family's:
    on the front path's loop it answers TF Serving's status itself (the process that holds the
    versions; a front worker forwards it there and awaits it), never through a thread."""
    return [Mount("openai-embeddings", "/v1/embeddings/", INFERENCE, embeddings,
                  pattern=re.compile(re.escape(EMBEDDINGS)), summary="OpenAI embeddings"),
            Mount("openai-models", "/v1/models/", INFERENCE, models, methods=frozenset({"GET", "HEAD"}),
                  pattern=re.compile(re.escape(MODELS) + r"(?:/[^/]+)?"),
                  summary="OpenAI model list and model (TF Serving's model status for its clients)")]


def token_mounts(generate: WSGIApp, completions: WSGIApp) -> list[Mount]:
    """Every path of the LLM families (token streams, and OpenAI's embeddings and model list
    beside them): answered on the loop by the families in the serving process, forwarded to it
    (on the worker's loop) in a front worker (appliance/fronts/app.py). ``completions`` answers
    all of OpenAI's paths."""
    return [generate_mount(generate), *completion_mounts(completions), *openai_mounts(completions, completions)]


def mounts_of(core: "Appliance") -> list[Mount]:
    out = []
    for spec in API_MOUNTS:
        module_name, _, function = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:  # the module exists but something it needs is missing: say so
                raise
            continue
        out += getattr(module, function)(core)
    return out
