"""The KServe v2 gRPC service (``inference.GRPCInferenceService``) with Triton's own client.

The service core runs in this process with the real models, and ``v2_grpc.add_to_server``
registers the service on the service's own gRPC server bound to a loopback port (what
``appliance.service.grpc_port`` does on the service's gRPC port); ``tritonclient.grpc`` talks to
it over the socket. Answers are compared with the model called in-process. Typed
``contents`` (instead of ``raw_input_contents``) are sent with tritonclient's generated
stub. When ``appliance.service.grpc_port`` exists, one more test runs against ``appliance serve``.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
tc_grpc = pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from appliance.api.kserve import grpc_service as v2_grpc  # noqa: E402
from appliance.core.appliance import Appliance  # noqa: E402
from appliance.core.config_file import load as load_config  # noqa: E402
from tests.support.servers import free_port, poll_until  # noqa: E402
from tests.support.modelgen import reference_predict, reference_predict_tflite  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5
MODELS = ("keras_mlp", "keras_mlp_tflite", "multisig_tflite", "string_model")


@pytest.fixture(scope="module")
def models(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("v2-grpc-models")
    for name in MODELS:
        shutil.copytree(models_dir / name, base / name)
    return base


@pytest.fixture(scope="module")
def core(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    config = load_config(None, {"models_dir": str(models), "state_dir": str(tmp_path_factory.mktemp("v2-grpc-state")),
                                "discovery.enabled": False, "poll_interval_s": 5.0})
    appliance = Appliance(config).start()
    try:
        assert appliance.manager is not None
        poll_until(appliance.manager.ready, timeout=180, what="every model loaded")
        yield appliance
    finally:
        appliance.close()


@pytest.fixture(scope="module")
def port(core: Appliance) -> Iterator[int]:
    """The service's own gRPC server (appliance/transport/grpc/h2_server.py) with the v2 service."""
    from appliance.transport.grpc.h2_server import LeanServer

    server = LeanServer(8, [("grpc.max_receive_message_length", core.config.grpc.max_message_bytes)])
    v2_grpc.add_to_server(server, core)
    bound = server.add_insecure_port("127.0.0.1:0")
    server.start()
    list(server.pool.map(time.sleep, [0.05] * 8))  # its pool's threads now, not inside a test (leak check)
    yield bound
    server.stop(None)


@pytest.fixture(scope="module")
def client(port: int) -> Iterator[Any]:
    c = tc_grpc.InferenceServerClient(f"127.0.0.1:{port}")
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(port: int) -> Iterator[Any]:
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield service_pb2_grpc.GRPCInferenceServiceStub(channel)
    channel.close()


def rng_x(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)


