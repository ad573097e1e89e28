"""Tensors of the Open Inference Protocol (KServe v2) <-> numpy, for REST and gRPC alike.

Three encodings of one tensor, all checked against its declared ``shape`` and ``datatype``
before any array exists:

* JSON ``data``: flat or nested lists (KServe v2 REST). Numbers go to numpy in one
  ``np.asarray`` call; the kind of what was parsed is checked once (no per-element Python).
* Raw bytes: Triton's binary tensor data extension over HTTP (the JSON header, then each
  binary input's bytes in input order, ``Inference-Header-Content-Length`` giving the header
  size) and gRPC's ``raw_input_contents``. Little-endian, row-major, no padding; BYTES
  elements are a 4-byte little-endian length and then the bytes. Fixed-size tensors are
  ``np.frombuffer`` views on the request body: no copy, no parsing.
* gRPC typed ``contents`` (``fp32_contents`` ...): see ``appliance.api.kserve.grpc_service``.

Size rules, the reason this module exists: the elements all shapes declare are counted
against ``limits.max_tensor_elements`` (``check_declared_elements``, appliance/api/tensor_limits.py)
and a declared size is compared with what the shape and datatype need, both *before*
anything is read; every slice is bounds-checked against the body, and leftover bytes are an
error. A mismatch is ``InvalidArgument`` (400 /
INVALID_ARGUMENT) naming the tensor, the sizes and why; never an over-read or a crash.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import numpy as np
import orjson

from appliance.api import tensor_limits
from appliance.core.errors import InvalidArgument

if TYPE_CHECKING:  # annotations only: no import a process without them would not make
    from numpy.typing import NDArray

    from appliance.api.json_arrays import Parsed
    from appliance.core.config import LimitsConfig

# datatype name -> numpy dtype (little-endian, as the protocol's binary form is).
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"), "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"), "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(object),
}
_BY_KIND = {(dt.kind, dt.itemsize): name for name, dt in DATATYPES.items()}
_KNOWN_ELSEWHERE = {"BF16": "BF16 has no numpy type on this server; send FP32 or FP16"}
MAX_DIMS = 32  # TensorFlow's own limit on a tensor's rank is far above any real model's
MAX_NESTING = 100  # of a tensor's JSON "data": Triton's limit (its qa test_json_recursion_depth_limit)


def datatype_of(dtype: np.dtype) -> str:
    """The protocol's name of a numpy dtype (strings of any kind are BYTES)."""
    if dtype.kind in "OSU":
        return "BYTES"
    return _BY_KIND.get((dtype.kind, dtype.itemsize), f"unsupported({dtype.name})")


def dtype_of(datatype: object, where: str) -> np.dtype:
    """The numpy dtype of a datatype name; 400 naming the input for anything else."""
    dt = DATATYPES.get(datatype) if isinstance(datatype, str) else None
    if dt is None:
        hint = _KNOWN_ELSEWHERE.get(datatype) if isinstance(datatype, str) else None
        raise InvalidArgument(f"{where}: invalid datatype {datatype!r}; "
                              + (hint or f"expected one of {', '.join(DATATYPES)}"))
    return dt


def check_shape(shape: object, where: str) -> tuple[int, ...]:
    """A request's ``shape``: a list of non-negative integers (no bools, no floats)."""
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS or not all(
            type(d) is int and 0 <= d < 1 << 63 for d in shape):
        raise InvalidArgument(f"{where}: 'shape' must be a list of at most {MAX_DIMS} non-negative integers, "
                              f"got {_short(shape)}")
    return tuple(shape)


U64_MAX = (1 << 64) - 1


def check_overflow(shape: Sequence[int], dtype: np.dtype, datatype: str, where: str) -> None:
    """A shape whose element count, or byte size, does not fit 64 bits: refused in Triton's
    words (its qa checks them), before the element limit is even looked at."""
    count = math.prod(shape)
    if count > U64_MAX:
        raise InvalidArgument(f"{where}: shape {list(shape)} causes total element count to exceed maximum size of "
                              f"{U64_MAX}")
    if dtype.kind != "O" and count * dtype.itemsize > U64_MAX:
        raise InvalidArgument(f"byte size overflow for {where}: shape {list(shape)} of {datatype} needs "
                              f"{count * dtype.itemsize} bytes, more than {U64_MAX}")


