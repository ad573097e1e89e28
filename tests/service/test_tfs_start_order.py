"""``appliance tfs`` opens its ports as tensorflow_model_server does: once the configured models
are AVAILABLE (appliance/service/models_wait.py). A client that waits for the port and calls at
once is answered, never UNAVAILABLE "loading"; a model that cannot load, or the deadline
passing, ends start-up with TF Serving's text, and no port was ever open.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import requests

grpc = pytest.importorskip("grpc")
pytest.importorskip("tensorflow_serving.apis.prediction_service_pb2_grpc")
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc  # noqa: E402

from tests.support.servers import ROOT, free_port, poll_until, stop_process  # noqa: E402

DATA = ROOT / "tests" / "data" / "tfserving"
START_S = 240  # loading TensorFlow and a model on a loaded 2-core box


def accepts(port: int) -> bool:
    """Whether a TCP connection to the loopback port is accepted now."""
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def tfs(tmp_path: Path, config: str, *extra: str) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    """``appliance tfs`` with ``config`` as its models.config: (process, gRPC port, REST port, log)."""
    (tmp_path / "models.config").write_text(config)
    grpc_port, rest_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "appliance.cli", "tfs", f"--port={grpc_port}", f"--rest_api_port={rest_port}",
           f"--model_config_file={tmp_path / 'models.config'}", *extra, "--host", "127.0.0.1",
           "--state", str(tmp_path / "state"), "--no-discovery"]
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    return proc, grpc_port, rest_port, log


def one_model(name: str, path: Path) -> str:
    return f'model_config_list {{ config {{ name: "{name}" base_path: "{path}" model_platform: "tensorflow" }} }}\n'


def predict(port: int) -> float:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "half"
    request.inputs["x"].dtype = 1  # DT_FLOAT
    request.inputs["x"].float_val.append(2.0)
    request.inputs["x"].tensor_shape.dim.add().size = 1
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # no wait_for_ready: the first try counts
        return prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, 30).outputs["y"].float_val[0]


def test_a_client_that_calls_as_soon_as_the_port_accepts_is_answered(tmp_path: Path) -> None:
    proc, grpc_port, rest_port, log = tfs(tmp_path, one_model("half", DATA / "saved_model_half_plus_two_cpu"))
    try:
        poll_until(lambda: accepts(grpc_port), START_S, "the gRPC port to accept",
                   lambda: log.read_text(errors="replace")[-3000:],
                   lambda: f"exited with {proc.returncode}" if proc.poll() is not None else None)
        assert predict(grpc_port) == 3.0  # before: StatusCode.UNAVAILABLE "... (loading)"
        poll_until(lambda: accepts(rest_port), 30, "the REST port to accept")
        r = requests.get(f"http://127.0.0.1:{rest_port}/v1/models/half", timeout=30)
        assert r.json()["model_version_status"][0]["state"] == "AVAILABLE"
        assert "waiting for the configured models before opening the ports" in log.read_text(errors="replace")
    finally:
        stop_process(proc)


def _fails_without_ever_listening(proc: subprocess.Popen[bytes], ports: tuple[int, int], log: Path) -> str:
    """Poll both ports until the process exits; none may ever accept. The log's text."""
    opened: list[int] = []

    def ended() -> bool:
        opened.extend(p for p in ports if accepts(p))
        return proc.poll() is not None

    try:
        poll_until(ended, START_S, "appliance tfs to give up", lambda: log.read_text(errors="replace")[-3000:])
    finally:
        stop_process(proc)
    assert not opened, f"ports {opened} accepted connections before start-up failed"
    assert proc.returncode == 1
    return log.read_text(errors="replace")


def test_a_model_that_cannot_load_fails_start_up_as_tf_serving(tmp_path: Path) -> None:
    """bad_half_plus_two (refused at load, as TF Serving refuses it): TF Serving's
    "1 model(s) did not become available: {{{name: bad version: 123} due to error: ...}, }"
    (server_core.cc: "{", then per model "{" + ServableId's "{name: .. version: ..}" + the error + "}, ")."""
    proc, grpc_port, rest_port, log = tfs(tmp_path, one_model("bad", DATA / "bad_half_plus_two"))
    text = _fails_without_ever_listening(proc, (grpc_port, rest_port), log)
    assert "Failed to start server. Error: UNKNOWN: 1 model(s) did not become available: " \
           "{{{name: bad version: 123} due to error: " in text, text[-3000:]


def test_a_model_without_versions_fails_start_up_at_the_deadline(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "appliance.toml").write_text("[tfs]\nwait_for_models_timeout_s = 3\n")
    proc, grpc_port, rest_port, log = tfs(tmp_path, one_model("nothing", tmp_path / "empty"),
                                          "--config", str(tmp_path / "appliance.toml"))
    text = _fails_without_ever_listening(proc, (grpc_port, rest_port), log)
    assert "1 model(s) did not become available within [tfs] wait_for_models_timeout_s = 3 s: " \
           "{{{name: nothing version: none on disk}}, }" in text, text[-3000:]
