"""appliance/api/json_arrays.py: numeric arrays straight into numpy, or left to the caller.

The judge is what the decoders did before: numpy over orjson's lists. The fast path must
give exactly that array, or step aside (a list, or None for the whole document), never a
different one: a ragged array taken for a rectangle would answer a malformed request.
"""

from __future__ import annotations

import json
import math

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.api.json_arrays import MIN_VALUES, loads, skeleton


def doc(value, key="instances", pad=True):
    body = {"signature_name": "serving_default", key: value}
    return json.dumps(body).encode()


def reference(raw):
    return np.asarray(orjson.loads(raw)["instances"])


def test_a_big_float_image_comes_back_as_numpy_equal_to_numpy_over_orjson():
    x = np.random.default_rng(0).standard_normal((2, 24, 24, 3))
    raw = doc(x.tolist())
    got = loads(raw)["instances"]
    assert isinstance(got, np.ndarray) and got.dtype == np.float64 and got.shape == (2, 24, 24, 3)
    np.testing.assert_array_equal(got, reference(raw))
    assert loads(raw)["signature_name"] == "serving_default"


def test_integers_stay_integers_and_big_ones_unsigned():
    ints = list(range(-600, 600))
    assert loads(doc(ints))["instances"].dtype == np.int64
    big = [2**63 + i for i in range(MIN_VALUES)]
    got = loads(doc(big))["instances"]
    assert got.dtype == np.uint64 and got[5] == 2**63 + 5
    mixed = ints[:-1] + [0.5]
    assert loads(doc(mixed))["instances"].dtype == np.float64


@pytest.mark.parametrize("rows", [
    [[1.0] * 40, [2.0] * 39, [3.0] * 41] + [[0.0] * 40] * 30,  # ragged, same total as 33 x 40
    [[1.0] * 40] * 32 + [[2.0, [3.0]] + [0.0] * 38],  # a nested value where a number belongs
])
def test_ragged_arrays_with_the_rectangles_count_are_never_taken(rows):
    raw = doc(rows)
    value = loads(raw)["instances"]
    assert isinstance(value, list)  # left to the decoder, which reports it ragged


@pytest.mark.parametrize("bad", [True, None, "1.0", {"b64": "AA=="}])
def test_anything_but_numbers_is_left_to_the_caller(bad):
    values = [1.0] * MIN_VALUES
    values[700] = bad
    assert isinstance(loads(doc(values))["instances"], list)


def test_documents_simdjson_refuses_are_left_whole():
    assert loads(b'{"instances": [' + b"1.0, " * MIN_VALUES + b"NaN]}") is None  # TF Serving takes NaN: orjson's path
    assert loads(b"{" * 4000 + b"}" * 4000) is None
    assert loads(b'{"instances": [1, 2]}') is None  # too short to be worth it


@pytest.mark.parametrize("other", [
    {"note": {"x": 1}},  # the key again after the array
    {"rows": [{"x": [2.5] * 3}]},  # after it, deeper, on an array of numbers too
    {"note": "x"},  # its name again as a string after the array
])
def test_a_key_seen_twice_is_left_to_the_caller(other):
    raw = json.dumps({"inputs": {"x": [1.5] * MIN_VALUES}, **other}).encode()
    assert isinstance(loads(raw)["inputs"]["x"], list)
    raw = json.dumps({**other, "inputs": {"x": [1.5] * MIN_VALUES}}).encode()  # the same before it
    assert isinstance(loads(raw)["inputs"]["x"], list)
    raw = json.dumps({"inputs": {"x": [1.5] * MIN_VALUES}}).encode()
    assert isinstance(loads(raw)["inputs"]["x"], np.ndarray)


def test_whitespace_anywhere_is_fine():
    rows = [[float(i + j) for j in range(40)] for i in range(40)]
    raw = json.dumps({"instances": rows}, indent=3).encode().replace(b":", b" \n: \t")
    np.testing.assert_array_equal(loads(raw)["instances"], np.asarray(rows))


def test_the_skeleton_of_a_rectangle():
    assert skeleton((2, 3)) == b"[[,,],[,,]]"
    assert skeleton((3,)) == b"[,,]"
    assert skeleton((1, 0)) == b"[[]]"


