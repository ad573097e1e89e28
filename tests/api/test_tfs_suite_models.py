"""The cases issue 24 adds to TF Serving's model-server test suite (tests/api/test_tfs_suite.py,
the upstream port): every testdata model TF Serving loads is AVAILABLE, synthetic warm-up
failures are warnings, TFLite shapes, busy ports, version labels, and the common client
mistakes answered with TF Serving's status and text, over REST and gRPC, against
``appliance tfs`` started as upstream's ``RunServer`` starts it (tests/support/tfs_suite.py).
A file of its own so that the two test workers run the two halves side by side (issue 49).
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import requests

grpc = pytest.importorskip("grpc")
pytest.importorskip("tensorflow_serving.apis.prediction_service_pb2_grpc")
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc  # noqa: E402

from tests.support.servers import ROOT, free_port, poll_until, spawn  # noqa: E402
from tests.support.tfs_suite import (  # noqa: E402,F401  (run_server: the module fixture)
    DATA, DT_FLOAT, RPC_TIMEOUT, TFServer, call_rest, half_plus_two, run_server, tflite_model,
    tflite_with_sigdef, verify_predict_request)


# -- issue 24: beyond the upstream file, over REST and gRPC ----------------------------------
TESTDATA_MODELS = {  # model -> what TF Serving does with it
    "saved_model_half_plus_two_cpu": "serves", "saved_model_half_plus_two_tf2_cpu": "serves",
    "saved_model_half_plus_three": "serves", "saved_model_half_plus_two_2_versions": "serves",
    "saved_model_half_plus_two_gpu": "serves", "saved_model_half_plus_two_gpu_trt": "serves",
    "saved_model_half_plus_two_mkl": "serves", "saved_model_half_plus_two_mlmd": "serves",
    "saved_model_half_plus_two_cpu_with_saved_model_config": "serves",
    "saved_model_half_plus_two_cpu_with_empty_saved_model_config": "serves",
    "saved_model_counter": "serves", "saved_model_half_plus_two_tflite": "serves",
    "saved_model_half_plus_two_tflite_with_sigdef": "serves", "parse_example_tflite": "serves",
    "bad_half_plus_two": "refuses",
}


# Fifteen models, each TensorFlow one tried in a child before it serves (tens of seconds apiece on a
# loaded 2-core box): the test that first asks for every_model carries that wait, so the tests
# using it get a pytest timeout above it.
EVERY_MODEL_S = 840
every_model_timeout = pytest.mark.timeout(EVERY_MODEL_S + 60)


@pytest.fixture(scope="module")
def every_model(run_server: Any, tmp_path_factory: pytest.TempPathFactory) -> TFServer:
    """One server with every copied testdata model in its models.config. TF Serving would not
    start with bad_half_plus_two in it (tests/service/test_tfs_start_order.py: neither does
    ``appliance tfs``); ``--no-wait-for-models`` opens the ports at once, as ``serve`` does, so
    the other models can be checked beside the refused one."""
    lines = ["model_config_list {"]
    for name in TESTDATA_MODELS:
        platform = "tflite" if "tflite" in name else "tensorflow"
        lines.append(f'  config {{ name: "{name}" base_path: "{DATA / name}" model_platform: "{platform}" }}')
    path = tmp_path_factory.mktemp("every") / "models.config"
    path.write_text("\n".join(lines + ["}"]) + "\n")
    server = run_server(None, None, model_config_file=path, wait_for_server_ready=False,
                        extra=("--no-wait-for-models",))
    server.server.wait_for(lambda: all(m["versions"] and m["versions"][0]["state"] in ("AVAILABLE", "END")
                                       for m in server.server.status()["models"].values())
                           and len(server.server.status()["models"]) == len(TESTDATA_MODELS), EVERY_MODEL_S,
                           "every testdata model loaded or refused")
    return server


@pytest.mark.parametrize("name", TESTDATA_MODELS)
@every_model_timeout
def test_every_testdata_model_loads_as_in_tf_serving(every_model: TFServer, name: str) -> None:
    model = every_model.server.status()["models"][name]
    states = {v["version"]: v["state"] for v in model["versions"]}
    if TESTDATA_MODELS[name] == "refuses":
        assert set(states.values()) == {"END"} and model["quarantined"], model
    else:
        assert "AVAILABLE" in states.values(), model


@every_model_timeout
def test_a_failing_synthetic_warmup_is_a_warning_and_the_version_serves(every_model: TFServer) -> None:
    """half_plus_three's 'tensorflow/serving/regress' SignatureDef declares a float input for
    the string placeholder tf_example: a synthetic call fails, TF Serving serves it anyway."""
    status = every_model.server.status()
    version = status["models"]["saved_model_half_plus_three"]["versions"][0]
    assert version["state"] == "AVAILABLE"
    assert "Type mismatch: actual float vs. expect string" in version["warmup_warnings"]["tensorflow/serving/regress"]
    assert any(e["kind"] == "warmup_warning" and e["model"] == "saved_model_half_plus_three"
               for e in status["events"]), status["events"][-10:]
    verify_predict_request(every_model.grpc_address, model_name="saved_model_half_plus_three", expected_output=4.0,
                           expected_version=123)
    r = requests.post(f"http://{every_model.rest_address}/v1/models/saved_model_half_plus_three:predict",
                      json={"instances": [2.0]}, timeout=30)
    assert r.json() == {"predictions": [4.0]}


@every_model_timeout
def test_parse_example_tflite_parses_as_tf_servings_tflite_session(every_model: TFServer) -> None:
    """tflite_session_test.cc TestBatchParallelismForString, over REST and gRPC: x and y from
    each tf.Example, or the defaults (0.0, "missing") where they are absent; an Example whose x
    is not a float list is refused with the session's text (runtimes/tflite_examples.py ExampleParser)."""
    from tensorflow.core.example import example_pb2

    def example(x: float | None) -> bytes:
        found = example_pb2.Example()
        if x is not None:
            found.features.feature["x"].float_list.value.append(x)
            found.features.feature["y"].bytes_list.value.append(b"test string")
        return found.SerializeToString()

    serialized = [example(0.25), example(None), example(-0.5)]
    x_out, y_out = "ParseExample/ParseExampleV2", "ParseExample/ParseExampleV2:1"
    url = f"http://{every_model.rest_address}/v1/models/parse_example_tflite:predict"
    body = {"instances": [{"b64": base64.b64encode(e).decode()} for e in serialized]}
    assert json.loads(call_rest(url, body)) == {"predictions": [
        {x_out: [0.25], y_out: ["test string"]}, {x_out: [0.0], y_out: ["missing"]},
        {x_out: [-0.5], y_out: ["test string"]}]}
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "parse_example_tflite"
    request.inputs["input"].dtype = 7  # DT_STRING
    request.inputs["input"].string_val.extend(serialized)
    request.inputs["input"].tensor_shape.dim.add().size = len(serialized)
    with grpc.insecure_channel(every_model.grpc_address) as channel:
        result = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, RPC_TIMEOUT)
    assert list(result.outputs[x_out].float_val) == [0.25, 0.0, -0.5]
    assert list(result.outputs[y_out].string_val) == [b"test string", b"missing", b"test string"]
    wrong = example_pb2.Example()
    wrong.features.feature["x"].int64_list.value.append(3)
    r = requests.post(url, json={"instances": [{"b64": base64.b64encode(wrong.SerializeToString()).decode()}]},
                      timeout=30)
    assert (r.status_code, r.json()) == (400, {"error": "Failed to invoke TfLite interpreter"})