def x_input(x: np.ndarray, datatype: str = "FP32", shape: list[int] | None = None) -> Any:
    inp = tc_grpc.InferInput("x", shape or list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    return inp


def test_health_and_metadata(client: Any) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("keras_mlp_tflite") and client.is_model_ready("keras_mlp", "1")
    assert not client.is_model_ready("keras_mlp", "4") and not client.is_model_ready("no_such_model")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "edge-appliance" and meta["extensions"] == [
        "binary_tensor_data", "classification", "model_configuration", "model_repository", "statistics", "parameters",
        "system_shared_memory"]
    model = client.get_model_metadata("keras_mlp", as_json=True)
    assert model["versions"] == ["1"] and model["platform"] == "tensorflow_savedmodel"
    assert model["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "64"]}]  # int64 in JSON: strings
    assert model["outputs"] == [{"name": "probs", "datatype": "FP32", "shape": ["-1", "10"]}]
    with pytest.raises(InferenceServerException, match="no_such_model") as err:
        client.get_model_metadata("no_such_model")
    assert err.value.status() == "StatusCode.NOT_FOUND"


@pytest.mark.parametrize("model", ["keras_mlp", "keras_mlp_tflite"])
def test_mlp_raw_contents_match_in_process(client: Any, models: Path, model: str) -> None:
    x = rng_x(4, seed=1)
    result = client.infer(model, [x_input(x)], outputs=[tc_grpc.InferRequestedOutput("probs")], request_id="g-1")
    response = result.get_response()
    assert response.id == "g-1" and response.model_version == "1" and len(response.raw_output_contents) == 1
    version = models / model / "1"
    want = (reference_predict(version, {"x": x}) if model == "keras_mlp"
            else reference_predict_tflite(version / "model.tflite", {"x": x}))["probs"]
    np.testing.assert_allclose(result.as_numpy("probs"), want, rtol=RTOL, atol=ATOL)


def test_multi_input_and_bytes_models(client: Any, models: Path) -> None:
    a, b = np.arange(4, dtype=np.float32).reshape(1, 4), np.full((1, 4), 2.0, dtype=np.float32)
    inputs = []
    for name, arr in (("a", a), ("b", b)):
        inputs.append(tc_grpc.InferInput(name, [1, 4], "FP32"))
        inputs[-1].set_data_from_numpy(arr)
    product = client.infer("multisig_tflite", inputs, parameters={"signature_name": "mul"}).as_numpy("product")
    want = reference_predict_tflite(models / "multisig_tflite" / "1" / "model.tflite", {"a": a, "b": b}, "mul")
    np.testing.assert_allclose(product, want["product"])
    text = np.array([b"v2", b"\x00\xffraw", b""], dtype=object)
    strings = tc_grpc.InferInput("text", [3], "BYTES")
    strings.set_data_from_numpy(text)
    result = client.infer("string_model", [strings])
    np.testing.assert_array_equal(result.as_numpy("len"), reference_predict(
        models / "string_model" / "1", {"text": text.astype(bytes)})["len"])
    assert list(result.as_numpy("echo_bytes")) == list(text)


def test_typed_contents_from_the_generated_stub(stub: Any, models: Path) -> None:
    x = rng_x(2, seed=2)
    request = service_pb2.ModelInferRequest(model_name="keras_mlp_tflite", model_version="1")
    tensor = request.inputs.add(name="x", datatype="FP32", shape=[2, 64])
    tensor.contents.fp32_contents.extend(x.reshape(-1).tolist())
    response = stub.ModelInfer(request)
    (out,) = response.outputs
    assert out.name == "probs" and out.datatype == "FP32" and list(out.shape) == [2, 10]
    got = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(2, 10)
    want = reference_predict_tflite(models / "keras_mlp_tflite" / "1" / "model.tflite", {"x": x})["probs"]
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def _raw_request(datatype: str = "FP32", shape: tuple[int, ...] = (1, 64), raw: list[bytes] | None = None,
                 **fields: Any) -> Any:
    request = service_pb2.ModelInferRequest(model_name="keras_mlp_tflite", **fields)
    request.inputs.add(name="x", datatype=datatype, shape=list(shape))
    request.raw_input_contents.extend(raw if raw is not None else [rng_x(1).tobytes()])
    return request


def _with_output(name: str) -> Any:
    request = _raw_request()
    request.outputs.add(name=name)
    return request


def _typed_wrong_count() -> Any:
    request = service_pb2.ModelInferRequest(model_name="keras_mlp_tflite")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 64]).contents.fp32_contents.extend([0.5] * 60)
    return request


def _typed_over_the_limit() -> Any:
    """Typed contents whose shape declares more than limits.max_tensor_elements (4 Mi)."""
    request = service_pb2.ModelInferRequest(model_name="keras_mlp_tflite")
    request.inputs.add(name="x", datatype="FP32", shape=[65537, 64]).contents.fp32_contents.extend([0.5] * 64)
    return request


