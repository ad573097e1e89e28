"""JSON documents whose big numeric arrays arrive as numpy arrays, without a Python number each.

A general JSON parser (orjson) builds a Python float per value, and the decoders then
copy those into numpy: for a 96x96x3 image request, 27,648 objects and about 3 ms, most of
a request's CPU. simdjson (pysimdjson) parses the document once and hands an array's
numbers over as one buffer (``Array.as_buffer``), so ``loads`` returns the document with
every numeric array of ``MIN_VALUES`` or more as an ``np.ndarray`` and everything else as
the usual Python values. The result is what ``np.asarray`` would have made of orjson's
lists, or nothing:

- every value an integer (within int64): int64; any other number among them: float64;
- nested arrays must be rectangular: the shape is read along first elements, the count
  of numbers must match it, and the array's skeleton (its brackets and commas, read off the
  raw bytes) must be exactly the rectangle's, so ``[[1, 2], [3], [4, 5, 6]]`` is never
  taken for a 3x2 array;
- anything else (booleans, strings, nulls, objects or ``NaN`` among the numbers, ragged
  nesting, an array whose key is not found exactly once in the bytes, a document with an
  escaped character or a duplicate key, one simdjson refuses) is left to the caller: ``loads`` returns None for a document it cannot take,
  and an array it cannot take stays a Python list, so the decoders' own checks and error
  texts apply unchanged.

Measured (bench/RESULTS.md, "Every core"): the image request decodes in about a third of
orjson's time, the skeleton check included.

Thread-safety: one simdjson parser per thread; ``loads`` keeps no proxy past its return.
"""

from __future__ import annotations

import math
import threading
from functools import lru_cache
from typing import TYPE_CHECKING, Callable, Literal, Mapping, TypeAlias, Union, cast

import numpy as np

from appliance.core.json_types import JSONScalar

if TYPE_CHECKING:  # NDArray is named in a string below: numpy.typing is not imported at run time
    from numpy.typing import NDArray

try:
    import simdjson
except ImportError:  # the decoders' orjson path does everything, a little slower
    simdjson = None  # type: ignore[assignment]  # the module or None: each use checks

MIN_VALUES = 1024  # smaller arrays are cheaper as lists than the skeleton check
MIN_BODY = 2 * MIN_VALUES  # bytes: a body shorter than this holds no array worth it ("1," a value at least)
_NOT_SKELETON = b"0123456789.eE+- \t\r\n"
_WHITESPACE = b" \t\r\n"
_local = threading.local()


# A document as ``loads`` returns it: JSON, with big numeric arrays already numpy (int64, uint64
# or float64). The decoders narrow it with isinstance, as they would a plain JSON document.
Parsed: TypeAlias = Union[JSONScalar, "NDArray[np.generic]", list["Parsed"], dict[str, "Parsed"]]
ParsedObject: TypeAlias = dict[str, Parsed]


class TooMany(Exception):
    """A top-level array holds more members than ``loads``'s ``rows`` allow (no value built yet)."""

    def __init__(self, key: str, count: int):
        super().__init__(key, count)
        self.key, self.count = key, count


def loads(raw: bytes, rows: Mapping[str, int] | None = None, before: Callable[[], None] | None = None) -> Parsed | None:
    """``raw`` parsed, big numeric arrays as numpy (module docstring); None when this path
    does not apply (the caller parses it its own way). Between simdjson's parse (its tape: no
    Python value yet) and the conversion, ``TooMany`` when an array under a top-level key of
    ``rows`` holds more members than its bound (simdjson keeps an array's count: free), then
    ``before()`` (the caller's other checks)."""
    if simdjson is None or len(raw) < MIN_BODY or b"\\" in raw:
        return None  # (an escape: simdjson finds members by their raw key, so "a\"b" would not be found)
    parser = getattr(_local, "parser", None)
    if parser is None:
        parser = _local.parser = simdjson.Parser()
    try:
        doc = parser.parse(raw)
    except (ValueError, TypeError, RuntimeError):  # not JSON simdjson takes: NaN, depth, bad bytes
        return None
    try:
        _check_rows(doc, rows or {})
        if before is not None:
            before()
        return _convert(doc, None, raw)
    except (_Duplicate, KeyError):  # a key twice, or one simdjson cannot look up as decoded
        return None
    finally:
        del doc  # the parser may be reused only once no proxy of this document is alive


