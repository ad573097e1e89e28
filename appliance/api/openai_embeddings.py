"""``POST /v1/embeddings`` of the OpenAI API, for encoder versions (``client.embeddings.create``).

**Signature convention.** A version serves embeddings when it has a signature named
``embed`` (else ``serving_default``) whose output ``embeddings`` (or its only output) is
[batch, dim] float, and whose input is either

* one string tensor [batch]: the texts as they are (a TFLite or SavedModel that tokenizes
  inside), or
* ``input_ids`` [batch, n] int (and optionally ``attention_mask`` [batch, n]): the texts
  tokenized with the version's ``assets/vocab.json``, right-padded with 0 to the longest (or
  to a fixed n), the mask 1 on tokens and 0 on padding.

``input`` is a string or a list of strings (or of token-id lists, for the ``input_ids``
form); ``encoding_format`` ``float`` (default) or ``base64`` (little-endian float32, as
OpenAI); ``dimensions`` is refused unless it is the model's own. The request runs through
the version's handle like any ``:predict`` (batching, labels, rollouts, metrics).
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, cast

import numpy as np

from appliance.api.openai_fields import FieldError
from appliance.core.errors import InvalidArgument
from appliance.core.json_types import JSONObject, JSONValue, ReadJSONObject

if TYPE_CHECKING:
    from appliance.core.seams import ModelHandle
    from appliance.core.tokenizer import Tokenizer
    from runtimes import SignatureInfo

SIGNATURES = ("embed", "serving_default")


def signature(handle: "ModelHandle", model: str) -> "SignatureInfo":
    for name in SIGNATURES:
        sig = handle.signatures.get(name)
        if sig is not None:
            return sig
    raise FieldError(f"model '{model}' serves no embeddings: it has no 'embed' or 'serving_default' signature",
                     "model")


def serves(handle: "ModelHandle") -> bool:
    """Whether the version is an encoder by the convention (module docstring), as ``/v1/models``
    lists it: an ``embed`` signature, or a ``serving_default`` whose output is ``embeddings``
    (any TensorFlow model has a serving_default: that alone makes no encoder)."""
    sig = handle.signatures.get("embed")
    named = sig is not None
    sig = sig or handle.signatures.get("serving_default")
    if sig is None or not ("embeddings" in sig.outputs or (named and len(sig.outputs) == 1)):
        return False
    names = list(sig.inputs)
    return "input_ids" in sig.inputs or (len(names) == 1 and sig.inputs[names[0]].is_string)


Item = str | list[int]  # one input: a text, or its token ids


def inputs(body: ReadJSONObject) -> list[Item]:
    given = body.get("input")
    items = [given] if isinstance(given, str) or (isinstance(given, list) and given and
                                                   all(isinstance(t, int) for t in given)) else given
    if not isinstance(items, list) or not items or not all(
            (isinstance(t, str) and t) or (isinstance(t, list) and t and all(type(i) is int for i in t))
            for t in items):
        raise FieldError("field 'input' must be a non-empty string, a list of them, or token-id lists", "input")
    return cast("list[Item]", items)  # each checked above


def feeds(sig: "SignatureInfo", items: list[Item], vocab: "Tokenizer | None",
          model: str) -> tuple[dict[str, np.ndarray], int]:
    """(the signature's inputs, prompt tokens) for the items (module docstring)."""
    names = list(sig.inputs)
    if len(names) == 1 and sig.inputs[names[0]].is_string:
        if not all(isinstance(t, str) for t in items):
            raise FieldError(f"model '{model}' takes text; 'input' must be strings", "input")
        return {names[0]: np.array([t.encode("utf-8") for t in items if isinstance(t, str)], dtype=object)}, 0
    if "input_ids" not in sig.inputs:
        raise FieldError(f"model '{model}': its embedding signature takes neither one string tensor nor "
                         f"'input_ids' (it takes {names})", "model")
    ids = [_ids(t, vocab, model) for t in items]
    spec = sig.inputs["input_ids"]
    fixed = spec.shape[1] if spec.shape and len(spec.shape) == 2 and spec.shape[1] > 0 else None
    width = fixed or max(len(t) for t in ids)
    if any(len(t) > width for t in ids):
        raise FieldError(f"field 'input': a text has {max(len(t) for t in ids)} tokens; this model takes at most "
                         f"{width}", "input")
    matrix = np.zeros((len(ids), width), spec.dtype)
    mask = np.zeros((len(ids), width), spec.dtype)
    for i, t in enumerate(ids):
        matrix[i, :len(t)], mask[i, :len(t)] = t, 1
    out = {"input_ids": matrix}
    if "attention_mask" in sig.inputs:
        out["attention_mask"] = mask.astype(sig.inputs["attention_mask"].dtype)
    return out, sum(len(t) for t in ids)


def _ids(item: Item, vocab: "Tokenizer | None", model: str) -> list[int]:
    if isinstance(item, list):
        return item
    if vocab is None:
        raise FieldError(f"model '{model}' ships no tokenizer (tokenizer.json, tokenizer.model or assets/vocab.json): send token-id lists", "input")
    try:
        return list(vocab.encode(item))
    except InvalidArgument as exc:
        raise FieldError(f"field 'input': {exc.message}", "input") from exc


def vectors(outputs: dict[str, np.ndarray], model: str) -> np.ndarray:
    name = "embeddings" if "embeddings" in outputs else (next(iter(outputs)) if len(outputs) == 1 else None)
    array = outputs.get(name) if name else None
    if array is None or array.ndim != 2:
        raise FieldError(f"model '{model}': its embedding signature must return 'embeddings' [batch, dim]", "model")
    return np.asarray(array, np.float32)


def answer(body: ReadJSONObject, found: np.ndarray, answered_by: str, tokens: int) -> JSONObject:
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise FieldError("field 'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and dims != found.shape[1]:
        raise FieldError(f"field 'dimensions': this model's embeddings have {found.shape[1]}", "dimensions")
    data: list[JSONValue] = [{"object": "embedding", "index": i,
                              "embedding": base64.b64encode(row.astype("<f4").tobytes()).decode()
                              if encoding == "base64" else row.tolist()} for i, row in enumerate(found)]
    return {"object": "list", "data": data, "model": answered_by,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


__all__ = ["answer", "feeds", "inputs", "serves", "signature", "vectors"]