BAD = {
    "wrong datatype name": (lambda: _raw_request(datatype="FLOAT"), ["invalid datatype 'FLOAT'"]),
    "datatype the model does not take": (lambda: _raw_request(datatype="INT32"), ["expects 'FP32'"]),
    "raw size disagrees with shape": (lambda: _raw_request(shape=(2, 64)), ["256 bytes", "[2, 64]", "need 512"]),
    "truncated raw contents": (lambda: _raw_request(raw=[rng_x(1).tobytes()[:255]]), ["255 bytes", "need 256"]),
    "raw entries do not match inputs": (lambda: _raw_request(raw=[b"", b""]), ["2 entries for 1 inputs"]),
    "typed contents disagree with shape": (_typed_wrong_count, ["needs 64 elements", "has 60"]),
    "unknown output name": (lambda: _with_output("logits"), ["unexpected inference output 'logits'"]),
    "raw shape over the element limit": (lambda: _raw_request(shape=(65537, 64)),
                                         ["limits.max_tensor_elements", "4194368 elements", "4194304"]),
    "typed shape over the element limit": (_typed_over_the_limit, ["limits.max_tensor_elements", "4194368"]),
    "version that is not a number": (lambda: _raw_request(model_version="v1"), ["version"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_invalid_argument(stub: Any, case: str) -> None:
    build, words = BAD[case]
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(build())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    for word in words:
        assert word in err.value.details(), f"{word!r} not in {err.value.details()!r}"
    assert stub.ModelInfer(_raw_request()).outputs[0].name == "probs"  # still serving


def test_unknown_model_is_not_found_and_metrics_count_v2(stub: Any, core: Appliance) -> None:
    request = _raw_request()
    request.model_name = "nope"
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in err.value.details()
    text = core.metrics.render()  # counted like /v1: under the model the request named, as a gRPC call
    assert b'edge_appliance_requests_total{API="v2_infer",entrypoint="GRPC",model_name="nope",status="NOT_FOUND"}' in text, \
        text[:3000]
    assert b':tensorflow:serving:request_count{model_name="nope",status="NOT_FOUND"}' in text
    assert b'API="v2_infer",entrypoint="GRPC",model_name="keras_mlp_tflite",status="OK"' in text


@pytest.fixture(scope="module")
def shm_tracker() -> None:
    """multiprocessing's resource tracker (a child process for the rest of the run), which
    tritonclient's shared-memory utilities start on first use: started before the test, so the
    leak check does not count it as the test's."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


@pytest.mark.usefixtures("shm_tracker")
def test_shared_memory_in_one_process(client: Any) -> None:
    """Without front workers the gRPC port's own v2 service reads and writes the regions: the
    input read from one, the output written into another, the same numbers as raw contents
    (tests/api/test_v2_shared_memory.py runs the same through the workers of ``appliance serve``)."""
    import uuid

    import tritonclient.utils.shared_memory as shm

    x = rng_x(2, seed=5)
    out_bytes = 2 * 10 * 4
    keys = {name: f"/edge-test-{uuid.uuid4().hex[:12]}" for name in ("in", "out")}
    handles = {"in": shm.create_shared_memory_region("in", keys["in"], x.nbytes),
               "out": shm.create_shared_memory_region("out", keys["out"], out_bytes)}
    try:
        shm.set_shared_memory_region(handles["in"], [x])
        client.register_system_shared_memory("in", keys["in"], x.nbytes)
        client.register_system_shared_memory("out", keys["out"], out_bytes)
        assert sorted(client.get_system_shared_memory_status().regions) == ["in", "out"]
        inp = tc_grpc.InferInput("x", list(x.shape), "FP32")
        inp.set_shared_memory("in", x.nbytes)
        out = tc_grpc.InferRequestedOutput("probs")
        out.set_shared_memory("out", out_bytes)
        result = client.infer("keras_mlp_tflite", [inp], outputs=[out])
        assert result.get_response().raw_output_contents == [b""]
        got = shm.get_contents_as_numpy(handles["out"], np.float32, [2, 10])
        np.testing.assert_allclose(got, client.infer("keras_mlp_tflite", [x_input(x)]).as_numpy("probs"), rtol=1e-6)
    finally:
        client.unregister_system_shared_memory()
        for handle in handles.values():
            shm.destroy_shared_memory_region(handle)
    assert not client.get_system_shared_memory_status().regions


@pytest.mark.skipif(importlib.util.find_spec("appliance.service.grpc_port") is None,
                    reason="appliance.transport.grpc.server (the service's gRPC port) is not in this checkout yet")
def test_served_on_the_service_grpc_port(start_server: Any, models: Path) -> None:
    grpc_port = free_port()
    server = start_server("--models", str(models / "keras_mlp_tflite"), "--model-name", "mlp",
                          "--grpc-port", str(grpc_port))
    c = tc_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        poll_until(lambda: _live(c), timeout=30, what="the v2 gRPC service", context=server.log_text)
        x = rng_x(1, seed=3)
        got = c.infer("mlp", [x_input(x)]).as_numpy("probs")
        want = reference_predict_tflite(models / "keras_mlp_tflite" / "1" / "model.tflite", {"x": x})["probs"]
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    finally:
        c.close()


def _live(c: Any) -> bool:
    try:
        return bool(c.is_server_live())
    except InferenceServerException:
        time.sleep(0.2)
        return False


# --- Triton's extensions: statistics, model configuration, streaming ----------------------------
def test_statistics_count_this_models_requests(client: Any, core: Appliance) -> None:
    """ModelStatistics: the figures move with the requests this test sends (real, not zeros)."""
    def figures() -> Any:
        return client.get_inference_statistics("keras_mlp_tflite", "1").model_stats[0]

    before = figures()
    x = rng_x(3, seed=7)
    client.infer("keras_mlp_tflite", [x_input(x)])
    with pytest.raises(InferenceServerException):  # a wrong shape: refused before the model runs
        client.infer("keras_mlp_tflite", [x_input(rng_x(1)[:, :8], shape=[1, 8])])
    after = figures()
    assert (after.name, after.version) == ("keras_mlp_tflite", "1")
    stats, old = after.inference_stats, before.inference_stats
    assert stats.success.count == old.success.count + 1 and stats.success.ns > old.success.ns
    assert after.inference_count >= before.inference_count + 3 and after.execution_count > before.execution_count
    assert stats.compute_infer.count > old.compute_infer.count and after.last_inference > 0
    assert any(b.batch_size >= 3 for b in after.batch_stats)
    every = client.get_inference_statistics().model_stats
    assert {(s.name, s.version) for s in every} >= {("keras_mlp", "1"), ("keras_mlp_tflite", "1")}
    with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found"):
        client.get_inference_statistics("nope")


def test_model_config_is_derived_from_signature_and_batching(client: Any, core: Appliance) -> None:
    config = client.get_model_config("keras_mlp", as_json=True)["config"]
    batching = core.config.batching
    assert config["name"] == "keras_mlp" and config["platform"] == "tensorflow_savedmodel"
    assert config["max_batch_size"] == batching.max_batch_size
    assert config["input"][0]["name"] == "x" and config["input"][0]["data_type"] == "TYPE_FP32"
    assert config["input"][0]["dims"] == ["64"]  # int64 in protobuf's JSON: strings
    assert config["output"][0]["dims"] == ["10"]
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == str(batching.batch_timeout_micros)
    assert config["version_policy"] == {"latest": {"num_versions": 1}}
    strings = client.get_model_config("string_model", as_json=True)["config"]
    assert {o["data_type"] for o in strings["output"]} == {"TYPE_STRING", "TYPE_INT64"}


@pytest.fixture(scope="module")
def aio_port(core: Appliance) -> Iterator[int]:
    """The grpcio transport (appliance/transport/grpc/aio_server.py), which serves streams."""
    from appliance.transport.grpc.aio_server import AioServer

    server = AioServer(4)
    v2_grpc.add_to_server(server, core)
    bound = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield bound
    server.stop(None)


def _stream(port: int, models: list[str], half_close_first: bool = False) -> list[tuple[Any, Any]]:
    """tritonclient's stream: one request per model name; every answer, as it arrives (after
    the client's half-close, with ``half_close_first``)."""
    import queue

    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    c = tc_grpc.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        c.start_stream(callback=lambda result, error: answers.put((result, error)))
        for i, model in enumerate(models):
            c.async_stream_infer(model, [x_input(rng_x(1, seed=i))], request_id=str(i))
        if half_close_first:
            c.stop_stream()
        got = [answers.get(timeout=120) for _ in models]
        c.stop_stream()
    finally:
        c.close()
    return got


@pytest.mark.parametrize("transport", ["lean", "grpcio"])  # the lean one through streams.py
def test_model_stream_infer_answers_each_request(transport: str, port: int, aio_port: int, models: Path) -> None:
    got = _stream(port if transport == "lean" else aio_port, ["keras_mlp_tflite", "nope", "keras_mlp_tflite"])
    errors = [str(e) for _, e in got if e is not None]
    assert len(errors) == 1 and "Request for unknown model: 'nope' is not found" in errors[0]
    answered = {r.get_response().id: r.as_numpy("probs") for r, e in got if e is None}
    assert set(answered) == {"0", "2"}
    for rid, probs in answered.items():
        want = reference_predict_tflite(models / "keras_mlp_tflite" / "1" / "model.tflite",
                                        {"x": rng_x(1, seed=int(rid))})["probs"]
        np.testing.assert_allclose(probs, want, rtol=RTOL, atol=ATOL)


def test_model_stream_infer_on_the_lean_transport_after_the_half_close(port: int) -> None:
    """Requests all sent and the stream half-closed before any answer: each is still answered."""
    got = _stream(port, ["keras_mlp_tflite", "keras_mlp_tflite"], half_close_first=True)
    assert [e for _, e in got] == [None, None], got
    assert sorted(r.get_response().id for r, _ in got) == ["0", "1"]
