"""Types for parsed JSON documents, so a signature can say "a JSON value" instead of ``Any``.

``JSONValue`` is what ``json.loads`` (or msgspec's untyped decode) can return; a reader narrows
it with ``isinstance`` before use (``core/json_read.py``). ``JSONObject`` is the common case: a
request's or answer's body, a config or manifest document. ``ReadJSONObject`` takes any
JSON-shaped mapping without invariance getting in the way (``dict[str, int]`` is not a
``dict[str, JSONValue]``).

One definition, in ``runtimes`` (the layer below core, tests/test_layers.py), re-exported here.
``sync`` may import neither, so it keeps a copy (sync/json_types.py); mypy compares the
recursive aliases by structure, so the copies interchange.
"""

from __future__ import annotations

from runtimes.json_types import JSONArray, JSONObject, JSONScalar, JSONValue, ReadJSONObject, ReadJSONValue

__all__ = ["JSONArray", "JSONObject", "JSONScalar", "JSONValue", "ReadJSONObject", "ReadJSONValue"]
