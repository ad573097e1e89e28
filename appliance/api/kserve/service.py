"""The Open Inference Protocol (KServe v2) on numpy: health, metadata and infer, shared by
the REST face (appliance/api/kserve/rest.py) and the gRPC face (grpc_service.py).

Requests go through the same model manager, version policy, batcher, rollouts and metrics
as TF Serving's ``/v1`` API: an infer call takes a handle with ``manager.handle`` and runs
``handle.run``, so v2 and v1 requests to one model share batches. A model's v2 inputs and
outputs are those of its ``serving_default`` signature (else of the first signature by
name, as model metadata says); a request picks another with the request parameter
``signature_name``. Stateless; every method may be called from any thread.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, NotRequired, TypedDict

import numpy as np

from runtimes import DEFAULT_SIGNATURE, SignatureInfo, TensorSpec

from appliance.version import __version__
from appliance.api.kserve import classification, codec, shared_memory
from appliance.core.errors import InvalidArgument, NotFound, Unavailable
from appliance.core.handle import shape_error
from appliance.core.policy import State
from appliance.core.request_context import NO_CONTEXT, RequestContext
from appliance.core.seams import ModelHandle, ModelStates, RouteKey, ServingCore
from appliance.core.shared_memory import SharedMemory, Slice

if TYPE_CHECKING:
    from appliance.api.json_arrays import Parsed
    from appliance.core.appliance import Appliance

SERVER_NAME = "edge-appliance"
EXTENSIONS = ("binary_tensor_data", "classification", "model_configuration", "model_repository", "statistics",
              "parameters")  # Triton's names of what this server answers (appliance/api/kserve/extensions.py)
SHARED_MEMORY = "system_shared_memory"  # while [shared_memory] enabled
SEQUENCE_PARAMETERS = ("sequence_id", "sequence_start", "sequence_end")  # Triton's sequence batcher's


class ServerMetadata(TypedDict):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(TypedDict):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(TypedDict):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]
    parameters: NotRequired[dict[str, str]]  # not in the spec: which signatures a client may name


@dataclass
class Tensor:
    """One named tensor of a request or response, already decoded."""

    name: str
    array: np.ndarray
    datatype: str


@dataclass
class Requested:
    """One output a request asks for; ``binary`` None means the request-wide default;
    ``region``: the shared-memory bytes it goes to (appliance/api/kserve/shared_memory.py)."""

    name: str
    binary: bool | None = None
    region: Slice | None = None
    classification: int = 0  # Triton's classification extension: the top N classes, as BYTES


@dataclass
class InferResult:
    model: str
    version: int
    outputs: list[tuple[Tensor, bool]]  # (tensor, as binary)
    shared: frozenset[str] = frozenset()  # outputs written into shared memory: answered without their data


class V2Service:
    """Health, metadata and inference of the v2 protocol on numpy arrays.

    ``states`` and ``ready`` are the serving process's (model status, readiness); a front
    worker answers inference only (appliance/fronts/), and forwards the rest.
    Thread-safety: every method may be called from any thread or loop (the core's seams are
    thread-safe; this class holds no state of its own).
    """

    def __init__(self, core: ServingCore, states: ModelStates | None = None,
                 ready: Callable[[], bool] | None = None, regions: SharedMemory | None = None):
        """``regions``: the shared-memory regions apps registered (the serving process's;
        appliance/core/shared_memory.py)."""
        self.core, self.states, self._ready, self.regions = core, states, ready, regions

    @classmethod
    def serving(cls, core: "Appliance") -> "V2Service":
        """The service of the process that holds the versions and the shared-memory regions:
        what its REST app, its gRPC port, and the REST requests and gRPC calls a front worker
        forwards to it (appliance/fronts/serving.py) all answer with, so a call answers the
        same whichever process it reached first."""
        return cls(core, core.states, core.ready, core.shared_memory)

    # -- health and metadata --------------------------------------------------------------
    def live(self) -> bool:
        return True  # answered at all: the server process is up

    def ready(self) -> bool:
        return self._ready is not None and self._ready()

    def model_ready(self, name: str, version: int | None) -> bool:
        with triton_words(name, version):  # NotFound for an unknown model/version
            slots = self._states().version_states(name, version)
        return any(s.state == State.AVAILABLE for s in slots)

    def server_metadata(self) -> ServerMetadata:
        shm = [SHARED_MEMORY] if self.regions is not None and self.regions.enabled else []
        name = self.core.config.kserve.server_id or SERVER_NAME
        return {"name": name, "version": __version__, "extensions": [*EXTENSIONS, *shm]}

    async def model_metadata(self, name: str, version: int | None) -> ModelMetadata:
        with triton_words(name, version):
            states = self._states().version_states(name)
            held_handle = await self.core.handles.handle(name, version)
        versions = [str(s.version) for s in sorted(states, key=lambda s: s.version) if s.state == State.AVAILABLE]
        with held_handle as held:
            signatures = dict(held.signatures)
            signature = default_signature(held)
            platform = held.platform
        body: ModelMetadata = {
            "name": name, "versions": versions, "platform": platform,
            "inputs": [_tensor_metadata(k, v) for k, v in signature.inputs.items()],
            "outputs": [_tensor_metadata(k, v) for k, v in signature.outputs.items()],
        }
        if len(signatures) > 1:  # not in the spec; tells a client which signatures it may name
            body["parameters"] = {"signature_name": signature.name, "signatures": ",".join(sorted(signatures))}
        return body

    def _states(self) -> ModelStates:
        if self.states is None:
            raise Unavailable("model status is answered by the serving process")
        return self.states

    # -- inference ------------------------------------------------------------------------
    async def raw_input(self, name: str, version: int | None, body: bytes) -> Tensor:
        """Triton's raw binary request (``Inference-Header-Content-Length: 0``): the whole body
        is the model's one input, its datatype the signature's, its shape what the body's size
        makes of the signature's shape (one unknown dimension; with a leading batch dimension
        and one more unknown, a batch of one, as Triton does); a BYTES input must take one
        element (shape [1], or [-1, 1] with a batch dimension): the body is that element."""
        with triton_words(name, version):
            held_handle = await self.core.handles.handle(name, version)
        with held_handle as held:
            signature = default_signature(held)
        if len(signature.inputs) != 1:
            raise InvalidArgument(f"Raw request must only have 1 input (found 1) to be deduced but got "
                                  f"{len(signature.inputs)} inputs in '{name}' model configuration")
        (input_name, spec), = signature.inputs.items()
        datatype = codec.datatype_of(spec.dtype)
        return Tensor(input_name, codec.raw_body_tensor(body, datatype, spec.shape, input_name), datatype)

    async def infer(self, name: str, version: int | None, inputs: list[Tensor], requested: list[Requested] | None,
                    parameters: Mapping[str, Parsed], binary_default: bool = False,
                    route_key: RouteKey | None = None, context: RequestContext = NO_CONTEXT) -> InferResult:
        """Check the decoded inputs against the signature, run them through the batcher and
        pick the requested outputs (all of them, in signature order, when none is named);
        ``context``: the request's (appliance/core/request_context.py)."""
        sequence = [k for k in SEQUENCE_PARAMETERS if k in parameters]
        if sequence:  # a stateful (sequence) model would need them; none here keeps state
            raise InvalidArgument(f"inference request to model '{name}' sets {', '.join(sequence)}, but the model "
                                  "is not a sequence model (it keeps no state between requests); send it without them")
        signature_name = parameters.get("signature_name")
        if signature_name is not None and not isinstance(signature_name, str):
            raise InvalidArgument("parameter 'signature_name' must be a string")
        with triton_words(name, version):
            held_handle = await self.core.handles.handle(name, version, None, route_key)
        with held_handle as held:
            signature = (_named_signature(held, name, signature_name) if signature_name
                         else default_signature(held))
            feeds = _feeds(signature, inputs, name)
            wanted = _wanted(signature, requested, name)
            outputs = await held.run(signature.name, feeds, context)
            served, path = held.version, held.path
        result = []
        for want in wanted:
            arr = outputs[want.name]
            if want.classification:
                arr = classification.top(arr, want.classification, classification.labels(path), want.name)
            if want.region is not None:
                shared_memory.write_output(self.regions, want.region, arr, want.name)
            result.append((Tensor(want.name, arr, codec.datatype_of(arr.dtype)),
                           binary_default if want.binary is None else want.binary))
        shared = frozenset(w.name for w in wanted if w.region is not None)
        return InferResult(name, served, result, shared)


