"""TF Serving's REST JSON <-> numpy, kept off per-element Python work where possible.

Requests: row format (``instances``) and columnar format (``inputs``), ``{"b64": ...}`` for
binary strings. Responses: ``predictions`` / ``outputs`` as TF Serving shapes them (a bare
value for a single output, objects for several), outputs whose name ends in ``_bytes``
as ``{"b64": ...}``. Numeric tensors go from orjson's parse straight into one
``np.asarray`` call, and back out through orjson's native numpy serialisation.

Hostile bodies (``[limits]``), each refused with a 400 that names the limit: a body long
enough to hold more than ``max_tensor_elements`` values has them counted on its bytes before
it is parsed (``count_values``), and an ``instances`` or ``examples`` list has its rows counted
on the bytes too, stopping past ``max_instances`` (appliance/api/json_rows.py: a 16 KB gzip body
of four million strings is refused before any of them becomes an object); orjson stops at 1024 levels, so 500,000 brackets cost
nothing; the parsed document must nest no deeper than ``max_json_depth`` (``nesting``).

As TF Serving (rapidjson with kParseNanAndInfFlag): ``NaN``, ``Infinity`` and ``Inf``
(signed) are accepted and non-finite outputs are written as ``NaN`` / ``Infinity`` /
``-Infinity``; a number past the double range is refused; a double past the float32 range
becomes an infinity in a float input; integers must fit the input's type, where an int8, uint8
or int16 input takes any int32 and wraps it (util/json_tensor.cc reads them as int32, TensorFlow
casts); booleans are no numbers, even among them; an empty list is an empty tensor of any
dtype; ``b64`` is the standard alphabet, padding optional (absl::Base64Unescape), URL-safe
refused with a hint.
Like rapidjson, a byte-order mark is skipped and whatever follows the root value is ignored.

Refusals are in TF Serving's words, worked out only once a body is refused: a parse error
as rapidjson words it (python-rapidjson, rapidjson_reader.py), a tensor TF Serving would refuse as
util/json_tensor.cc words it (json_tensor_errors.py); what only this decoder refuses (a limit,
more than 64 dimensions) in its own words.
"""

from __future__ import annotations

import base64
import contextvars
import itertools
import json
import re
from typing import Any, Mapping, TypeAlias, TypeGuard, Union

import numpy as np
import orjson

from runtimes import SignatureInfo, TensorSpec

from appliance.api import json_arrays
from appliance.api.json_arrays import Parsed
from appliance.api.json_rows import rows_over
from appliance.api.tfserving.b64 import b64_decode as b64_decode  # re-exported: rest.py decodes features with it
from appliance.api.tensor_limits import check_body_values, check_elements  # shared with KServe v2
from appliance.api.tfserving.service import data_type_string
from appliance.core.config import LimitsConfig
from appliance.core.errors import InvalidArgument
from appliance.core.json_types import JSONValue

DUMP = orjson.OPT_SERIALIZE_NUMPY
DEFAULT_LIMITS = LimitsConfig()
_TRUSTED: contextvars.ContextVar["_Trust | None"] = contextvars.ContextVar("numbers_only", default=None)
_NATIVE = frozenset("biuf")  # dtype kinds orjson serialises itself
MAX_DIMS = 64  # numpy's limit on an array's dimensions
# A body this long has its rows and values counted on its bytes before any parse (bounded memory:
# simdjson's tape takes 16-32 bytes a value); a shorter one is parsed by simdjson first, whose tape
# holds each array's count (no pass of ours: the hot path's image requests are ~0.2 MB).
SCAN_FIRST = 1 << 20
ROWS = ("instances", "examples")  # the row lists limits.max_instances bounds (predict; classify and regress)
Strings: TypeAlias = Union[bytes, list["Strings"]]  # a string tensor's nested lists, decoded


