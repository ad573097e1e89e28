"""Narrowing a parsed JSON value (``json_types.JSONValue``) to what a reader expects.

A status section, a manifest or a report is read field by field with ``.get``; each field is
a ``JSONValue`` until checked. These helpers do the ``isinstance`` check once and give an
empty or ``None`` answer for a value of the wrong shape, which is what the readers did
before with ``x.get(...) or {}`` (a malformed document reads as a missing field).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from appliance.core.json_types import ReadJSONObject, ReadJSONValue

_EMPTY: ReadJSONObject = {}


def obj(value: object) -> ReadJSONObject:
    """``value`` if it is a JSON object, else an empty one."""
    return value if isinstance(value, Mapping) else _EMPTY


def seq(value: object) -> Sequence[ReadJSONValue]:
    """``value`` if it is a JSON array, else an empty one (a string is not an array)."""
    return value if isinstance(value, (list, tuple)) else ()


def objs(value: object) -> list[ReadJSONObject]:
    """The JSON objects in the array ``value`` (anything else in it, or a non-array, skipped)."""
    return [item for item in seq(value) if isinstance(item, Mapping)]


def int_or_none(value: object) -> int | None:
    """``int(value)`` for a number or a numeric string, else ``None``."""
    if not isinstance(value, (int, float, str)):
        return None
    try:
        return int(value)
    except (ValueError, OverflowError):
        return None


def str_or_none(value: object) -> str | None:
    """``value`` if it is a string, else ``None``."""
    return value if isinstance(value, str) else None


def number(value: object, default: float = 0.0) -> float:
    """``value`` as a float if it is a number (not a bool), else ``default``."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


__all__ = ["int_or_none", "number", "obj", "objs", "seq", "str_or_none"]