@every_model_timeout
def test_the_counter_model_is_not_changed_by_warm_up(every_model: TFServer) -> None:
    """A stateful model (TF Serving's saved_model_counter): warm-up takes none of its
    input-less actions, so get_counter answers 0 as on TF Serving, and incr_counter 1."""
    def call(signature: str) -> float:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "saved_model_counter"
        request.model_spec.signature_name = signature
        with grpc.insecure_channel(every_model.grpc_address) as channel:
            result = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, RPC_TIMEOUT)
        return result.outputs["output"].float_val[0]

    assert call("get_counter") == 0.0
    assert call("incr_counter") == 1.0
    assert call("reset_counter") == 0.0


@pytest.mark.parametrize("model", [tflite_model, tflite_with_sigdef])
def test_tflite_rest_row_format_resizes_as_tf_serving(run_server: Any, model: Any) -> None:
    """testPredictREST's request on TF Serving's TFLite half_plus_two: [3] into a [1,1] input."""
    rest = run_server("default", model(), model_type="tflite").rest_address
    body = call_rest(f"http://{rest}/v1/models/default:predict", {"instances": [2.0, 3.0, 4.0]})
    assert json.loads(body.decode()) == {"predictions": [3.0, 3.5, 4.0]}
    body = call_rest(f"http://{rest}/v1/models/default:predict", {"inputs": [[2.0], [3.0]]})
    assert json.loads(body.decode()) == {"outputs": [[3.0], [3.5]]}


