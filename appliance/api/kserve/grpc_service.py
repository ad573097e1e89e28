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

import asyncio
import logging
import math
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Mapping, TypeVar

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import Message

from appliance.api.kserve import classification, codec
from appliance.api.kserve import shared_memory as shm
from appliance.core.errors import ApplianceError, InvalidArgument, NotFound
from appliance.api.grpc_errors import CallContext, guarded, guarded_run, observed
from appliance.core.config import LimitsConfig
from appliance.core.json_types import JSONScalar
from appliance.core.request_context import NO_CONTEXT, RequestContext
from appliance.core.shared_memory import SharedMemory
from appliance.protos.kserve import model_config_pb2, pb
from appliance.api.kserve.rest import parse_version
from appliance.api.kserve.extensions import V2Extensions
from appliance.api.kserve.service import Requested, Tensor, V2Service

if TYPE_CHECKING:
    from appliance.core.appliance import Appliance


SERVICE_NAME = "inference.GRPCInferenceService"
STREAM = "ModelStreamInfer"  # bidirectional: both transports serve it (the lean one through streams.py)
STREAM_IN_FLIGHT = 64  # a stream's requests running at once; the next is read when one is answered
log = logging.getLogger("appliance.grpc")

# datatype -> the typed contents field that carries it (FP16 has none: raw only)
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
_ALL_FIELDS = tuple(sorted(set(_CONTENTS_FIELD.values())))


Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)
Parameters = dict[str, JSONScalar]  # an InferParameter's choices: bool, int64, uint64, double, string
RepositoryParameters = dict[str, JSONScalar | bytes]  # a ModelRepositoryParameter's: bytes too (files)


def _with_caller(call: Callable[[Req, CallContext], Awaitable[Resp]]) -> Callable[[Req, CallContext], Awaitable[Resp]]:
    """``call`` with the call's peer as shared memory's ``CALLER`` (only this host may use regions)."""
    async def with_caller(request: Req, context: CallContext) -> Resp:
        caller = shm.CALLER.set(context.peer())
        try:
            return await call(request, context)
        finally:
            shm.CALLER.reset(caller)
    return with_caller


def add_to_server(server: grpc.Server, core: "Appliance") -> None:
    """Register ``inference.GRPCInferenceService`` on ``server`` (before ``server.start()``)."""
    server.add_generic_rpc_handlers((V2GRPC.serving(core).handler(),))