def loads(body: bytes, limits: LimitsConfig = DEFAULT_LIMITS) -> Parsed:
    """A request body, parsed and checked against ``limits`` (see the module docstring)."""
    if not body:  # TF Serving's own check, before rapidjson sees the body
        raise InvalidArgument("JSON Parse error: The document is empty")
    big = len(body) >= SCAN_FIRST
    if big:  # counted on the bytes before any parser's memory is taken (module docstring)
        _check_rows_on_bytes(body, limits)
    check_body_values(body, limits)
    try:  # big numeric arrays straight into numpy, when it can; rows bounded on simdjson's tape first
        doc = json_arrays.loads(body, {key: limits.max_instances for key in ROWS})
    except json_arrays.TooMany as over:
        raise _too_many_rows(over.key, over.count, limits) from None
    if doc is None:
        if not big:
            _check_rows_on_bytes(body, limits)
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            if "depth" in str(exc):  # orjson's own cap (1024 levels) keeps 500,000 brackets harmless
                raise _too_deep(limits) from None
            doc = _as_rapidjson_reads(body, exc, limits)
    if nesting(doc, limits.max_json_depth) > limits.max_json_depth:
        raise _too_deep(limits)
    return doc


def _check_rows_on_bytes(body: bytes, limits: LimitsConfig) -> None:
    over = rows_over(body, ROWS, limits.max_instances)
    if over is not None:
        raise _too_many_rows(*over, limits)


def _too_many_rows(key: str, counted: int, limits: LimitsConfig) -> InvalidArgument:
    return InvalidArgument(f"'{key}' has more than {limits.max_instances} entries ({counted} counted before "
                           "parsing), over the limit per request (limits.max_instances); split the request")


def _as_rapidjson_reads(body: bytes, refused: orjson.JSONDecodeError, limits: LimitsConfig) -> Parsed:
    """A body orjson refused, as TF Serving's rapidjson reads it: NaN and Infinity taken, a
    byte-order mark skipped, anything after the root value ignored; else rapidjson's error
    text and offset (python-rapidjson, by appliance/api/tfserving/rapidjson_reader.py)."""
    from appliance.api.tfserving.rapidjson_reader import read  # bodies orjson refused only

    verdict = read(body)  # first: C, a tenth of the NaN pass below (which any string in a body sets off)
    if verdict is None:  # deeper than python-rapidjson follows (1000 levels), so past max_json_depth too
        raise _too_deep(limits) from refused
    if verdict.error is not None:
        raise InvalidArgument(verdict.error) from refused
    root = body[verdict.start:verdict.end]
    try:
        doc: Parsed = orjson.loads(root)
        return doc
    except orjson.JSONDecodeError as exc:
        if _NONFINITE.search(root) is not None:
            return _loads_nonfinite(root, exc, limits)
        # rapidjson takes it, orjson not: a string that is not UTF-8 (rapidjson does not check)
        raise InvalidArgument(f"JSON Parse error: {exc}") from exc


def dumps(obj: object) -> bytes:
    """``obj`` (JSON values, numpy arrays and scalars, orjson Fragments) as JSON bytes."""
    return orjson.dumps(obj, option=DUMP)


def _too_deep(limits: LimitsConfig) -> InvalidArgument:
    return InvalidArgument(f"JSON nested deeper than the limit of {limits.max_json_depth} levels "
                           "(limits.max_json_depth)")


def nesting(doc: Parsed, limit: int) -> int:
    """How deeply ``doc`` nests, along every object member and the first element of every
    list (stopping once past ``limit``). O(depth + members), not O(values): a tensor is
    regular, so its first elements show its depth, and one nested deeper elsewhere is
    ragged, which the conversion refuses."""
    deepest, stack = 0, [(doc, 0)]
    while stack and deepest <= limit:
        value, level = stack.pop()
        if isinstance(value, list):
            level += 1
            if value:
                stack.append((value[0], level))
        elif isinstance(value, np.ndarray):  # a numeric array json_arrays.py made: regular
            level += value.ndim
        elif isinstance(value, dict):
            level += 1
            stack.extend((v, level) for v in value.values())
        deepest = max(deepest, level)
    return deepest


# --- NaN and Infinity (orjson refuses them; TF Serving accepts them) ---------------------
_NONFINITE = re.compile(rb'"(?:[^"\\]|\\.)*"|(-?)(NaN|Infinity|Inf)(?![A-Za-z0-9_])', re.DOTALL)
_INT64 = range(-(1 << 63), 1 << 64)


