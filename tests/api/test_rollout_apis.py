"""Rollouts are the core's, so traffic over any API decides them: TF Serving gRPC alone,
KServe v2 REST alone and KServe v2 gRPC alone each promote an equal candidate and abort a
bad one, in shadow and in canary mode, with every client request answered correctly.

Per API one server serves four models at version 1 = y = 2x + 1, and a version 2 lands
next to each: shadow "same" (promoted), shadow "drift" (aborted on output drift), canary
"same" (promoted) and canary "flaky" (fails on inputs of 100 and more: aborted on its error
rate, while the serving version answers those clients again). No request goes over TF
Serving's REST API, where the rollout used to be decided.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import requests

from tests.support.servers import free_port
from tests.core.test_rollout import built_variants, decisions, write_config

MODELS = {  # model -> (version 2 variant, rollout mode)
    "shadow_same": ("same", "shadow"),
    "shadow_drift": ("drift", "shadow"),
    "canary_same": ("same", "canary"),
    "canary_flaky": ("flaky", "canary"),
}
EXPECTED = {"shadow_same": ("promote", "all gates held"), "shadow_drift": ("abort", "output drift"),
            "canary_same": ("promote", "all gates held"), "canary_flaky": ("abort", "error rate")}


@pytest.fixture(scope="module")
def variants() -> Path:
    return built_variants()  # built once for this file and tests/core/test_rollout.py


def tfs_grpc_client(server: Any) -> Callable[[str, float], list[float]]:
    import grpc
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)

    def call(model: str, value: float) -> list[float]:
        request = predict_pb2.PredictRequest()
        request.model_spec.name = model
        request.inputs["x"].CopyFrom(_tensor_proto(np.full((1, 4), value, np.float32)))
        answer = stub.Predict(request, timeout=30)
        return list(answer.outputs["y"].float_val)
    call.close = channel.close  # type: ignore[attr-defined]
    return call


def _tensor_proto(array: np.ndarray) -> Any:
    from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2

    proto = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_shape=tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in array.shape]))
    proto.float_val.extend(array.reshape(-1).tolist())
    return proto


def v2_rest_client(server: Any) -> Callable[[str, float], list[float]]:
    session = requests.Session()

    def call(model: str, value: float) -> list[float]:
        body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [value] * 4}]}
        r = session.post(f"{server.url}/v2/models/{model}/infer", json=body, timeout=30)
        if r.status_code != 200:
            raise AssertionError(f"{r.status_code} {r.text[:200]}")
        return [float(v) for v in r.json()["outputs"][0]["data"]]
    call.close = session.close  # type: ignore[attr-defined]
    return call


def v2_grpc_client(server: Any) -> Callable[[str, float], list[float]]:
    import tritonclient.grpc as tc

    client = tc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")

    def call(model: str, value: float) -> list[float]:
        inp = tc.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(np.full((1, 4), value, np.float32))
        return [float(v) for v in client.infer(model, [inp], client_timeout=30).as_numpy("y").reshape(-1)]
    call.close = client.close  # type: ignore[attr-defined]
    return call


CLIENTS = {"tfs-grpc": tfs_grpc_client, "v2-rest": v2_rest_client, "v2-grpc": v2_grpc_client}


@pytest.mark.parametrize("api", list(CLIENTS))
def test_rollouts_are_decided_by_traffic_over_one_api(api: str, start_server: Any, variants: Path,
                                                       tmp_path: Path) -> None:
    base = tmp_path / "models"
    for name in MODELS:
        shutil.copytree(variants / "base", base / name / "1")
    grpc_port = free_port()
    # a lenient latency gate: the judge here is outputs and errors, whatever the box's load
    config = write_config(tmp_path, base, MODELS, min_requests=30, p99_ratio=50.0)
    server = start_server("--config", str(config), "--grpc-port", str(grpc_port))
    server.grpc_port = grpc_port
    for name, (variant, _) in MODELS.items():  # version 2 appears by one rename, as sync commits it
        shutil.copytree(variants / variant, tmp_path / f"stage-{name}")
        os.rename(tmp_path / f"stage-{name}", base / name / "2")
    server.wait_for(lambda: all(m.get("candidate_version") == 2 for m in server.status()["models"].values()),
                    120, "every candidate loaded next to version 1")
    # The rollouts started when the candidates became AVAILABLE, before any request.
    server.wait_for(lambda: set(server.status().get("rollouts", {})) == set(MODELS), 30,
                    "a rollout in /api/status for every model before any traffic")

    failures: list[str] = []
    answered = [0]
    stop = threading.Event()

    def client(worker: int) -> None:
        call = CLIENTS[api](server)
        i = 0
        try:
            while not stop.is_set():
                i += 1
                for name in MODELS:
                    value = 150.0 if (name == "canary_flaky" and i % 3 == 0) else float(i % 7)
                    try:
                        got = call(name, value)
                    except Exception as exc:  # any failure a client sees fails the test
                        failures.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
                        continue
                    if got != [value * 2 + 1] * 4:
                        failures.append(f"{name}: answered {got} for {value}")
                    answered[0] += 1
        finally:
            call.close()  # type: ignore[attr-defined]

    threads = [threading.Thread(target=client, args=(w,), name=f"rollout-{api}-{w}") for w in range(3)]
    for t in threads:
        t.start()
    try:
        server.wait_for(lambda: len(decisions(server)) == len(MODELS), 240, f"a decision for every model ({api})")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failures == [] and answered[0] > 0

    done = decisions(server)
    for name, (action, reason) in EXPECTED.items():
        assert done[name]["action"] == action and reason in done[name]["reason"], (name, done[name])
    assert done["shadow_drift"]["output_drift"] > 0.5 and done["shadow_same"]["output_drift"] == 0
    models = server.status()["models"]
    assert models["shadow_same"]["serving_version"] == 2 and models["canary_same"]["serving_version"] == 2
    assert models["shadow_drift"]["serving_version"] == 1 and models["canary_flaky"]["serving_version"] == 1