class V2GRPC:
    """The RPC methods: coroutines, each taking a request message and returning the response.
    ``extensions``: statistics, model configuration and repository (the serving process's;
    a front worker forwards those calls, appliance/fronts/grpc_front.py)."""

    def __init__(self, service: V2Service, extensions: V2Extensions | None = None):
        self.core, self.service, self.extensions = service.core, service, extensions

    @classmethod
    def serving(cls, core: "Appliance") -> "V2GRPC":
        """The methods of the process that holds the versions (its own gRPC port, and the
        calls front workers forward to it): every method, the extensions included."""
        return cls(V2Service.serving(core), V2Extensions(core))

    def handler(self) -> grpc.GenericRpcHandler:
        handlers = dict((
            _unary("ServerLive", pb.ServerLiveRequest, pb.ServerLiveResponse, self.server_live),
            _unary("ServerReady", pb.ServerReadyRequest, pb.ServerReadyResponse, self.server_ready),
            _unary("ModelReady", pb.ModelReadyRequest, pb.ModelReadyResponse, self.model_ready),
            _unary("ServerMetadata", pb.ServerMetadataRequest, pb.ServerMetadataResponse, self.server_metadata),
            _unary("ModelMetadata", pb.ModelMetadataRequest, pb.ModelMetadataResponse, self.model_metadata),
            _unary_run("ModelInfer", pb.ModelInferRequest, pb.ModelInferResponse, self.model_infer),
            _unary("ModelStatistics", pb.ModelStatisticsRequest, pb.ModelStatisticsResponse, self.model_statistics),
            _unary("ModelConfig", pb.ModelConfigRequest, pb.ModelConfigResponse, self.model_config),
            _unary("RepositoryIndex", pb.RepositoryIndexRequest, pb.RepositoryIndexResponse, self.repository_index),
            _unary("RepositoryModelLoad", pb.RepositoryModelLoadRequest, pb.RepositoryModelLoadResponse, self.load),
            _unary("RepositoryModelUnload", pb.RepositoryModelUnloadRequest, pb.RepositoryModelUnloadResponse,
                   self.unload),
            _unary("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest,
                   pb.SystemSharedMemoryStatusResponse, self.shm_status),
            _unary("SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest,
                   pb.SystemSharedMemoryRegisterResponse, self.shm_register),
            _unary("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest,
                   pb.SystemSharedMemoryUnregisterResponse, self.shm_unregister),
            _unary("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest, pb.CudaSharedMemoryStatusResponse,
                   self.cuda_status),
            _unary("CudaSharedMemoryRegister", pb.CudaSharedMemoryRegisterRequest,
                   pb.CudaSharedMemoryRegisterResponse, self.cuda_register),
            _unary("CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest,
                   pb.CudaSharedMemoryUnregisterResponse, self.cuda_unregister),
        ))
        handlers[STREAM] = grpc.stream_stream_rpc_method_handler(
            self.model_stream_infer, request_deserializer=pb.ModelInferRequest.FromString,
            response_serializer=pb.ModelStreamInferResponse.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    # -- health and metadata --------------------------------------------------------------
    async def server_live(self, request: pb.ServerLiveRequest) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.service.live())

    async def server_ready(self, request: pb.ServerReadyRequest) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.service.ready())

    async def model_ready(self, request: pb.ModelReadyRequest) -> pb.ModelReadyResponse:
        try:  # as Triton: an unknown model is simply not ready
            ready = self.service.model_ready(request.name, _grpc_version(request.version))
        except NotFound:
            ready = False
        return pb.ModelReadyResponse(ready=ready)

    async def server_metadata(self, request: pb.ServerMetadataRequest) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**self.service.server_metadata())

    async def model_metadata(self, request: pb.ModelMetadataRequest) -> pb.ModelMetadataResponse:
        meta = await self.service.model_metadata(request.name, _grpc_version(request.version))
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=meta["name"], versions=meta["versions"], platform=meta["platform"],
            inputs=[tensor(**t) for t in meta["inputs"]], outputs=[tensor(**t) for t in meta["outputs"]])

    # -- statistics, model configuration, repository (appliance/api/kserve/extensions.py) ----
    async def model_statistics(self, request: pb.ModelStatisticsRequest) -> pb.ModelStatisticsResponse:
        stats = self._extensions().statistics(request.name, _grpc_version(request.version))
        response = pb.ModelStatisticsResponse()
        json_format.ParseDict(stats, response)  # fills ``response`` in place (and returns it)
        return response

    async def model_config(self, request: pb.ModelConfigRequest) -> pb.ModelConfigResponse:
        config = await self._extensions().config(request.name, _grpc_version(request.version))
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig()))

    async def repository_index(self, request: pb.RepositoryIndexRequest) -> pb.RepositoryIndexResponse:
        response = pb.RepositoryIndexResponse()
        json_format.ParseDict({"models": self._extensions().index(request.ready)}, response)
        return response

    async def load(self, request: pb.RepositoryModelLoadRequest) -> pb.RepositoryModelLoadResponse:
        await self._extensions().load(request.model_name, _repository_parameters(request.parameters))
        return pb.RepositoryModelLoadResponse()

    async def unload(self, request: pb.RepositoryModelUnloadRequest) -> pb.RepositoryModelUnloadResponse:
        await self._extensions().unload(request.model_name, _repository_parameters(request.parameters))
        return pb.RepositoryModelUnloadResponse()

    def _extensions(self) -> V2Extensions:
        if self.extensions is None:  # a front worker forwards these calls; never reached there
            raise NotFound("this method is answered by the serving process")
        return self.extensions

    # -- shared memory (appliance/api/kserve/shared_memory.py) ------------------------------
    async def shm_status(self, request: pb.SystemSharedMemoryStatusRequest) -> pb.SystemSharedMemoryStatusResponse:
        response = pb.SystemSharedMemoryStatusResponse()
        for region in shm.registry(self.service.regions).status(request.name or None):
            response.regions[region["name"]].CopyFrom(response.RegionStatus(**region))
        return response

    async def shm_register(self, request: pb.SystemSharedMemoryRegisterRequest) -> pb.SystemSharedMemoryRegisterResponse:
        if not request.name:
            raise InvalidArgument("'region name' is necessary to register system shared memory region")
        try:
            shm.registry(self.service.regions).register(request.name, request.key, request.offset, request.byte_size)
        except InvalidArgument as exc:
            if exc.message.startswith("Unable to open shared memory region"):
                raise _Unopenable(exc.message) from None
            raise
        return pb.SystemSharedMemoryRegisterResponse()

    async def shm_unregister(self, request: pb.SystemSharedMemoryUnregisterRequest) -> pb.SystemSharedMemoryUnregisterResponse:
        shm.registry(self.service.regions).unregister(request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    async def cuda_status(self, request: pb.CudaSharedMemoryStatusRequest) -> pb.CudaSharedMemoryStatusResponse:
        response = pb.CudaSharedMemoryStatusResponse()
        for region in shm.CUDA_REGIONS.status(request.name or None):
            response.regions[region["name"]].CopyFrom(response.RegionStatus(**region))
        return response

    async def cuda_register(self, request: pb.CudaSharedMemoryRegisterRequest) -> pb.CudaSharedMemoryRegisterResponse:
        shm.CUDA_REGIONS.register(request.name, request.raw_handle, request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    async def cuda_unregister(self, request: pb.CudaSharedMemoryUnregisterRequest) -> pb.CudaSharedMemoryUnregisterResponse:
        shm.CUDA_REGIONS.unregister(request.name or None)
        return pb.CudaSharedMemoryUnregisterResponse()

    # -- inference ------------------------------------------------------------------------
    async def model_stream_infer(self, requests: AsyncIterator[pb.ModelInferRequest],
                                 context: CallContext) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Triton's ModelStreamInfer: every request of the stream is an ordinary ModelInfer,
        run as it arrives (several at once, so they batch), and answered as it completes; a
        failed one is answered with ``error_message`` and the stream goes on. Ends once the
        client has half-closed and every request is answered. At most ``STREAM_IN_FLIGHT``
        run at once: the next request is not read (so the transport gives the client no
        credit for more) until one is answered."""
        answers: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()  # None: the requests ended
        tasks: set[asyncio.Task[None]] = set()
        slots = asyncio.Semaphore(STREAM_IN_FLIGHT)  # read and not yet handed to the transport
        unanswered = 0

        async def one(request: pb.ModelInferRequest) -> None:
            try:
                response = pb.ModelStreamInferResponse(infer_response=await self.model_infer(request))
            except ApplianceError as exc:
                response = pb.ModelStreamInferResponse(error_message=exc.message)
            except Exception as exc:  # a bug here must not end the other requests' stream
                log.exception("unhandled error in ModelStreamInfer")
                response = pb.ModelStreamInferResponse(error_message=f"internal error: {type(exc).__name__}")
            answers.put_nowait(response)

        async def read() -> None:
            nonlocal unanswered
            try:
                async for request in requests:
                    await slots.acquire()
                    unanswered += 1
                    task = asyncio.get_running_loop().create_task(one(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
            finally:  # also when reading failed: the loop below ends, and ``await reader`` raises
                answers.put_nowait(None)

        reader = asyncio.get_running_loop().create_task(read())
        try:
            ended = False
            while not ended or unanswered:  # counted, not the task set: a task's answer comes before its end
                answer = await answers.get()
                if answer is None:
                    ended = True
                    continue
                unanswered -= 1
                yield answer
                slots.release()
            await reader  # its error, if reading failed
        finally:
            for task in (reader, *tasks):
                task.cancel()

    async def model_infer(self, request: pb.ModelInferRequest,
                          context: RequestContext = NO_CONTEXT) -> pb.ModelInferResponse:
        with observed(self.core.metrics, request.model_name, "v2_infer"):
            regions = self.service.regions
            inputs = _inputs(request, self.core.config.limits, regions)
            requested = [_requested(o, regions) for o in request.outputs] or None
            result = await self.service.infer(request.model_name, _grpc_version(request.model_version), inputs,
                                              requested, _parameters(request.parameters), context=context)
            response = pb.ModelInferResponse(model_name=result.model, model_version=str(result.version),
                                             id=request.id)
            for tensor, _ in result.outputs:
                response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.array.shape)
                # one entry per output, in order (Triton's): empty for one written into shared memory
                response.raw_output_contents.append(b"" if tensor.name in result.shared else codec.to_raw(tensor.array))
            return response


def _unary(name: str, request: type[Req], response: type[Resp], fn: Callable[[Req], Awaitable[Resp]]
           ) -> tuple[str, grpc.RpcMethodHandler]:
    """One unary method's handler: its messages' codecs, its errors as statuses, the caller set."""
    return name, grpc.unary_unary_rpc_method_handler(
        _with_caller(guarded(fn, name)), request_deserializer=request.FromString,
        response_serializer=response.SerializeToString)


def _unary_run(name: str, request: type[Req], response: type[Resp], fn: Callable[[Req, RequestContext], Awaitable[Resp]]
               ) -> tuple[str, grpc.RpcMethodHandler]:
    """``_unary`` for a method that runs a model: ``fn`` is given the call's ``RequestContext``."""
    return name, grpc.unary_unary_rpc_method_handler(
        _with_caller(guarded_run(fn, name)), request_deserializer=request.FromString,
        response_serializer=response.SerializeToString)


class _Unopenable(InvalidArgument):
    """A region whose key opens nothing: INTERNAL over gRPC, the code Triton answers (its qa
    checks it); still 400 over REST."""

    grpc_code = "INTERNAL"


def _grpc_version(text: str) -> int | None:
    return parse_version(text) if text else None


def _parameters(params: Mapping[str, pb.InferParameter]) -> Parameters:
    out: Parameters = {}
    for key, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, choice) if choice else None
    return out


def _repository_parameters(params: Mapping[str, pb.ModelRepositoryParameter]) -> RepositoryParameters:
    """A load's parameters: ``config`` (a string) and files (bytes) as Triton sends them."""
    out: RepositoryParameters = {}
    for key, value in params.items():
        choice = value.WhichOneof("parameter_choice")
        out[key] = getattr(value, choice) if choice else None
    return out


def _inputs(request: pb.ModelInferRequest, limits: LimitsConfig, regions: SharedMemory | None = None) -> list[Tensor]:
    """The request's tensors; every shape is checked, and the elements they declare counted
    against ``limits.max_tensor_elements``, before any array is built. Inputs in shared memory
    (their parameters name a region) take no raw_input_contents entry, as tritonclient sends them."""
    raw = request.raw_input_contents
    slices = [shm.named_slice(regions, _parameters(item.parameters), f"input '{item.name}'") if item.parameters
              else None for item in request.inputs]
    carried = sum(1 for piece in slices if piece is None)
    if raw and len(raw) != carried:
        raise InvalidArgument(f"raw_input_contents has {len(raw)} entries for {carried} inputs not in shared "
                              "memory; it needs one per such input, in input order")
    shapes = [_declared_shape(item) for item in request.inputs]
    codec.check_declared_elements([(item.name, shape) for item, shape in zip(request.inputs, shapes)], limits)
    tensors, next_raw = [], 0
    for item, shape, region in zip(request.inputs, shapes, slices):
        where = f"input '{item.name}'"
        has_contents = item.HasField("contents") and any(len(getattr(item.contents, f)) for f in _ALL_FIELDS)
        if region is not None:
            if has_contents:
                raise InvalidArgument(f"unexpected 'content' provided when using shared memory for input tensor "
                                      f"'{item.name}' for model '{request.model_name}'")
            array = shm.read_input(regions, region, item.datatype, shape)
        elif raw:
            if has_contents:
                raise InvalidArgument(f"{where} sets 'contents' while the request uses raw_input_contents; "
                                      "use one of the two for every input")
            array = codec.from_raw(memoryview(raw[next_raw]), item.datatype, shape, where)
            next_raw += 1
        else:
            array = _from_contents(item, shape, where)
        tensors.append(Tensor(item.name, array, item.datatype))
    return tensors


def _requested(output: pb.ModelInferRequest.InferRequestedOutputTensor, regions: SharedMemory | None) -> Requested:
    """One requested output; written into shared memory when its parameters name a region."""
    params = _parameters(output.parameters) if output.parameters else {}
    where = f"output '{output.name}'"
    return Requested(output.name, region=shm.named_slice(regions, params, where),
                     classification=classification.count(params.get("classification", 0), where))


def _declared_shape(item: pb.ModelInferRequest.InferInputTensor) -> tuple[int, ...]:
    """An input's datatype and shape checked; its shape."""
    where = f"input '{item.name}'"
    dtype = codec.dtype_of(item.datatype, where)
    if any(d < 0 for d in item.shape):
        raise InvalidArgument(f"{where}: 'shape' must be non-negative integers, got {list(item.shape)}")
    shape = codec.check_shape(list(item.shape), where)
    codec.check_overflow(shape, dtype, item.datatype, where)
    return shape


def _from_contents(item: pb.ModelInferRequest.InferInputTensor, shape: tuple[int, ...], where: str) -> np.ndarray:
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
