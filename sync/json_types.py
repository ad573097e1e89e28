"""Types for parsed JSON documents in ``sync`` (the same aliases as ``appliance/core/json_types.py``).

``sync`` is a layer below ``appliance.core`` (tests/test_layers.py) and may not import it, so
the aliases are written here again; mypy compares recursive aliases by structure, so a value
typed with one is accepted where the other is expected. A reader narrows with ``isinstance``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias, Union

JSONScalar: TypeAlias = Union[None, bool, int, float, str]
JSONValue: TypeAlias = Union[JSONScalar, list["JSONValue"], dict[str, "JSONValue"]]
JSONObject: TypeAlias = dict[str, JSONValue]
JSONArray: TypeAlias = list[JSONValue]

ReadJSONValue: TypeAlias = Union[JSONScalar, Sequence["ReadJSONValue"], Mapping[str, "ReadJSONValue"]]
ReadJSONObject: TypeAlias = Mapping[str, ReadJSONValue]

__all__ = ["JSONArray", "JSONObject", "JSONScalar", "JSONValue", "ReadJSONObject", "ReadJSONValue"]
