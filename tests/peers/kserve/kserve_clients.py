"""KServe's own Python clients against a running appliance (issue 44), run by
tests/peers/test_kserve_clients.py with the python of the venv scripts/peer_venv_kserve.sh makes
(the kserve package pins pydantic, starlette and psutil away from the project's venv).

    ~/.cache/edge-appliance/peer-venvs/kserve/bin/python tests/peers/kserve/kserve_clients.py \\
        http://127.0.0.1:8501 127.0.0.1:8500 keras_mlp expected.json

``expected.json``: {"x": [[...64 floats...]], "probs": [[...10 floats...]]}, the model run
in-process by the caller. Each check prints ``PASS name: detail`` or ``FAIL name: error``; the
exit status is 1 when any fails. The checks are KServe's client calls as its own tests
(kserve python/kserve/test/test_inference_client.py, test_server_grpc_client.py) make them:
``InferenceRESTClient`` over the v2 protocol (health, model ready, JSON, binary-input and
binary-output inference, an unknown model's error) and the v1 protocol's predict,
``InferenceGRPCClient`` (health, model ready, inference, an unknown model's status), and
KServe's generated gRPC stub for server and model metadata. Only the URL and model differ.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, Awaitable, Callable

import grpc
import httpx
import numpy as np
from kserve import InferenceGRPCClient, InferenceRESTClient, InferInput, InferRequest
from kserve.inference_client import RESTConfig
from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
from kserve.protocol.grpc.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub
from kserve.protocol.infer_type import RequestedOutput

RESULTS: list[bool] = []
RTOL, ATOL = 1e-4, 1e-5


async def check(name: str, fn: Callable[[], Awaitable[Any]]) -> None:
    try:
        detail = await fn()
        RESULTS.append(True)
        print(f"PASS {name}: {detail}", flush=True)
    except Exception as exc:  # a report of every check, not the first failure
        RESULTS.append(False)
        print(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)


def close(got: Any, want: np.ndarray) -> str:
    got = np.asarray(got, dtype=np.float32).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    return f"{got.shape} matches the model"


def mlp_request(x: np.ndarray, binary: bool = False, binary_output: bool = False,
                from_numpy: bool = False) -> InferRequest:
    tensor = InferInput(name="x", datatype="FP32", shape=list(x.shape))
    if binary or from_numpy:  # from_numpy: typed contents, the way to_grpc() wants its data
        tensor.set_data_from_numpy(x, binary_data=binary)
    else:
        tensor.data = x.tolist()  # nested lists, as KServe's own tests send them
    outputs = [RequestedOutput(name="probs", parameters={"binary_data_output": True})] if binary_output else None
    return InferRequest(model_name="", infer_inputs=[tensor], request_id="2ja0ls9j1309",
                        parameters={"test-param": "abc"}, request_outputs=outputs)


async def rest_v2(base: str, model: str, x: np.ndarray, want: np.ndarray) -> None:
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=120, verbose=False))

    async def infer(request: InferRequest | dict[str, Any]) -> str:
        res = await client.infer(base, request, model_name=model)
        assert res.id == "2ja0ls9j1309", f"id {res.id!r} not echoed"
        assert res.outputs[0].name == "probs", res.outputs[0].name
        return close(res.outputs[0].as_numpy(), want)

    async def unknown() -> str:
        try:
            await client.infer(base, mlp_request(x), model_name="no_such_model")
        except httpx.HTTPStatusError as exc:
            assert exc.response.status_code == 404 and "unknown model" in str(exc), str(exc)
            return str(exc)[:120]
        raise AssertionError("no HTTPStatusError")

    async def not_ready() -> str:
        value = await client.is_model_ready(base, "no_such_model")
        assert value is False, f"answered {value!r}"
        return "False"

    as_dict = {"id": "2ja0ls9j1309", "parameters": {"test-param": "abc"},
               "inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.tolist(),
                           "parameters": {"test-param": "abc"}}]}
    await check("rest v2 is_server_live", lambda: is_true_of(client.is_server_live(base)))
    await check("rest v2 is_server_ready", lambda: is_true_of(client.is_server_ready(base)))
    await check("rest v2 is_model_ready", lambda: is_true_of(client.is_model_ready(base, model)))
    await check("rest v2 is_model_ready (unknown model)", not_ready)
    await check("rest v2 infer (dict)", lambda: infer(as_dict))
    await check("rest v2 infer (InferRequest, JSON)", lambda: infer(mlp_request(x)))
    await check("rest v2 infer (binary input)", lambda: infer(mlp_request(x, binary=True)))
    await check("rest v2 infer (binary output)", lambda: infer(mlp_request(x, binary_output=True)))
    await check("rest v2 infer (unknown model)", unknown)
    await client.close()


async def is_true_of(call: Awaitable[Any]) -> str:
    value = await call
    assert value is True, f"answered {value!r}, not True"
    return "True"


async def rest_v1(base: str, model: str, x: np.ndarray, want: np.ndarray) -> None:
    client = InferenceRESTClient(RESTConfig(protocol="v1", timeout=120))

    async def predict() -> str:
        res = await client.infer(base, {"instances": x.tolist()}, model_name=model)
        return close(res["predictions"], want)

    await check("rest v1 infer (predict)", predict)
    await client.close()


async def grpc_v2(target: str, model: str, x: np.ndarray, want: np.ndarray) -> None:
    client = InferenceGRPCClient(target, timeout=120)

    async def infer() -> str:
        request = mlp_request(x, from_numpy=True)
        request.model_name = model
        res = await client.infer(request)
        assert res.id == "2ja0ls9j1309", f"id {res.id!r} not echoed"
        return close(res.outputs[0].as_numpy(), want)

    async def unknown() -> str:
        request = mlp_request(x, from_numpy=True)
        request.model_name = "no_such_model"
        try:
            await client.infer(request)
        except grpc.RpcError as exc:
            code = exc.code()
            assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT), code
            assert "unknown model" in exc.details(), exc.details()
            return f"{code.name}: {exc.details()[:80]}"
        raise AssertionError("no RpcError")

    await check("grpc is_server_live", lambda: is_true_of(client.is_server_live()))
    await check("grpc is_server_ready", lambda: is_true_of(client.is_server_ready()))
    await check("grpc is_model_ready", lambda: is_true_of(client.is_model_ready(model)))
    await check("grpc infer", infer)
    await check("grpc infer (unknown model)", unknown)
    await client.close()


async def grpc_metadata(target: str, model: str) -> None:
    async with grpc.aio.insecure_channel(target) as channel:
        stub = GRPCInferenceServiceStub(channel)

        async def server() -> str:
            res = await stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=120)
            assert res.name and res.version, res
            return f"{res.name} {res.version} {list(res.extensions)[:3]}"

        async def metadata() -> str:
            res = await stub.ModelMetadata(pb.ModelMetadataRequest(name=model), timeout=120)
            assert res.name == model and [t.name for t in res.inputs] == ["x"], res
            assert [t.datatype for t in res.outputs] == ["FP32"] and list(res.outputs[0].shape) == [-1, 10], res
            return f"{res.name} {res.platform} inputs {[(t.name, list(t.shape)) for t in res.inputs]}"

        await check("grpc server metadata (KServe's stub)", server)
        await check("grpc model metadata (KServe's stub)", metadata)


async def main(argv: list[str]) -> int:
    base, target, model, expected = argv
    with open(expected) as f:
        data = json.load(f)
    x, want = np.asarray(data["x"], dtype=np.float32), np.asarray(data["probs"], dtype=np.float32)
    await rest_v2(base, model, x, want)
    await rest_v1(base, model, x, want)
    await grpc_v2(target, model, x, want)
    await grpc_metadata(target, model)
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
