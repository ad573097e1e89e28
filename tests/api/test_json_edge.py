"""The hostile-JSON cases TF Serving's and Triton's own tests pin down, against the real server.

Deep nesting, 500,000 brackets, a 10^6-digit number, shapes no memory could hold, NaN and
Infinity both ways, doubles past float32's range, URL-safe and broken base64, gzip bombs,
chunked bodies over the limit; then 10,000 of them while the server's RSS is watched.
"""

from __future__ import annotations

import gzip
import json
import math
import select
import socket
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import requests

from appliance.api.tfserving import json_format as tfs_json
from appliance.api.tfserving import json_tensor_errors, rapidjson_reader
from appliance.core.errors import InvalidArgument
from runtimes import SignatureInfo, TensorSpec

MAX_BODY = 1536 * 1024  # room for 500,000 brackets and a 10^6-digit number; small enough to bomb past
NO_DISCOVERY = "[discovery]\nenabled = false\n"


@pytest.fixture(scope="module")
def server(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = tmp_path_factory.mktemp("edge-config") / "appliance.toml"
    models = "".join(f'[[models]]\nname = "{name}"\nbase_path = "{models_dir / name}"\n'
                     for name in ("half_plus_two", "string_model", "keras_mlp_tflite"))
    config.write_text(f"poll_interval_s = 5.0\n[server]\nmax_body_bytes = {MAX_BODY}\n{NO_DISCOVERY}{models}")
    srv = module_server("--config", str(config), timeout=180)
    return srv


def predict(server: Any, model: str, body: bytes | str | dict[str, Any], **kw: Any) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(f"{server.url}/v1/models/{model}:predict", data=data, timeout=60, **kw)


def refused(resp: requests.Response, status: int, *words: str) -> str:
    assert resp.status_code == status, resp.text[:500]
    message = resp.json()["error"]
    for word in words:
        assert word in message, message
    return message


def alive(server: Any) -> None:
    assert server.proc.poll() is None, server.log_text()[-3000:]
    assert server.get("/healthz").status_code == 200


def nested(depth: int) -> bytes:
    """``{"instances": [...]}`` with ``depth`` levels of JSON nesting in all."""
    inner = depth - 2  # the object and the instances list
    return b'{"instances": ' + b"[" * (inner + 1) + b"1.0" + b"]" * (inner + 1) + b"}"


# --- nesting --------------------------------------------------------------------------------
def test_nesting_past_the_limit_is_400_naming_it(server: Any) -> None:
    refused(predict(server, "half_plus_two", nested(101)), 400, "max_json_depth", "100")
    refused(predict(server, "string_model", b'{"instances": ["' + b"[" * 500 + b'"], "x": ' + b"{\"a\":" * 120
                    + b"1" + b"}" * 120 + b"}"), 400, "max_json_depth")


def test_nesting_at_the_limit_is_not_a_depth_error(server: Any) -> None:
    message = refused(predict(server, "half_plus_two", nested(100)), 400)  # 98 dimensions: numpy's limit is 64
    assert "max_json_depth" not in message
    ok = predict(server, "string_model", {"instances": ["[" * 5000, "{" * 5000]})  # brackets inside strings
    assert ok.status_code == 200, ok.text[:300]


def test_500000_brackets_is_400_and_the_process_lives(server: Any) -> None:
    for body in (b"[" * 500_000, b"[" * 250_000 + b"]" * 250_000, b'{"instances": ' + b"[" * 499_990,
                 b'{"instances": ["\xff", ' + b"[" * 499_980):  # past orjson at the byte, into python-rapidjson
        refused(predict(server, "half_plus_two", body), 400, "max_json_depth")
    alive(server)


BIG_ARRAY = b"[" + b",".join([b"1.5"] * 2000) + b"]"  # json_arrays.py makes it numpy (>= 1024 numbers)


@pytest.mark.parametrize("body, words", [
    (b'[{"x": ' + BIG_ARRAY + b"}]", ("Is not object", '"x": [1.5, 1.5')),
    (b'{"signature_name": 1, "instances": ' + BIG_ARRAY + b"}", ("'signature_name' key must be a string",)),
])
def test_a_refused_body_holding_a_big_numeric_array_is_shown_in_the_400(server: Any, body: bytes,
                                                                        words: tuple[str, ...]) -> None:
    """TF Serving's refusal shows the body (json_tensor.cc's debug string), also the arrays
    json_arrays.py read as numpy, as the lists they were (shown unconverted they were a 500)."""
    refused(predict(server, "half_plus_two", body), 400, *words)
    alive(server)


# --- numbers --------------------------------------------------------------------------------
def test_a_million_digit_number_is_400(server: Any) -> None:
    digits = b"9" * 1_000_000
    refused(predict(server, "half_plus_two", b'{"instances": [' + digits + b"]}"), 400, "JSON Parse error")
    refused(predict(server, "half_plus_two", b'{"instances": [-' + digits + b", NaN]}"), 400, "JSON Parse error")
    alive(server)


def test_nan_and_infinity_accepted_and_written_as_tf_serving_does(server: Any) -> None:
    body = b'{"instances": [NaN, Infinity, -Infinity, Inf, -Inf, 1.0]}'
    resp = predict(server, "half_plus_two", body)
    assert resp.status_code == 200, resp.text
    assert resp.text.replace(" ", "") == '{"predictions":[NaN,Infinity,-Infinity,Infinity,-Infinity,2.5]}'
    got = json.loads(resp.text)["predictions"]  # Python's json reads them as TF Serving's clients do
    assert math.isnan(got[0]) and got[1:] == [math.inf, -math.inf, math.inf, -math.inf, 2.5]
    columnar = predict(server, "half_plus_two", b'{"inputs": {"x": [NaN, 2.0]}}')
    assert columnar.text.replace(" ", "") == '{"outputs":[NaN,3.0]}'


def test_nan_inside_strings_is_just_text(server: Any) -> None:
    resp = predict(server, "string_model", b'{"instances": ["NaN", "-Infinity"]}')
    assert resp.status_code == 200, resp.text
    assert [row["len"] for row in resp.json()["predictions"]] == [3, 9]


def test_a_double_past_float32_range_is_infinity(server: Any) -> None:
    resp = predict(server, "half_plus_two", {"instances": [1e39, -3.5e38, 3.0e38]})
    assert resp.status_code == 200, resp.text
    assert json.loads(resp.text)["predictions"] == [math.inf, -math.inf, pytest.approx(1.5e38, rel=1e-6)]
    refused(predict(server, "half_plus_two", b'{"instances": [1e400]}'), 400, "JSON Parse error")


# --- TF Serving's parser: rapidjson 1.1.0 -----------------------------------------------------
# body -> TF Serving's text after "JSON Parse error: ", or (start, end) of the root value it reads.
# Each checked against rapidjson 1.1.0 (tensorflow_serving/workspace.bzl) built from source and run
# with TF Serving's flags (util/json_tensor.cc ParseJson); so were 120,000 fuzzed bodies.
RAPIDJSON = [
    (b"x", "Invalid value. at offset: 0"),
    (b" ", "The document is empty. at offset: 1"),
    (b"]", "The document is empty. at offset: 0"),  # the start state reports any token that cannot begin a value so
    (b'{"a":1,}', "Missing a name for object member. at offset: 7"),
    (b"{1:2}", "Missing a name for object member. at offset: 1"),
    (b'{"a" 1}', "Missing a colon after a name of object member. at offset: 5"),
    (b'{"a":1 "b":2}', "Missing a comma or '}' after an object member. at offset: 7"),
    (b"[1 2]", "Missing a comma or ']' after an array element. at offset: 3"),
    (b"[1,]", "Invalid value. at offset: 3"),
    (b'"abc', "Missing a closing quotation mark in string. at offset: 4"),
    (b'["a\x01"]', "Invalid escape character in string. at offset: 3"),  # 1.1.0's word for a control byte
    (b'["\\ud800\\u0041"]', "The surrogate pair in string is invalid. at offset: 2"),
    (b'["\\u12"]', "Incorrect hex digit after \\u escape in string. at offset: 2"),
    (b"[01]", "Missing a comma or ']' after an array element. at offset: 2"),
    (b"[1.]", "Miss fraction part in number. at offset: 3"),
    (b"[1e+]", "Miss exponent in number. at offset: 4"),
    (b"[1e400]", "Number too big to be stored in double. at offset: 1"),
    (b"[" + b"9" * 400 + b"]", "Number too big to be stored in double. at offset: 1"),
    (b"[Infinix]", "Invalid value. at offset: 7"),
    (b"[1\x002]", "Missing a comma or ']' after an array element. at offset: 2"),  # a NUL byte ends the body
    (b'{"a":[1,2,[3,4],{"b":[5]}]}x', (0, 27)),  # kParseStopWhenDoneFlag: what follows the root is not read
    (b"\xef\xbb\xbf[1]", (3, 6)),  # a byte-order mark is skipped
    (b"[NaN, -Infinity, Inf]", (0, 21)),  # kParseNanAndInfFlag
    (b'["\xff"]', (0, 5)),  # strings are not checked for UTF-8
    # What python-rapidjson (a later rapidjson, recursive, without TF Serving's flags) does not do
    # itself and rapidjson_reader.py adds; each checked against rapidjson 1.1.0 as above:
    (b"\xef\xbb\xbf[1 2]", "Missing a comma or ']' after an array element. at offset: 6"),  # offsets count the BOM
    (b"\xbb\xbf[1]", (2, 5)),  # each byte of a byte-order mark is skipped on its own
    (b"[1]  x", (0, 3)),  # the root ends before the whitespace that follows it
    (b"[1]\x00x", (0, 3)),  # a NUL byte ends the body after the root too
    (b"\t:", "The document is empty. at offset: 1"),  # the iterative parser's start state (recursive: "Invalid value.")
    (b'"a\x1f"', "Invalid escape character in string. at offset: 2"),  # the later rapidjson: "Invalid encoding"
    (b"[\xff]", "Invalid value. at offset: 1"),  # a byte that is not UTF-8, outside a string
    (b'{"a": [1, 2], "b": "\xff\xfe"} {"c": 1', (0, 24)),
]


@pytest.mark.parametrize("body, verdict", RAPIDJSON, ids=lambda v: repr(v)[:40])
def test_rapidjson_reader_reads_as_tf_serving(body: bytes, verdict: Any) -> None:
    got = rapidjson_reader.read(body)
    assert got is not None
    if isinstance(verdict, str):
        assert got.error == f"JSON Parse error: {verdict}"
        with pytest.raises(InvalidArgument) as err:  # and the decoder answers with it
            tfs_json.loads(body)
        assert err.value.message == got.error
    else:
        assert got.error is None and (got.start, got.end) == verdict


def test_rapidjson_reader_finds_the_fault_after_a_tensor_of_numbers() -> None:
    numbers = b",".join(b"%d.25" % i for i in range(200_000))
    body = b'{"instances": [[' + numbers + b"], [" + numbers + b"}"
    assert rapidjson_reader.read(body).error == (  # type: ignore[union-attr]
        f"JSON Parse error: Missing a comma or ']' after an array element. at offset: {len(body) - 1}")


def test_rapidjson_reader_leaves_a_body_past_1000_levels_to_the_depth_limit() -> None:
    """TF Serving's iterative parser follows any depth; python-rapidjson stops at Python's
    recursion limit (1000 levels), past any max_json_depth: the decoder names that limit."""
    body = b'{"instances": ["\xff", ' + b"[" * 5000 + b"]" * 5000 + b"]}"  # orjson stops at the byte, not the depth
    assert rapidjson_reader.read(body) is None
    with pytest.raises(InvalidArgument) as err:
        tfs_json.loads(body)
    assert "max_json_depth" in err.value.message


def test_bodies_tf_serving_reads_are_served(server: Any) -> None:
    for body in (b'{"instances": [1.0, 2.0]} and then some text', b'\xef\xbb\xbf{"instances": [1.0, 2.0]}',
                 b'{"instances": [NaN, 2.0]}\n{"instances": [3.0]}'):
        resp = predict(server, "half_plus_two", body)
        assert resp.status_code == 200, (body, resp.text)
        assert resp.json()["predictions"][1] == 3.0


# --- TF Serving's debug text of a JSON value (util/json_tensor.cc JsonValueToDebugString) -----
@pytest.mark.parametrize("body, text", [  # each checked against rapidjson 1.1.0's PrettyWriter
    (b"[1, 2.5e-7, 1e21, 1e20, -0.0, 100, 18446744073709551615, 1.2345e-300]",
     "[1, 2.5e-7, 1e21, 100000000000000000000.0, -0.0, 100, 18446744073709551615, 1.2345000000000001e-300]"),
    (b'{"a": {"b": [1, {"c": null}]}, "d": "\xc3\xa9\\n\\"\\u0001", "e": [], "f": {}}',
     '{\n    "a": {\n        "b": [1, {\n                "c": null\n            }]\n    },\n    "d": "\u00e9\\n\\"\\u0001",'
     '\n    "e": [],\n    "f": {}\n}'),
    (b"[1.0, NaN, 2.0]", "[1.0, "),  # rapidjson's writer refuses NaN, and stops there
    (b"[" + b",".join([b"1.5"] * 100) + b"]", "[" + ", ".join(["1.5"] * 52)),  # cut once 256 bytes are out
    (b'{"instances": ["' + b"a" * 300 + b'", 1]}', '{\n    "instances": ["' + "a" * 300 + '"'),
])
def test_values_are_shown_as_tf_serving_shows_them(body: bytes, text: str) -> None:
    assert json_tensor_errors.debug_string(tfs_json.loads(body)) == text


# --- TF Serving's values (util/json_tensor.cc AddValueToTensor, TensorFlow's Tensor::FromProto) ---
def decoded(raw: bytes, dtype: Any, numpy: bool) -> Any:
    """The input ``x`` of ``dtype`` that ``raw`` decodes to, or the refusal's text; ``numpy``:
    whether json_arrays.py must have given the decoder the values as an array (else lists)."""
    doc = tfs_json.loads(raw)
    value = doc.get("inputs", doc.get("instances"))
    assert isinstance(value, np.ndarray) == numpy, type(value)
    spec = TensorSpec("x", np.dtype(dtype), None)
    try:
        return tfs_json.decode_predict(doc, SignatureInfo("serving_default", {"x": spec}, {"y": spec}), raw)[0]["x"]
    except InvalidArgument as exc:
        return exc.message


WIDE = [v * 997 for v in range(-1000, 1000)]  # enough values for json_arrays.py's numpy path, all int32


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16])
@pytest.mark.parametrize("values", [[300, -129, 127, 256, -1, 70000, 2147483647, -2147483648], WIDE], ids=len)
def test_small_integer_inputs_take_any_int32_and_wrap_it_as_tf_serving_does(dtype: Any, values: list[int]) -> None:
    """AddValueToTensor reads int8, uint8 and int16 values with rapidjson's IsInt (int32) into
    int_val, and Tensor::FromProto narrows them with a C++ cast: 300 is 44 in an int8."""
    got = decoded(json.dumps({"inputs": values}).encode(), dtype, numpy=values is WIDE)
    assert isinstance(got, np.ndarray), got
    assert got.dtype == dtype and got.tolist() == np.array(values, np.int32).astype(dtype).tolist()
    for past in (2147483648, -2147483649):  # no int32: TF Serving's type error, in its words
        name = np.dtype(dtype).name
        raw = json.dumps({"inputs": values + [past]}).encode()
        assert decoded(raw, dtype, numpy=values is WIDE) == \
            f"JSON Value: {past} Type: Number is not of expected type: {name}"


