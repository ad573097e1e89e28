"""Types for parsed JSON documents, so a signature can say "a JSON value" instead of ``Any``.

``JSONValue`` is what ``json.loads`` (or msgspec's untyped decode) can return; a reader narrows
it with ``isinstance`` before use, which is the check a request handler owes anyway. ``JSONObject``
is the common case: the top-level body of a request or answer, or a config/manifest document.
A function that *builds* a document for ``json.dumps`` may return ``JSONObject`` too.

Mypy accepts the recursive alias (since 0.990); the ``Mapping``/``Sequence`` forms let a
function that only reads take a ``dict[str, int]`` or a ``list[str]`` without a copy (``dict``
and ``list`` are invariant, so ``dict[str, int]`` is not a ``dict[str, JSONValue]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias, Union

JSONScalar: TypeAlias = Union[None, bool, int, float, str]
JSONValue: TypeAlias = Union[JSONScalar, list["JSONValue"], dict[str, "JSONValue"]]
JSONObject: TypeAlias = dict[str, JSONValue]
JSONArray: TypeAlias = list[JSONValue]

# Read-only views: accept any JSON-shaped container without invariance getting in the way.
ReadJSONValue: TypeAlias = Union[JSONScalar, Sequence["ReadJSONValue"], Mapping[str, "ReadJSONValue"]]
ReadJSONObject: TypeAlias = Mapping[str, ReadJSONValue]

__all__ = ["JSONArray", "JSONObject", "JSONScalar", "JSONValue", "ReadJSONObject", "ReadJSONValue"]