def _loads_nonfinite(body: bytes, first: orjson.JSONDecodeError, limits: LimitsConfig) -> Parsed:
    """Parse a body with NaN/Infinity tokens as rapidjson would, numbers as orjson would."""
    found = False

    def spell(match: re.Match[bytes]) -> bytes:  # Python's json spells them NaN, Infinity, -Infinity
        nonlocal found
        if match.group(2) is None:
            return match.group(0)  # a string, kept as it is
        found = True
        return b"NaN" if match.group(2) == b"NaN" else match.group(1) + b"Infinity"

    text = _NONFINITE.sub(spell, body)
    if not found:
        raise InvalidArgument(f"JSON Parse error: {first}") from first
    try:
        doc: Parsed = json.loads(text, parse_float=_finite, parse_int=_integer)
        return doc
    except RecursionError:
        raise _too_deep(limits) from None
    except ValueError as exc:
        raise InvalidArgument(f"JSON Parse error: {exc}") from exc


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is infinity when parsed as double")
    return value


def _integer(text: str) -> int | float:
    """Like orjson: 64-bit integers as int, longer ones as float (so a huge one is refused)."""
    if len(text) <= 21:
        value = int(text)
        if value in _INT64:
            return value
    return _finite(text)


# --- decoding ---------------------------------------------------------------------------


def _is_b64(obj: Parsed) -> TypeGuard[dict[str, Parsed]]:
    return isinstance(obj, dict) and len(obj) == 1 and "b64" in obj


def _strings(value: Parsed, where: str, depth: int = 0) -> Strings:
    """Nested lists of str / {"b64"} -> nested lists of bytes."""
    if depth > MAX_DIMS:
        raise InvalidArgument(f"{where}: a tensor has at most {MAX_DIMS} dimensions")
    if isinstance(value, list):
        return [_strings(v, where, depth + 1) for v in value]
    if isinstance(value, str):
        return value.encode()
    if _is_b64(value):
        return b64_decode(value, where)
    raise InvalidArgument(f"{where}: expected a string or {{\"b64\": ...}}, got {type(value).__name__}")


def _contains_b64(value: Parsed) -> bool:
    while isinstance(value, list) and value:
        value = value[0]
    return _is_b64(value)


def to_array(value: Parsed, spec: TensorSpec, where: str) -> np.ndarray:
    """One input's JSON value as an array of the signature's dtype and rank."""
    try:
        if spec.is_string:
            arr = np.array(_strings(value, where), dtype=object)
            # every element, not just the first: ["", [""]] is ragged too (numpy makes it an
            # object array holding a list, which no backend takes)
            if arr.dtype != object or (arr.ndim and not all(isinstance(v, bytes) for v in arr.flat)):
                raise ValueError("inhomogeneous string tensor")
        else:
            if _contains_b64(value):
                raise InvalidArgument(f"{where}: {{\"b64\": ...}} given for a {data_type_string(spec.dtype)} input; "
                                      "b64 is for string (DT_STRING) inputs")
            arr = _numeric(value, spec, where)
    except InvalidArgument:
        raise
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidArgument(f"{where}: cannot be converted to a {data_type_string(spec.dtype)} tensor "
                              "(is it ragged, or of the wrong type?)") from exc
    return arr


_KIND_NAMES = {"U": "String", "S": "String", "O": "Null or Object", "b": "Bool", "f": "Decimal", "i": "Integer",
               "u": "Integer"}


# AddValueToTensor reads an int8, uint8 or int16 input's values as int32 (rapidjson's IsInt) into
# the TensorProto's int_val, and Tensor::FromProto narrows each with a C++ cast: 300 is 44 in an int8
_READ_AS = {np.dtype(t): np.dtype(np.int32) for t in (np.int8, np.uint8, np.int16)}


