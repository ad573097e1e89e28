"""appliance/protos/tfserving/wire.py against TensorFlow: TensorProtos read as ``tf.make_ndarray``
reads them, tf.Examples parsed by ``tf.io.parse_example`` as the JSON features say."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
from tensorflow.core.framework import tensor_pb2  # noqa: E402

from appliance.api.tfserving.grpc_service import from_tensor  # noqa: E402
from appliance.protos.tfserving import pb  # noqa: E402
from appliance.protos.tfserving import wire as pw  # noqa: E402

NUMERIC = [np.float32, np.float64, np.int32, np.uint8, np.int16, np.int8, np.int64, np.bool_, np.uint16,
           np.float16, np.uint32, np.uint64]


def values(dtype: Any, n: int) -> np.ndarray:
    if np.dtype(dtype).kind == "b":
        return np.arange(n) % 3 == 0
    if np.dtype(dtype).kind == "f":
        return (np.arange(n) - n / 2).astype(dtype) / 3
    lo, hi = int(np.iinfo(dtype).min), int(np.iinfo(dtype).max)  # both ends of the range, exactly
    return np.array([lo + (hi - lo) * i // max(n - 1, 1) for i in range(n)], dtype=dtype)


def typed(array: np.ndarray) -> bytes:
    """A TensorProto of ``array`` in its typed field, built on TensorFlow's own message."""
    enum = pw.ENUM_OF[array.dtype]
    t = tensor_pb2.TensorProto(dtype=enum)
    for size in array.shape:
        t.tensor_shape.dim.add(size=size)
    flat = array.reshape(-1)
    getattr(t, pw.VALUE_FIELD[enum]).extend(flat.view(np.uint16).tolist() if enum == 19 else flat.tolist())
    return bytes(t.SerializeToString())


def both(data: bytes) -> list[np.ndarray]:
    return [pw.decode_tensor(data), from_tensor(pb.TensorProto.FromString(data))]


@pytest.mark.parametrize("dtype", NUMERIC, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (7,), (2, 3)])
def test_numeric_tensors_read_as_tensorflow_reads_them(dtype: Any, shape: tuple[int, ...]) -> None:
    array = values(dtype, int(np.prod(shape))).reshape(shape)
    for data in (tf.make_tensor_proto(array).SerializeToString(), typed(array)):
        want = tf.make_ndarray(tensor_pb2.TensorProto.FromString(data))
        for got in both(data):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_string_tensors_and_one_value_filling_the_shape() -> None:
    words = np.array([[b"a", b""], [b"\xff\x00", b"long" * 100]], dtype=object)
    data = tf.make_tensor_proto(words).SerializeToString()
    for got in both(data):
        assert got.dtype == object and got.tolist() == words.tolist()
    one = tensor_pb2.TensorProto(dtype=1, float_val=[2.5])
    one.tensor_shape.dim.add(size=4)
    want = tf.make_ndarray(one)
    for got in both(one.SerializeToString()):
        np.testing.assert_array_equal(got, want)


def _shape(t: Any, *sizes: int) -> None:
    for size in sizes:
        t.tensor_shape.dim.add(size=size)


@pytest.mark.parametrize("dtype, build, reason", [
    (7, lambda t: (_shape(t, -1), t.string_val.append(b"a")), "negative dimension"),
    (1, lambda t: (_shape(t, -1), setattr(t, "tensor_content", b"\0" * 4)), "negative dimension"),
    (8, lambda t: t.scomplex_val.extend([1, 2]), "unsupported tensor dtype enum 8"),  # DT_COMPLEX64
    (1, lambda t: (_shape(t, 3), t.float_val.extend([1, 2])), "reshape"),
    (1, lambda t: (_shape(t, 2), setattr(t, "tensor_content", b"\0" * 7)), "multiple of element size"),
], ids=["negative string", "negative content", "complex", "two values for three", "short content"])
def test_bad_tensors_are_value_errors(dtype: int, build: Any, reason: str) -> None:
    t = pb.TensorProto(dtype=dtype)
    build(t)
    for decode in (lambda: pw.decode_tensor(t.SerializeToString()), lambda: from_tensor(t)):
        with pytest.raises(ValueError, match=reason):
            decode()


def test_a_truncated_tensor_proto_is_a_value_error() -> None:
    data = tf.make_tensor_proto(np.ones(4, np.float32)).SerializeToString()
    with pytest.raises(ValueError, match="not a valid TensorProto"):
        pw.decode_tensor(data[:-3])


def test_examples_parse_in_tensorflow_as_the_features_say() -> None:
    context = pw.encode_example({"c": 7, "x": 0.0, "s": "ctx"})
    serialized = [pw.merge_examples(context, pw.encode_example(f)) for f in
                  ({"x": [1.5, 2], "n": [1, True], "s": [b"\xff", "b"]}, {"x": [3.0, 4.0], "n": [5, 6]})]
    spec = {"x": tf.io.FixedLenFeature([2], tf.float32), "n": tf.io.FixedLenFeature([2], tf.int64),
            "c": tf.io.FixedLenFeature([1], tf.int64), "s": tf.io.VarLenFeature(tf.string)}
    got = tf.io.parse_example(tf.constant(serialized), spec)
    np.testing.assert_array_equal(got["x"].numpy(), [[1.5, 2.0], [3.0, 4.0]])
    np.testing.assert_array_equal(got["n"].numpy(), [[1, 1], [5, 6]])
    np.testing.assert_array_equal(got["c"].numpy(), [[7], [7]])
    assert tf.sparse.to_dense(got["s"]).numpy().tolist() == [[b"\xff", b"b"], [b"ctx", b""]]
    empty = tf.train.Example.FromString(pw.encode_example({"e": []}))
    assert empty.features.feature["e"].HasField("bytes_list")


@pytest.mark.parametrize("value", [[1, "a"], [1.0, True], {"a": 1}, None, 1 << 64])
def test_features_that_are_no_feature_are_value_errors(value: Any) -> None:
    with pytest.raises(ValueError, match="feature value"):
        pw.encode_example({"f": value})


def test_dtype_names_are_tensorflows() -> None:
    for enum, name in pw.DTYPE_NAMES.items():
        assert tf.dtypes.as_dtype(enum).as_datatype_enum == enum
        assert tf.dtypes.as_dtype(pw.DTYPES[enum] if enum != 7 else tf.string).as_datatype_enum == enum, name