def _check_rows(doc: simdjson.SimValue, rows: Mapping[str, int]) -> None:
    if not rows or not isinstance(doc, simdjson.Object):
        return
    keys = list(doc.keys())
    if len(set(keys)) != len(keys):
        raise _Duplicate(keys)  # which one would the caller's parser take? Not this path's to say
    for key, bound in rows.items():
        if key in keys:
            value = doc[key]
            if isinstance(value, simdjson.Array) and len(value) > bound:
                raise TooMany(key, len(value))


class _Duplicate(Exception):
    """A key twice in one object: orjson keeps the last, simdjson finds the first."""


def _convert(value: simdjson.SimValue, key: str | None, raw: bytes) -> Parsed:
    if isinstance(value, simdjson.Object):
        keys = list(value.keys())
        if len(set(keys)) != len(keys):
            raise _Duplicate(keys)
        return {k: _convert(value[k], k, raw) for k in keys}  # items() would convert every value
    if isinstance(value, simdjson.Array):
        if not len(value):
            return []
        first = value[0]
        if isinstance(first, simdjson.Object):
            return [_convert(v, None, raw) for v in value]
        if key is not None and _numeric_leaf(first):
            arr = _numbers(value, key, raw)
            if arr is not None:
                return arr
        # as_list builds JSON containers; its stub says bare ``dict``/``list`` for them
        return cast("list[Parsed]", value.as_list())
    return value


def _numeric_leaf(value: simdjson.SimValue) -> bool:
    while isinstance(value, simdjson.Array):
        if not len(value):
            return False
        value = value[0]
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numbers(array: simdjson.Array, key: str, raw: bytes) -> NDArray[np.generic] | None:
    shape = _shape(array)
    count = math.prod(shape)
    if count < MIN_VALUES:
        return None
    flat = _buffer(array)
    if flat is None or flat.size != count or not _rectangular(raw, key, shape):
        return None
    return flat.reshape(shape)


def _shape(array: simdjson.SimValue) -> tuple[int, ...]:
    shape = []
    while isinstance(array, simdjson.Array):
        shape.append(len(array))
        if not len(array):
            break
        array = array[0]
    return tuple(shape)


def _buffer(array: simdjson.Array) -> NDArray[np.generic] | None:
    """The numbers, flattened: int64 when every one is an integer, uint64 when they are but
    some exceed int64 (as numpy reads them), else float64."""
    kinds: tuple[tuple[Literal["i", "u", "d"], type[np.generic]], ...] = (
        ("i", np.int64), ("u", np.uint64), ("d", np.float64))
    for of_type, dtype in kinds:
        try:
            return np.frombuffer(array.as_buffer(of_type=of_type), dtype=dtype)
        except (TypeError, ValueError, OverflowError):  # INCORRECT_TYPE: not all of that kind
            continue
    return None


def _rectangular(raw: bytes, key: str, shape: tuple[int, ...]) -> bool:
    """Whether the array under ``key`` in ``raw`` has exactly the rectangle's skeleton."""
    quoted = b'"' + key.encode() + b'"'
    at = raw.find(quoted)
    if at < 0:  # escaped: which array is it?
        return False
    colon = _skip(raw, at + len(quoted))
    start = _skip(raw, colon + 1)
    if raw[colon:colon + 1] != b":" or raw[start:start + 1] != b"[":
        return False
    # The array holds only numbers (its buffer was read), so it holds no quote: the first quote
    # from its start lies past its end, and a second occurrence of the key (which array is
    # it?) can only be from there on (before it, back to the first, are only the colon and
    # whitespace). memchr finds that quote at memory speed; looking for the key through the
    # array's bytes cost a fifth of a CNN request's decode.
    after = raw.find(b'"', start)
    end = len(raw) if after < 0 else after
    if raw.find(quoted, end) >= 0:
        return False
    # Deleting number characters and whitespace leaves the array's skeleton, then what follows
    # it up to that quote. Both the array's and the rectangle's skeletons are balanced, so the
    # one starts with the other only if equal.
    return raw[start:end].translate(None, _NOT_SKELETON).startswith(skeleton(shape))


def _skip(raw: bytes, at: int) -> int:
    """The first position from ``at`` that is not JSON whitespace."""
    while at < len(raw) and raw[at] in _WHITESPACE:
        at += 1
    return at


@lru_cache(maxsize=64)
def skeleton(shape: tuple[int, ...]) -> bytes:
    """The brackets and commas of a rectangular nested array of ``shape``."""
    inner = b"[" + b"," * max(0, shape[-1] - 1) + b"]" if shape[-1] else b"[]"
    for size in reversed(shape[:-1]):
        inner = b"[" + b",".join([inner] * size) + b"]"
    return inner
