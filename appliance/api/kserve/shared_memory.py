"""Triton's shared-memory extensions of the Open Inference Protocol, as tritonclient speaks them:
``tritonclient.utils.shared_memory`` creates a region, ``register_system_shared_memory``
registers it here, and inputs and outputs name it in their parameters instead of carrying data.

REST (Triton's http_server.cc), every answer JSON, errors ``{"error": ...}``:

    GET  /v2/systemsharedmemory[/region/{name}]/status   -> [{"name", "key", "offset", "byte_size"}]
    POST /v2/systemsharedmemory/region/{name}/register   {"key", "offset", "byte_size"} -> 200
    POST /v2/systemsharedmemory[/region/{name}]/unregister                                -> 200
    ... and the same under /v2/cudasharedmemory ({"raw_handle": {"b64"}, "device_id", "byte_size"})

gRPC: ``SystemSharedMemory{Status,Register,Unregister}`` and ``CudaSharedMemory*`` of
``inference.GRPCInferenceService`` (appliance/api/kserve/grpc_service.py registers them).

In inference, an input with ``shared_memory_region`` (and ``shared_memory_byte_size``,
``shared_memory_offset``, default 0) is read from the region into the request's array (one
copy: ``SharedMemory.read_into``), checked as strictly as binary data against its shape and
datatype; an output with them is written straight into the region after the model ran, and
the answer describes it (name, datatype, shape) without its data. The registry and its checks
are appliance/core/shared_memory.py's; every bad region is a 400 naming it.

CUDA shared memory: the same endpoints, answering that this device has no CUDA support
(``register`` 400 naming what is missing, ``status`` an empty list); the interface a GPU
build fills in is ``CudaSharedMemory`` below.

Registration needs the inference token (the ``/v2/`` mount and gRPC's interceptor). And every
use of a region (status, register, unregister, an infer request naming one) is answered only for
a caller on this host: a loopback peer or the Unix socket (``CALLER``, set by the REST and gRPC
adapters from the connection's peer, and carried with a request a front worker forwards); any
other gets 403 / PERMISSION_DENIED, unless ``[shared_memory] allow_remote``. A remote peer cannot
share this host's memory anyway: what it could do is name objects the service can open.
"""

from __future__ import annotations

import base64
import contextvars
import ipaddress
import re
from typing import TYPE_CHECKING, Mapping, TypedDict, TypeVar
from urllib.parse import unquote

import numpy as np
import orjson

from appliance.api.kserve import codec
from appliance.core.errors import InvalidArgument, MethodNotAllowed, NotFound, PermissionDenied
from appliance.core.json_types import JSONObject, JSONValue
from appliance.core.shared_memory import SharedMemory, Slice

if TYPE_CHECKING:  # the REST face imports this module: no protobuf for an annotation
    from appliance.protos.kserve import pb


SYSTEM, CUDA = "systemsharedmemory", "cudasharedmemory"
REGION = "shared_memory_region"
BYTE_SIZE, OFFSET = "shared_memory_byte_size", "shared_memory_offset"
ACTIONS = ("status", "register", "unregister")
Response = tuple[int, bytes, list[tuple[str, str]]]
_JSON = [("Content-Type", "application/json")]


_NAMES_A_REGION = re.compile(rb"shared_memory_region")


def uses_shared_memory(body: bytes | bytearray | memoryview) -> bool:
    """Whether an infer request (a v2 JSON body, or a ModelInferRequest's bytes) names a region:
    what a front worker forwards to the serving process, where the registry is. Searches the
    buffer in place (a large body is never copied); a false positive is only forwarded."""
    return _NAMES_A_REGION.search(body) is not None


def message_names_a_region(request: pb.ModelInferRequest) -> bool:
    """``uses_shared_memory`` for a parsed ModelInferRequest."""
    return any(REGION in t.parameters for t in (*request.inputs, *request.outputs))


# The peer of the request being answered: an address ("127.0.0.1", "::1", gRPC's "ipv4:1.2.3.4:5"),
# "unix:..." for the Unix socket; None or "": no adapter said (refused: who it is is unknown).
CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("shared_memory_caller", default=None)


def registry(regions: SharedMemory | None) -> SharedMemory:
    """The serving process's regions, for a caller allowed to use them (module docstring); a
    process without them (a front worker) never gets here: it forwards every request that names a
    region."""
    if regions is None:
        raise InvalidArgument("shared memory is served by the serving process; this request reached a process "
                              "without the registry")
    caller = CALLER.get()
    if not same_host(caller) and not getattr(regions.settings(), "allow_remote", False):
        raise PermissionDenied(f"shared memory is for callers on this device (a loopback address or the Unix "
                               f"socket); this request came from {str(caller)[:80]} ([shared_memory] allow_remote)")
    return regions


