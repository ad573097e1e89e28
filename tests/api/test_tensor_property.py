"""Property: any JSON body either converts to the declared dtype and back identically, or is
refused with the 400 TF Serving's rules give it (tfs_json: parse, decode, shape check, encode).

The expected refusal is worked out from the body's structure alone (``expected_refusal``):
TF Serving's exact message for a structural fault (util/json_tensor.cc: no
``instances``/``inputs``, both, an empty or non-list ``instances``, an unknown or missing
input ...), and for a value that does not convert, TF Serving's wording for the part of the
request it is in (an element of ``instances``, or ``inputs``) followed by one of the reasons
json_tensor.cc gives, or one of our own where TF Serving would take the value (more than 64
dimensions). A well-formed tensor is never refused, a body TF Serving refuses is never taken
(json_tensor_errors.predict_error says so), and a tensor taken holds TF Serving's values."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from appliance.api.tfserving import json_format as tfs_json
from appliance.core.handle import shape_error
from appliance.api.tfserving.json_tensor_errors import predict_error
from appliance.core.errors import InvalidArgument
from runtimes import SignatureInfo, TensorSpec

DTYPES = [np.float32, np.float64, np.int32, np.int64, np.int8, np.uint8, np.bool_, object]
TF_NAMES = {"float32": "float", "float64": "double", "object": "string"}  # DataTypeString, where numpy's differs
SIGNATURE = "serving_default"
MAX_DEPTH = 100  # [limits] max_json_depth's default
# Why a value fails to become a tensor (util/json_tensor.cc AddInstanceItem, FillTensorProto, AddValueToTensor)
TFS_REASONS = (r"JSON Value: .* Type: (Null|False|True|Object|Array|String|Number) is not of expected type: {tf}",
               r"JSON Value: .* found at incorrect level: \d+ in the JSON DOM\. Expected at level: \d+",
               r"Encountered list at unexpected level: \d+ expected < \d+",
               r"Encountered list at unexpected size: \d+ at level: \d+ expected size: \d+",
               r"Expecting tensor size: \d+ but got: \d+",
               r"Expecting shape \[[\d,]*\] but got: \[[\d,]*\]",
               r"JSON Value: .* not formatted correctly for base64 data",
               r"Unable to base64 decode( \(URL-safe base64 .+\))?")
# ... and ours, where TF Serving takes the value but this decoder does not, after "<where>: "
OUR_REASONS = (r"a tensor has at most 64 dimensions",
               r"cannot be converted to a {dtype} tensor \(is it ragged, or of the wrong type\?\)")
ROW = r"Failed to process element: \d+ (key: x )?of 'instances' list\. Error: INVALID_ARGUMENT: "

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
    """(well_formed, body): a well-formed tensor in each request shape, or any JSON there."""
    def shapes(value: Any) -> Any:
        return st.one_of(st.builds(lambda v: {"instances": v}, value), st.builds(lambda v: {"inputs": v}, value),
                         st.builds(lambda v: {"inputs": {"x": v}}, value),
                         st.builds(lambda v: {"instances": [{"x": v}]}, value))
    return st.tuples(st.just(True), shapes(tensors(dtype))) | \
        st.tuples(st.just(False), shapes(json_values) | json_values)


def is_b64(value: Any) -> bool:
    return isinstance(value, dict) and list(value) == ["b64"]


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


def is_element_object(value: Any) -> bool:
    return isinstance(value, dict) and not (list(value) == ["b64"] and isinstance(value["b64"], str))


def expected_refusal(body: dict[str, Any], dtype: np.dtype) -> tuple[str, Any]:
    """("exact", message) or ("suffix", text after "JSON Value: <body> ") when the body's
    structure decides the refusal; ("inputs", None) when it all depends on whether the values
    convert; ("rows", (row, messages)) for ``instances``: a value of a row up to ``row`` fails
    to convert, or (at ``row``) one of ``messages`` (TF Serving goes row by row, key by key)."""
    if "instances" in body:
        if "inputs" in body:
            return "suffix", "Not formatted correctly expecting only one of 'inputs' or 'instances' keys to exist "
        rows = body["instances"]
        if not isinstance(rows, list):
            return "suffix", "Expecting 'instances' to be an list/array"
        if not rows:
            return "suffix", "No values in 'instances' array"
        objects = is_element_object(rows[0])
        for i, row in enumerate(rows):
            if not objects and is_element_object(row):
                return "rows", (i, [f"Expecting value/list but got object at item {i} of input list"])
            if objects and not is_element_object(row):
                return "rows", (i, [f"Expecting object but got list at item {i} of input list"])
            if objects and list(row) != ["x"]:
                unknown = [k for k in row if k != "x"][:1]
                return "rows", (i, [rf"Failed to process element: {i} key: {re.escape(k)} of 'instances' list\. Error: "
                                    rf"INVALID_ARGUMENT: JSON object: does not have named input: {re.escape(k)}"
                                    for k in unknown] +
                                [rf"Failed to process element: {i} of 'instances' list\. JSON object: .* keys must be "
                                 "equal to: x"])
        return "rows", (len(rows), [])
    if "inputs" in body:
        value = body["inputs"]
        if is_element_object(value) and "x" not in value:  # named inputs; keys the signature lacks are ignored
            return "exact", "Missing named input: x in 'inputs' object."
        return "inputs", None
    return "exact", "Missing 'inputs' or 'instances' key"


def check_refusal(message: str, body: Any, dtype: np.dtype, well_formed: bool) -> None:
    assert not well_formed, f"a well-formed tensor was refused: {message} ({body!r})"
    kind, want = expected_refusal(body, dtype)
    if kind == "exact":
        assert message == want
        return
    if kind == "suffix":
        assert message.startswith("JSON Value: ") and message.endswith(" " + want), message
        return
    tf = TF_NAMES.get(dtype.name, dtype.name)
    tfs = "(" + "|".join(r.format(tf=tf) for r in TFS_REASONS) + ")"
    ours = "(" + "|".join(r.format(dtype=tf) for r in OUR_REASONS) + ")"
    if kind == "inputs":
        assert re.fullmatch(tfs, message, re.S) or re.fullmatch(r"(inputs|input 'x'): " + ours, message), message
        return
    last, structural = want
    if any(re.fullmatch(m, message, re.S) for m in structural):
        return
    value = re.fullmatch(ROW + tfs, message, re.S)
    if value:
        assert int(re.search(r"element: (\d+)", message).group(1)) <= last, message  # type: ignore[union-attr]
        return
    assert re.fullmatch(r"(instances|input 'x'): " + ours, message), message


def expected(value: Any, dtype: np.dtype) -> np.ndarray:
    """The JSON value as TF Serving converts it: doubles to float32 (past its range: inf),
    integers and booleans unchanged, save that an int8 or uint8 input reads an int32 and
    narrows it with a C++ cast (AddValueToTensor, Tensor::FromProto)."""
    if dtype == object:
        return np.array(_strings(value), dtype=object)
    if dtype.kind in "iub":  # integers and booleans exactly as read: no rounding
        exact = np.asarray(value, dtype=object)
        read_as = np.dtype(np.int32) if dtype in (np.int8, np.uint8) else dtype
        converted = exact.astype(read_as)
        assert np.array_equal(converted.astype(object), exact), f"{value!r} changed on its way to {read_as}"
        return converted.astype(dtype)
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
    well_formed, body = data.draw(bodies(dtype))
    raw = json.dumps(body, allow_nan=True).encode()  # NaN and Infinity as TF Serving's clients send them
    try:
        doc = tfs_json.loads(raw)
    except InvalidArgument as exc:  # the only thing a body that json.dumps wrote can fail for
        assert exc.message == f"JSON nested deeper than the limit of {MAX_DEPTH} levels (limits.max_json_depth)"
        assert depth(body) > MAX_DEPTH
        return
    if not isinstance(doc, dict):  # appliance/api/tfserving/rest.py refuses it before decoding
        assert not well_formed
        return
    expectation = expected_refusal(doc, want)
    try:
        inputs, row_format = tfs_json.decode_predict(doc, sig, raw)
    except InvalidArgument as exc:
        assert exc.http_status == 400
        check_refusal(exc.message, doc, want, well_formed)
        return
    accepted = expectation[0] == "inputs" or expectation[0] == "rows" and not expectation[1][1]
    assert accepted, f"accepted, but {expectation[1]!r} was expected: {doc!r}"
    refusal = predict_error(doc, sig)  # booleans among numbers, say
    assert refusal is None, f"accepted, but TF Serving refuses it: {refusal} ({doc!r})"
    arr = inputs["x"]
    assert arr.dtype == want
    assert same(arr, expected(input_value(body), want)), (body, arr)
    problem = shape_error(arr, sig.inputs["x"], "input 'x'")
    assert problem is None or "input 'x'" in problem
    assert same(back(tfs_json.encode_predict({"y": arr}, row_format), want), arr)


@pytest.mark.parametrize("instances", [["", [""]], [["a"], "b"], [[""], [[""]]]], ids=str)
def test_ragged_string_tensors_are_refused_whatever_their_first_element(instances: list[Any]) -> None:
    """Found by the property above: a string tensor whose first element is fine but a later
    one is a list became an object array holding a list, and encoding it failed (500)."""
    raw = json.dumps({"instances": instances}).encode()
    with pytest.raises(InvalidArgument) as err:
        tfs_json.decode_predict(tfs_json.loads(raw), signature(object, None), raw)
    assert err.value.http_status == 400 and "Expecting shape" in err.value.message, err.value.message
