"""What the two files of TF Serving's model-server test suite share (tests/api/test_tfs_suite.py,
the upstream port, and tests/api/test_tfs_suite_models.py, the cases issue 24 adds): upstream's
``RunServer`` as a module fixture (one ``appliance tfs`` per distinct start-up line, kept for the
module), its request helpers and the testdata paths.

Source: tensorflow/serving@9d981c5c2708d23c5407c7c1e30309e6f9798874,
``tensorflow_serving/model_servers/test_util/tensorflow_model_server_test_base.py`` (Apache-2.0).
Two files, not one, so that pytest-xdist's two workers (``--dist loadfile``: a whole file to a
worker) run the suite's longest file in two halves side by side (issue 49: the one file was a
sixth of the suite, a worker's last minutes alone).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest
import requests
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

from tests.support.servers import ROOT, Server, free_port, spawn

DATA = ROOT / "tests" / "data" / "tfserving"
RPC_TIMEOUT = 20.0
HTTP_REST_TIMEOUT_MS = 5000
DEFAULT_SIGNATURE = "serving_default"
DT_FLOAT = 1


class TFServer:
    """(proc, grpc host:port, rest host:port) of upstream's RunServer, plus our Server."""

    def __init__(self, server: Server, grpc_port: int, socket_path: str):
        self.server, self.socket_path = server, socket_path
        self.grpc_address = f"localhost:{grpc_port}"
        self.rest_address = f"localhost:{server.port}"


@pytest.fixture(scope="module")
def run_server(module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Upstream's ``RunServer``: one ``appliance tfs`` per distinct set of arguments, kept for
    the module (``module_server`` is requested so the leak check knows these children are the
    module's; it starts nothing itself)."""
    servers: dict[tuple, TFServer] = {}
    started: list[Server] = []

    def run(model_name: str | None, model_path: Path | str | None, model_type: str = "tf",
            model_config_file: Path | str | None = None, monitoring_config_file: Path | None = None,
            batching_parameters_file: Path | None = None, grpc_channel_arguments: str = "",
            wait_for_server_ready: bool = True, model_config_file_poll_period: int | None = None,
            extra: tuple[str, ...] = ()) -> TFServer:
        key = (model_name, str(model_path), model_type, str(model_config_file), str(monitoring_config_file),
               str(batching_parameters_file), grpc_channel_arguments, model_config_file_poll_period, extra)
        if key in servers:
            return servers[key]
        tmp = tmp_path_factory.mktemp("tfs")
        port, rest_api_port = free_port(), free_port()
        socket_path = str(tmp / "tf-serving.sock")  # upstream: /tmp/tf-serving.sock, one per host
        flags = [f"--port={port}", f"--rest_api_port={rest_api_port}",
                 f"--rest_api_timeout_in_ms={HTTP_REST_TIMEOUT_MS}", f"--grpc_socket_path={socket_path}"]
        if model_config_file:
            flags.append(f"--model_config_file={model_config_file}")
        elif model_path:
            flags += [f"--model_name={model_name}", f"--model_base_path={model_path}"]
        else:
            raise ValueError("Both model_config_file and model_path cannot be empty!")
        if model_type == "tflite":
            flags.append("--prefer_tflite_model=true")
        if monitoring_config_file:
            flags.append(f"--monitoring_config_file={monitoring_config_file}")
        if model_config_file_poll_period is not None:
            flags.append(f"--model_config_file_poll_wait_seconds={model_config_file_poll_period}")
        if batching_parameters_file:
            flags += ["--enable_batching", f"--batching_parameters_file={batching_parameters_file}"]
        flags.append("--grpc_channel_arguments=" + ",".join(a for a in (grpc_channel_arguments,
                                                                        "grpc.so_reuseaddr=1") if a))
        cmd = [sys.executable, "-m", "appliance.cli", "tfs", *flags, *extra, "--host", "127.0.0.1",
               "--state", str(tmp / "state"), "--no-discovery"]
        server = spawn(cmd, rest_api_port, tmp / "state", tmp / "server.log", ready=wait_for_server_ready)
        started.append(server)
        servers[key] = TFServer(server, port, socket_path)
        return servers[key]

    yield run
    for server in started:
        server.stop()


def call_rest(url: str, req: Any) -> bytes:
    """Upstream's CallREST: POST the JSON (GET without one); the body of a 200."""
    r = requests.post(url, data=json.dumps(req), timeout=30) if req is not None else requests.get(url, timeout=30)
    assert r.status_code == 200, f"{r.status_code} {r.text}"
    return r.content


def sorted_object(obj: Any) -> Any:
    """Upstream's SortedObject."""
    if isinstance(obj, dict):
        return sorted((k, sorted_object(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sorted(sorted_object(x) for x in obj)
    return obj


def model_version(model_path: Path) -> int:
    """Upstream's _GetModelVersion: the one integer directory under the base path."""
    return int(os.listdir(model_path)[0])


def verify_model_spec(spec: Any, name: str, signature: str, version: int) -> None:
    assert spec.name == name
    assert spec.signature_name == signature
    assert spec.version.value == version


def verify_predict_request(address: str, expected_output: float, expected_version: int,
                           model_name: str = "default", specify_output: bool = True, batch_input: bool = False,
                           signature_name: str = DEFAULT_SIGNATURE, rpc_timeout: float = RPC_TIMEOUT) -> None:
    """Upstream's VerifyPredictRequest: x = [2.0] (shape [1], or [1, 1] with batch_input)."""
    request = predict_pb2.PredictRequest()
    request.model_spec.name = model_name
    request.model_spec.signature_name = signature_name
    request.inputs["x"].dtype = DT_FLOAT
    request.inputs["x"].float_val.append(2.0)
    request.inputs["x"].tensor_shape.dim.add().size = 1
    if batch_input:
        request.inputs["x"].tensor_shape.dim.add().size = 1
    if specify_output:
        request.output_filter.append("y")
    with grpc.insecure_channel(address) as channel:
        result = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, rpc_timeout)
    assert "y" in result.outputs
    assert result.outputs["y"].dtype == DT_FLOAT
    assert len(result.outputs["y"].float_val) == 1
    assert result.outputs["y"].float_val[0] == expected_output
    verify_model_spec(result.model_spec, model_name, signature_name, expected_version)


def half_plus_two() -> Path:  # _GetSavedModelBundlePath
    return DATA / "saved_model_half_plus_two_cpu"


def half_plus_two_tf2() -> Path:
    return DATA / "saved_model_half_plus_two_tf2_cpu"


def half_plus_three() -> Path:
    return DATA / "saved_model_half_plus_three"


def tflite_model() -> Path:
    return DATA / "saved_model_half_plus_two_tflite"


def tflite_with_sigdef() -> Path:
    return DATA / "saved_model_half_plus_two_tflite_with_sigdef"