def test_tflite_shape_the_model_cannot_take_gets_tf_serving_text(run_server: Any, models_dir: Path) -> None:
    """A [1,63] input into a [?,64] FullyConnected: TF Serving's session resizes, LiteRT
    refuses to allocate: "Failed to allocate tensors" (tflite_session.cc). TF Serving's code
    is INTERNAL; ours INVALID_ARGUMENT on purpose, and the text names the input after TF
    Serving's words (runtimes/tflite_file.py ``refused``)."""
    server = run_server("mlp", models_dir / "keras_mlp_tflite", model_type="tflite")
    r = requests.post(f"http://{server.rest_address}/v1/models/mlp:predict", json={"instances": [[0.5] * 63]},
                      timeout=30)
    refused = "Failed to allocate tensors (input 'x' of shape [1,63], the model declares [-1,64])"
    assert (r.status_code, r.json()) == (400, {"error": refused})
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "mlp"
    request.inputs["x"].dtype = DT_FLOAT
    request.inputs["x"].float_val.extend([0.5] * 63)
    request.inputs["x"].tensor_shape.dim.add().size = 1
    request.inputs["x"].tensor_shape.dim.add().size = 63
    with grpc.insecure_channel(server.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, RPC_TIMEOUT)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, refused)
    r = requests.post(f"http://{server.rest_address}/v1/models/mlp:predict", json={"instances": [[0.5] * 64]},
                      timeout=30)
    assert r.status_code == 200 and len(r.json()["predictions"][0]) == 10  # the interpreter recovers


def test_tflite_requests_of_different_shapes_are_never_merged(run_server: Any) -> None:
    """With batching on, [3], [1,1] and [2,1] inputs arrive together: each answer is its own."""
    rest = run_server("default", tflite_model(), model_type="tflite",
                      batching_parameters_file=DATA / "batching_config.txt").rest_address
    cases = [({"instances": [2.0, 3.0, 4.0]}, {"predictions": [3.0, 3.5, 4.0]}),
             ({"instances": [[2.0]]}, {"predictions": [[3.0]]}),
             ({"instances": [[2.0], [4.0]]}, {"predictions": [[3.0], [4.0]]}),
             ({"inputs": [6.0]}, {"outputs": [5.0]})]
    wrong: list[str] = []

    def client(body: Any, want: Any) -> None:
        for _ in range(25):
            got = requests.post(f"http://{rest}/v1/models/default:predict", json=body, timeout=30).json()
            if got != want:
                wrong.append(f"{body} -> {got}, not {want}")

    threads = [threading.Thread(target=client, args=case) for case in cases for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert wrong == [], wrong[:5]


LABELS_CONFIG = """model_config_list {{
  config {{
    name: "hpt"
    base_path: "{path}"
    model_platform: "tensorflow"
    model_version_policy {{ specific {{ versions: 123 versions: 124 }} }}
    version_labels {{ key: "stable" value: {stable} }}
    version_labels {{ key: "canary" value: 124 }}
  }}
}}
"""


def test_version_labels_and_a_reload_over_rest_and_grpc(run_server: Any, tmp_path: Path) -> None:
    config = tmp_path / "models.config"
    config.write_text(LABELS_CONFIG.format(path=DATA / "saved_model_half_plus_two_2_versions", stable=123))
    server = run_server(None, None, model_config_file=config, model_config_file_poll_period=1)

    def available() -> list[str]:
        states = requests.get(f"http://{server.rest_address}/v1/models/hpt", timeout=30).json()["model_version_status"]
        return sorted(s["version"] for s in states if s["state"] == "AVAILABLE")

    poll_until(lambda: available() == ["123", "124"], 60, "both versions available")  # ready: one of them is

    def grpc_version(label: str) -> int:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "hpt"
        request.model_spec.version_label = label
        request.inputs["x"].dtype = DT_FLOAT
        request.inputs["x"].float_val.append(2.0)
        request.inputs["x"].tensor_shape.dim.add().size = 1
        with grpc.insecure_channel(server.grpc_address) as channel:
            result = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, RPC_TIMEOUT)
        assert result.outputs["y"].float_val[0] == 3.0
        return result.model_spec.version.value

    assert grpc_version("stable") == 123 and grpc_version("canary") == 124
    r = requests.post(f"http://{server.rest_address}/v1/models/hpt/labels/stable:predict",
                      json={"instances": [2.0]}, timeout=30)
    assert r.json() == {"predictions": [3.0]}
    config.write_text(LABELS_CONFIG.format(path=DATA / "saved_model_half_plus_two_2_versions", stable=124))
    poll_until(lambda: grpc_version("stable") == 124, 60, "the stable label moved by the config file")
    status = requests.get(f"http://{server.rest_address}/v1/models/hpt/labels/stable", timeout=30).json()
    assert [s["version"] for s in status["model_version_status"]] == ["124"]