@st.composite
def rectangles(draw):
    """A rectangular nested array of at least MIN_VALUES numbers, then maybe spoiled: one value
    moved to a neighbouring row (ragged, same count), or one replaced by a nested list."""
    inner = draw(st.integers(1, 8))
    dims = draw(st.lists(st.integers(1, 6), min_size=0, max_size=2))
    rows = max(1, -(-MIN_VALUES // (inner * math.prod(dims)))) + draw(st.integers(0, 3))
    shape = (rows, *dims, inner)
    kind = draw(st.sampled_from(["int", "float", "mixed"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = rng.integers(-10**6, 10**6, math.prod(shape)).tolist() if kind != "float" else \
        rng.standard_normal(math.prod(shape)).tolist()
    if kind == "mixed":
        values[draw(st.integers(0, len(values) - 1))] = 0.25
    data = np.asarray(values, dtype=object).reshape(shape).tolist()
    spoil = draw(st.sampled_from(["none", "none", "move", "nest"]))
    if spoil == "move" and rows > 1 and len(shape) == 2:
        data[0].append(data[1].pop())  # rows of inner+1 and inner-1: the same count of numbers
    elif spoil == "nest":
        row = data
        while isinstance(row[0], list):
            row = row[0]
        row[0] = [row[0]]
    return data, spoil


@settings(max_examples=200, deadline=None)
@given(rectangles())
def test_whatever_the_array_the_answer_is_numpys_or_left_alone(case):
    data, spoil = case
    raw = doc(data)
    got = loads(raw)["instances"]
    if spoil == "none":  # a plain rectangle is always taken, and is numpy's array
        want = np.asarray(orjson.loads(raw)["instances"])
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    elif spoil == "move" and len(np.asarray(data[0], dtype=object).shape) == 1 and len(data[0]) != len(data[1]):
        assert isinstance(got, list)  # ragged: never taken for the rectangle of the same count
    elif spoil == "nest":
        assert isinstance(got, list)


def test_arrays_cross_the_channel_with_their_shape_and_dtype():
    """What a worker and the serving process exchange (appliance/transport/channel.py): every
    array comes back as it went, 0-d and empty ones, strings and views among them."""
    from appliance.fronts import messages as m
    from appliance.transport.channel import Codec, frame, unframe

    arrays = {"scalar": np.array(4.5, np.float32), "numpy scalar": np.float32(2.5), "empty": np.zeros((0, 3), np.int8),
              "strided": np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2], "bool": np.array([True, False]),
              "strings": np.array([b"a", b"bc", "d\u00e9"], dtype=object).reshape(3, 1), "f16": np.ones((2, 2), np.float16)}
    sent = m.Run(7, "mlp", None, "stable", {"x-user": None}, "serving_default", arrays, 3)  # type: ignore[arg-type]  # a numpy scalar among the arrays, on purpose
    got = unframe(Codec(m.ToServing), frame(sent))
    assert isinstance(got, m.Run)
    assert (got.id, got.version, got.label, got.route_headers, got.decoded_version) == (7, None, "stable", {"x-user": None}, 3)
    back = got.inputs
    for name, arr in arrays.items():
        arr = np.asarray(arr)
        assert back[name].shape == arr.shape and back[name].dtype == arr.dtype, name
        assert back[name].tolist() == arr.tolist(), name


def test_big_requests_are_answered_as_the_model_answers(start_server, models_dir, tmp_path):
    """Requests big enough for the fast path (20 x 64 numbers) through the real server, in
    every JSON form TF Serving and KServe v2 take: the reference interpreter's answers."""
    import shutil

    import requests

    from tests.support.modelgen import reference_predict_tflite

    base = tmp_path / "models"
    shutil.copytree(models_dir / "keras_mlp_tflite", base / "mlp")
    server = start_server("--models", str(base), "--backend", "tflite")
    x = np.round(np.random.default_rng(1).standard_normal((20, 64)), 3).astype(np.float32)
    want = reference_predict_tflite(base / "mlp" / "1" / "model.tflite", {"x": x})["probs"]
    xi = np.arange(20 * 64).reshape(20, 64) % 7
    want_int = reference_predict_tflite(base / "mlp" / "1" / "model.tflite", {"x": xi.astype(np.float32)})["probs"]

    def post(path, body):
        r = requests.post(server.url + path, data=json.dumps(body), timeout=30)
        return r.status_code, r.json()

    for body in ({"instances": x.tolist()}, {"inputs": x.tolist()}, {"inputs": {"x": x.tolist()}}):
        status, got = post("/v1/models/mlp:predict", body)
        assert status == 200, got
        np.testing.assert_allclose(got.get("predictions", got.get("outputs")), want, rtol=1e-5, atol=1e-6)
    status, got = post("/v1/models/mlp:predict", {"instances": xi.tolist()})
    np.testing.assert_allclose(got["predictions"], want_int, rtol=1e-5, atol=1e-6)
    for data in (x.ravel().tolist(), x.tolist()):
        status, got = post("/v2/models/mlp/infer", {"inputs": [{"name": "x", "shape": [20, 64], "datatype": "FP32",
                                                                 "data": data}]})
        assert status == 200, got
        np.testing.assert_allclose(np.reshape(got["outputs"][0]["data"], (20, 10)), want, rtol=1e-5, atol=1e-6)
    ragged = x.tolist()
    ragged[0].append(ragged[1].pop())  # rows of 65 and 63: the count of 20 x 64
    for path, body in (("/v1/models/mlp:predict", {"instances": ragged}),
                       ("/v2/models/mlp/infer", {"inputs": [{"name": "x", "shape": [20, 64], "datatype": "FP32",
                                                            "data": ragged}]})):
        status, got = post(path, body)
        assert status == 400 and "error" in got, got


def test_a_big_body_refused_gets_tf_servings_words_as_a_small_one_does(start_server, models_dir, tmp_path):
    """The error path words a refusal from the body as parsed: a body whose arrays came as
    numpy is worded as the same body of lists is."""
    import shutil

    import requests

    base = tmp_path / "models"
    shutil.copytree(models_dir / "keras_mlp_tflite", base / "mlp")
    server = start_server("--models", str(base), "--backend", "tflite")
    big = np.ones((20, 64), np.float32).tolist()
    small = np.ones((2, 64), np.float32).tolist()
    answers = []
    for rows in (big, small):
        body = {"signature_name": "serving_default", "instances": rows, "inputs": rows}  # both: refused
        r = requests.post(f"{server.url}/v1/models/mlp:predict", data=json.dumps(body), timeout=30)
        answers.append((r.status_code, r.json()["error"]))
    assert answers[0] == answers[1] and answers[0][0] == 400, answers


def test_escaped_keys_and_strings_leave_the_document_to_orjson():
    raw = json.dumps({'we"ird': 1, "instances": [1.5] * MIN_VALUES}).encode()
    assert loads(raw) is None
    assert orjson.loads(raw)['we"ird'] == 1


def _int8_tflite(path):
    """A LiteRT model whose int8 input ``x`` comes back as int32 ``y``: what the decoder made of it."""
    import tensorflow as tf

    class Widen(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.int8, name="x")])
        def serve(self, x):
            return {"y": tf.cast(x, tf.int32)}

    module = Widen()
    converter = tf.lite.TFLiteConverter.from_concrete_functions([module.serve.get_concrete_function()], module)
    path.mkdir(parents=True)
    (path / "model.tflite").write_bytes(converter.convert())


def test_an_int8_input_takes_what_tf_serving_takes_as_list_or_numpy(start_server, tmp_path):
    """Through the real server: int32 values wrapped into the int8 (TF Serving reads int32 and
    TensorFlow casts), an empty list as an empty tensor, a boolean refused in TF Serving's words;
    a big body (numpy from json_arrays.py) as a small one (lists)."""
    import requests

    _int8_tflite(tmp_path / "models" / "widen" / "1")
    server = start_server("--models", str(tmp_path / "models"), "--backend", "tflite")

    def post(body):
        r = requests.post(f"{server.url}/v1/models/widen:predict", data=json.dumps(body), timeout=30)
        return r.status_code, r.json()

    small = [300, -129, 127, 2147483647, -2147483648]
    wide = [v * 997 for v in range(-1000, 1000)]  # all int32, enough for the numpy path, at most 2048 rows
    assert isinstance(loads(json.dumps({"inputs": wide}).encode())["inputs"], np.ndarray)
    for values in (small, wide):
        status, got = post({"inputs": values})
        assert status == 200, got
        assert got["outputs"] == np.array(values, np.int32).astype(np.int8).astype(np.int32).tolist()
    assert post({"inputs": []}) == (200, {"outputs": []})
    for values in (small + [True], wide + [False]):
        status, got = post({"instances": values})
        assert status == 400 and got["error"] == (
            f"Failed to process element: {len(values) - 1} of 'instances' list. Error: INVALID_ARGUMENT: JSON Value: "
            f"{json.dumps(values[-1])} Type: {values[-1]} is not of expected type: int8"), got


def test_only_list_tensors_pay_for_the_numbers_only_pass(monkeypatch):
    """decode_predict asks numbers_only (a pass over every byte of the body) only for a tensor
    that arrived as lists; an image json_arrays made numpy never pays for it, and both decode
    to the same float32 values."""
    from appliance.api.tfserving import json_format
    from runtimes import SignatureInfo, TensorSpec

    calls = []
    real = json_format.numbers_only
    monkeypatch.setattr(json_format, "numbers_only", lambda raw, body: calls.append(len(raw)) or real(raw, body))
    rng = np.random.default_rng(3)
    for shape, scans in (((1, 32, 32, 3), 0), ((1, 8), 1)):  # above MIN_VALUES: numpy; below: lists
        x = rng.standard_normal(shape).round(4)
        raw = orjson.dumps({"instances": x.tolist()})
        sig = SignatureInfo("serving_default", {"x": TensorSpec("x", np.dtype(np.float32), (-1, *shape[1:]))}, {})
        calls.clear()
        inputs, _ = json_format.decode_predict(json_format.loads(raw), sig, raw)
        assert len(calls) == scans, (shape, calls)
        np.testing.assert_array_equal(inputs["x"], x.astype(np.float32))
