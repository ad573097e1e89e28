"""TF Serving's REST API against the real server (``appliance serve`` child process).

One server per module holds every model (configured through a TOML file: labels,
version policies, per-model backends); each answer is compared with the model called
in-process (tests.support.modelgen.reference_predict / reference_predict_tflite). Expected
status codes and texts follow TF Serving's handler (http_rest_api_handler.cc,
json_tensor.cc) where the issue and TF Serving differ:
unknown signature and unknown label are 400 (INVALID_ARGUMENT), not 404.
"""

from __future__ import annotations

import base64
import json
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from tests.support.modelgen import build_half_plus_two, reference_predict, reference_predict_tflite
from tests.runtimes.test_runtimes import examples

RTOL, ATOL = 1e-4, 1e-5
MAX_BODY = 256 * 1024
MLP = "keras_mlp"
NO_DISCOVERY = "[discovery]\nenabled = false\n"  # not under test here; keeps start and stop quick


def quiet_config(tmp_path: Path) -> str:
    path = tmp_path / "quiet.toml"
    path.write_text(NO_DISCOVERY)
    return str(path)


def mlp_version(models_dir: Path, dest: Path) -> Path:
    """keras_mlp/1 with both artifacts: the SavedModel and its model.tflite."""
    shutil.copytree(models_dir / "keras_mlp" / "1", dest)
    if not (dest / "model.tflite").exists():
        shutil.copy(models_dir / "keras_mlp_tflite" / "1" / "model.tflite", dest / "model.tflite")
    return dest


def toml_models(entries: list[dict[str, Any]]) -> str:
    out = []
    for e in entries:
        out.append("[[models]]")
        for k, v in e.items():
            if isinstance(v, dict):
                out.append(f"{k} = {{ " + ", ".join(f"{a} = {b}" for a, b in v.items()) + " }")
            else:
                out.append(f"{k} = {json.dumps(v)}")
    return "\n".join(out) + "\n"


class Models:
    """Where the module's models live (the server's copies)."""

    def __init__(self, base: Path):
        self.base = base

    def v(self, name: str, version: int = 1) -> Path:
        return self.base / name / str(version)


@pytest.fixture(scope="module")
def models(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Models:
    base = tmp_path_factory.mktemp("rest-models")
    for name in ("half_plus_two", "string_model", "multisig_tflite"):
        shutil.copytree(models_dir / name, base / name)
    mlp_version(models_dir, base / MLP / "1")
    shutil.copytree(models_dir / "half_plus_two" / "1", base / "hpt" / "1")
    return Models(base)


@pytest.fixture(scope="module")
def server(module_server: Any, models: Models, tmp_path_factory: pytest.TempPathFactory) -> Any:
    b = models.base
    config = tmp_path_factory.mktemp("rest-config") / "appliance.toml"
    config.write_text(f"poll_interval_s = 1.0\n[server]\nmax_body_bytes = {MAX_BODY}\n{NO_DISCOVERY}" + toml_models([
        {"name": "half_plus_two", "base_path": str(b / "half_plus_two"), "labels": {"stable": 1}},
        {"name": "hpt", "base_path": str(b / "hpt"), "version_policy": "all", "labels": {"stable": 1, "canary": 2}},
        {"name": MLP, "base_path": str(b / MLP)},  # auto: measured
        {"name": "keras_tf", "base_path": str(b / MLP), "backend": "tf-cpu"},
        {"name": "keras_lite", "base_path": str(b / MLP), "backend": "tflite"},
        {"name": "string_model", "base_path": str(b / "string_model")},
        {"name": "multisig_tflite", "base_path": str(b / "multisig_tflite")},
    ]))
    srv = module_server("--config", str(config), ready=False)
    # Built while the server starts (TensorFlow imports on both sides); it appears by one rename.
    build_half_plus_two(b / "hpt" / "2", a=0.5, b=3.0, c=4.0)  # y = x/2 + 3: tells the versions apart
    srv.wait_for(lambda: ready(srv) and len(hpt_available(srv)) == 2, timeout=180, what="every model and hpt v2")
    return srv


def ready(srv: Any) -> bool:
    try:
        return srv.get("/readyz", timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


def hpt_available(srv: Any) -> list[str]:
    statuses = srv.get("/v1/models/hpt").json()["model_version_status"]
    return [s["version"] for s in statuses if s["state"] == "AVAILABLE"]


# --- helpers -----------------------------------------------------------------------------
def ok(resp: requests.Response) -> Any:
    assert resp.status_code == 200, f"{resp.status_code}: {resp.text[:500]}"
    assert resp.headers["Content-Type"].startswith("application/json")
    return resp.json()


def error(resp: requests.Response, status: int, *words: str) -> str:
    """Assert a TF-Serving-style error: the status, a JSON body {"error": str} naming ``words``."""
    assert resp.status_code == status, f"wanted {status}, got {resp.status_code}: {resp.text[:500]}"
    assert resp.headers.get("Content-Type", "").startswith("application/json"), resp.headers
    body = resp.json()
    assert isinstance(body, dict) and list(body) == ["error"] and isinstance(body["error"], str), body
    message = body["error"]
    assert message and "Traceback" not in message and 'File "' not in message, message
    for word in words:
        assert word.lower() in message.lower(), f"{word!r} not in {message!r}"
    return message


def predict(server: Any, model: str, body: Any, suffix: str = "") -> requests.Response:
    return server.post(f"/v1/models/{model}{suffix}:predict", body)


def mlp_rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 64)).astype(np.float32)