@pytest.mark.parametrize("dtype, name", [(np.float32, "float"), (np.float64, "double"), (np.int32, "int32"),
                                         (np.int64, "int64"), (np.uint8, "uint8")])
def test_a_boolean_among_numbers_is_refused_as_tf_serving_refuses_it(dtype: Any, name: str) -> None:
    """numpy makes [true, 1.5] floats and [1, true] integers; TF Serving's IsNumber and IsInt
    are false for a boolean."""
    assert decoded(b'{"inputs": [[1, 2], [3, false]]}', dtype, numpy=False) == \
        f"JSON Value: false Type: False is not of expected type: {name}"
    rows = json.dumps({"instances": [1] * 2000 + [True]}).encode()  # big, but json_arrays.py takes numbers only
    assert decoded(rows, dtype, numpy=False) == ("Failed to process element: 2000 of 'instances' list. Error: "
                                                 f"INVALID_ARGUMENT: JSON Value: true Type: True is not of expected "
                                                 f"type: {name}")


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.uint8, np.int64, np.bool_, np.float32])
@pytest.mark.parametrize("body, shape", [(b'{"inputs": []}', (0,)), (b'{"inputs": {"x": [[], []]}}', (2, 0)),
                                         (b'{"instances": [[]]}', (1, 0))])
