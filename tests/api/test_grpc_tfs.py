"""TF Serving's gRPC API against ``appliance serve``, called with the real client:
``tensorflow-serving-api``'s PredictionServiceStub and ModelServiceStub, with TensorFlow's
own ``make_tensor_proto``/``make_ndarray``. Every answer is compared with the REST API's
and with the model called in-process."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("tensorflow_serving.apis.prediction_service_pb2_grpc")
tf = pytest.importorskip("tensorflow")
from tensorflow_serving.apis import (  # noqa: E402
    classification_pb2, get_model_metadata_pb2, get_model_status_pb2, inference_pb2, model_management_pb2,
    model_service_pb2_grpc, predict_pb2, prediction_service_pb2_grpc, regression_pb2)

from tests.support.servers import free_port, poll_until  # noqa: E402
from tests.support.modelgen import reference_predict_tflite  # noqa: E402

NO_DISCOVERY = "[discovery]\nenabled = false\n"


def models_toml(models: list[tuple[str, Path, str]]) -> str:
    """[[models]] tables; the third item is more TOML for that table (backend, labels)."""
    return "".join(f'[[models]]\nname = "{name}"\nbase_path = "{path}"\n{extra}\n' for name, path, extra in models)


@pytest.fixture(scope="module")
def server(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = tmp_path_factory.mktemp("grpc-config") / "appliance.toml"
    config.write_text("poll_interval_s = 1.0\n" + NO_DISCOVERY + models_toml([
        ("half_plus_two", models_dir / "half_plus_two", "labels = { stable = 1 }"),
        ("mlp", models_dir / "keras_mlp_tflite", 'backend = "tflite"'),
    ]))
    port = free_port()
    srv = module_server("--config", str(config), "--grpc-port", str(port),
                        env={"EDGE_APPLIANCE_TEST_HOOKS": "1"})  # SIGUSR1 freezes the batchers
    srv.grpc_port = port
    return srv


@pytest.fixture
def predict_stub(channel: Any) -> Any:
    return prediction_service_pb2_grpc.PredictionServiceStub(channel)


@pytest.fixture
def model_stub(channel: Any) -> Any:
    return model_service_pb2_grpc.ModelServiceStub(channel)


def x_rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 64)).astype(np.float32)


def predict_request(model: str, x: np.ndarray, **spec: Any) -> Any:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model
    for key, value in spec.items():
        if key == "version":
            request.model_spec.version.value = value
        else:
            setattr(request.model_spec, key, value)
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(x))
    return request


# -- Predict ------------------------------------------------------------------------------
def test_predict_matches_rest_and_in_process(server: Any, predict_stub: Any, models_dir: Path) -> None:
    x = x_rows(3, seed=1)
    response = predict_stub.Predict(predict_request("mlp", x), timeout=30)
    got = tf.make_ndarray(response.outputs["probs"])
    want = reference_predict_tflite(models_dir / "keras_mlp_tflite" / "1" / "model.tflite", {"x": x})["probs"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    rest = server.post("/v1/models/mlp:predict", {"inputs": {"x": x.tolist()}}).json()["outputs"]
    np.testing.assert_allclose(got, np.array(rest), rtol=1e-5, atol=1e-6)
    assert response.model_spec.name == "mlp" and response.model_spec.version.value == 1
    assert response.model_spec.signature_name == "serving_default"


def test_predict_accepts_typed_fields_as_well_as_tensor_content(predict_stub: Any) -> None:
    x = x_rows(2, seed=2)
    content = predict_stub.Predict(predict_request("mlp", x), timeout=30)
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "mlp"
    tensor = request.inputs["x"]
    tensor.dtype = tf.float32.as_datatype_enum
    tensor.tensor_shape.dim.add(size=2)
    tensor.tensor_shape.dim.add(size=64)
    tensor.float_val.extend(x.reshape(-1).tolist())
    typed = predict_stub.Predict(request, timeout=30)
    np.testing.assert_array_equal(tf.make_ndarray(typed.outputs["probs"]), tf.make_ndarray(content.outputs["probs"]))


def test_version_label_and_output_filter(predict_stub: Any) -> None:
    x = x_rows(1, seed=3)
    by_version = predict_stub.Predict(predict_request("half_plus_two", np.array([[1.0], [3.0]], np.float32),
                                                      version=1), timeout=30)
    assert tf.make_ndarray(by_version.outputs["y"]).reshape(-1).tolist() == [2.5, 3.5]
    request = predict_request("half_plus_two", np.array([[5.0]], np.float32), version_label="stable")
    request.output_filter.append("y")
    labelled = predict_stub.Predict(request, timeout=30)
    assert list(labelled.outputs) == ["y"] and tf.make_ndarray(labelled.outputs["y"]).tolist() == [[4.5]]
    bad = predict_request("mlp", x)
    bad.output_filter.append("nope")
    with pytest.raises(grpc.RpcError) as err:
        predict_stub.Predict(bad, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nope" in err.value.details()


@pytest.mark.parametrize("change, code, words", [
    (lambda r: setattr(r.model_spec, "name", "nope"), "NOT_FOUND", ["nope"]),
    (lambda r: r.model_spec.version.__setattr__("value", 7), "NOT_FOUND", ["mlp"]),
    (lambda r: setattr(r.model_spec, "version_label", "nope"), "INVALID_ARGUMENT", ["label"]),
    (lambda r: setattr(r.model_spec, "signature_name", "nope"), "FAILED_PRECONDITION", ['Serving signature key "nope" not found.']),
    (lambda r: r.inputs["z"].CopyFrom(r.inputs["x"]), "INVALID_ARGUMENT",  # predict_util.cc VerifyRequestInputsSize
     ["input size does not match signature: 2!=1 len({x,z}) != len({x}). Sent extra: {z}. Missing but required: {}."]),
    (lambda r: r.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones((1, 64), np.int32))), "INVALID_ARGUMENT",
     ["Expects arg[0] to be float but int32 is provided"]),  # TensorFlow's FunctionCallFrame::SetArgs
    (lambda r: r.inputs["x"].tensor_shape.dim.add(size=3), "INVALID_ARGUMENT", ["tensor parsing error: x"]),
    (lambda r: r.inputs["x"].CopyFrom(tf.make_tensor_proto(np.ones((1, 7), np.float32))), "INVALID_ARGUMENT",
     ["x"]),
])
def test_errors_have_tf_serving_codes(predict_stub: Any, change: Any, code: str, words: list[str]) -> None:
    request = predict_request("mlp", x_rows(1, seed=4))
    change(request)
    with pytest.raises(grpc.RpcError) as err:
        predict_stub.Predict(request, timeout=30)
    assert err.value.code() == getattr(grpc.StatusCode, code), err.value.details()
    for word in words:
        assert word.lower() in err.value.details().lower(), err.value.details()


# -- Classify, Regress, MultiInference --------------------------------------------------
def examples(*xs: float) -> list[Any]:
    return [tf.train.Example(features=tf.train.Features(feature={
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=[x]))})) for x in xs]


def test_classify_and_regress_match_rest(server: Any, predict_stub: Any) -> None:
    request = classification_pb2.ClassificationRequest()
    request.model_spec.name, request.model_spec.signature_name = "half_plus_two", "classify_x_to_y"
    request.input.example_list.examples.extend(examples(2.0, 20.0))
    got = predict_stub.Classify(request, timeout=60)
    rest = server.post("/v1/models/half_plus_two:classify",
                       {"signature_name": "classify_x_to_y", "examples": [{"x": 2.0}, {"x": 20.0}]}).json()["results"]
    assert [[(c.label, pytest.approx(c.score)) for c in row.classes] for row in got.result.classifications] == \
        [[(label, score) for label, score in row] for row in rest]

    request = regression_pb2.RegressionRequest()
    request.model_spec.name, request.model_spec.signature_name = "half_plus_two", "regress_x_to_y"
    request.input.example_list.examples.extend(examples(1.0, 80.0))
    got = predict_stub.Regress(request, timeout=60)
    assert [r.value for r in got.result.regressions] == [2.5, 42.0]
    assert got.model_spec.version.value == 1 and got.model_spec.signature_name == "regress_x_to_y"


def test_multi_inference_runs_every_task(predict_stub: Any) -> None:
    request = inference_pb2.MultiInferenceRequest()
    for method, sig in (("tensorflow/serving/classify", "classify_x_to_y"),
                        ("tensorflow/serving/regress", "regress_x_to_y")):
        task = request.tasks.add(method_name=method)
        task.model_spec.name, task.model_spec.signature_name = "half_plus_two", sig
    request.input.example_list.examples.extend(examples(4.0))
    got = predict_stub.MultiInference(request, timeout=60)
    assert len(got.results) == 2
    assert got.results[1].regression_result.regressions[0].value == 4.0
    assert len(got.results[0].classification_result.classifications) == 1


# -- metadata and status ------------------------------------------------------------------
def test_model_metadata_is_tf_servings_signature_def_map(server: Any, predict_stub: Any) -> None:
    request = get_model_metadata_pb2.GetModelMetadataRequest()
    request.model_spec.name = "half_plus_two"
    request.metadata_field.append("signature_def")
    got = predict_stub.GetModelMetadata(request, timeout=30)
    sigmap = get_model_metadata_pb2.SignatureDefMap()
    assert got.metadata["signature_def"].Unpack(sigmap)
    rest = server.get("/v1/models/half_plus_two/metadata").json()["metadata"]["signature_def"]["signature_def"]
    assert set(sigmap.signature_def) == set(rest)
    x = sigmap.signature_def["serving_default"].inputs["x"]
    assert x.dtype == tf.float32.as_datatype_enum and x.name == rest["serving_default"]["inputs"]["x"]["name"]
    assert sigmap.signature_def["regress_x_to_y"].method_name == "tensorflow/serving/regress"
    request.metadata_field[:] = ["nope"]
    with pytest.raises(grpc.RpcError) as err:
        predict_stub.GetModelMetadata(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_model_status(model_stub: Any) -> None:
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = "mlp"
    got = model_stub.GetModelStatus(request, timeout=30)
    assert [(s.version, get_model_status_pb2.ModelVersionStatus.State.Name(s.state)) for s in
            got.model_version_status] == [(1, "AVAILABLE")]
    assert got.model_version_status[0].status.error_code == 0
    request.model_spec.name = "nope"
    with pytest.raises(grpc.RpcError) as err:
        model_stub.GetModelStatus(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


# -- one batcher for both APIs ----------------------------------------------------------
def test_grpc_and_rest_requests_share_a_batch(server: Any, predict_stub: Any) -> None:
    def batching() -> dict[str, Any]:
        return server.status()["models"]["mlp"]["versions"][0]["batching"]

    before = batching()
    answers: dict[str, Any] = {}
    x1, x2 = x_rows(1, seed=5), x_rows(1, seed=6)
    frozen = server.log_text().count("batchers frozen")
    server.proc.send_signal(signal.SIGUSR1)
    server.wait_for(lambda: server.log_text().count("batchers frozen") > frozen, 30, "the freeze")
    threads = [threading.Thread(target=lambda: answers.__setitem__(
                   "grpc", predict_stub.Predict(predict_request("mlp", x1), timeout=60))),
               threading.Thread(target=lambda: answers.__setitem__(
                   "rest", server.post("/v1/models/mlp:predict", {"instances": x2.tolist()})))]
    try:
        for t in threads:
            t.start()
        server.wait_for(lambda: batching()["queue_depth_rows"] == 2, 30, "both requests queued")
    finally:
        server.proc.send_signal(signal.SIGUSR1)
        for t in threads:
            t.join(60)
    after = batching()
    assert after["batches"] - before["batches"] == 1 and after["rows"] - before["rows"] == 2
    assert answers["rest"].status_code == 200
    assert not np.allclose(tf.make_ndarray(answers["grpc"].outputs["probs"]),
                           np.array(answers["rest"].json()["predictions"]))


# -- HandleReloadConfigRequest and the Unix socket ---------------------------------------
def answer(stub: Any, model: str, seed: int) -> np.ndarray:
    """The probabilities ``model`` answers (an array: a message itself is always truthy)."""
    return tf.make_ndarray(stub.Predict(predict_request(model, x_rows(1, seed=seed)), timeout=30).outputs["probs"])



def test_reload_config_replaces_the_models_over_a_unix_socket(start_server: Any, models_dir: Path,
                                                             tmp_path: Path) -> None:
    sock = tmp_path / "grpc.sock"
    config = tmp_path / "appliance.toml"
    token = "reload-" + "k" * 24
    admin = (("authorization", f"Bearer {token}"),)
    config.write_text(NO_DISCOVERY + f'[grpc]\nport = 0\nsocket_path = "{sock}"\n[security]\nadmin_token = "{token}"\n'
                      + models_toml([
        ("half_plus_two", models_dir / "half_plus_two", ""),
        ("mlp", models_dir / "keras_mlp_tflite", 'backend = "tflite"')]))
    server = start_server("--config", str(config), "--grpc-port", "0")
    with grpc.insecure_channel(f"unix:{sock}") as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        predict, models = prediction_service_pb2_grpc.PredictionServiceStub(ch), \
            model_service_pb2_grpc.ModelServiceStub(ch)
        assert answer(predict, "mlp", 7).shape == (1, 10)
        request = model_management_pb2.ReloadConfigRequest()
        entry = request.config.model_config_list.config.add(name="mlp2", base_path=str(models_dir / "keras_mlp_tflite"),
                                                            model_platform="tflite")
        entry.model_version_policy.specific.versions.append(1)
        with pytest.raises(grpc.RpcError) as err:  # changing what is served is an admin call
            models.HandleReloadConfigRequest(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = models.HandleReloadConfigRequest(request, timeout=60, metadata=admin)
        assert reply.status.error_code == 0
        poll_until(lambda: server.status()["models"].get("mlp2", {}).get("serving_version") == 1, 60, "mlp2")
        assert answer(predict, "mlp2", 8).shape == (1, 10)

        def gone() -> bool:
            try:
                predict.Predict(predict_request("mlp", x_rows(1, seed=9)), timeout=30)
            except grpc.RpcError as err:
                return err.code() == grpc.StatusCode.NOT_FOUND
            return False

        poll_until(gone, 60, "mlp removed by the new config")
        bad = model_management_pb2.ReloadConfigRequest()
        bad.config.model_config_list.config.add(name="x", base_path=str(tmp_path), model_platform="pytorch")
        with pytest.raises(grpc.RpcError) as err:
            models.HandleReloadConfigRequest(bad, timeout=30, metadata=admin)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "pytorch" in err.value.details()
        assert answer(predict, "mlp2", 10).shape == (1, 10)
