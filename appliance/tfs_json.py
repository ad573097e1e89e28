"""TF Serving's REST JSON <-> numpy, kept off per-element Python work where possible.

Requests: row format (``instances``) and columnar format (``inputs``), ``{"b64": ...}`` for
binary strings. Responses: ``predictions`` / ``outputs`` as TF Serving shapes them (a bare
value for a single output, objects for several), outputs whose name ends in ``_bytes``
as ``{"b64": ...}``. Numeric tensors go from orjson's parse straight into one
``np.asarray`` call, and back out through orjson's native numpy serialisation.
"""

from __future__ import annotations

import base64
import binascii
import contextvars
import re
from typing import Any, Mapping

import numpy as np
import orjson

from runtimes import SignatureInfo, TensorSpec

from . import protowire as pw
from .errors import InvalidArgument

DUMP = orjson.OPT_SERIALIZE_NUMPY
_TRUSTED: contextvars.ContextVar[bool] = contextvars.ContextVar("numbers_only", default=False)
_NATIVE = frozenset("biuf")  # dtype kinds orjson serialises itself
_MAX_DEPTH = 32


def loads(body: bytes) -> Any:
    if not body or not body.strip():
        raise InvalidArgument("JSON Parse error: The document is empty")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"JSON Parse error: {exc}") from exc


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=DUMP)


# --- decoding ---------------------------------------------------------------------------
def _b64(obj: Any, where: str) -> bytes:
    try:
        return base64.b64decode(obj["b64"], validate=True)
    except (binascii.Error, TypeError, ValueError) as exc:
        raise InvalidArgument(f"{where}: 'b64' value is not valid base64: {exc}") from exc


def _is_b64(obj: Any) -> bool:
    return isinstance(obj, dict) and len(obj) == 1 and "b64" in obj


def _strings(value: Any, where: str, depth: int = 0) -> Any:
    """Nested lists of str / {"b64"} -> nested lists of bytes."""
    if depth > _MAX_DEPTH:
        raise InvalidArgument(f"{where}: nested deeper than {_MAX_DEPTH} levels")
    if isinstance(value, list):
        return [_strings(v, where, depth + 1) for v in value]
    if isinstance(value, str):
        return value.encode()
    if _is_b64(value):
        return _b64(value, where)
    raise InvalidArgument(f"{where}: expected a string or {{\"b64\": ...}}, got {type(value).__name__}")


def _contains_b64(value: Any) -> bool:
    while isinstance(value, list) and value:
        value = value[0]
    return _is_b64(value)


def to_array(value: Any, spec: TensorSpec, where: str) -> np.ndarray:
    """One input's JSON value as an array of the signature's dtype and rank."""
    try:
        if spec.is_string:
            arr = np.array(_strings(value, where), dtype=object)
            if arr.dtype != object or (arr.ndim and arr.size and not isinstance(arr.flat[0], bytes)):
                raise ValueError("inhomogeneous string tensor")
        else:
            if _contains_b64(value):
                raise InvalidArgument(f"{where}: {{\"b64\": ...}} given for a {spec.dtype.name} input; "
                                      "b64 is for string (DT_STRING) inputs")
            arr = _numeric(value, spec, where)
    except InvalidArgument:
        raise
    except (ValueError, TypeError, OverflowError) as exc:
        raise InvalidArgument(f"{where}: cannot be converted to a {spec.dtype.name} tensor "
                              f"(is it ragged, or of the wrong type?): {_first_line(exc)}") from exc
    return arr


_KIND_NAMES = {"U": "String", "S": "String", "O": "Null or Object", "b": "Bool", "f": "Decimal", "i": "Integer",
               "u": "Integer"}


def _numeric(value: Any, spec: TensorSpec, where: str) -> np.ndarray:
    """Like TF Serving: numbers for numeric inputs (no numeric strings, booleans or nulls),
    integers for integer inputs, booleans for bool inputs."""
    if _TRUSTED.get() and spec.dtype.kind == "f":  # only numbers in the body: convert in one step
        return np.asarray(value, dtype=spec.dtype)
    arr = np.asarray(value)
    have, want = arr.dtype.kind, spec.dtype.kind
    fits = (have in "iu" and want in "iuf") or (have == want == "f") or (have == want == "b")
    if not fits:
        tf_name = pw.DTYPE_NAMES.get(pw.ENUM_OF.get(spec.dtype, 0), spec.dtype.name).removeprefix("DT_").lower()
        raise InvalidArgument(f"{where}: JSON Value of type {_KIND_NAMES.get(have, have)} "
                              f"is not of expected type: {tf_name}")
    return arr if arr.dtype == spec.dtype else arr.astype(spec.dtype)


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def shape_error(arr: np.ndarray, spec: TensorSpec, where: str) -> str | None:
    """Why ``arr`` does not fit the signature's declared shape, or None when it fits."""
    if spec.shape is None:
        return None
    want = spec.shape
    if arr.ndim == len(want) and all(w in (-1, None) or w == g for w, g in zip(want, arr.shape)):
        return None
    pretty = "[" + ",".join(str(d) for d in want) + "]"
    return f"{where}: expected shape {pretty} ({spec.dtype.name}), got [{','.join(str(d) for d in arr.shape)}]"