def test_an_empty_list_is_an_empty_tensor_of_any_dtype(dtype: Any, body: bytes, shape: tuple[int, ...]) -> None:
    """numpy makes [] float64; TF Serving fills a tensor of the input's dtype with no values."""
    got = decoded(body, dtype, numpy=False)
    assert isinstance(got, np.ndarray) and got.dtype == dtype and got.shape == shape, got


# --- shapes no memory can hold --------------------------------------------------------------------
@pytest.mark.parametrize("shape", [[1 << 60, 64], [-1, 64], [1 << 62, 1 << 62], [-5]])
def test_declared_shapes_past_memory_are_400_with_nothing_allocated(server: Any, shape: list[int]) -> None:
    process = psutil.Process(server.proc.pid)
    before = process.memory_info().rss
    body = {"inputs": [{"name": "x", "shape": shape, "datatype": "FP32", "data": [1.0] * 64}]}
    resp = requests.post(f"{server.url}/v2/models/keras_mlp_tflite/infer", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert "shape" in resp.json()["error"]
    assert process.memory_info().rss - before < 32 << 20
    alive(server)


# --- base64 ------------------------------------------------------------------------------------------
def test_url_safe_base64_is_400_saying_so(server: Any) -> None:
    refused(predict(server, "string_model", {"instances": [{"b64": "_-8_"}]}), 400, "URL-safe", "'+' and '/'")


@pytest.mark.parametrize("text", ["not base64!!", "A", "AP8===", "AP8=x", "////=", "é"])
def test_broken_base64_is_400_saying_so(server: Any, text: str) -> None:
    message = refused(predict(server, "string_model", {"instances": [{"b64": text}]}), 400)
    assert message == ("Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: Unable to base64 "
                       "decode")  # util/json_tensor.cc JsonDecodeBase64Object


def test_base64_padding_is_optional_as_in_absl(server: Any) -> None:
    resp = predict(server, "string_model", {"instances": [{"b64": "AP8"}, {"b64": "AP8="}]})
    assert resp.status_code == 200, resp.text
    assert [row["echo_bytes"] for row in resp.json()["predictions"]] == [{"b64": "AP8="}] * 2


# --- bodies: gzip and chunked ------------------------------------------------------------------------
def test_gzip_body_is_accepted_as_tf_serving_does(server: Any) -> None:
    body = gzip.compress(b'{"instances": [1.0, 2.0, 5.0]}')
    resp = predict(server, "half_plus_two", body, headers={"Content-Encoding": "gzip"})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"predictions": [2.5, 3.0, 4.5]}