# --- predict: half_plus_two (TF1 graph) ---------------------------------------------------
def test_half_plus_two_row_format(server: Any, models: Models) -> None:
    got = ok(predict(server, "half_plus_two", {"instances": [1.0, 2.0, 5.0]}))
    assert list(got) == ["predictions"]
    np.testing.assert_allclose(got["predictions"], [2.5, 3.0, 4.5])
    want = reference_predict(models.v("half_plus_two"), {"x": [1.0, 2.0, 5.0]})["y"]
    np.testing.assert_allclose(got["predictions"], want, rtol=RTOL)


def test_half_plus_two_nested_rows_and_columns(server: Any, models: Models) -> None:
    got = ok(predict(server, "half_plus_two", {"instances": [[1.0, 2.0], [3.0, 4.0]]}))
    np.testing.assert_allclose(got["predictions"], [[2.5, 3.0], [3.5, 4.0]])
    got = ok(predict(server, "half_plus_two", {"inputs": [3.0, 4.0]}))
    assert list(got) == ["outputs"]
    np.testing.assert_allclose(got["outputs"], [3.5, 4.0])
    got = ok(predict(server, "half_plus_two", {"inputs": {"x": [[1.0], [7.0]]}}))
    want = reference_predict(models.v("half_plus_two"), {"x": [[1.0], [7.0]]})["y"]
    np.testing.assert_allclose(got["outputs"], want, rtol=RTOL)
    got = ok(predict(server, "half_plus_two", {"instances": [{"x": 2.0}, {"x": 4.0}]}))
    np.testing.assert_allclose(got["predictions"], [3.0, 4.0])
    got = ok(predict(server, "half_plus_two", {"signature_name": "serving_default", "instances": [2, 3, 4]}))
    np.testing.assert_allclose(got["predictions"], [3.0, 3.5, 4.0])


def test_columnar_scalar_input_gives_a_bare_value(server: Any) -> None:
    """TF Serving: a scalar in 'inputs' is a tensor of shape [], the single output a bare value."""
    got = ok(predict(server, "half_plus_two", {"inputs": 5.0}))
    assert got == {"outputs": 4.5}


def test_classify_and_regress(server: Any, models: Models) -> None:
    path = models.v("half_plus_two")
    got = ok(server.post("/v1/models/half_plus_two:classify",
                         {"signature_name": "classify_x_to_y", "examples": [{"x": 2.0}, {"x": 20.0}]}))
    assert got == {"results": [[["", 3.0]], [["", 12.0]]]}  # no 'classes' output: label ""
    got = ok(server.post("/v1/models/half_plus_two:regress",
                         {"signature_name": "regress_x_to_y", "examples": [{"x": 2.0}, {"x": 80.0}]}))
    assert list(got) == ["results"]
    np.testing.assert_allclose(got["results"], [3.0, 42.0])
    got = ok(server.post("/v1/models/half_plus_two:regress",
                         {"signature_name": "regress_x_to_y2", "examples": [{"x": 4.0}]}))
    want = reference_predict(path, {"inputs": examples(x=[4.0])}, "regress_x_to_y2")["outputs"]
    np.testing.assert_allclose(got["results"], np.reshape(want, -1), rtol=RTOL)


def test_classify_regress_with_context(server: Any, models: Models) -> None:
    """The context's features are merged into every example (Input.example_list_with_context)."""
    got = ok(server.post("/v1/models/half_plus_two:regress", {
        "signature_name": "regress_x_to_y", "context": {"x": 6.0}, "examples": [{"x2": 1.0}, {"x2": 9.0}]}))
    want = reference_predict(models.v("half_plus_two"), {"inputs": examples(x=[6.0, 6.0], x2=[1.0, 9.0])},
                             "regress_x_to_y")["outputs"]
    np.testing.assert_allclose(got["results"], np.reshape(want, -1), rtol=RTOL)
    np.testing.assert_allclose(got["results"], [5.0, 5.0])
    got = ok(server.post("/v1/models/half_plus_two:classify", {
        "signature_name": "classify_x_to_y", "context": {"x2": 3.0}, "examples": [{"x": 0.0}]}))
    assert got == {"results": [[["", 2.0]]]}