def check_declared_elements(declared: Sequence[tuple[str, Sequence[int]]], limits: LimitsConfig) -> None:
    """``limits.max_tensor_elements`` on the elements the (name, shape) of a request's inputs
    declare, all together: called before any input's data is read, so no tensor past the
    limit is built. The error names the largest input's shape."""
    total = sum(math.prod(shape) for _, shape in declared)
    if declared and total > limits.max_tensor_elements:
        name, shape = max(declared, key=lambda d: math.prod(d[1]))
        tensor_limits.check_element_count(total, limits, f" by their declared shapes (input '{name}': shape "
                                                         f"{list(shape)})")


def nbytes_for(shape: Sequence[int], dtype: np.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _short(value: object, limit: int = 80) -> str:
    text = orjson.dumps(value, default=str).decode() if not isinstance(value, (bytes, memoryview)) else "<bytes>"
    return text if len(text) <= limit else text[:limit] + "..."


# --- JSON data ----------------------------------------------------------------------------
_JSON_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf"}  # wanted kind -> parsed kinds accepted
_KIND_WORDS = {"b": "booleans", "i": "integers", "u": "integers", "f": "non-integer numbers", "U": "strings",
               "O": "mixed values"}


def from_json(data: Parsed, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """``data`` (flat or nested, row-major) as an array of ``shape`` and ``datatype``."""
    dtype = dtype_of(datatype, where)
    count = math.prod(shape)
    check_nesting(data, where)
    if not isinstance(data, (list, np.ndarray)):  # an array: appliance/api/json_arrays.py decoded it
        data = [data]  # a scalar for a one-element tensor, as some clients send it
    try:
        arr = _json_strings(data, where) if dtype.kind == "O" else _json_numbers(data, dtype, datatype, where)
    except ValueError as exc:  # ragged nesting
        raise InvalidArgument(f"{where}: 'data' is not a regular (rectangular) array: {_first_line(exc)}") from exc
    if arr.size != count:
        raise InvalidArgument(f"{where}: shape {list(shape)} needs {count} elements, 'data' has {arr.size}")
    return arr.reshape(shape)


def check_nesting(data: Parsed, where: str) -> None:
    """Triton's nesting limit, on the first element's chain (a deeper list elsewhere is ragged,
    which the conversion refuses): no per-element walk."""
    depth, value = 0, data
    while isinstance(value, list) and value:
        depth += 1
        if depth > MAX_NESTING:
            raise InvalidArgument(f"{where}: JSON nesting depth exceeds maximum allowed limit ({MAX_NESTING})")
        value = value[0]


def _json_numbers(data: list[Parsed] | NDArray[np.generic], dtype: np.dtype, datatype: str, where: str) -> np.ndarray:
    arr = np.asarray(data)
    if arr.size and arr.dtype.kind not in _JSON_KINDS[dtype.kind]:
        got = _KIND_WORDS.get(arr.dtype.kind, arr.dtype.name)
        raise InvalidArgument(f"{where}: 'data' holds {got}, which a {datatype} tensor cannot take")
    if dtype.kind in "iu" and arr.size and arr.dtype != dtype:
        info = np.iinfo(dtype)
        low, high = arr.min(), arr.max()
        if low < info.min or high > info.max:
            raise InvalidArgument(f"{where}: value {low if low < info.min else high} is out of range for {datatype}")
    return arr if arr.dtype == dtype else arr.astype(dtype)


def _json_strings(data: list[Parsed] | NDArray[np.generic], where: str) -> np.ndarray:
    flat = _flatten_strings(data, where, 0)
    out = np.empty(len(flat), dtype=object)
    out[:] = flat
    return out


def _flatten_strings(value: Iterable[object], where: str, depth: int) -> list[bytes]:
    if depth > MAX_NESTING:
        raise InvalidArgument(f"{where}: JSON nesting depth exceeds maximum allowed limit ({MAX_NESTING})")
    out: list[bytes] = []
    widths: set[int | None] = set()  # nested list lengths (None: a string) must all agree
    for v in value:
        if isinstance(v, str):
            out.append(v.encode())
            widths.add(None)
        elif isinstance(v, list):
            inner = _flatten_strings(v, where, depth + 1)
            widths.add(len(inner))
            out.extend(inner)
        else:
            raise InvalidArgument(f"{where}: a BYTES tensor takes strings in 'data', got {type(v).__name__}")
    if len(widths) > 1:
        raise InvalidArgument(f"{where}: 'data' is not a regular (rectangular) array")
    return out


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def to_json(arr: np.ndarray, name: str) -> np.ndarray | list[str]:
    """An output's ``data``: flat, row-major, in a form orjson writes natively."""
    if arr.dtype.kind in "biuf":
        if arr.dtype == np.float16:
            arr = arr.astype(np.float32)
        flat = arr.reshape(-1)
        return flat if flat.flags.c_contiguous else np.ascontiguousarray(flat)
    try:
        return [v.decode() if isinstance(v, bytes) else str(v) for v in arr.reshape(-1).tolist()]
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"output {name!r} holds bytes that are not UTF-8, which JSON cannot carry; "
                              "request it with \"parameters\": {\"binary_data\": true}") from exc


# --- raw bytes --------------------------------------------------------------------------------
def from_raw(buf: memoryview, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """One tensor from exactly ``buf`` (its whole binary payload): a view, never a copy."""
    dtype = dtype_of(datatype, where)
    if dtype.kind == "O":
        return _bytes_elements(buf, math.prod(shape), where).reshape(shape)
    need = nbytes_for(shape, dtype)
    if len(buf) != need:
        raise InvalidArgument(f"{where}: {len(buf)} bytes of binary data disagree with shape {list(shape)} and "
                              f"datatype {datatype}, which need {need} bytes")
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
    if dtype.kind == "b" and need and np.frombuffer(buf, dtype=np.uint8).max() > 1:
        raise InvalidArgument(f"{where}: a BOOL element must be the byte 0 or 1")
    return arr


_U32 = struct.Struct("<I")


def _bytes_elements(buf: memoryview, count: int, where: str) -> np.ndarray:
    """BYTES elements: each a 4-byte little-endian length, then that many bytes."""
    if 4 * count > len(buf):  # each element needs at least its 4-byte length: refuse before allocating
        raise InvalidArgument(f"{where}: {count} BYTES elements need at least {4 * count} bytes, "
                              f"the binary data has {len(buf)}")
    out = np.empty(count, dtype=object)
    pos, end = 0, len(buf)
    for i in range(count):
        if pos + 4 > end:
            raise InvalidArgument(f"{where}: binary data ends inside the length of BYTES element {i} "
                                  f"(of {count})")
        (length,) = _U32.unpack_from(buf, pos)
        pos += 4
        if length > end - pos:
            raise InvalidArgument(f"{where}: BYTES element {i} says {length} bytes, only {end - pos} are left")
        out[i] = bytes(buf[pos:pos + length])
        pos += length
    if pos != end:
        raise InvalidArgument(f"{where}: {end - pos} bytes are left after the {count} BYTES elements "
                              "the shape asks for")
    return out


def to_raw(arr: np.ndarray) -> bytes:
    """An output's binary form: little-endian row-major bytes, or length-prefixed BYTES."""
    if arr.dtype.kind in "OSU":
        parts = []
        for v in arr.reshape(-1).tolist():
            b = v if isinstance(v, bytes) else str(v).encode()
            parts.append(_U32.pack(len(b)))
            parts.append(b)
        return b"".join(parts)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr).tobytes()


def raw_view(arr: np.ndarray) -> memoryview:
    """``to_raw`` as a view, without copying an array whose own bytes are its binary form
    (contiguous little-endian numbers): what is written straight into a shared-memory region."""
    if arr.dtype.kind in "OSU":
        return memoryview(to_raw(arr))
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr).data.cast("B")


