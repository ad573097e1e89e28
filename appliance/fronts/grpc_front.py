"""A front worker's gRPC port: the inference methods answered here, the rest forwarded.

The gRPC port is served by the front workers too (SO_REUSEPORT, as the REST port):
TF Serving's Predict, Classify, Regress and MultiInference and KServe v2's ModelInfer run the
API families' own gRPC code on the worker's ``RemoteCore`` (protobuf decode and encode, and
HTTP/2 framing, on the worker's core; the model in the serving process), with the same token
check as an interceptor. Every other method (model status and metadata, health, reload,
repository) goes whole to the serving process, which runs its own handler for it and
answers, so what those report is always the serving process's state.

``FrontGRPC`` is the generic handler.
"""

from __future__ import annotations

import grpc

from appliance.api.kserve.grpc_service import SERVICE_NAME, STREAM, V2GRPC
from appliance.fronts import messages as m
from appliance.api.kserve.service import V2Service
from appliance.api.tfserving.grpc_service import PREDICTION_SERVICE, TFServingGRPC
from appliance.fronts.link import Link
from appliance.fronts.remote import RemoteCore
from appliance.protos.kserve import pb

INFER = f"/{SERVICE_NAME}/ModelInfer"
STREAMING = f"/{SERVICE_NAME}/{STREAM}"
HOT = frozenset({f"/{PREDICTION_SERVICE}/Predict", f"/{PREDICTION_SERVICE}/Classify",
                 f"/{PREDICTION_SERVICE}/Regress", f"/{PREDICTION_SERVICE}/MultiInference", INFER})


class FrontGRPC(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc is untyped: its base class is Any
    def __init__(self, core: RemoteCore):
        self.link = core.link
        self.local = [*TFServingGRPC(core).handlers(), V2GRPC(V2Service(core)).handler()]
        self._cache: dict[str, grpc.RpcMethodHandler | None] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = details.method
        handler = self._cache.get(method)
        if handler is None:
            local = method in HOT or method == STREAMING  # a stream is never forwarded as one message
            handler = self._cache[method] = self._hot(details) if local else _forwarding(method, self.link)
        return handler

    def _hot(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        for generic in self.local:
            handler = generic.service(details)
            if handler is not None:
                if details.method == INFER:
                    return _regions_forwarded(handler, self.link)
                return handler
        return None


def _regions_forwarded(handler: grpc.RpcMethodHandler, link: Link) -> grpc.RpcMethodHandler:
    """ModelInfer answered here, except a request naming a shared-memory region: the serving
    process, which holds the regions, answers it (appliance/api/kserve/shared_memory.py), as
    it answers the shared-memory RPCs themselves (forwarded whole, ``_forwarding``). Such a
    request carries no tensor, so passing it on whole costs little."""
    from appliance.api.kserve.shared_memory import message_names_a_region

    fn = handler.unary_unary

    async def call(request: pb.ModelInferRequest,  # V2GRPC's ModelInfer is a coroutine
                   context: grpc.aio.ServicerContext) -> object:  # object: handed to the response serializer
        if not message_names_a_region(request):
            return await fn(request, context)
        return pb.ModelInferResponse.FromString(await _forward(INFER, request.SerializeToString(), context, link))
    return grpc.unary_unary_rpc_method_handler(call, request_deserializer=handler.request_deserializer,
                                               response_serializer=handler.response_serializer)


def _forwarding(method: str, link: Link) -> grpc.RpcMethodHandler:
    """A handler of raw bytes: the call answered by the serving process's own handler."""
    async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return await _forward(method, request, context, link)
    return grpc.unary_unary_rpc_method_handler(call)


async def _forward(method: str, request: bytes, context: grpc.aio.ServicerContext, link: Link) -> bytes:
    """The serving process's answer to a call (appliance/fronts/serving.py ``_grpc``): its
    response's bytes, or its status and trailing metadata given to this call."""
    reply = await link.call(m.GrpcCall(link.next_id(), method, request, m.metadata(context.invocation_metadata()),
                                       context.time_remaining(), context.peer()))
    if isinstance(reply, m.GrpcDone):
        return reply.response
    if isinstance(reply, m.GrpcStatus):
        context.set_trailing_metadata(m.pairs(reply.trailing))
        context.abort(grpc.StatusCode[reply.code], reply.details)
    context.abort(grpc.StatusCode.UNAVAILABLE, m.unexpected(reply).message)
    raise AssertionError("context.abort returns only by raising")
