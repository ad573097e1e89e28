"""Just enough protobuf wire format for TF Serving's messages, without TensorFlow.

Used for ``assets.extra/tf_serving_warmup_requests`` (TFRecords of ``PredictionLog``) and
to build serialized ``tf.Example`` protos for ``:classify``/``:regress``, so a LiteRT-only
device needs neither TensorFlow nor generated stubs for these. Field numbers are those of
tensorflow/core/framework/{tensor,tensor_shape,types}.proto, tensorflow/core/example/
{example,feature}.proto and tensorflow_serving/apis/{prediction_log,predict,classification,
regression,input,model}.proto.
"""

from __future__ import annotations

import struct
from typing import Any, Iterator

import numpy as np

# DataType enum -> numpy dtype (object = DT_STRING holding bytes).
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.float32), 2: np.dtype(np.float64), 3: np.dtype(np.int32), 4: np.dtype(np.uint8),
    5: np.dtype(np.int16), 6: np.dtype(np.int8), 7: np.dtype(object), 9: np.dtype(np.int64),
    10: np.dtype(np.bool_), 17: np.dtype(np.uint16), 19: np.dtype(np.float16),
    22: np.dtype(np.uint32), 23: np.dtype(np.uint64),
}
DTYPE_NAMES = {1: "DT_FLOAT", 2: "DT_DOUBLE", 3: "DT_INT32", 4: "DT_UINT8", 5: "DT_INT16", 6: "DT_INT8",
               7: "DT_STRING", 9: "DT_INT64", 10: "DT_BOOL", 17: "DT_UINT16", 19: "DT_HALF",
               22: "DT_UINT32", 23: "DT_UINT64"}
ENUM_OF: dict[np.dtype, int] = {v: k for k, v in DTYPES.items()}
# TensorProto's typed repeated field for each dtype (field number, packed element format).
_VAL_FIELDS = {5: "f", 6: "d", 7: "varint", 10: "varint", 11: "varint", 13: "varint", 16: "varint", 17: "varint"}


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated protobuf message: a varint runs past the end")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value): varints as int, length-delimited as bytes."""
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            size, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > end:  # a length or fixed field running past the buffer: truncated, never cut short silently
            raise ValueError(f"truncated protobuf message: field {number} ends at byte {pos} of {end}")
        yield number, wire, value


def first(buf: bytes, number: int, default: Any = None) -> Any:
    for n, _, v in fields(buf):
        if n == number:
            return v
    return default


def _packed_varints(value: bytes) -> list[int]:
    out, pos = [], 0
    while pos < len(value):
        v, pos = _varint(value, pos)
        out.append(v)
    return out


def decode_shape(buf: bytes) -> tuple[int, ...] | None:
    dims = []
    for n, _, v in fields(buf):
        if n == 2:
            size = first(v, 1, 0)
            dims.append(size - (1 << 64) if size >= 1 << 63 else size)
        elif n == 3 and v:
            return None
    return tuple(dims)


def decode_tensor(buf: bytes) -> np.ndarray:
    """A TensorProto (tensor_content or typed ``*_val`` fields) as a numpy array."""
    dtype_enum, shape, content, vals = 0, (), None, []
    for n, wire, v in fields(buf):
        if n == 1:
            dtype_enum = v
        elif n == 2:
            shape = decode_shape(v) or ()
        elif n == 4:
            content = v
        elif n == 8:
            vals.append(bytes(v))
        elif n in (5, 6):
            fmt = "<f" if n == 5 else "<d"
            vals.extend(struct.unpack(f"<{len(v) // struct.calcsize(fmt)}{fmt[1]}", v) if wire == 2
                        else struct.unpack(fmt, v))
        elif n in (7, 10, 11, 13, 16, 17):
            vals.extend(_packed_varints(v) if wire == 2 else [v])
    if dtype_enum not in DTYPES:
        raise ValueError(f"unsupported tensor dtype enum {dtype_enum}")
    dtype = DTYPES[dtype_enum]
    count = int(np.prod(shape)) if shape else 1
    if content is not None and dtype != np.dtype(object):
        return np.frombuffer(content, dtype=dtype).reshape(shape).copy()
    if dtype_enum == 19:  # half_val holds the raw 16-bit patterns
        arr = np.array(vals, dtype=np.uint16).view(np.float16)
    elif dtype == np.dtype(object):
        arr = np.array(vals, dtype=object)
    else:
        raw = np.array(vals, dtype=np.uint64 if dtype.kind in "iu" else None)
        arr = (raw.astype(np.int64) if dtype.kind == "i" else raw).astype(dtype)
    if arr.size == 1 and count > 1:  # a single value fills the whole tensor
        arr = np.full(count, arr[0], dtype=dtype)
    return arr.reshape(shape)


# --- encoding ------------------------------------------------------------------------------
def _enc_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_bytes(number: int, payload: bytes) -> bytes:
    return _enc_varint(number << 3 | 2) + _enc_varint(len(payload)) + payload


def field_varint(number: int, value: int) -> bytes:
    return _enc_varint(number << 3) + _enc_varint(value)


def _feature(value: Any) -> bytes:
    values = value if isinstance(value, list) else [value]
    if all(isinstance(v, bool) or isinstance(v, int) for v in values) and values:
        packed = b"".join(_enc_varint(int(v)) for v in values)
        return field_bytes(3, field_bytes(1, packed))  # int64_list
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and values:
        return field_bytes(2, field_bytes(1, struct.pack(f"<{len(values)}f", *values)))  # float_list
    if all(isinstance(v, (bytes, str)) for v in values):
        items = b"".join(field_bytes(1, v.encode() if isinstance(v, str) else v) for v in values)
        return field_bytes(1, items)  # bytes_list
    raise ValueError(f"feature value {value!r} mixes types or is not int, float or string")


def encode_example(features: dict[str, Any]) -> bytes:
    """A serialized ``tf.Example``: ints -> int64_list, floats -> float_list, str/bytes -> bytes_list."""
    entries = b"".join(field_bytes(1, field_bytes(1, k.encode()) + field_bytes(2, _feature(v)))
                       for k, v in features.items())
    return field_bytes(1, entries)  # Example.features (Features.feature map entries)


def merge_examples(context: bytes, example: bytes) -> bytes:
    """Example-with-context: the context's features then the example's (later keys win)."""
    return context + example  # concatenated messages merge; map entries with equal keys: last wins
