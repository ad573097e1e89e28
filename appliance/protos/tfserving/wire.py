"""TensorFlow's ``TensorProto`` and ``tf.Example`` to and from numpy, on the protobuf
messages of appliance/protos/tfserving (TF Serving's own descriptors in a private pool).

The protobuf library parses and serializes; this module only maps message fields to numpy
and back, so a LiteRT-only device needs neither TensorFlow nor generated stubs. Used by the
gRPC service (request tensors), the warm-up replay (appliance/core/warmup.py) and REST
``:classify``/``:regress`` (``tf.Example`` from JSON features). Pure functions, thread-safe.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
from google.protobuf.message import DecodeError, Message

from appliance.protos.tfserving import POOL, pb

# DataType enum -> numpy dtype (object = DT_STRING holding bytes).
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.float32), 2: np.dtype(np.float64), 3: np.dtype(np.int32), 4: np.dtype(np.uint8),
    5: np.dtype(np.int16), 6: np.dtype(np.int8), 7: np.dtype(object), 9: np.dtype(np.int64),
    10: np.dtype(np.bool_), 17: np.dtype(np.uint16), 19: np.dtype(np.float16),
    22: np.dtype(np.uint32), 23: np.dtype(np.uint64),
}
_DATA_TYPE = POOL.FindEnumTypeByName("tensorflow.DataType")
DTYPE_NAMES: dict[int, str] = {n: _DATA_TYPE.values_by_number[n].name for n in DTYPES}
ENUM_OF: dict[np.dtype, int] = {v: k for k, v in DTYPES.items()}
# The repeated field that holds each dtype's values (tensorflow/core/framework/tensor.proto).
VALUE_FIELD: dict[int, str] = {
    1: "float_val", 2: "double_val", 3: "int_val", 4: "int_val", 5: "int_val", 6: "int_val",
    7: "string_val", 9: "int64_val", 10: "bool_val", 17: "int_val", 19: "half_val",
    22: "uint32_val", 23: "uint64_val",
}
_DIRECT = {1, 2, 3, 9, 10}  # fields whose Python values numpy takes as they are


def tensor_to_array(tensor: Message) -> np.ndarray:
    """A ``TensorProto`` message as numpy, read as ``tf.make_ndarray`` reads it:
    ``tensor_content`` when set (numeric dtypes), else the dtype's typed field, where one
    value fills the whole shape. A bad dtype, shape or value count is a ``ValueError``."""
    dtype = DTYPES.get(tensor.dtype)
    if dtype is None:
        raise ValueError(f"unsupported tensor dtype enum {tensor.dtype}")
    shape = tuple(d.size for d in tensor.tensor_shape.dim)
    if any(d < 0 for d in shape):
        raise ValueError(f"negative dimension in shape {list(shape)}")
    if tensor.tensor_content and dtype.kind != "O":
        return np.frombuffer(tensor.tensor_content, dtype=dtype).reshape(shape).copy()
    values = _typed_values(tensor, dtype)
    count = math.prod(shape)
    if values.size == 1 and count > 1:  # one value fills the tensor, as TensorFlow reads it
        values = np.full(count, values[0], dtype=dtype)
    return values.reshape(shape)


def _typed_values(tensor: Message, dtype: np.dtype) -> np.ndarray:
    repeated = getattr(tensor, VALUE_FIELD[tensor.dtype])
    if dtype.kind == "O":
        return np.array(list(repeated), dtype=object)
    if tensor.dtype in _DIRECT:  # fromiter with a count: half np.array's time on a repeated field
        return np.fromiter(repeated, dtype=dtype, count=len(repeated))
    if tensor.dtype == 19:  # half_val holds the raw 16-bit patterns
        return np.fromiter(repeated, dtype=np.uint16, count=len(repeated)).view(np.float16)
    wide = np.uint64 if tensor.dtype == 23 else np.int64  # then narrowed as TensorFlow's cast does
    return np.fromiter(repeated, dtype=wide, count=len(repeated)).astype(dtype)


def decode_tensor(buf: bytes) -> np.ndarray:
    """A serialized ``TensorProto`` as numpy (see ``tensor_to_array``)."""
    try:
        tensor = pb.TensorProto.FromString(buf)
    except DecodeError as exc:
        raise ValueError(f"not a valid TensorProto: {exc}") from exc
    return tensor_to_array(tensor)


# --- tf.Example ----------------------------------------------------------------------------
def _fill_feature(feature: Message, value: object) -> None:
    values = value if isinstance(value, list) else [value]
    if values and all(isinstance(v, (bool, int)) for v in values):
        try:
            feature.int64_list.value.extend(int(v) for v in values if isinstance(v, (bool, int)))  # all are
        except ValueError as exc:  # protobuf's own range check
            raise ValueError(f"feature value {value!r}: an integer is out of the range of int64 ({exc})") from exc
    elif values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        feature.float_list.value.extend(float(v) for v in values if isinstance(v, (int, float)))  # all are
    elif all(isinstance(v, (bytes, str)) for v in values):
        feature.bytes_list.SetInParent()  # an empty list is still a bytes_list
        feature.bytes_list.value.extend(v.encode() if isinstance(v, str) else v for v in values)
    else:
        raise ValueError(f"feature value {value!r} mixes types or is not int, float or string")


def encode_example(features: Mapping[str, object]) -> bytes:
    """A serialized ``tf.Example``: ints -> int64_list, floats -> float_list, str/bytes -> bytes_list."""
    example = pb.Example()
    for key, value in features.items():
        _fill_feature(example.features.feature[key], value)
    return bytes(example.SerializeToString())


def merge_examples(context: bytes, example: bytes) -> bytes:
    """Example-with-context, as TF Serving builds it (servables/tensorflow/util.cc
    ``InputToSerializedExampleTensor``): the serialized context, then the serialized example.
    Protobuf merges concatenated messages; a feature in both: the example's wins."""
    return context + example


def input_examples(input_msg: Message) -> list[bytes]:
    """Serialized tf.Examples of a serving ``Input`` (example_list, or example_list_with_context
    with its context in front of each), as TF Serving's InputToSerializedExampleTensor builds
    them; empty when the Input holds none."""
    kind = input_msg.WhichOneof("kind")
    if kind == "example_list":
        return [e.SerializeToString() for e in input_msg.example_list.examples]
    if kind == "example_list_with_context":
        listed = input_msg.example_list_with_context
        context = listed.context.SerializeToString()
        return [merge_examples(context, e.SerializeToString()) for e in listed.examples]
    return []
