"""The lean gRPC server's fallback is said where an operator looks, not only in the log.

With no usable libnghttp2 (``$EDGE_APPLIANCE_LIBNGHTTP2`` pointing at a library that is not
there, as a container base without ``libnghttp2-14`` is) the service still answers gRPC, on
grpcio in the serving process, and ``/api/status`` lists a ``fallback`` problem that names the
missing library and the fix; with the library it runs the lean server and lists none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.support.servers import ROOT, free_port, model_copy

SAMPLES = ROOT / "appliance" / "sample_models"

pytest.importorskip("tensorflow_serving.apis.prediction_service_pb2_grpc", reason="tensorflow-serving-api (the test extra)")


def predict_over_grpc(port: int) -> list[float]:
    from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "half_plus_two"
    shape = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=3)])
    request.inputs["x"].CopyFrom(tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=shape,
                                                        float_val=[1.0, 2.0, 5.0]))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request, timeout=60)
    return list(reply.outputs["y"].float_val)


def serve(start_server: Any, tmp_path: Path, env: dict[str, str]) -> tuple[Any, int]:
    """The bundled sample (its model.tflite, on LiteRT: no TensorFlow in the service)."""
    port = free_port()
    models = model_copy(SAMPLES, tmp_path, "half_plus_two")
    return start_server("--models", str(models), "--grpc-port", str(port), "--backend", "tflite", env=env), port


def test_without_libnghttp2_grpc_answers_on_grpcio_and_says_so(start_server: Any, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such" / "libnghttp2.so.14")
    server, port = serve(start_server, tmp_path, {"EDGE_APPLIANCE_LIBNGHTTP2": missing})
    assert predict_over_grpc(port) == [2.5, 3.0, 4.5]  # it still serves
    status = server.status()
    assert status["grpc"]["transport"] == "grpcio"
    found = [p for p in status["problems"] if p["kind"] == "fallback"]
    assert len(found) == 1 and found[0]["severity"] == "warning" and found[0]["part"] == "gRPC", status["problems"]
    assert missing in found[0]["message"] and "apt-get install libnghttp2-14" in found[0]["message"]
    assert server.log_text().count("the lean gRPC server cannot run") == 1  # once, not once per look


def test_with_libnghttp2_grpc_runs_the_lean_server_and_no_fallback_is_listed(start_server: Any, tmp_path: Path) -> None:
    from appliance.transport.grpc import nghttp2

    try:
        nghttp2.load()
    except nghttp2.Missing as exc:
        pytest.skip(f"this machine has no libnghttp2: {exc}")
    server, port = serve(start_server, tmp_path, {})
    assert predict_over_grpc(port) == [2.5, 3.0, 4.5]
    status = server.status()
    assert status["grpc"]["transport"] == "lean" and status["grpc"]["http2"].startswith("libnghttp2 ")
    assert not [p for p in status["problems"] if p["kind"] == "fallback"]