def test_gzip_bomb_is_413(server: Any) -> None:
    bomb = gzip.compress(b'{"instances": [' + b" " * (64 << 20) + b"1.0]}", 9)
    assert len(bomb) < MAX_BODY // 8
    refused(predict(server, "half_plus_two", bomb, headers={"Content-Encoding": "gzip"}), 413,
            "inflates", "max_body_bytes")
    alive(server)


@pytest.mark.parametrize("encoding, body, words", [
    ("gzip", b'{"instances": [1.0]}', ("not valid gzip",)),
    ("gzip", gzip.compress(b'{"instances": [1.0]}', mtime=0)[:-12], ("truncated",)),
    ("br", b'{"instances": [1.0]}', ("not supported",)),
])
def test_broken_or_unknown_encodings_are_400(server: Any, encoding: str, body: bytes, words: tuple[str, ...]) -> None:
    refused(predict(server, "half_plus_two", body, headers={"Content-Encoding": encoding}), 400, *words)


def test_chunked_body_over_the_limit_is_413_before_it_ends(server: Any) -> None:
    """The body never ends (no last chunk): a 413 proves the server did not wait to buffer it all."""
    reply = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/models/half_plus_two:predict HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n%s\r\n" % (16 * 1024, b" " * (16 * 1024))
        sent = 0
        while sent <= MAX_BODY and not select.select([sock], [], [], 0)[0]:  # until over the limit
            sock.sendall(chunk)
            sent += len(chunk)
        assert select.select([sock], [], [], 30)[0], "no answer although the body is over the limit"
        try:
            while data := sock.recv(65536):  # the server closes after its 413
                reply += data
        except ConnectionResetError:  # what we sent after its answer was never read: fine
            pass
    assert sent > MAX_BODY
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