def _named(signature: SignatureInfo, values: Mapping[str, Any], where: str,
           ignore_extra: bool = False) -> dict[str, np.ndarray]:
    """Named inputs. Columnar requests ignore keys the signature lacks, as TF Serving does."""
    if ignore_extra:
        values = {k: v for k, v in values.items() if k in signature.inputs}
    unknown = [k for k in values if k not in signature.inputs]
    if unknown:
        raise InvalidArgument(f"{where}: unknown input {unknown[0]!r}; signature {signature.name!r} takes "
                              f"{', '.join(sorted(signature.inputs))}")
    missing = [k for k in signature.inputs if k not in values]
    if missing:
        raise InvalidArgument(f"{where}: missing input {missing[0]!r} of signature {signature.name!r}")
    return {k: to_array(v, signature.inputs[k], f"input {k!r}") for k, v in values.items()}


_NUMERIC_BYTES = b"0123456789.eE+-,[]{}: \t\r\n"
_QUOTED = re.compile(rb'"[^"]*"')


def numbers_only(raw: bytes, body: Mapping[str, Any]) -> bool:
    """True when every JSON string in ``raw`` is a key or a top-level string value, so
    the tensors hold nothing but numbers and can go to numpy without a per-element check.
    One C-speed pass over the bytes instead of a second pass over the parsed values."""
    if b"\\" in raw:
        return False
    expected = len(body) + sum(isinstance(v, str) for v in body.values())
    if isinstance(body.get("inputs"), dict):
        expected += len(body["inputs"])
    if raw.count(b'"') != 2 * expected:
        return False
    return not _QUOTED.sub(b"", raw.translate(None, _NUMERIC_BYTES))


def decode_predict(body: Mapping[str, Any], signature: SignatureInfo,
                   raw: bytes | None = None) -> tuple[dict[str, np.ndarray], bool]:
    """(inputs, row_format) of a :predict request body (``raw``: its bytes, for the fast check)."""
    token = _TRUSTED.set(raw is not None and numbers_only(raw, body))
    try:
        return _decode_predict(body, signature)
    finally:
        _TRUSTED.reset(token)


def _decode_predict(body: Mapping[str, Any], signature: SignatureInfo) -> tuple[dict[str, np.ndarray], bool]:
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
    if not isinstance(instances, list):
        raise InvalidArgument("'instances' must be a list, one entry per instance")
    if instances and isinstance(instances[0], dict) and not _is_b64(instances[0]):
        return _rows_named(signature, instances), True
    return _single(signature, instances, "instances"), True


def _single(signature: SignatureInfo, value: Any, where: str) -> dict[str, np.ndarray]:
    if len(signature.inputs) != 1:
        raise InvalidArgument(f"{where}: signature {signature.name!r} has {len(signature.inputs)} inputs "
                              f"({', '.join(sorted(signature.inputs))}); name each of them")
    (name, spec), = signature.inputs.items()
    return {name: to_array(value, spec, where)}


def _rows_named(signature: SignatureInfo, instances: list[Any]) -> dict[str, np.ndarray]:
    columns: dict[str, list[Any]] = {}
    for i, row in enumerate(instances):
        if not isinstance(row, dict):
            raise InvalidArgument(f"instances[{i}]: every instance must be an object like the first one")
        if i and row.keys() != columns.keys():
            raise InvalidArgument(f"instances[{i}]: has inputs {sorted(row)}, expected {sorted(columns)}")
        for k, v in row.items():
            columns.setdefault(k, []).append(v)
    return _named(signature, columns, "instances")


# --- encoding ---------------------------------------------------------------------------
def _jsonable(name: str, arr: np.ndarray) -> Any:
    """An output array in a form orjson serialises as TF Serving would print it."""
    if arr.dtype.kind in _NATIVE:
        if arr.ndim == 0:  # orjson serialises arrays, not 0-d ones: a bare value
            return arr.item()
        if arr.dtype == np.float16:
            arr = arr.astype(np.float32)
        return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    encode_b64 = name.endswith("_bytes")
    flat = [_text(v, encode_b64) for v in arr.reshape(-1)]
    return np.array(flat, dtype=object).reshape(arr.shape).tolist() if arr.ndim else flat[0]


def _text(value: Any, encode_b64: bool) -> Any:
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
    sizes = {v.shape[0] if v.ndim else None for v in outputs.values()}
    if len(sizes) != 1 or None in sizes:
        raise InvalidArgument("outputs have different batch sizes; use the columnar 'inputs' format")
    columns = {k: _jsonable(k, v) for k, v in outputs.items()}
    n = sizes.pop()
    return dumps({"predictions": [{k: col[i] for k, col in columns.items()} for i in range(n)]})