def _numeric(value: Parsed, spec: TensorSpec, where: str) -> np.ndarray:
    """Like TF Serving: numbers for numeric inputs (no numeric strings, booleans or nulls),
    integers for integer inputs, booleans for bool inputs; an empty list is an empty tensor."""
    if spec.dtype.kind == "f" and isinstance(value, list) and _trusted():  # only numbers: convert in one step
        with np.errstate(over="ignore"):  # a double past float32's range is an infinity, as in TF Serving
            return np.asarray(value, dtype=spec.dtype)
    arr = np.asarray(value)
    if not arr.size:  # numpy makes [] float64; TF Serving takes it for any dtype
        return arr.astype(spec.dtype)
    have, want = arr.dtype.kind, spec.dtype.kind
    fits = (have in "iu" and want in "iuf") or (have == want == "f") or (have == want == "b")
    if not fits or have in "iuf" and _holds_bool(value, arr.ndim):  # numpy makes [true, 1.5] floats
        raise InvalidArgument(f"{where}: JSON Value of type {_KIND_NAMES.get(have, have)} "
                              f"is not of expected type: {data_type_string(spec.dtype)}")
    if arr.dtype == spec.dtype:
        return arr
    if have in "iu" and want in "iu" and not _fits(arr, _READ_AS.get(spec.dtype, spec.dtype)):
        raise InvalidArgument(f"{where}: a value is out of the range of {data_type_string(spec.dtype)}")
    with np.errstate(over="ignore"):
        return arr.astype(spec.dtype)  # an integer wraps as in a C++ cast


def _holds_bool(value: Parsed, ndim: int) -> bool:
    """Whether nested lists of ``ndim`` levels hold a boolean among their numbers, counted at
    C speed (json_arrays.py's arrays hold none: it takes numbers only)."""
    if not isinstance(value, list):
        return False
    leaves: Any = value  # nested lists, ndim deep: each chain below flattens one level
    for _ in range(ndim - 1):
        leaves = itertools.chain.from_iterable(leaves)
    return bool in set(map(type, leaves))


def _fits(arr: np.ndarray, dtype: np.dtype) -> bool:
    info = np.iinfo(dtype)
    return bool(info.min <= arr.min() and arr.max() <= info.max)


def _named(signature: SignatureInfo, values: Mapping[str, Parsed], where: str,
           ignore_extra: bool = False) -> dict[str, np.ndarray]:
    """Named inputs. Columnar requests ignore keys the signature lacks, as TF Serving does."""
    if ignore_extra:
        values = {k: v for k, v in values.items() if k in signature.inputs}
    unknown = [k for k in values if k not in signature.inputs]
    if unknown:
        raise InvalidArgument(f"{where}: unknown input {unknown[0]!r}; signature {signature.name!r} takes "
                              f"{', '.join(sorted(signature.inputs))}")
    missing = [k for k in signature.inputs if k not in values]
    if missing and where == "inputs":  # TF Serving's text (util/json_tensor.cc FillTensorMapFromInputsMap)
        raise InvalidArgument(f"Missing named input: {missing[0]} in 'inputs' object.")
    if missing:
        raise InvalidArgument(f"{where}: missing input {missing[0]!r} of signature {signature.name!r}")
    return {k: to_array(v, signature.inputs[k], f"input {k!r}") for k, v in values.items()}


_NUMERIC_BYTES = b"0123456789.eE+-,[]{}: \t\r\n"
_QUOTED = re.compile(rb'"[^"]*"')


def numbers_only(raw: bytes, body: Mapping[str, Parsed]) -> bool:
    """True when every JSON string in ``raw`` is a key or a top-level string value, so
    the tensors hold nothing but numbers and can go to numpy without a per-element check.
    One C-speed pass over the bytes instead of a second pass over the parsed values."""
    if b"\\" in raw:
        return False
    expected = len(body) + sum(isinstance(v, str) for v in body.values())
    inputs = body.get("inputs")
    if isinstance(inputs, dict):
        expected += len(inputs)
    if raw.count(b'"') != 2 * expected:
        return False
    return not _QUOTED.sub(b"", raw.translate(None, _NUMERIC_BYTES))