# --- status and metadata ------------------------------------------------------------------
def test_model_status(server: Any) -> None:
    got = ok(server.get("/v1/models/half_plus_two"))
    assert got == {"model_version_status": [
        {"version": "1", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}]}
    got = ok(server.get("/v1/models/hpt"))
    assert [s["version"] for s in got["model_version_status"]] == ["2", "1"]  # newest first, as TF Serving
    assert all(s["state"] == "AVAILABLE" for s in got["model_version_status"])
    got = ok(server.get("/v1/models/hpt/versions/1"))
    assert [s["version"] for s in got["model_version_status"]] == ["1"]
    got = ok(server.get("/v1/models/hpt/labels/canary"))
    assert [s["version"] for s in got["model_version_status"]] == ["2"]
    got = ok(server.get("/v1/models/half_plus_two/labels/stable"))
    assert [s["version"] for s in got["model_version_status"]] == ["1"]


def test_status_url_quirks_as_tf_serving(server: Any) -> None:
    assert ok(server.get("/v1/models/half%5Fplus%5Ftwo"))["model_version_status"][0]["version"] == "1"
    assert ok(server.get("/v1/models/hpt/versions/0002"))["model_version_status"][0]["version"] == "2"
    # the metadata sub-resource is matched case-sensitively: /METADATA falls through to status
    assert "model_version_status" in ok(server.get("/v1/models/half_plus_two/METADATA"))


def tensor(dtype: str, dims: list[int] | None, name: str | None = None) -> dict[str, Any]:
    shape = ({"dim": [], "unknown_rank": True} if dims is None else
             {"dim": [{"size": str(d), "name": ""} for d in dims], "unknown_rank": False})
    out: dict[str, Any] = {"dtype": dtype, "tensor_shape": shape}
    if name is not None:
        out["name"] = name
    return out


def test_metadata_of_a_tf1_model(server: Any) -> None:
    got = ok(server.get("/v1/models/half_plus_two/metadata"))
    assert got["model_spec"] == {"name": "half_plus_two", "signature_name": "", "version": "1"}
    sigs = got["metadata"]["signature_def"]["signature_def"]
    assert set(sigs) == {"serving_default", "classify_x_to_y", "regress_x_to_y", "regress_x_to_y2", "regress_x2_to_y3"}
    assert sigs["serving_default"] == {
        "inputs": {"x": tensor("DT_FLOAT", None, "x:0")},
        "outputs": {"y": tensor("DT_FLOAT", None, "y:0")},
        "method_name": "tensorflow/serving/predict", "defaults": {}}
    classify = sigs["classify_x_to_y"]
    assert classify["method_name"] == "tensorflow/serving/classify"
    assert classify["inputs"] == {"inputs": tensor("DT_STRING", [-1], "tf_example:0")}
    assert list(classify["outputs"]) == ["scores"]
    assert sigs["regress_x_to_y"]["method_name"] == "tensorflow/serving/regress"
    assert list(sigs["regress_x_to_y2"]["outputs"]) == ["outputs"]


def test_metadata_of_versions_and_labels(server: Any) -> None:
    assert ok(server.get("/v1/models/hpt/metadata"))["model_spec"]["version"] == "2"
    assert ok(server.get("/v1/models/hpt/versions/1/metadata"))["model_spec"]["version"] == "1"
    assert ok(server.get("/v1/models/hpt/labels/canary/metadata"))["model_spec"] == {
        "name": "hpt", "signature_name": "", "version": "2"}


@pytest.mark.parametrize("model", [MLP, "keras_tf", "keras_lite"])
def test_metadata_of_the_keras_model_on_each_backend(server: Any, model: str) -> None:
    sig = ok(server.get(f"/v1/models/{model}/metadata"))["metadata"]["signature_def"]["signature_def"]["serving_default"]
    x = sig["inputs"]["x"]
    assert (x["dtype"], x["tensor_shape"]) == ("DT_FLOAT", tensor("DT_FLOAT", [-1, 64])["tensor_shape"])
    probs = sig["outputs"]["probs"]
    assert (probs["dtype"], probs["tensor_shape"]) == ("DT_FLOAT", tensor("DT_FLOAT", [-1, 10])["tensor_shape"])
    assert isinstance(x["name"], str) and x["name"]
    assert sig["method_name"] == "tensorflow/serving/predict"


def test_metadata_of_string_and_multisig_models(server: Any) -> None:
    sig = ok(server.get("/v1/models/string_model/metadata"))["metadata"]["signature_def"]["signature_def"]
    s = sig["serving_default"]
    assert s["inputs"]["text"]["dtype"] == "DT_STRING"
    assert s["outputs"]["len"]["dtype"] == "DT_INT64" and s["outputs"]["echo_bytes"]["dtype"] == "DT_STRING"
    sigs = ok(server.get("/v1/models/multisig_tflite/metadata"))["metadata"]["signature_def"]["signature_def"]
    assert set(sigs) == {"add", "mul"}
    assert set(sigs["add"]["inputs"]) == {"a", "b"} and list(sigs["mul"]["outputs"]) == ["product"]
    assert sigs["add"]["inputs"]["a"]["tensor_shape"] == tensor("DT_FLOAT", [-1, 4])["tensor_shape"]


# --- versions and labels ----------------------------------------------------------------------
@pytest.mark.parametrize("suffix, version", [
    ("", 2), ("/versions/1", 1), ("/versions/2", 2), ("/labels/stable", 1), ("/labels/canary", 2)])