def same_host(peer: str | None) -> bool:
    """Whether ``peer`` (a REST ``REMOTE_ADDR`` or a gRPC peer string) is on this host."""
    if not peer:  # no adapter said, or a peer with no address: unknown, so not this host
        return False
    if peer.startswith("unix:"):
        return True
    host = peer
    if host.startswith(("ipv4:", "ipv6:")):  # gRPC's: the port follows the last colon
        host = unquote(host[5:]).rsplit(":", 1)[0]  # grpcio >= 1.48 writes ipv6:%5B::1%5D:port
    host = host.strip("[]").split("%", 1)[0]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return bool((mapped or address).is_loopback)


class CudaRegionStatus(TypedDict):
    """A CUDA region as Triton's status lists it."""

    name: str
    device_id: int
    byte_size: int


class CudaSharedMemory:
    """CUDA IPC regions: what a GPU build implements (cudaIpcOpenMemHandle on ``raw_handle``,
    cudaMemcpy in and out of the batch, cudaIpcCloseMemHandle on unregister). Here: none."""

    MISSING = ("CUDA shared memory is not supported on this device: it needs an NVIDIA GPU, its driver and a "
               "CUDA runtime (libcudart), and this build has no CUDA IPC support; use system shared memory")

    def check_supported(self, name: str) -> None:
        """Before the request's fields are read: what a device without CUDA answers every register."""
        raise InvalidArgument(f"failed to register CUDA shared memory region '{name}': {self.MISSING}")

    def register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        if not name or not raw_handle or not byte_size:  # Triton's words for these (its qa checks them)
            raise InvalidArgument(f"failed to register shared memory region '{name}': invalid args (a region name, "
                                  "a raw_handle and a byte_size are needed)")
        self.check_supported(name)

    def status(self, name: str | None) -> list[CudaRegionStatus]:
        if name:
            raise NotFound(f"Unable to find cuda shared memory region: '{name}'")
        return []

    def unregister(self, name: str | None) -> None:
        """Nothing is ever registered: nothing to do (Triton answers an unknown name the same)."""


CUDA_REGIONS = CudaSharedMemory()


# -- REST ----------------------------------------------------------------------------------------
def route(parts: list[str]) -> tuple[str, str, str] | None:
    """(kind, region name or "", action) of /v2/<kind>[/region/<name>]/<action>, split after
    "v2"; None when the path is not one of these endpoints."""
    if not parts or parts[0] not in (SYSTEM, CUDA) or parts[-1] not in ACTIONS:
        return None
    middle = parts[1:-1]
    if middle == []:
        return parts[0], "", parts[-1]
    if len(middle) == 2 and middle[0] == "region" and middle[1]:
        return parts[0], unquote(middle[1]), parts[-1]
    return None


def answer(regions: SharedMemory | None, kind: str, name: str, action: str, method: str, body: bytes) -> Response:
    """One shared-memory request over REST (the module docstring's table)."""
    if action == "status" and method != "GET" or action != "status" and method != "POST":
        raise MethodNotAllowed(f"Method Not Allowed: {method} on {kind} {action}")
    if action == "status":
        listed = registry(regions).status(name or None) if kind == SYSTEM else CUDA_REGIONS.status(name or None)
        return 200, orjson.dumps(listed), _JSON
    if action == "unregister":
        (registry(regions) if kind == SYSTEM else CUDA_REGIONS).unregister(name or None)
        return 200, b"", _JSON
    if not name:
        raise InvalidArgument(f"'region name' is necessary to register {'system' if kind == SYSTEM else 'cuda'} "
                              "shared memory region")
    request = _register_body(body)
    if kind == SYSTEM:
        registry(regions).register(name, _field(request, "key", str), _field(request, "offset", int, 0),
                                _field(request, "byte_size", int))
    else:
        CUDA_REGIONS.check_supported(name)
        CUDA_REGIONS.register(name, _raw_handle(request), _field(request, "device_id", int, 0),
                              _field(request, "byte_size", int))
    return 200, b"", _JSON


def _register_body(body: bytes) -> JSONObject:
    try:
        value: JSONValue = orjson.loads(body) if body.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"the shared memory register request is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument("the shared memory register request must be a JSON object")
    return value


_MISSING = object()
Field = TypeVar("Field", int, str)