def raw_body_tensor(body: bytes, datatype: str, declared: Sequence[int | None] | None, name: str) -> np.ndarray:
    """A raw binary request's one tensor (``V2Service.raw_input``: Triton's rules)."""
    dims = [-1] if declared is None else [-1 if d is None else int(d) for d in declared]
    if datatype == "BYTES":
        fixed = [d for d in dims if d != -1]
        if len(dims) - len(fixed) > 1 or any(d != 1 for d in fixed):
            raise InvalidArgument(f"For BYTE datatype raw input '{name}', the model must have input shape [1]")
        out = np.empty(1, dtype=object)
        out[0] = bytes(body)
        return out.reshape([1] * len(dims))
    dtype = DATATYPES[datatype]
    if len(body) % dtype.itemsize:
        raise InvalidArgument(f"raw input '{name}': {len(body)} bytes are not a whole number of {datatype} "
                              f"elements ({dtype.itemsize} bytes each)")
    if dims.count(-1) > 1 and dims[0] == -1:  # the batch dimension and more: a batch of one, as Triton does
        dims[0] = 1
    if dims.count(-1) > 1:
        raise InvalidArgument(f"The shape of the raw input '{name}' can not be deduced because there are more than "
                              f"one variable-sized dimension (the model's input shape {dims})")
    known = math.prod(d for d in dims if d != -1)
    unknown = dims.count(-1)
    elements = len(body) // dtype.itemsize
    if (unknown == 0 and known != elements) or (unknown == 1 and (not known or elements % known)):
        raise InvalidArgument(f"raw input '{name}': {elements} {datatype} elements do not fit the model's input "
                              f"shape {dims}; a raw request's shape must follow from its size")
    shape = [elements // known if d == -1 else d for d in dims]
    return np.frombuffer(body, dtype=dtype).reshape(shape)


# --- the binary tensor extension over HTTP ------------------------------------------------------
def header_length(value: str | None, body_size: int) -> int | None:
    """``Inference-Header-Content-Length``: None when absent (the whole body is JSON)."""
    if value is None:
        return None
    try:
        length = int(value.strip())
    except ValueError:
        raise InvalidArgument(f"Inference-Header-Content-Length is not an integer: {value[:40]!r}") from None
    if not 0 < length <= body_size:  # 0 (a raw binary request) is taken before this (rest.py)
        raise InvalidArgument(f"Inference-Header-Content-Length {length} is outside the body "
                              f"(1 to {body_size} bytes)")
    return length


def binary_size(params: Mapping[str, object], where: str) -> int | None:
    size = params.get("binary_data_size")
    if size is None:
        return None
    if type(size) is not int or size < 0:
        raise InvalidArgument(f"{where}: 'binary_data_size' must be a non-negative integer, got {_short(size)}")
    return size


def check_binary_size(size: int, datatype: str, shape: tuple[int, ...], where: str) -> None:
    """A fixed-size datatype's ``binary_data_size`` must be exactly what shape and datatype need."""
    dtype = DATATYPES[datatype]
    if dtype.kind != "O" and size != nbytes_for(shape, dtype):
        raise InvalidArgument(f"{where}: binary_data_size {size} disagrees with shape {list(shape)} and datatype "
                              f"{datatype}, which need {nbytes_for(shape, dtype)} bytes")


class BinaryBody:
    """The bytes after the JSON header, handed out in input order with bounds checks."""

    __slots__ = ("view", "pos")

    def __init__(self, body: bytes, start: int):
        self.view = memoryview(body)
        self.pos = start

    def take(self, size: int, where: str) -> memoryview:
        left = len(self.view) - self.pos
        if size > left:
            raise InvalidArgument(f"{where}: 'binary_data_size' is {size} bytes but only {left} bytes of binary "
                                  "data are left in the body (truncated request?)")
        chunk = self.view[self.pos:self.pos + size]
        self.pos += size
        return chunk

    def finish(self) -> None:
        left = len(self.view) - self.pos
        if left:
            raise InvalidArgument(f"the body has {left} bytes after the last binary input; the "
                                  "binary_data_size values and Inference-Header-Content-Length must add up "
                                  "to Content-Length")


def join_binary(header: Mapping[str, object], chunks: Iterable[bytes]) -> tuple[bytes, int]:
    """A response body: the JSON header then each binary output; and the header's size."""
    head = orjson.dumps(header, option=orjson.OPT_SERIALIZE_NUMPY)
    return b"".join([head, *chunks]), len(head)