def test_predict_by_version_and_label(server: Any, models: Models, suffix: str, version: int) -> None:
    got = ok(predict(server, "hpt", {"instances": [1.0, 2.0, 5.0]}, suffix))
    want = reference_predict(models.v("hpt", version), {"x": [1.0, 2.0, 5.0]})["y"]
    np.testing.assert_allclose(got["predictions"], want, rtol=RTOL)
    np.testing.assert_allclose(got["predictions"], [0.5 * x + (1 + version) for x in (1.0, 2.0, 5.0)])


def test_label_of_a_single_version_model(server: Any) -> None:
    got = ok(predict(server, "half_plus_two", {"instances": [1.0]}, "/labels/stable"))
    np.testing.assert_allclose(got["predictions"], [2.5])
    got = ok(server.post("/v1/models/hpt/labels/canary:regress",
                         {"signature_name": "regress_x_to_y", "examples": [{"x": 2.0}]}))
    np.testing.assert_allclose(got["results"], [4.0])


# --- predict: Keras MLP on every backend ------------------------------------------------------
@pytest.mark.parametrize("model", [MLP, "keras_tf", "keras_lite"])
def test_keras_mlp_rows_and_columns(server: Any, models: Models, model: str) -> None:
    x = mlp_rows(3, seed=len(model))
    saved, tflite = models.v(MLP), models.v(MLP) / "model.tflite"
    ref = (reference_predict_tflite(tflite, {"x": x}) if model == "keras_lite" else reference_predict(saved, {"x": x}))
    got = ok(predict(server, model, {"instances": x.tolist()}))
    np.testing.assert_allclose(got["predictions"], ref["probs"], rtol=RTOL, atol=ATOL)
    got = ok(predict(server, model, {"inputs": {"x": x.tolist()}}))
    np.testing.assert_allclose(got["outputs"], ref["probs"], rtol=RTOL, atol=ATOL)
    got = ok(predict(server, model, {"instances": [{"x": row} for row in x.tolist()]}))
    np.testing.assert_allclose(got["predictions"], ref["probs"], rtol=RTOL, atol=ATOL)


def test_keras_backends_agree(server: Any) -> None:
    x = mlp_rows(2, seed=9).tolist()
    tf_out = ok(predict(server, "keras_tf", {"instances": x}))["predictions"]
    lite_out = ok(predict(server, "keras_lite", {"instances": x}))["predictions"]
    np.testing.assert_allclose(tf_out, lite_out, rtol=1e-3, atol=1e-5)


def test_concurrent_requests_each_get_their_answer(server: Any, models: Models) -> None:
    tflite = models.v(MLP) / "model.tflite"
    inputs = [mlp_rows(1 + i % 3, seed=100 + i) for i in range(16)]
    results: dict[int, Any] = {}

    def client(i: int) -> None:
        with requests.Session() as s:
            results[i] = s.post(f"{server.url}/v1/models/keras_lite:predict",
                                data=json.dumps({"instances": inputs[i].tolist()}), timeout=60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, x in enumerate(inputs):
        got = ok(results[i])["predictions"]
        np.testing.assert_allclose(got, reference_predict_tflite(tflite, {"x": x})["probs"], rtol=RTOL, atol=ATOL)


# --- multiple inputs and outputs, strings and b64 -------------------------------------------
def test_multi_signature_tflite(server: Any, models: Models) -> None:
    path = models.v("multisig_tflite") / "model.tflite"
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 3.0, np.float32)
    for sig, out in (("add", "sum"), ("mul", "product")):
        want = reference_predict_tflite(path, {"a": a, "b": b}, sig)[out]
        rows = [{"a": a[i].tolist(), "b": b[i].tolist()} for i in range(2)]
        got = ok(predict(server, "multisig_tflite", {"signature_name": sig, "instances": rows}))
        np.testing.assert_allclose(got["predictions"], want, rtol=RTOL)
        got = ok(predict(server, "multisig_tflite", {"signature_name": sig, "inputs": {"a": a.tolist(), "b": b.tolist()}}))
        np.testing.assert_allclose(got["outputs"], want, rtol=RTOL)


def test_string_model_b64_in_and_bytes_out(server: Any, models: Models) -> None:
    raw = [b"hello", b"\x00\xff\xfebinary", b""]
    body = {"instances": [{"b64": base64.b64encode(r).decode()} for r in raw]}
    got = ok(predict(server, "string_model", body))
    want = reference_predict(models.v("string_model"), {"text": np.array(raw, dtype=object)})
    assert len(got["predictions"]) == 3
    for i, row in enumerate(got["predictions"]):  # several outputs: one object per instance
        assert set(row) == {"len", "echo_bytes"}
        assert row["len"] == int(want["len"][i])
        assert row["echo_bytes"] == {"b64": base64.b64encode(raw[i]).decode()}  # *_bytes: always b64
    got = ok(predict(server, "string_model", {"inputs": {"text": ["abc", {"b64": "AP8="}]}}))
    assert got == {"outputs": {"len": [3, 2], "echo_bytes": [{"b64": "YWJj"}, {"b64": "AP8="}]}}
    got = ok(predict(server, "string_model", {"instances": [{"text": "plain"}]}))
    assert got["predictions"] == [{"len": 5, "echo_bytes": {"b64": base64.b64encode(b"plain").decode()}}]