def _field(request: Mapping[str, JSONValue], key: str, kind: type[Field], default: Field | object = _MISSING) -> Field:
    value = request.get(key, default)
    if value is _MISSING:
        raise InvalidArgument(f"Shared memory register request has no '{key}' field")
    if type(value) is not kind or not isinstance(value, kind) or (isinstance(value, int) and value < 0):
        raise InvalidArgument(f"Shared memory register request: '{key}' must be a "
                              f"{'non-negative integer' if kind is int else 'string'}, got {value!r}")
    return value


def _raw_handle(request: Mapping[str, JSONValue]) -> bytes:
    handle = request.get("raw_handle")
    text = handle.get("b64") if isinstance(handle, dict) else None
    if not isinstance(text, str):
        raise InvalidArgument("Shared memory register request has no 'raw_handle' field ({\"b64\": ...})")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise InvalidArgument(f"'raw_handle' is not base64: {exc}") from None


# -- inference (REST and gRPC alike) --------------------------------------------------------------
def named_slice(regions: SharedMemory | None, params: Mapping[str, object], where: str, required_size: bool = True) -> Slice | None:
    """The region bytes a tensor's parameters name; None when they name none."""
    if REGION not in params:
        if BYTE_SIZE in params or OFFSET in params:
            raise InvalidArgument(f"{where}: '{BYTE_SIZE}' and '{OFFSET}' need '{REGION}'")
        return None
    if BYTE_SIZE not in params:
        raise InvalidArgument(f"{where}: '{REGION}' needs '{BYTE_SIZE}'")
    return registry(regions).slice(params[REGION], params.get(OFFSET, 0), params[BYTE_SIZE], where)


def read_input(regions: SharedMemory | None, piece: Slice, datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    """An input tensor from its region: its size checked against shape and datatype first, then
    one copy into the array (BYTES elements parsed from it as binary data is)."""
    codec.check_binary_size(piece.byte_size, datatype, shape, piece.where)
    raw = np.empty(piece.byte_size, np.uint8)
    registry(regions).read_into(piece, raw.data)
    return codec.from_raw(raw.data, datatype, shape, piece.where)


def write_output(regions: SharedMemory | None, piece: Slice, array: np.ndarray, name: str) -> None:
    """An output tensor straight into its region: refused when the region's slice is smaller."""
    data = codec.raw_view(array)
    if len(data) > piece.byte_size:
        raise InvalidArgument(f"shared memory size specified with the request for output '{name}' "
                              f"({piece.byte_size} bytes) should be at least {len(data)} bytes to hold the results")
    registry(regions).write(piece, data)


# -- OpenAPI (merged into /openapi.json with the rest of the v2 REST API) -----------------------------
def _openapi_paths() -> JSONObject:
    error: JSONObject = {"description": "error", "content": {"application/json": {"schema": {
        "type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}}}}
    name: JSONObject = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    listed: JSONObject = {"description": "the regions", "content": {"application/json": {"schema": {"type": "array", "items": {
        "type": "object"}}}}}
    done: JSONObject = {"description": "done (empty body)"}
    register: JSONObject = {"required": True, "content": {"application/json": {"schema": {"type": "object", "properties": {
        "key": {"type": "string"}, "offset": {"type": "integer", "minimum": 0},
        "byte_size": {"type": "integer", "minimum": 1}}, "required": ["key", "byte_size"]}}}}
    paths: JSONObject = {}
    for kind, what in ((SYSTEM, "system (POSIX)"), (CUDA, "CUDA")):
        base = f"/v2/{kind}"
        paths[f"{base}/status"] = {"get": {"summary": f"Triton's {what} shared-memory regions",
                                           "responses": {"200": listed, "400": error}}}
        paths[f"{base}/unregister"] = {"post": {"summary": f"unregister every {what} shared-memory region",
                                                "responses": {"200": done, "400": error}}}
        paths[f"{base}/region/{{name}}/status"] = {"get": {"summary": f"one {what} shared-memory region",
                                                           "parameters": [name],
                                                           "responses": {"200": listed, "400": error, "404": error}}}
        paths[f"{base}/region/{{name}}/register"] = {"post": {
            "summary": f"register a {what} shared-memory region (key, offset, byte_size)", "parameters": [name],
            "requestBody": register, "responses": {"200": done, "400": error}}}
        paths[f"{base}/region/{{name}}/unregister"] = {"post": {
            "summary": f"unregister a {what} shared-memory region", "parameters": [name],
            "responses": {"200": done, "400": error}}}
    return paths


OPENAPI_PATHS: JSONObject = _openapi_paths()