@contextmanager
def triton_words(name: str, version: int | None) -> Iterator[None]:
    """An unknown model or version in Triton's words, which Triton's clients and tests look
    for (Triton core's model_repository_manager.cc), where the core speaks TF Serving's."""
    try:
        yield
    except NotFound as exc:
        at = "" if version is None else f" version {version}"
        why = exc.message.partition("; ")[2]  # the core's reason, when it gave one (quarantined...)
        raise NotFound(f"Request for unknown model: '{name}'{at} is not found" + (f"; {why}" if why else "")) from exc


def default_signature(held: ModelHandle) -> SignatureInfo:
    """serving_default, else the first signature by name: what model metadata describes, so
    a client that builds its request from the metadata is always answered."""
    signatures = held.signatures
    if DEFAULT_SIGNATURE in signatures:
        return signatures[DEFAULT_SIGNATURE]
    if not signatures:
        raise InvalidArgument(f"{held.model} version {held.version} has no signatures")
    return signatures[sorted(signatures)[0]]


def _named_signature(held: ModelHandle, model: str, name: str) -> SignatureInfo:
    signatures = held.signatures
    if name not in signatures:
        raise InvalidArgument(f"model '{model}' has no signature '{name}'; it has {', '.join(sorted(signatures))}")
    return signatures[name]