# --- bad input: every case is 4xx with {"error": ...} naming the problem ---------------------
def test_malformed_json(server: Any) -> None:
    error(predict(server, "half_plus_two", b'{"instances": [1.0, 2.0'), 400, "JSON")
    error(predict(server, "half_plus_two", b"instances = [1, 2]"), 400, "JSON Parse error")
    error(predict(server, "half_plus_two", b"[1, 2]"), 400, "object")
    error(predict(server, "half_plus_two", b'"just a string"'), 400, "object")


def test_empty_body(server: Any) -> None:
    error(predict(server, "half_plus_two", b""), 400, "JSON Parse error", "empty")
    error(predict(server, "half_plus_two", b"  \n "), 400, "empty")


def test_both_instances_and_inputs(server: Any) -> None:
    error(predict(server, "half_plus_two", {"instances": [1.0], "inputs": [1.0]}), 400, "instances", "inputs")


def test_neither_instances_nor_inputs(server: Any) -> None:
    message = error(predict(server, "half_plus_two", {"signature_name": "serving_default"}), 400)
    assert message == "Missing 'inputs' or 'instances' key"  # TF Serving's text


@pytest.mark.parametrize("model, body", [
    ("half_plus_two", {"instances": [[1.0, 2.0], [3.0]]}),
    ("half_plus_two", {"instances": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0, 7.0]]}),
    ("half_plus_two", {"instances": [1.0, [1.0]]}),
    ("half_plus_two", {"inputs": [[1.0], [2.0, 3.0]]}),
    ("keras_tf", {"instances": [[0.0] * 64, [0.0] * 63]}),
    ("keras_lite", {"instances": [[0.0] * 64, [0.0] * 63]}),
    ("multisig_tflite", {"signature_name": "add", "inputs": {"a": [[1, 2, 3, 4], [1, 2]], "b": [[1, 2, 3, 4]] * 2}}),
    ("string_model", {"instances": [["a", "b"], ["c"]]}),
])
def test_ragged_lists(server: Any, model: str, body: Any) -> None:
    error(predict(server, model, body), 400)


@pytest.mark.parametrize("body", [
    {"instances": ["a", "b"]},
    {"instances": [[1.0, "x"]]},
    {"inputs": {"x": ["1.0"]}},
    {"instances": ["1.5", "2"]},  # numeric strings are still strings: TF Serving refuses them
    {"instances": [True, False]},
    {"instances": [1.0, None]},
    {"inputs": None},
    {"instances": [{"b64": "AAAA"}]},  # binary for a float input
])
def test_wrong_dtype_for_a_float_input(server: Any, body: Any) -> None:
    error(predict(server, "half_plus_two", body), 400)


def test_wrong_dtype_message_names_the_type(server: Any) -> None:
    error(predict(server, "half_plus_two", {"instances": ["a", "b"]}), 400, "float")


@pytest.mark.parametrize("body", [
    {"instances": [1, 2]},
    {"instances": [{"text": 3}]},
    {"inputs": {"text": [[1.5]]}},
    {"instances": [{"b64": "not base64!!"}]},
    {"instances": [{"b64": 12}]},
    {"instances": [{"text": {"b64": "aGk=", "x": 1}}]},
])
def test_wrong_values_for_a_string_input(server: Any, body: Any) -> None:
    error(predict(server, "string_model", body), 400)


@pytest.mark.parametrize("model", ["keras_lite", "keras_tf", MLP])
def test_wrong_shape(server: Any, model: str) -> None:
    error(predict(server, model, {"instances": [[0.5] * 63]}), 400)  # 63 features, the MLP takes 64


def test_rank_one_input_is_judged_by_the_backend_as_tf_serving_does(server: Any) -> None:
    """TF Serving hands the request's shape to the backend: TensorFlow's MatMul refuses a
    rank-1 [64] for an [N, 64] input (400), while its TFLite session resizes the input and
    LiteRT's FullyConnected takes the 64 values as one row (200)."""
    error(predict(server, "keras_tf", {"inputs": {"x": [0.5] * 64}}), 400)
    for model in ("keras_lite", MLP):
        answer = predict(server, model, {"inputs": {"x": [0.5] * 64}})
        assert answer.status_code == 200, answer.text


def test_wrong_shape_message_names_the_input(server: Any) -> None:
    error(predict(server, "keras_lite", {"instances": [[0.5] * 63]}), 400, "x", "64")


def test_unknown_input_name(server: Any) -> None:
    error(predict(server, "half_plus_two", {"instances": [{"y": 1.0}]}), 400, "y")
    error(predict(server, "multisig_tflite", {"signature_name": "add", "instances": [{"a": [1, 2, 3, 4], "c": [1, 2, 3, 4]}]}),
          400)
    error(predict(server, "half_plus_two", {"inputs": {"y": [1.0]}}), 400, "x")  # TF Serving: Missing named input: x