class _Trust:
    """``numbers_only(raw, body)``, worked out the first time a list tensor asks for it: a body
    whose tensors appliance/api/json_arrays.py already made numpy (it read them as numbers
    only) never pays for the pass over its bytes, an image request's 0.15 ms."""

    __slots__ = ("raw", "body", "answer")

    def __init__(self, raw: bytes, body: Mapping[str, Parsed]):
        self.raw, self.body = raw, body
        self.answer: bool | None = None

    def __call__(self) -> bool:
        if self.answer is None:
            self.answer = numbers_only(self.raw, self.body)
        return self.answer


def _trusted() -> bool:
    """Whether the body under decode holds numbers only (``_Trust``); False without its bytes."""
    trust = _TRUSTED.get()
    return trust is not None and trust()


def decode_predict(body: Mapping[str, Parsed], signature: SignatureInfo, raw: bytes | None = None,
                   limits: LimitsConfig = DEFAULT_LIMITS) -> tuple[dict[str, np.ndarray], bool]:
    """(inputs, row_format) of a :predict request body (``raw``: its bytes, for the fast check)."""
    token = _TRUSTED.set(_Trust(raw, body) if raw is not None else None)
    try:
        inputs, row_format = _decode_predict(body, signature, limits)
    except InvalidArgument as exc:
        from appliance.api.tfserving.json_tensor_errors import predict_error  # the error path only

        worded = predict_error({k: as_lists(v) for k, v in body.items()}, signature)  # TF Serving's text, where TF Serving refuses it too
        if worded is None:
            raise
        raise InvalidArgument(worded) from exc
    finally:
        _TRUSTED.reset(token)
    check_elements(inputs, limits)
    return inputs, row_format