# -- ports: TF Serving exits when it cannot bind; bind_retry waits, never "ready" meanwhile --
def _tfs_line(tmp_path: Path, grpc_port: int, rest_port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "appliance.cli", "tfs", f"--port={grpc_port}", f"--rest_api_port={rest_port}",
            "--model_name=default", f"--model_base_path={tflite_model()}", "--host", "127.0.0.1",
            "--state", str(tmp_path / "state"), "--no-discovery", *extra]


def _busy_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_busy_grpc_port_fails_start_up_with_the_port_and_the_reason(tmp_path: Path) -> None:
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        proc = subprocess.run(_tfs_line(tmp_path, port, free_port()), capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = next(line for line in proc.stderr.splitlines() if "Failed to start server" in line)
    assert f"127.0.0.1:{port}" in line and "address already in use" in line, line


def test_a_busy_rest_port_fails_start_up_with_the_port_and_the_reason(tmp_path: Path) -> None:
    with _busy_port() as busy:
        port = busy.getsockname()[1]
        proc = subprocess.run(_tfs_line(tmp_path, free_port(), port), capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "in use" in proc.stderr, proc.stderr[-2000:]


def test_bind_retry_keeps_the_device_not_ready_until_grpc_listens(tmp_path: Path) -> None:
    config = tmp_path / "appliance.toml"
    config.write_text("[grpc]\nbind_retry = true\n")
    rest = free_port()
    busy = _busy_port()
    port = busy.getsockname()[1]
    server = spawn(_tfs_line(tmp_path, port, rest, "--config", str(config)), rest, tmp_path / "state",
                   tmp_path / "server.log", ready=False)
    try:
        server.wait_for(lambda: server.status()["models"]["default"]["versions"][0]["state"] == "AVAILABLE",
                        120, "the model loaded")
        problems = [p["message"] for p in server.status()["problems"] if p["kind"] == "part_down"]
        assert any(f"127.0.0.1:{port}" in p and "retrying" in p for p in problems), problems
        ready = server.get("/readyz")
        assert ready.status_code == 503, ready.text
        busy.close()
        server.wait_for(lambda: server.get("/readyz").status_code == 200, 90, "ready once gRPC is bound")
        verify_predict_request(f"localhost:{port}", expected_output=3.0, specify_output=False, expected_version=123)
        assert not any(p.get("part") == "gRPC" for p in server.status()["problems"])
    finally:
        busy.close()
        server.stop()


# -- the common client mistakes: TF Serving's status and text, byte for byte ----------------
# (request, TF Serving's HTTP status and {"error": text}, where in tensorflow/serving the text is made)
REST_MISTAKES = {
    "unknown model": ("POST", "/v1/models/missing:predict", {"instances": [2.0]},
                      404, "Servable not found for request: Latest(missing)"),  # core/basic_manager.cc:139
    "unknown version": ("POST", "/v1/models/default/versions/7:predict", {"instances": [2.0]},
                        404, "Servable not found for request: Specific(default, 7)"),  # core/basic_manager.cc:139
    "unknown label": ("POST", "/v1/models/default/labels/nope:predict", {"instances": [2.0]},
                      400, "Unrecognized servable version label: nope"),  # model_servers/server_core.cc:891
    "unknown signature": ("POST", "/v1/models/default:predict", {"signature_name": "nope", "instances": [2.0]},
                          400, 'Serving signature name: "nope" not found in signature def'),
    # ^ model_servers/http_rest_api_handler.cc:237
    "unknown input name, row format": (
        "POST", "/v1/models/default:predict", {"instances": [{"x2": 2.0}]}, 400,
        "Failed to process element: 0 key: x2 of 'instances' list. Error: INVALID_ARGUMENT: JSON object: does not "
        "have named input: x2"),  # util/json_tensor.cc:449 inside :563
    "unknown input name, columnar": ("POST", "/v1/models/default:predict", {"inputs": {"x2": [2.0]}},
                                     400, "Missing named input: x in 'inputs' object."),  # util/json_tensor.cc:635
    "wrong dtype": ("POST", "/v1/models/default:predict", {"instances": ["a"]}, 400,
                    "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: JSON Value: \"a\" "
                    "Type: String is not of expected type: float"),  # util/json_tensor.cc:281 inside :584
    "ragged": ("POST", "/v1/models/default:predict", {"instances": [[1.0], [1.0, 2.0]]}, 400,
               "Failed to process element: 1 of 'instances' list. Error: INVALID_ARGUMENT: Expecting tensor size: 1 "
               "but got: 2"),  # util/json_tensor.cc:463 inside :584
    "malformed JSON": ("POST", "/v1/models/default:predict", '{"instances": [1.0}', 400,
                       "JSON Parse error: Missing a comma or ']' after an array element. at offset: 18"),
    # ^ util/json_tensor.cc:487 (rapidjson's GetParseError_En); the parse errors below are rapidjson 1.1.0's
    # (tensorflow_serving/workspace.bzl), each checked against that version built from source
    "not JSON": ("POST", "/v1/models/default:predict", "instances = [1.0]", 400,
                 "JSON Parse error: Invalid value. at offset: 0"),
    "an empty body": ("POST", "/v1/models/default:predict", "", 400,
                      "JSON Parse error: The document is empty"),  # util/json_tensor.cc:475, before rapidjson
    "only whitespace": ("POST", "/v1/models/default:predict", " \n", 400,
                        "JSON Parse error: The document is empty. at offset: 2"),
    "a trailing comma in an object": ("POST", "/v1/models/default:predict", '{"instances": [1.0],}', 400,
                                      "JSON Parse error: Missing a name for object member. at offset: 20"),
    "a trailing comma in an array": ("POST", "/v1/models/default:predict", '{"instances": [1.0,]}', 400,
                                     "JSON Parse error: Invalid value. at offset: 19"),
    "a missing colon": ("POST", "/v1/models/default:predict", '{"instances" [1.0]}', 400,
                        "JSON Parse error: Missing a colon after a name of object member. at offset: 13"),
    "a missing comma between members": (
        "POST", "/v1/models/default:predict", '{"instances": [1.0] "signature_name": ""}', 400,
        "JSON Parse error: Missing a comma or '}' after an object member. at offset: 20"),
    "single quotes": ("POST", "/v1/models/default:predict", "{'instances': [1.0]}", 400,
                      "JSON Parse error: Missing a name for object member. at offset: 1"),
    "an unterminated string": ("POST", "/v1/models/default:predict", '{"instances": ["abc', 400,
                               "JSON Parse error: Missing a closing quotation mark in string. at offset: 19"),
    "a bad escape": ("POST", "/v1/models/default:predict", '{"instances": ["a\\x"]}', 400,
                     "JSON Parse error: Invalid escape character in string. at offset: 17"),
    "a number past a double": ("POST", "/v1/models/default:predict", '{"instances": [1e400]}', 400,
                               "JSON Parse error: Number too big to be stored in double. at offset: 15"),
    "a truncated body": ("POST", "/v1/models/default:predict", '{"instances": [1.0]', 400,
                         "JSON Parse error: Missing a comma or '}' after an object member. at offset: 19"),
    "not an object": ("POST", "/v1/models/default:predict", "[1.0]", 400,
                      "JSON Value: [1.0] Is not object"),  # util/json_tensor.cc ParseJson
    "signature_name not a string": (
        "POST", "/v1/models/default:predict", {"signature_name": 1, "instances": [1.0]}, 400,
        'JSON Value: {\n    "signature_name": 1,\n    "instances": [1.0]\n} not formatted correctly. '
        "'signature_name' key must be a string value."),  # util/json_tensor.cc FormatSignatureError
    "no instances": ("POST", "/v1/models/default:predict", {"instances": []}, 400,
                     'JSON Value: {\n    "instances": []\n} No values in \'instances\' array'),
    "instances and inputs": (
        "POST", "/v1/models/default:predict", {"instances": [1.0], "inputs": [1.0]}, 400,
        'JSON Value: {\n    "instances": [1.0],\n    "inputs": [1.0]\n} Not formatted correctly expecting only one '
        "of 'inputs' or 'instances' keys to exist "),
    "a null": ("POST", "/v1/models/default:predict", {"instances": [1.0, None]}, 400,
               "Failed to process element: 1 of 'instances' list. Error: INVALID_ARGUMENT: JSON Value: null Type: "
               "Null is not of expected type: float"),
    "a boolean": ("POST", "/v1/models/default:predict", {"instances": [True]}, 400,
                  "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: JSON Value: true Type: "
                  "True is not of expected type: float"),
    "wrong dtype, columnar": ("POST", "/v1/models/default:predict", {"inputs": [1.5, "a"]}, 400,
                              'JSON Value: "a" Type: String is not of expected type: float'),
    "ragged, columnar": ("POST", "/v1/models/default:predict", {"inputs": [[1.0], [1.0, 2.0]]}, 400,
                         "Encountered list at unexpected size: 2 at level: 1 expected size: 1"),
    "b64 for a float": ("POST", "/v1/models/default:predict", {"instances": [{"b64": "AAAA"}]}, 400,
                        "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: JSON Value: {\n"
                        '    "b64": "AAAA"\n} Type: Object is not of expected type: float'),
    "missing keys": ("POST", "/v1/models/default:predict", {"foo": 1},
                     400, "Missing 'inputs' or 'instances' key"),  # util/json_tensor.cc:704
    "encoded path": ("POST", "/v1/models/..%2F..%2Fetc:predict", {"instances": [2.0]},
                     404, "Servable not found for request: Latest(../../etc)"),
    # ^ model_servers/http_rest_api_util.cc:110 (DecodeArg) then core/basic_manager.cc:139
    "status of an unknown model": ("GET", "/v1/models/missing", None,
                                   404, "Could not find any versions of model missing"),
    # ^ model_servers/get_model_status_impl.cc:100
    "status of an unknown version": ("GET", "/v1/models/default/versions/7", None,
                                     404, "Could not find version 7 of model default"),
    # ^ model_servers/get_model_status_impl.cc:89
}
@pytest.mark.parametrize("case", REST_MISTAKES)
def test_rest_mistakes_get_tf_servings_status_and_text(run_server: Any, case: str) -> None:
    method, path, body, status, text = REST_MISTAKES[case]
    url = f"http://{run_server('default', half_plus_two()).rest_address}{path}"
    data = body if isinstance(body, str) or body is None else json.dumps(body)
    r = requests.request(method, url, data=data, timeout=30)
    assert (r.status_code, r.text and r.json()) == (status, {"error": text})


def _grpc_predict(address: str, name: str = "default", version: int | None = None, label: str = "",
                  signature: str = "", alias: str = "x", dtype: int = DT_FLOAT) -> Any:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    if version is not None:
        request.model_spec.version.value = version
    if label:
        request.model_spec.version_label = label
    request.model_spec.signature_name = signature
    request.inputs[alias].dtype = dtype
    if dtype == DT_FLOAT:
        request.inputs[alias].float_val.append(2.0)
    else:
        request.inputs[alias].int_val.append(2)
    request.inputs[alias].tensor_shape.dim.add().size = 1
    with grpc.insecure_channel(address) as channel:
        return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, RPC_TIMEOUT)


GRPC_MISTAKES = {  # keyword arguments of _grpc_predict -> TF Serving's code and details
    "unknown model": ({"name": "missing"}, "NOT_FOUND", "Servable not found for request: Latest(missing)"),
    "unknown version": ({"version": 7}, "NOT_FOUND", "Servable not found for request: Specific(default, 7)"),
    "unknown label": ({"label": "nope"}, "INVALID_ARGUMENT", "Unrecognized servable version label: nope"),
    "unknown signature": ({"signature": "nope"}, "FAILED_PRECONDITION", 'Serving signature key "nope" not found.'),
    # ^ servables/tensorflow/predict_util.cc:93
    "unknown input name": ({"alias": "x2"}, "INVALID_ARGUMENT",
                           "input tensor alias not found in signature: x2. Inputs expected to be in the set {x}."),
    # ^ TensorFlow's cc/saved_model/util.cc GetInputValues, called from predict_util.cc:127
    "wrong dtype": ({"dtype": 3}, "INVALID_ARGUMENT", "Expects arg[0] to be float but int32 is provided"),
    # ^ TensorFlow's DirectSession (common_runtime/direct_session.cc), through session->Run in predict_util.cc:108
}
@pytest.mark.parametrize("case", GRPC_MISTAKES)
def test_grpc_mistakes_get_tf_servings_code_and_text(run_server: Any, case: str) -> None:
    kwargs, code, text = GRPC_MISTAKES[case]
    with pytest.raises(grpc.RpcError) as err:
        _grpc_predict(run_server("default", half_plus_two()).grpc_address, **kwargs)
    assert (err.value.code().name, err.value.details()) == (code, text)
