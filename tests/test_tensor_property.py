"""Property: any JSON body either converts to the declared dtype and back identically, or is
refused with a 400 that names the problem (tfs_json: parse, decode, shape check, encode)."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from appliance.api.tfserving import json_format as tfs_json
from appliance.core.errors import InvalidArgument
from runtimes import SignatureInfo, TensorSpec

DTYPES = [np.float32, np.float64, np.int32, np.int64, np.int8, np.uint8, np.bool_, object]
# Words an error names its subject by: the request part, the input, or the limit.
SUBJECTS = ("instances", "inputs", "input 'x'", "JSON", "b64", "limits.")

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | \
    st.fixed_dictionaries({"b64": st.text(max_size=8)})
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=24)


def signature(dtype: Any, shape: tuple[int, ...] | None) -> SignatureInfo:
    spec = TensorSpec("x", np.dtype(dtype), shape)
    return SignatureInfo("serving_default", {"x": spec}, {"y": TensorSpec("y", np.dtype(dtype), shape)})


@st.composite
def tensors(draw: Any, dtype: Any) -> Any:
    """A well-formed tensor of ``dtype`` as JSON (strings as text or {"b64": ...})."""
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    if dtype is object:
        items = draw(st.lists(st.binary(max_size=6), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
        flat = [{"b64": base64.b64encode(b).decode()} if draw(st.booleans()) else b.decode("latin-1")
                for b in items]
        return np.array(flat, dtype=object).reshape(shape).tolist()
    elements = {"allow_nan": True, "allow_infinity": True} if np.dtype(dtype).kind == "f" else None
    return draw(hnp.arrays(dtype, shape, elements=elements)).tolist()


def bodies(dtype: Any) -> Any:
    value = tensors(dtype) | json_values
    return st.one_of(st.builds(lambda v: {"instances": v}, value), st.builds(lambda v: {"inputs": v}, value),
                     st.builds(lambda v: {"inputs": {"x": v}}, value),
                     st.builds(lambda v: {"instances": [{"x": v}]}, value), json_values)


def expected(value: Any, dtype: np.dtype) -> np.ndarray:
    """The JSON value as TF Serving converts it: doubles to float32 (past its range: inf),
    integers and booleans unchanged."""
    if dtype == object:
        return np.array(_strings(value), dtype=object)
    if dtype.kind in "iub":  # integers and booleans exactly: no wrapping, no rounding
        exact = np.asarray(value, dtype=object)
        converted = exact.astype(dtype)
        assert np.array_equal(converted.astype(object), exact), f"{value!r} changed on its way to {dtype}"
        return converted
    with np.errstate(over="ignore"):
        return np.asarray(value).astype(dtype)


def _strings(value: Any) -> Any:
    if isinstance(value, list):
        return [_strings(v) for v in value]
    if isinstance(value, dict):
        text = value["b64"]
        return base64.b64decode(text + "=" * (-len(text) % 4))
    return value.encode()


def back(text: bytes, dtype: np.dtype) -> np.ndarray:
    doc = json.loads(text)  # Python's json reads NaN and Infinity, as TF Serving's clients do
    value = doc.get("predictions", doc.get("outputs"))
    if dtype == object:
        return np.array(_strings(value), dtype=object)
    return np.asarray(value, dtype=dtype)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind == "f":
        return bool(np.array_equal(a, b, equal_nan=True))
    return bool(np.array_equal(a, b))


def input_value(body: dict[str, Any]) -> Any:
    if "instances" in body:
        rows = body["instances"]
        return [r["x"] for r in rows] if rows and isinstance(rows[0], dict) and "b64" not in rows[0] else rows
    value = body["inputs"]
    return value["x"] if isinstance(value, dict) and "b64" not in value else value


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [None, (-1,), (-1, 2)], ids=str)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_json_to_tensor_and_back_or_a_400_naming_the_problem(dtype: Any, shape: Any, data: Any) -> None:
    sig, want = signature(dtype, shape), np.dtype(dtype)
    body = data.draw(bodies(dtype))
    raw = json.dumps(body, allow_nan=True).encode()  # NaN and Infinity as TF Serving's clients send them
    try:
        doc = tfs_json.loads(raw)
        if not isinstance(doc, dict):
            raise InvalidArgument("JSON Value: the request body Is not object")
        inputs, row_format = tfs_json.decode_predict(doc, sig, raw)
    except InvalidArgument as exc:
        assert exc.http_status == 400
        assert any(word in exc.message for word in SUBJECTS), exc.message
        return
    arr = inputs["x"]
    assert arr.dtype == want
    assert same(arr, expected(input_value(body), want)), (body, arr)
    problem = tfs_json.shape_error(arr, sig.inputs["x"], "input 'x'")
    assert problem is None or "input 'x'" in problem
    assert same(back(tfs_json.encode_predict({"y": arr}, row_format), want), arr)


@pytest.mark.parametrize("instances", [["", [""]], [["a"], "b"], [[""], [[""]]]], ids=str)
def test_ragged_string_tensors_are_refused_whatever_their_first_element(instances: list[Any]) -> None:
    """Found by the property above: a string tensor whose first element is fine but a later
    one is a list became an object array holding a list, and encoding it failed (500)."""
    raw = json.dumps({"instances": instances}).encode()
    with pytest.raises(InvalidArgument) as err:
        tfs_json.decode_predict(tfs_json.loads(raw), signature(object, None), raw)
    assert err.value.http_status == 400 and "ragged" in err.value.message
