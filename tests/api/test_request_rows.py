"""A request with more rows than the batch queue can ever hold is a permanent client error,
answered alike by every API: 400 over REST (TF Serving's and KServe v2's), INVALID_ARGUMENT
over gRPC (TF Serving's PredictionService and v2's GRPCInferenceService), with TF Serving's
text. Never 503 / UNAVAILABLE "retry later": no wait could make it fit. A request that fits
the queue is split into batches and answered.

One server, batching at ``max_batch_size = 2`` and ``max_enqueued_batches = 2``: the queue
holds 4 rows, so 4 rows are served and 5 refused, with the real clients of each API.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

grpc = pytest.importorskip("grpc")
pytest.importorskip("tritonclient.grpc")
pytest.importorskip("tensorflow_serving.apis.prediction_service_pb2_grpc")
tf = pytest.importorskip("tensorflow")
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc  # noqa: E402
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402

from tests.support.servers import free_port  # noqa: E402

TOO_MANY = "Task size 5 is larger than maximum input batch size 4"  # TF Serving's text, then ours


@pytest.fixture(scope="module")
def server(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = tmp_path_factory.mktemp("rows-config") / "appliance.toml"
    config.write_text("poll_interval_s = 5.0\n[discovery]\nenabled = false\n"
                      "[batching]\nmax_batch_size = 2\nmax_enqueued_batches = 2\n"
                      f'[[models]]\nname = "mlp"\nbase_path = "{models_dir / "keras_mlp_tflite"}"\n')
    port = free_port()
    srv = module_server("--config", str(config), "--grpc-port", str(port), timeout=120)
    srv.grpc_port = port
    return srv


def x_rows(n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal((n, 64)).astype(np.float32)


def refused(resp: requests.Response) -> None:
    assert resp.status_code == 400, resp.text[:300]
    assert "Retry-After" not in resp.headers
    message = resp.json()["error"]
    assert message.startswith(TOO_MANY) and "max_enqueued_batches 2" in message, message


def test_tf_serving_rest(server: Any) -> None:
    refused(server.post("/v1/models/mlp:predict", {"instances": x_rows(5).tolist()}))
    refused(server.post("/v1/models/mlp:predict", {"inputs": {"x": x_rows(5).tolist()}}))
    served = server.post("/v1/models/mlp:predict", {"instances": x_rows(4).tolist()})
    assert served.status_code == 200 and np.array(served.json()["predictions"]).shape == (4, 10)


def v2_body(x: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]}


def test_v2_rest(server: Any) -> None:
    refused(server.post("/v2/models/mlp/infer", v2_body(x_rows(5))))
    served = server.post("/v2/models/mlp/infer", v2_body(x_rows(4)))
    assert served.status_code == 200 and served.json()["outputs"][0]["shape"] == [4, 10]


def rpc_refused(call: Any, request: Any) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert err.value.details().startswith(TOO_MANY), err.value.details()


def test_tf_serving_grpc(channel: Any) -> None:
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)

    def request(n: int) -> Any:
        req = predict_pb2.PredictRequest()
        req.model_spec.name = "mlp"
        req.inputs["x"].CopyFrom(tf.make_tensor_proto(x_rows(n)))
        return req

    rpc_refused(stub.Predict, request(5))
    answer = stub.Predict(request(4), timeout=30)
    assert tf.make_ndarray(answer.outputs["probs"]).shape == (4, 10)


def test_v2_grpc(channel: Any) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

    def request(n: int) -> Any:
        req = service_pb2.ModelInferRequest(model_name="mlp")
        req.inputs.add(name="x", datatype="FP32", shape=[n, 64])
        req.raw_input_contents.append(x_rows(n).tobytes())
        return req

    rpc_refused(stub.ModelInfer, request(5))
    answer = stub.ModelInfer(request(4), timeout=30)
    assert list(answer.outputs[0].shape) == [4, 10]
