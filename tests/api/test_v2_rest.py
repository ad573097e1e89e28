"""The Open Inference Protocol (KServe v2) over HTTP, against the real server.

Triton's own client (``tritonclient.http``) talks to ``appliance serve`` in JSON and in
binary mode (Triton's binary tensor data extension); every answer is compared with the
model called in-process. A request built by hand from the documented JSON, a binary one
built byte by byte, the bad inputs the issue lists (each a 400 naming what is wrong, the
server serving on), and a v1 + v2 pair that must run as one batch.
"""

from __future__ import annotations

import json
import shutil
import signal
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from tests.support.modelgen import reference_predict, reference_predict_tflite

tc_http = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
MAX_BODY = 256 * 1024
MODELS = ("keras_mlp", "keras_mlp_tflite", "multisig_tflite", "string_model")


@pytest.fixture(scope="module")
def models(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("v2-models")
    for name in MODELS:
        shutil.copytree(models_dir / name, base / name)
    return base


@pytest.fixture(scope="module")
def server(module_server: Any, models: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = tmp_path_factory.mktemp("v2-config") / "appliance.toml"
    config.write_text(f"poll_interval_s = 5.0\n[server]\nmax_body_bytes = {MAX_BODY}\n"
                      "[discovery]\nenabled = false\n")
    # test hooks: SIGUSR1 freezes the batchers (the shared-batch test)
    return module_server("--config", str(config), "--models", str(models), timeout=180,
                         env={"EDGE_APPLIANCE_TEST_HOOKS": "1"})


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    c = tc_http.InferenceServerClient(f"127.0.0.1:{server.port}", concurrency=2)
    yield c
    c.close()


def rng_x(rows: int, dim: int = 64, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)


def v2_error(resp: requests.Response, status: int, *words: str) -> str:
    """A v2 error: the status and a JSON body {"error": str} naming every one of ``words``."""
    assert resp.status_code == status, f"wanted {status}, got {resp.status_code}: {resp.text[:500]}"
    body = resp.json()
    assert isinstance(body, dict) and list(body) == ["error"] and isinstance(body["error"], str), body
    message = body["error"]
    assert "Traceback" not in message, message
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in {message!r}"
    return message


def binary_request(header: dict[str, Any], *chunks: bytes, length: int | None = None) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    headers = {"Inference-Header-Content-Length": str(len(head) if length is None else length),
               "Content-Type": "application/octet-stream"}
    return head + b"".join(chunks), headers


# --- health and metadata --------------------------------------------------------------------
def test_health_and_server_metadata(client: Any, server: Any) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("keras_mlp") and client.is_model_ready("keras_mlp", "1")
    assert not client.is_model_ready("keras_mlp", "7")
    assert not client.is_model_ready("no_such_model")
    meta = client.get_server_metadata()
    assert meta["name"] == "edge-appliance" and "binary_tensor_data" in meta["extensions"]
    live = server.get("/v2/health/live")  # the protocol's bodies (inference_rest.md "Health")
    assert live.status_code == 200 and live.json() == {"live": True}
    assert server.get("/v2/health/ready").json() == {"ready": True}
    assert server.get("/v2/models/keras_mlp/ready").json() == {"name": "keras_mlp", "ready": True}
    v2_error(server.get("/v2/models/keras_mlp/versions/7/ready"), 404,
             "Request for unknown model: 'keras_mlp' version 7 is not found")
    v2_error(server.get("/v2/models/no_such_model/ready"), 404, "Request for unknown model: 'no_such_model' is not found")
    v2_error(server.get("/v2/nothing/here"), 404, "/v2/nothing/here")
    v2_error(server.post("/v2/health/live", b""), 405, "POST")


def test_model_metadata_from_the_signature(client: Any, server: Any) -> None:
    meta = client.get_model_metadata("keras_mlp")
    assert meta == {"name": "keras_mlp", "versions": ["1"], "platform": "tensorflow_savedmodel",
                    "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}],
                    "outputs": [{"name": "probs", "datatype": "FP32", "shape": [-1, 10]}]}
    assert client.get_model_metadata("keras_mlp_tflite", "1")["platform"] == "tflite"
    strings = client.get_model_metadata("string_model")
    assert {t["name"]: t["datatype"] for t in strings["inputs"] + strings["outputs"]} == {
        "text": "BYTES", "len": "INT64", "echo_bytes": "BYTES"}
    multi = client.get_model_metadata("multisig_tflite")  # no serving_default: the first by name
    assert [t["name"] for t in multi["inputs"]] == ["a", "b"] and multi["outputs"][0]["name"] == "sum"
    assert multi["parameters"] == {"signature_name": "add", "signatures": "add,mul"}
    v2_error(server.get("/v2/models/keras_mlp/versions/9"), 404, "keras_mlp")
    v2_error(server.get("/v2/models/keras_mlp/versions/x1"), 400, "version")


# --- inference with Triton's client ------------------------------------------------------------
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("model", ["keras_mlp", "keras_mlp_tflite"])
def test_mlp_matches_in_process(client: Any, models: Path, model: str, binary: bool) -> None:
    x = rng_x(3, seed=1)
    inp = tc_http.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    result = client.infer(model, [inp], outputs=[tc_http.InferRequestedOutput("probs", binary_data=binary)],
                          request_id="r-7")
    got = result.as_numpy("probs")
    out = result.get_output("probs")
    assert ("data" in out) != binary and out["shape"] == [3, 10] and out["datatype"] == "FP32"
    assert result.get_response()["id"] == "r-7" and result.get_response()["model_version"] == "1"
    version = models / model / "1"
    want = (reference_predict(version, {"x": x}) if model == "keras_mlp"
            else reference_predict_tflite(version / "model.tflite", {"x": x}))["probs"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_no_outputs_named_means_all_in_binary(client: Any) -> None:
    x = rng_x(1, seed=2)
    inp = tc_http.InferInput("x", [1, 64], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("keras_mlp_tflite", [inp])  # tritonclient then sets binary_data_output
    assert result.get_output("probs")["parameters"]["binary_data_size"] == 40
    assert result.as_numpy("probs").shape == (1, 10)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_multi_input_signatures(client: Any, models: Path, binary: bool) -> None:
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 3.0, dtype=np.float32)
    inputs = []
    for name, arr in (("a", a), ("b", b)):
        inputs.append(tc_http.InferInput(name, [2, 4], "FP32"))
        inputs[-1].set_data_from_numpy(arr, binary_data=binary)
    tflite = models / "multisig_tflite" / "1" / "model.tflite"
    for signature, output in (("add", "sum"), ("mul", "product")):
        result = client.infer("multisig_tflite", inputs, parameters={"signature_name": signature})
        want = reference_predict_tflite(tflite, {"a": a, "b": b}, signature=signature)[output]
        np.testing.assert_allclose(result.as_numpy(output), want, rtol=RTOL)
    default = client.infer("multisig_tflite", inputs)  # what the metadata says: "add"
    np.testing.assert_allclose(default.as_numpy("sum"), a + b)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_bytes_in_int64_and_bytes_out(client: Any, models: Path, binary: bool) -> None:
    text = np.array([b"edge", b"", "appliance \u00e9".encode()], dtype=object)
    inp = tc_http.InferInput("text", [3], "BYTES")
    inp.set_data_from_numpy(text, binary_data=binary)
    outputs = [tc_http.InferRequestedOutput("len", binary_data=binary),
               tc_http.InferRequestedOutput("echo_bytes", binary_data=binary)]
    result = client.infer("string_model", [inp], outputs=outputs)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["len", "echo_bytes"]  # as requested
    want = reference_predict(models / "string_model" / "1", {"text": text.astype(bytes)})
    np.testing.assert_array_equal(result.as_numpy("len"), want["len"])
    echoed = [v if isinstance(v, bytes) else v.encode() for v in result.as_numpy("echo_bytes")]
    assert echoed == list(text)


def test_client_sees_bad_input_as_error(client: Any) -> None:
    inp = tc_http.InferInput("x", [1, 64], "FP64")
    inp.set_data_from_numpy(rng_x(1).astype(np.float64))
    with pytest.raises(InferenceServerException, match="expects 'FP32'"):
        client.infer("keras_mlp", [inp])


# --- hand-built requests --------------------------------------------------------------------------
def test_documented_json_request(server: Any, models: Path) -> None:
    x = rng_x(2, seed=3)
    body = {"id": "42", "inputs": [{"name": "x", "shape": [2, 64], "datatype": "FP32", "data": x.tolist()}],
            "outputs": [{"name": "probs"}]}
    resp = server.post("/v2/models/keras_mlp/infer", body, headers={"Content-Type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["Content-Type"] == "application/json" and "Inference-Header-Content-Length" not in resp.headers
    answer = resp.json()
    assert answer["id"] == "42" and answer["model_name"] == "keras_mlp" and answer["model_version"] == "1"
    (out,) = answer["outputs"]
    assert out["name"] == "probs" and out["datatype"] == "FP32" and out["shape"] == [2, 10]
    assert len(out["data"]) == 20  # flat, row-major
    want = reference_predict(models / "keras_mlp" / "1", {"x": x})["probs"]
    np.testing.assert_allclose(np.array(out["data"]).reshape(2, 10), want, rtol=RTOL, atol=ATOL)
    flat = dict(body, inputs=[dict(body["inputs"][0], data=x.reshape(-1).tolist())])  # flat data too
    again = server.post("/v2/models/keras_mlp/versions/1/infer", flat).json()
    np.testing.assert_allclose(np.array(again["outputs"][0]["data"]).reshape(2, 10), want, rtol=RTOL, atol=ATOL)


def test_binary_request_built_by_hand(server: Any, models: Path) -> None:
    x = rng_x(1, seed=4)
    header = {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32",
                          "parameters": {"binary_data_size": x.nbytes}}],
              "outputs": [{"name": "probs", "parameters": {"binary_data": True}}]}
    body, headers = binary_request(header, x.tobytes())
    resp = server.post("/v2/models/keras_mlp_tflite/infer", body, headers=headers)
    assert resp.status_code == 200, resp.text
    length = int(resp.headers["Inference-Header-Content-Length"])
    assert resp.headers["Content-Type"] == "application/octet-stream"
    head = json.loads(resp.content[:length])
    assert head["outputs"][0]["parameters"] == {"binary_data_size": 40}
    assert len(resp.content) == length + 40
    got = np.frombuffer(resp.content[length:], dtype="<f4").reshape(1, 10)
    want = reference_predict_tflite(models / "keras_mlp_tflite" / "1" / "model.tflite", {"x": x})["probs"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


# --- bad input: a clear 400 each, and the server keeps serving ----------------------------------------
X = rng_x(1, seed=5)
X_HEADER = {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "parameters": {"binary_data_size": 256}}]}


def _json(inp: dict[str, Any], **extra: Any) -> tuple[bytes, dict[str, str]]:
    return json.dumps({"inputs": [inp], **extra}).encode(), {"Content-Type": "application/json"}


def _x(**change: Any) -> dict[str, Any]:
    return {"name": "x", "shape": [1, 64], "datatype": "FP32", "data": X.reshape(-1).tolist(), **change}


BAD = {
    "unknown datatype name": (_json(_x(datatype="FLOAT32")), ["invalid datatype", "FLOAT32", "FP32"]),
    "datatype the model does not take": (_json(_x(datatype="INT32", data=[1] * 64)), ["INT32", "expects 'FP32'"]),
    "shape disagrees with data length": (_json(_x(data=[0.5] * 63)), ["[1, 64]", "64 elements", "63"]),
    "ragged data": (_json(_x(shape=[2, 2], data=[[1.0, 2.0], [3.0]])), ["regular"]),
    "strings for a number tensor": (_json(_x(shape=[1, 2], data=["1", "2"])), ["strings", "FP32"]),
    "shape the model does not take": (_json(_x(shape=[1, 63], data=[0.5] * 63)), ["expected shape", "[-1,64]"]),
    "unknown input name": (_json(_x(name="y")), ["unexpected inference input 'y'", "takes x"]),
    "unknown output name": (_json(_x(), outputs=[{"name": "logits"}]), ["unexpected inference output 'logits'"]),
    "not JSON": ((b"{inputs: nope", {}), ["not valid JSON"]),
    "negative dimension": (_json(_x(shape=[-1, 64])), ["non-negative"]),
    "both data and binary_data_size": (_json(_x(parameters={"binary_data_size": 256})), ["exactly one", "both"]),
    "binary_data_size without the header-length header": (
        (json.dumps(X_HEADER).encode() + X.tobytes(), {}), ["binary_data_size", "no Inference-Header-Content-Length"]),
    "binary size disagrees with shape and datatype": (
        binary_request({"inputs": [dict(X_HEADER["inputs"][0], parameters={"binary_data_size": 128})]},
                       X.tobytes()[:128]), ["binary_data_size 128", "[1, 64]", "FP32", "need 256 bytes"]),
    "binary size larger than what the body holds (truncated body)": (
        binary_request(X_HEADER, X.tobytes()[:100]), ["binary_data_size' is 256", "only 100 bytes", "truncated"]),
    "binary size of a gigabyte": (
        binary_request({"inputs": [dict(X_HEADER["inputs"][0], parameters={"binary_data_size": 1 << 30})]},
                       X.tobytes()), ["binary_data_size 1073741824 disagrees", "need 256 bytes"]),
    "bytes left after the last binary input": (binary_request(X_HEADER, X.tobytes(), b"\0" * 8), ["8 bytes after"]),
    "header length larger than the body": (
        binary_request(X_HEADER, X.tobytes(), length=10_000), ["Inference-Header-Content-Length 10000", "outside"]),
    "header length that is not a number": (
        (binary_request(X_HEADER, X.tobytes())[0], {"Inference-Header-Content-Length": "abc"}), ["not an integer"]),
    # limits.max_tensor_elements (4 Mi by default) on the declared shapes, before any data is read
    "declared shape over the element limit": (
        _json(_x(shape=[65537, 64])), ["limits.max_tensor_elements", "4194368 elements", "4194304"]),
    "binary declared shape over the element limit": (
        binary_request({"inputs": [dict(X_HEADER["inputs"][0], shape=[65537, 64])]}, X.tobytes()),
        ["limits.max_tensor_elements", "4194368 elements"]),
    "BYTES declared shape over the element limit": (
        binary_request({"inputs": [{"name": "text", "shape": [4194305], "datatype": "BYTES",
                                    "parameters": {"binary_data_size": 6}}]}, struct.pack("<I", 2) + b"ab"),
        ["limits.max_tensor_elements", "4194305 elements"]),
    "BYTES element longer than the data": (
        binary_request({"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES",
                                    "parameters": {"binary_data_size": 6}}]}, struct.pack("<I", 99) + b"ab"),
        ["BYTES element 0", "99 bytes"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_clear_400(server: Any, case: str) -> None:
    (body, headers), words = BAD[case]
    model = "string_model" if "BYTES" in case else "keras_mlp_tflite"
    v2_error(server.post(f"/v2/models/{model}/infer", body, headers=headers), 400, *words)
    good = server.post("/v2/models/keras_mlp_tflite/infer", _json(_x())[0])  # still serving
    assert good.status_code == 200 and good.json()["outputs"][0]["shape"] == [1, 10]


def test_limits_and_unknown_models(server: Any) -> None:
    big = np.zeros((1100, 64), dtype=np.float32)  # 281,600 bytes: over max_body_bytes as binary too
    body, headers = binary_request({"inputs": [{"name": "x", "shape": [1100, 64], "datatype": "FP32",
                                                "parameters": {"binary_data_size": big.nbytes}}]}, big.tobytes())
    v2_error(server.post("/v2/models/keras_mlp_tflite/infer", body, headers=headers), 413, "max_body_bytes")
    v2_error(server.post("/v2/models/nope/infer", _json(_x())[0]), 404, "nope")
    v2_error(server.post("/v2/models/keras_mlp/versions/3/infer", _json(_x())[0]), 404, "keras_mlp")
    v2_error(server.get("/v2/models/keras_mlp/infer"), 405, "POST")
    divide = _json(_x(), parameters={"signature_name": "div"})[0]
    v2_error(server.post("/v2/models/multisig_tflite/infer", divide), 400, "no signature 'div'", "add, mul")


# --- one batcher for both APIs -------------------------------------------------------------------------
def _batching(server: Any, model: str) -> dict[str, Any]:
    return server.status()["models"][model]["versions"][0]["batching"]


def test_v1_and_v2_requests_share_a_batch(server: Any) -> None:
    """Freeze the batcher (SIGUSR1), queue one TF Serving and one v2 request, thaw it: one
    batch of two rows answers both."""
    model, x1, x2 = "keras_mlp_tflite", rng_x(1, seed=6), rng_x(1, seed=7)
    before = _batching(server, model)
    answers: dict[str, Any] = {}

    def v1() -> None:
        answers["v1"] = server.post(f"/v1/models/{model}:predict", {"instances": x1.tolist()})

    def v2() -> None:
        answers["v2"] = server.post(f"/v2/models/{model}/infer", _json(_x(data=x2.reshape(-1).tolist()))[0])

    frozen_before = server.log_text().count("batchers frozen")
    server.proc.send_signal(signal.SIGUSR1)  # freeze; the signal is handled asynchronously:
    server.wait_for(lambda: server.log_text().count("batchers frozen") > frozen_before, 30, "the freeze")
    threads = [threading.Thread(target=f) for f in (v1, v2)]
    try:
        for t in threads:
            t.start()
        server.wait_for(lambda: _batching(server, model)["queue_depth_rows"] == 2, timeout=30,
                        what="both requests queued")
    finally:
        server.proc.send_signal(signal.SIGUSR1)  # thaw
        for t in threads:
            t.join(60)
    after = _batching(server, model)
    assert after["batches"] - before["batches"] == 1 and after["rows"] - before["rows"] == 2
    assert answers["v1"].status_code == 200 and answers["v2"].status_code == 200
    p1 = np.array(answers["v1"].json()["predictions"])
    p2 = np.array(answers["v2"].json()["outputs"][0]["data"]).reshape(1, 10)
    assert not np.allclose(p1, p2)  # each got its own row back
