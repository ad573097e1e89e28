"""Request and response bodies, declared once as msgspec ``Struct`` s: the same declaration
checks a request (``check``) and writes ``/openapi.json``'s components (``components``).

A field's declaration carries its JSON type, its bounds (``msgspec.Meta``) and, in
``Meta(extra={"error": ...})``, the sentence a refusal says: ``field 'n' must be an integer
from 1 to 8`` followed by msgspec's own detail in brackets (which element, which bound).
Checks that need the model (a token id inside the vocabulary, a prompt inside the context,
``max_tokens`` against the room left) stay with the code that has the model.

Why msgspec and not pydantic (``bench/request_schemas.py``; bench/RESULTS.md, "One
declaration per request body (issue 46)"; the shared 2-core box at load ~20, so read ratios):
a typical chat body (3 messages, one tool, the sampling fields, 831 bytes) is checked in
28 us by ``orjson.loads`` + ``msgspec.convert`` (the path used here: the handlers keep
reading a dict) and 13 us by ``msgspec.json.decode`` to the Struct, against 55 us by
pydantic's ``model_validate_json`` and 134 us by ``orjson.loads`` + ``model_validate``; the
handler's whole read of the body went from 132-154 us (hand-written checks) to 67-77 us.
Declaring the Structs adds 0.8 MiB RSS (0.7 MiB USS) to an interpreter that already holds
msgspec, numpy and the core (as a front worker does: appliance/fronts/messages.py);
importing pydantic and declaring the same chat request adds 10.3 MiB RSS (7.2 MiB USS).
A front worker loads only this module and the KServe bodies (through
appliance/api/kserve/rest.py): +0.3 MiB.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, cast

import msgspec

from appliance.core.errors import InvalidArgument
from appliance.core.json_types import JSONObject

T = TypeVar("T", bound=msgspec.Struct)
REF = "#/components/schemas/{name}"
_PATH = re.compile(r"`\$\.([^.\[`]+)")
_UNKNOWN = re.compile(r"unknown field `(.+)`$")
_MISSING = re.compile(r"missing required field `(.+)`$")


class FieldError(InvalidArgument):
    """A 400 naming the request field (OpenAI's ``param``) and, where OpenAI has one, a ``code``."""

    def __init__(self, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


# Any: msgspec.Meta's keywords passed through as given; its stub overloads them by kind of bound
# (ge/gt/le/lt, min_length/max_length, ...), which no one annotation of ``**bounds`` matches.
def error(text: str, **bounds: Any) -> msgspec.Meta:
    """A field's bounds (``msgspec.Meta``'s keywords) with the sentence its refusal says."""
    return msgspec.Meta(**bounds, extra={"error": text})


def _unknown_default(key: str) -> str:
    return f"unknown field {key!r}"


def check(body: Mapping[str, object], kind: type[T], unknown: Callable[[str], str] = _unknown_default) -> T:
    """``body`` (a decoded JSON object) as ``kind``, or a ``FieldError`` naming the field:
    ``unknown(key)`` says what an undeclared field gets. Strict: no string is read as a
    number, no number as a bool."""
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        raise refusal(str(exc), kind, unknown) from None


def refusal(detail: str, kind: type[msgspec.Struct], unknown: Callable[[str], str]) -> FieldError:
    """msgspec's ValidationError text as a ``FieldError`` on the top-level field it is about."""
    found = _PATH.search(detail)
    if found is not None:
        name = found.group(1)
        return FieldError(f"field '{name}' {errors(kind).get(name, 'is not valid')} ({detail})", name)
    if (found := _UNKNOWN.search(detail)) is not None:
        return FieldError(unknown(found.group(1)), found.group(1))
    if (found := _MISSING.search(detail)) is not None:
        name = found.group(1)
        return FieldError(f"field '{name}' is required and {errors(kind).get(name, 'is missing')}", name)
    return FieldError(f"the request is not valid: {detail}", None)


@functools.cache
def errors(kind: type[msgspec.Struct]) -> dict[str, str]:
    """Each field's refusal sentence (``Meta(extra={"error": ...})``), by its JSON name."""
    return {f.encode_name: text for f in _fields(kind) if (text := _error_of(f.type)) is not None}


def _error_of(node: msgspec.inspect.Type) -> str | None:
    if isinstance(node, msgspec.inspect.Metadata) and node.extra and "error" in node.extra:
        return str(node.extra["error"])
    inner: Sequence[msgspec.inspect.Type] = node.types if isinstance(node, msgspec.inspect.UnionType) else ()
    return next((text for t in inner if (text := _error_of(t)) is not None), None)


def names(kind: type[msgspec.Struct]) -> tuple[str, ...]:
    """The JSON names of a body's fields, as declared."""
    return tuple(f.encode_name for f in _fields(kind))


def _fields(kind: type[msgspec.Struct]) -> tuple[msgspec.inspect.Field, ...]:
    return cast(msgspec.inspect.StructType, msgspec.inspect.type_info(kind)).fields  # a Struct's info is one


def components(kinds: Sequence[type[msgspec.Struct]]) -> JSONObject:
    """The JSON Schemas of ``kinds`` and of every struct they hold, for
    ``components/schemas`` (refs ``#/components/schemas/<Name>``)."""
    schemas: JSONObject = msgspec.json.schema_components(kinds, ref_template=REF)[1]
    return schemas


def ref(kind: type[msgspec.Struct]) -> JSONObject:
    return {"$ref": REF.format(name=kind.__name__)}


__all__ = ["FieldError", "check", "components", "error", "errors", "names", "ref", "refusal"]