def test_extra_named_input_in_columnar_format_is_ignored(server: Any) -> None:
    """TF Serving (FillTensorMapFromInputsMap) ignores keys of 'inputs' the signature lacks."""
    got = ok(predict(server, "half_plus_two", {"inputs": {"x": [1.0, 2.0], "extra": [5]}}))
    np.testing.assert_allclose(got["outputs"], [2.5, 3.0])


@pytest.mark.parametrize("body", [
    {"signature_name": "add", "instances": [1.0, 2.0]},  # plain list for a two-input signature
    {"signature_name": "add", "inputs": [[1, 2, 3, 4]]},
    {"signature_name": "add", "instances": [{"a": [1, 2, 3, 4]}]},  # b missing
    {"signature_name": "add", "inputs": {"a": [[1, 2, 3, 4]]}},
    {"signature_name": "add", "instances": [{"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]}, [1, 2, 3, 4]]},
    {"signature_name": "add", "instances": [{"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]}, {"a": [1, 2, 3, 4]}]},
])
def test_bad_use_of_multiple_inputs(server: Any, body: Any) -> None:
    error(predict(server, "multisig_tflite", body), 400)


def test_bad_instances_values(server: Any) -> None:
    error(predict(server, "half_plus_two", {"instances": []}), 400, "instances")
    error(predict(server, "half_plus_two", {"instances": 5}), 400, "instances")
    error(predict(server, "half_plus_two", {"instances": {"x": 1.0}}), 400, "instances")
    error(predict(server, "half_plus_two", {"signature_name": 3, "instances": [1.0]}), 400, "signature_name")


def test_unknown_signature(server: Any) -> None:
    message = error(predict(server, "half_plus_two", {"signature_name": "nope", "instances": [1.0]}), 400, "nope")
    assert message == 'Serving signature name: "nope" not found in signature def'
    error(predict(server, "multisig_tflite", {"instances": [{"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]}]}), 400,
          "serving_default")
    error(server.post("/v1/models/half_plus_two:classify", {"signature_name": "nope", "examples": [{"x": 1.0}]}), 400,
          "No signature was found with the name: nope")


def test_unknown_model(server: Any) -> None:
    message = error(predict(server, "no_such_model", {"instances": [1.0]}), 404)
    assert message == "Servable not found for request: Latest(no_such_model)"
    error(server.get("/v1/models/no_such_model"), 404, "no_such_model")
    error(server.get("/v1/models/no_such_model/metadata"), 404, "no_such_model")
    error(server.post("/v1/models/no_such_model:regress", {"examples": [{"x": 1.0}]}), 404, "no_such_model")


def test_unknown_version(server: Any) -> None:
    message = error(predict(server, "half_plus_two", {"instances": [1.0]}, "/versions/9"), 404)
    assert message == "Servable not found for request: Specific(half_plus_two, 9)"
    error(server.get("/v1/models/half_plus_two/versions/9"), 404, "9")
    error(server.get("/v1/models/half_plus_two/versions/9/metadata"), 404, "9")
    error(server.get("/v1/models/half_plus_two/versions/18446744073709551615"), 400, "version")


def test_unknown_label(server: Any) -> None:
    """TF Serving: INVALID_ARGUMENT 'Unrecognized servable version label: <l>' (400)."""
    message = error(predict(server, "half_plus_two", {"instances": [1.0]}, "/labels/canary"), 400)
    assert message == "Unrecognized servable version label: canary"
    error(server.get("/v1/models/hpt/labels/nope"), 400, "nope")
    error(server.get("/v1/models/hpt/labels/nope/metadata"), 400, "nope")


def test_huge_body(server: Any) -> None:
    body = b'{"instances": [' + b"1.0, " * (MAX_BODY // 5 + 10) + b"1.0]}"
    assert len(body) > MAX_BODY
    error(predict(server, "half_plus_two", body), 413)
    just_under = b'{"instances": [1.0]' + b" " * (MAX_BODY - 20) + b"}"
    assert len(just_under) <= MAX_BODY
    np.testing.assert_allclose(ok(predict(server, "half_plus_two", just_under))["predictions"], [2.5])


def test_huge_chunked_body(server: Any) -> None:
    def chunks() -> Any:
        yield b'{"instances": ['
        for _ in range(MAX_BODY // 1000 + 10):
            yield b"1.0, " * 200
        yield b"1.0]}"

    error(requests.post(f"{server.url}/v1/models/half_plus_two:predict", data=chunks(), timeout=30), 413)


@pytest.mark.parametrize("body", [
    {"signature_name": "regress_x_to_y"},
    {"signature_name": "regress_x_to_y", "examples": {"x": 1.0}},
    {"signature_name": "regress_x_to_y", "examples": []},
    {"signature_name": "regress_x_to_y", "examples": [1.0]},
    {"signature_name": "regress_x_to_y", "examples": [{"x": 1.0}], "context": [1]},
    {"signature_name": "regress_x_to_y", "examples": [{"x": None}]},
    {"signature_name": "regress_x_to_y", "examples": [{"x": [[1.0]]}]},
    {"signature_name": "regress_x_to_y", "examples": [{"x": 2}]},  # int64 feature for a float spec
    {"signature_name": "regress_x_to_y", "examples": [{"x2": 2.0}]},  # required feature x missing
    {"examples": [{"x": 2.0}]},  # serving_default has no 'inputs': not a regression signature
])
def test_bad_regress_requests(server: Any, body: Any) -> None:
    error(server.post("/v1/models/half_plus_two:regress", body), 400)


@pytest.mark.parametrize("model", ["keras_lite", "keras_tf"])
def test_classify_with_a_signature_that_cannot_classify(server: Any, model: str) -> None:
    """TF Serving: 400 'No classification inputs found in SignatureDef' (a client's mistake, not a 5xx),
    whichever backend serves the model."""
    error(server.post(f"/v1/models/{model}:classify", {"examples": [{"x": 1.0}]}), 400)
    error(server.post(f"/v1/models/{model}:regress", {"examples": [{"x": 1.0}]}), 400)


def test_bad_classify_requests(server: Any) -> None:
    error(server.post("/v1/models/half_plus_two:classify", {"examples": [{"x": 2.0}]}), 400, "classification")
    error(server.post("/v1/models/half_plus_two:classify", {"signature_name": "classify_x_to_y"}), 400, "examples")
    error(server.post("/v1/models/half_plus_two:classify", b"{"), 400, "JSON")


# --- URL grammar (TF Serving: anything under /v1/ that does not parse is 400 Malformed) ------
@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models/half_plus_two:predict"),
    ("GET", "/v1/models/half_plus_two/versions/1:predict"),
    ("POST", "/v1/models/half_plus_two:explode"),
    ("POST", "/v1/models/half_plus_two:PREDICT"),
    ("POST", "/v1/models/half_plus_two"),
    ("POST", "/v1/models/half_plus_two/metadata"),
    ("POST", "/v1/models/half_plus_two/versions/one:predict"),
    ("POST", "/v1/models/half_plus_two/version/1:predict"),
    ("POST", "/v1/models/half_plus_two/versions/1/labels/stable:predict"),
    ("POST", "/v1/models/half_plus_two:predict?debug=1"),
    ("GET", "/v1/models/half_plus_two/"),
    ("GET", "/v1/models/half_plus_two/metadata/"),
    ("POST", "/v1/models/half_plus_two:predict/"),
    ("GET", "/v1/foo"),
    ("GET", "/v1/models/half_plus_two/debug"),
    ("GET", "/v1//models/half_plus_two"),
    ("PUT", "/v1/models/half_plus_two"),
    ("DELETE", "/v1/models/half_plus_two"),
])
def test_malformed_requests(server: Any, method: str, path: str) -> None:
    resp = requests.request(method, server.url + path, data=b'{"instances": [1.0]}', timeout=30,
                            allow_redirects=False)
    error(resp, 400, "Malformed request", method)


def test_a_bare_v1_models_is_openais_model_list(server: Any) -> None:
    """TF Serving answers ``GET /v1/models`` 400 "Missing model name in request."
    (http_rest_api_handler.cc: its status pattern matches with no name). No TF Serving client
    can use that answer, so the OpenAI-compatible API serves its model list there (issue 25,
    appliance/api/openai.py): the models that generate, none of this module's. Every other
    TF Serving path under /v1/models keeps TF Serving's answer."""
    listed = ok(server.get("/v1/models"))
    assert listed == {"object": "list", "data": []}
    assert ok(server.get("/v1/models?verbose=1")) == listed
    error(server.post("/v1/models", b"{}"), 400, "Malformed request")
    assert ok(server.get("/v1/models/half_plus_two"))["model_version_status"]


def test_no_500_and_no_trace_for_any_client_mistake(server: Any) -> None:
    bodies = [b"\xff\xfe\x00", b"{" * 10000, b'{"instances": ' + b"[" * 5000 + b"]" * 5000 + b"}",
              b'{"instances": [1e999]}', b'{"instances": [NaN]}', b'{"inputs": {"x": {"b64": "AAAA"}}}',
              b'{"instances": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1.0]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}',
              b'{"instances": [{"x": 1.0}, {"y": 2.0}]}', b'{"instances": [{}]}', b'{"inputs": {}}']
    for model in ("half_plus_two", "keras_lite", "string_model"):
        for body in bodies:
            resp = predict(server, model, body)
            assert resp.status_code < 500, f"{model} {body[:60]!r}: {resp.status_code} {resp.text[:300]}"
            assert "Traceback" not in resp.text


# --- service endpoints --------------------------------------------------------------------
def test_healthz_and_readyz(server: Any) -> None:
    assert ok(server.get("/healthz"))
    assert ok(server.get("/readyz"))


def test_api_status(server: Any) -> None:
    status = ok(server.get("/api/status"))
    assert {"service", "device", "models"} <= set(status)
    assert status["service"]["ready"] is True
    assert status["device"]["cpu_count"] >= 1
    models = status["models"]
    assert {"half_plus_two", "hpt", MLP, "keras_tf", "keras_lite", "string_model", "multisig_tflite"} <= set(models)
    assert models["hpt"]["labels"] == {"stable": 1, "canary": 2}
    assert models["hpt"]["serving_version"] == 2
    mlp = models[MLP]["versions"][0]
    assert mlp["state"] == "AVAILABLE" and mlp["backend"] in ("tf-cpu", "tflite")
    decision = mlp["decision"]
    assert decision["how"] == "measured" and decision["chosen"] == mlp["backend"]
    considered = {c["backend"]: c for c in decision["considered"]}
    # every registered backend is considered; LiteRT-LM (issue 25) serves .litertlm bundles
    # only, so for this version it is never a candidate, whether or not it is installed
    assert set(considered) == {"tf-gpu", "tf-cpu", "tflite", "litertlm"}
    assert not considered["litertlm"]["available"]
    for name, c in considered.items():
        assert isinstance(c["available"], bool) and c["reason"], c
    for name in ("tf-cpu", "tflite"):
        assert considered[name]["available"] and considered[name]["batch1_ms"] > 0
    pinned = models["keras_tf"]["versions"][0]
    assert pinned["backend"] == "tf-cpu" and pinned["decision"]["how"] == "pinned"
    assert models["keras_lite"]["versions"][0]["backend"] == "tflite"
    assert "Traceback" not in json.dumps(status)


def test_openapi(server: Any) -> None:
    spec = ok(server.get("/openapi.json"))
    assert spec["openapi"].startswith("3.")
    assert any(p.endswith(":predict") for p in spec["paths"])
    assert "/v1/models/{model}/metadata" in spec["paths"]


def test_wrong_method_outside_v1_is_json_405(server: Any) -> None:
    error(server.post("/healthz", {"x": 1}), 405)


def test_unknown_path_outside_v1_is_json_404(server: Any) -> None:
    resp = server.get("/no/such/page")
    assert resp.status_code == 404
    assert "Traceback" not in resp.text


# --- models whose load depends on one feature: their own small servers -------------------------
def settled(srv: Any, model: str) -> dict[str, Any] | None:
    """The newest version's status once it is AVAILABLE or END (None before, or while no HTTP)."""
    try:
        versions = srv.status()["models"].get(model, {}).get("versions") or []
    except requests.ConnectionError:
        return None
    return versions[0] if versions and versions[0]["state"] in ("AVAILABLE", "END") else None


def test_signatureless_tflite(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "m"
    shutil.copytree(models_dir / "nosig_tflite", base / "nosig_tflite")
    srv = start_server("--models", str(base), "--config", quiet_config(tmp_path), ready=False)
    version = srv.wait_for(lambda: settled(srv, "nosig_tflite"), what="nosig_tflite to load or fail")
    assert version["state"] == "AVAILABLE", version["error"]
    path = base / "nosig_tflite" / "1" / "model.tflite"
    for x in ([[3.0]], [[1.0], [2.0], [-4.0]]):
        got = ok(srv.post("/v1/models/nosig_tflite:predict", {"instances": x}))
        want = reference_predict_tflite(path, {"x": np.array(x, np.float32)})["y"]
        np.testing.assert_allclose(got["predictions"], want)
    sig = ok(srv.get("/v1/models/nosig_tflite/metadata"))["metadata"]["signature_def"]["signature_def"]
    assert list(sig) == ["serving_default"] and list(sig["serving_default"]["inputs"]) == ["x"]


def test_readyz_is_503_until_a_model_is_available(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "m"
    (base / "multisig_tflite").mkdir(parents=True)  # the model exists, no version yet
    srv = start_server("--models", str(base), "--poll-interval", "0.2", "--config", quiet_config(tmp_path), ready=False)

    def readyz() -> list[requests.Response]:  # a list: a 503 Response is falsy
        try:
            return [srv.get("/readyz", timeout=5)]
        except requests.ConnectionError:
            return []

    (first,) = srv.wait_for(readyz, what="the HTTP server")
    assert first.status_code == 503, first.text
    assert first.json()["ready"] is False
    error(predict(srv, "multisig_tflite", {"signature_name": "add", "inputs": {"a": [[1] * 4], "b": [[1] * 4]}}), 503)
    assert ok(srv.get("/healthz"))  # alive while not ready
    stage = tmp_path / "stage"
    shutil.copytree(models_dir / "multisig_tflite" / "1", stage)
    stage.rename(base / "multisig_tflite" / "1")
    srv.wait_for(lambda: srv.get("/readyz").status_code == 200, what="ready")
    got = ok(predict(srv, "multisig_tflite", {"signature_name": "add", "inputs": {"a": [[1] * 4], "b": [[2] * 4]}}))
    assert got == {"outputs": [[3.0] * 4]}
