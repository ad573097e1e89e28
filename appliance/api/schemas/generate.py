"""The ``:generate`` request body (appliance/api/generate.py). The bounds that depend on the
model or the config (token ids inside the vocabulary, ``max_new_tokens`` under
``[generation] max_new_tokens_limit``, one of ``input_ids`` and ``text``) are checked there."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import UNSET, UnsetType

from appliance.api.schemas import error

TokenIds = Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)]


class GenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /v1/models/{m}[/versions/{v}|/labels/{l}]:generate``: ``input_ids`` or ``text``.
    A field left out takes its default ([generation] config, greedy); null is refused."""

    input_ids: Annotated[TokenIds, error("must be a non-empty list of token ids")] | UnsetType = UNSET
    text: Annotated[str, error("must be a non-empty string", min_length=1)] | UnsetType = UNSET
    max_new_tokens: Annotated[int, error("must be a positive integer (at most [generation] "
                                         "max_new_tokens_limit)", ge=1)] | UnsetType = UNSET
    temperature: Annotated[float, error("must be a number from 0 to 100 (0: greedy)", ge=0,
                                        le=100)] | UnsetType = UNSET
    top_k: Annotated[int, error("must be an integer from 0 (off) to 2**31", ge=0, le=1 << 31)] | UnsetType = UNSET
    top_p: Annotated[float, error("must be a number above 0, at most 1", gt=0, le=1)] | UnsetType = UNSET
    seed: Annotated[int, error("must be an integer from 0 to 2**63-1", ge=0, le=(1 << 63) - 1)] | None = None
    stop: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]],
                    error("must be a list of token ids")] | UnsetType = UNSET
    stream: Annotated[bool, error("must be true or false")] | UnsetType = UNSET


class Generated(msgspec.Struct):
    """The answer without ``stream``: the tokens (None from a text-level bundle), their text
    (None without a tokenizer) and the stream's summary (appliance/core/streams.py)."""

    tokens: list[int] | None
    text: str | None
    finish_reason: str
    model_name: str
    model_version: str
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float | None
    tokens_per_s: float | None
    elapsed_ms: float


class GenerateError(msgspec.Struct):
    error: str


__all__ = ["GenerateError", "GenerateRequest", "Generated"]