def as_lists(value: Parsed) -> JSONValue:
    """``value`` with json_arrays.py's numpy arrays as the lists they were in the body."""
    if isinstance(value, np.ndarray):
        listed: JSONValue = value.tolist()
        return listed
    if isinstance(value, dict):
        return {k: as_lists(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_lists(v) for v in value]
    return value


def check_rows(count: int, what: str, limits: LimitsConfig = DEFAULT_LIMITS) -> None:
    if count > limits.max_instances:
        raise InvalidArgument(f"'{what}' has {count} entries, over the limit of {limits.max_instances} "
                              "per request (limits.max_instances); split the request")


def _decode_predict(body: Mapping[str, Parsed], signature: SignatureInfo,
                    limits: LimitsConfig) -> tuple[dict[str, np.ndarray], bool]:
    has_rows, has_cols = "instances" in body, "inputs" in body
    if has_rows and has_cols:
        raise InvalidArgument("JSON Value: both 'instances' and 'inputs' given; use one of them")
    if not has_rows and not has_cols:
        raise InvalidArgument("Missing 'inputs' or 'instances' key")
    if has_cols:
        value = body["inputs"]
        if isinstance(value, dict) and not _is_b64(value):
            return _named(signature, value, "inputs", ignore_extra=True), False
        return _single(signature, value, "inputs"), False
    instances = body["instances"]
    if not isinstance(instances, (list, np.ndarray)):
        raise InvalidArgument("'instances' must be a list, one entry per instance")
    if not len(instances):
        raise InvalidArgument("JSON Value: No values in 'instances' array")
    check_rows(len(instances), "instances", limits)
    if isinstance(instances, list) and len(instances) and isinstance(instances[0], dict) and not _is_b64(instances[0]):
        return _rows_named(signature, instances), True
    return _single(signature, instances, "instances"), True


def _single(signature: SignatureInfo, value: Parsed, where: str) -> dict[str, np.ndarray]:
    if len(signature.inputs) != 1:
        raise InvalidArgument(f"{where}: signature {signature.name!r} has {len(signature.inputs)} inputs "
                              f"({', '.join(sorted(signature.inputs))}); name each of them")
    (name, spec), = signature.inputs.items()
    return {name: to_array(value, spec, where)}


def _rows_named(signature: SignatureInfo, instances: list[Parsed]) -> dict[str, np.ndarray]:
    columns: dict[str, list[Parsed]] = {}
    for i, row in enumerate(instances):
        if not isinstance(row, dict):
            raise InvalidArgument(f"instances[{i}]: every instance must be an object like the first one")
        if i and row.keys() != columns.keys():
            raise InvalidArgument(f"instances[{i}]: has inputs {sorted(row)}, expected {sorted(columns)}")
        for k, v in row.items():
            columns.setdefault(k, []).append(v)
    unknown = [k for k in columns if k not in signature.inputs]
    if unknown:  # every row has the first one's keys: TF Serving's text names element 0 (util/json_tensor.cc)
        raise InvalidArgument(f"Failed to process element: 0 key: {unknown[0]} of 'instances' list. Error: "
                              f"INVALID_ARGUMENT: JSON object: does not have named input: {unknown[0]}")
    return _named(signature, columns, "instances")


# --- encoding ---------------------------------------------------------------------------
_NONFINITE_TOKENS = {"nan": b"NaN", "inf": b"Infinity", "-inf": b"-Infinity"}


def _jsonable(name: str, arr: np.ndarray) -> object:
    """An output array in a form orjson serialises as TF Serving would print it."""
    if arr.dtype.kind in _NATIVE:
        if arr.dtype == np.float16:
            arr = arr.astype(np.float32)
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():  # orjson would write null
            return orjson.Fragment(_nonfinite_json(arr))
        if arr.ndim == 0:  # orjson serialises arrays, not 0-d ones: a numpy scalar keeps float32's digits
            return arr[()]
        return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    encode_b64 = name.endswith("_bytes")
    flat = [_text(v, encode_b64) for v in arr.reshape(-1)]
    return np.array(flat, dtype=object).reshape(arr.shape).tolist() if arr.ndim else flat[0]


def numbers_json(arr: np.ndarray) -> object:
    """A numeric array (or 0-d value) as TF Serving writes it, ``NaN``, ``Infinity`` and
    ``-Infinity`` spelled out (orjson alone writes ``null``): :regress results and scores."""
    return _jsonable("", arr)


def _nonfinite_json(arr: np.ndarray) -> bytes:
    """A float array with NaN or infinities as TF Serving writes it: orjson's text, whose
    ``null`` stand exactly for the non-finite values, with their spellings put back."""
    text = orjson.dumps(np.ascontiguousarray(arr) if arr.ndim else arr.item(), option=DUMP)
    tokens = [_NONFINITE_TOKENS[str(v)] for v in arr[~np.isfinite(arr)].tolist()]
    pieces = text.split(b"null")
    out = [pieces[0]]
    for token, piece in zip(tokens, pieces[1:]):
        out += [token, piece]
    return b"".join(out)


def _text(value: object, encode_b64: bool) -> object:
    if isinstance(value, bytes):
        if encode_b64:
            return {"b64": base64.b64encode(value).decode()}
        try:
            return value.decode()
        except UnicodeDecodeError:
            return {"b64": base64.b64encode(value).decode()}
    return value.item() if hasattr(value, "item") else value


def encode_predict(outputs: Mapping[str, np.ndarray], row_format: bool) -> bytes:
    if not row_format:
        if len(outputs) == 1:
            (name, arr), = outputs.items()
            return dumps({"outputs": _jsonable(name, arr)})
        return dumps({"outputs": {k: _jsonable(k, v) for k, v in outputs.items()}})
    if len(outputs) == 1:
        (name, arr), = outputs.items()
        return dumps({"predictions": _jsonable(name, arr)})
    sizes = {v.shape[0] if v.ndim else -1 for v in outputs.values()}
    if len(sizes) != 1 or -1 in sizes:
        raise InvalidArgument("outputs have different batch sizes; use the columnar 'inputs' format")
    n = sizes.pop()
    return dumps({"predictions": [{k: _row(k, v, i) for k, v in outputs.items()} for i in range(n)]})


def _row(name: str, arr: np.ndarray, i: int) -> object:
    """Row ``i`` of one output, for a row-format response with several outputs."""
    row = arr[i]
    if isinstance(row, np.ndarray) or arr.dtype.kind in _NATIVE:
        return _jsonable(name, np.asarray(row))
    return _text(row, name.endswith("_bytes"))