# --- memory across 10,000 of them ------------------------------------------------------------
def hostile_requests() -> list[tuple[str, bytes, dict[str, str], int]]:
    """(path, body, headers, expected status) for one round; the costly ones once a round."""
    hpt, text = "/v1/models/half_plus_two:predict", "/v1/models/string_model:predict"
    v2 = "/v2/models/keras_mlp_tflite/infer"
    cheap = [
        (hpt, nested(101), {}, 400),
        (hpt, b'{"instances": [NaN, 1e39]}', {}, 200),
        (hpt, b'{"instances": [1e400]}', {}, 400),
        (text, b'{"instances": [{"b64": "_-8_"}]}', {}, 400),
        (text, b'{"instances": [{"b64": "AP8=x"}]}', {}, 400),
        (hpt, gzip.compress(b'{"instances": [1.0]}'), {"Content-Encoding": "gzip"}, 200),
        (hpt, gzip.compress(b" " * (8 << 20)), {"Content-Encoding": "gzip"}, 413),
        (v2, json.dumps({"inputs": [{"name": "x", "shape": [1 << 60, 64], "datatype": "FP32",
                                     "data": [0.0]}]}).encode(), {}, 400),
        (hpt, b'{"instances": [[[1.0], [2.0, 3.0]]]}', {}, 400),
    ]
    costly = [(hpt, b"[" * 500_000, {}, 400), (hpt, b'{"instances": [' + b"7" * 1_000_000 + b"]}", {}, 400)]
    return cheap * 20 + costly


def test_rss_stays_flat_across_10000_hostile_requests(server: Any) -> None:
    process = psutil.Process(server.proc.pid)
    round_ = hostile_requests()
    session = requests.Session()

    def send(n: int) -> None:
        for i in range(n):
            path, body, headers, status = round_[i % len(round_)]
            resp = session.post(server.url + path, data=body, headers=headers, timeout=60)
            assert resp.status_code == status, (path, body[:80], resp.text[:300])

    send(len(round_) * 3)  # warm: allocator arenas, caches and thread stacks reach their size
    before = process.memory_info().rss
    send(10_000)
    after = process.memory_info().rss
    session.close()
    alive(server)
    print(f"server RSS across 10,000 hostile requests: {before >> 20} MiB -> {after >> 20} MiB")
    # Generous: allocator noise is a few MB; a leak of one body per request would be gigabytes.
    assert after - before < 64 << 20, f"RSS grew from {before >> 20} MiB to {after >> 20} MiB"
