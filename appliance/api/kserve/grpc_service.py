"""The Open Inference Protocol's gRPC service, ``inference.GRPCInferenceService``.

``add_to_server(server, core)`` registers ServerLive, ServerReady, ModelReady,
ServerMetadata, ModelMetadata and ModelInfer on a ``grpc.server`` (the TF Serving gRPC
port: ``appliance.service.grpc_port`` calls it). The work is ``v2_rest.V2Service``'s, so gRPC,
REST v2 and TF Serving requests share the manager, the version policy and the batches.

Tensors: inputs come as ``raw_input_contents`` (one entry per input, what tritonclient
sends) or as typed ``contents``; outputs always go back as ``raw_output_contents``, as
Triton answers. Sizes are checked as strictly as over HTTP (``codec``): the elements the
shapes declare are counted against ``limits.max_tensor_elements`` before any array is built,
and a raw entry that disagrees with its shape and datatype is INVALID_ARGUMENT naming both.

Errors map through ``ApplianceError.grpc_code``: INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE
(loading, queue full), RESOURCE_EXHAUSTED; anything unexpected is logged and INTERNAL.
The service is registered with a generic handler, so no generated stub is needed at run
time: only grpcio and protobuf.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import grpc
import numpy as np

from appliance.api.kserve import codec
from appliance.core.errors import InvalidArgument, NotFound
from appliance.api.grpc_errors import guarded, observed
from appliance.protos.kserve import pb
from appliance.api.kserve.rest import parse_version
from appliance.api.kserve.service import Requested, Tensor, V2Service

if TYPE_CHECKING:
    from appliance.core.appliance import Appliance


SERVICE_NAME = "inference.GRPCInferenceService"

# datatype -> the typed contents field that carries it (FP16 has none: raw only)
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
_ALL_FIELDS = tuple(sorted(set(_CONTENTS_FIELD.values())))


def add_to_server(server: grpc.Server, core: "Appliance") -> None:
    """Register ``inference.GRPCInferenceService`` on ``server`` (before ``server.start()``)."""
    server.add_generic_rpc_handlers((V2GRPC(V2Service(core, core.states, core.ready)).handler(),))


class V2GRPC:
    """The RPC methods: coroutines, each taking a request message and returning the response."""

    def __init__(self, service: V2Service):
        self.core, self.service = service.core, service

    def handler(self) -> grpc.GenericRpcHandler:
        methods: dict[str, tuple[Any, Any, Callable[[Any], Awaitable[Any]]]] = {
            "ServerLive": (pb.ServerLiveRequest, pb.ServerLiveResponse, self.server_live),
            "ServerReady": (pb.ServerReadyRequest, pb.ServerReadyResponse, self.server_ready),
            "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse, self.model_ready),
            "ServerMetadata": (pb.ServerMetadataRequest, pb.ServerMetadataResponse, self.server_metadata),
            "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse, self.model_metadata),
            "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse, self.model_infer),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            name: grpc.unary_unary_rpc_method_handler(guarded(fn, name), request_deserializer=req.FromString,
                                                      response_serializer=resp.SerializeToString)
            for name, (req, resp, fn) in methods.items()})

    # -- health and metadata --------------------------------------------------------------
    async def server_live(self, request: Any) -> Any:
        return pb.ServerLiveResponse(live=self.service.live())

    async def server_ready(self, request: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.service.ready())

    async def model_ready(self, request: Any) -> Any:
        try:  # as Triton: an unknown model is simply not ready
            ready = self.service.model_ready(request.name, _grpc_version(request.version))
        except NotFound:
            ready = False
        return pb.ModelReadyResponse(ready=ready)

    async def server_metadata(self, request: Any) -> Any:
        return pb.ServerMetadataResponse(**self.service.server_metadata())

    async def model_metadata(self, request: Any) -> Any:
        meta = await self.service.model_metadata(request.name, _grpc_version(request.version))
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]], outputs=[tensor(**t) for t in meta["outputs"]])

    # -- inference ------------------------------------------------------------------------
    async def model_infer(self, request: Any) -> Any:
        with observed(self.core.metrics, request.model_name, "v2_infer"):
            inputs = _inputs(request, self.core.config.limits)
            requested = [Requested(o.name) for o in request.outputs] or None
            result = await self.service.infer(request.model_name, _grpc_version(request.model_version), inputs,
                                        requested, _parameters(request.parameters))
            response = pb.ModelInferResponse(model_name=result.model, model_version=str(result.version),
                                             id=request.id)
            for tensor, _ in result.outputs:
                response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.array.shape)
                response.raw_output_contents.append(codec.to_raw(tensor.array))
            return response


def _grpc_version(text: str) -> int | None:
    return parse_version(text) if text else None


def _parameters(params: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, choice) if choice else None
    return out


def _inputs(request: Any, limits: Any) -> list[Tensor]:
    """The request's tensors; every shape is checked, and the elements they declare counted
    against ``limits.max_tensor_elements``, before any array is built."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidArgument(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
                              "it needs one per input, in input order")
    shapes = [_declared_shape(item) for item in request.inputs]
    codec.check_declared_elements([(item.name, shape) for item, shape in zip(request.inputs, shapes)], limits)
    tensors = []
    for i, (item, shape) in enumerate(zip(request.inputs, shapes)):
        where = f"input '{item.name}'"
        has_contents = item.HasField("contents") and any(len(getattr(item.contents, f)) for f in _ALL_FIELDS)
        if raw:
            if has_contents:
                raise InvalidArgument(f"{where} sets 'contents' while the request uses raw_input_contents; "
                                      "use one of the two for every input")
            array = codec.from_raw(memoryview(raw[i]), item.datatype, shape, where)
        else:
            array = _from_contents(item, shape, where)
        tensors.append(Tensor(item.name, array, item.datatype))
    return tensors


def _declared_shape(item: Any) -> tuple[int, ...]:
    """An input's datatype and shape checked; its shape."""
    where = f"input '{item.name}'"
    codec.dtype_of(item.datatype, where)
    if any(d < 0 for d in item.shape):
        raise InvalidArgument(f"{where}: 'shape' must be non-negative integers, got {list(item.shape)}")
    return codec.check_shape(list(item.shape), where)


def _from_contents(item: Any, shape: tuple[int, ...], where: str) -> np.ndarray:
    field = _CONTENTS_FIELD.get(item.datatype)
    if field is None:
        raise InvalidArgument(f"{where}: {item.datatype} has no typed contents field; send it in raw_input_contents")
    others = [f for f in _ALL_FIELDS if f != field and len(getattr(item.contents, f))]
    if others:
        raise InvalidArgument(f"{where}: a {item.datatype} tensor goes in contents.{field}, not {others[0]}")
    values = getattr(item.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise InvalidArgument(f"{where}: shape {list(shape)} needs {count} elements, contents.{field} has "
                              f"{len(values)}")
    dtype = codec.DATATYPES[item.datatype]
    if dtype.kind == "O":
        arr = np.empty(count, dtype=object)
        arr[:] = list(values)
        return arr.reshape(shape)
    wide = np.array(values, dtype=np.float64 if dtype.kind == "f" else np.int64 if dtype.kind == "i"
                    else np.uint64 if dtype.kind == "u" else np.bool_)
    if dtype.kind in "iu" and wide.size:
        info = np.iinfo(dtype)
        if wide.min() < info.min or wide.max() > info.max:
            raise InvalidArgument(f"{where}: a value is out of range for {item.datatype}")
    return wide.astype(dtype).reshape(shape)