def _tensor_metadata(name: str, spec: TensorSpec) -> TensorMetadata:
    shape = [-1] if spec.shape is None else [-1 if d is None else int(d) for d in spec.shape]
    return {"name": name, "datatype": codec.datatype_of(spec.dtype), "shape": shape}


def _feeds(signature: SignatureInfo, inputs: list[Tensor], model: str) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {}
    for tensor in inputs:
        spec = signature.inputs.get(tensor.name)
        if spec is None:
            raise InvalidArgument(f"unexpected inference input '{tensor.name}' for model '{model}'; "
                                  f"signature '{signature.name}' takes {', '.join(signature.inputs)}")
        if tensor.name in feeds:
            raise InvalidArgument(f"input '{tensor.name}' is given twice")
        want = codec.datatype_of(spec.dtype)
        if tensor.datatype != want:
            raise InvalidArgument(f"inference input '{tensor.name}' data-type is '{tensor.datatype}', "
                                  f"but model '{model}' expects '{want}'")
        problem = shape_error(tensor.array, spec, f"input '{tensor.name}'")
        if problem:
            raise InvalidArgument(f"{problem} for model '{model}'")
        feeds[tensor.name] = tensor.array
    missing = [k for k in signature.inputs if k not in feeds]
    if missing:
        raise InvalidArgument(f"model '{model}' (signature '{signature.name}') needs input '{missing[0]}', "
                              "which the request lacks")
    return feeds


def _wanted(signature: SignatureInfo, requested: list[Requested] | None, model: str) -> list[Requested]:
    if not requested:
        return [Requested(k) for k in signature.outputs]
    seen = set()
    for want in requested:
        if want.name not in signature.outputs:
            raise InvalidArgument(f"unexpected inference output '{want.name}' for model '{model}'; "
                                  f"signature '{signature.name}' has {', '.join(signature.outputs)}")
        if want.name in seen:
            raise InvalidArgument(f"output '{want.name}' already exists in request")  # Triton's words
        seen.add(want.name)
    return requested
