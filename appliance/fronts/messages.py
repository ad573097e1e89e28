"""The messages between front workers and the serving process, each a declared struct
(what appliance/transport/channel.py sends: msgspec ``Struct``s, decoded for the union each
side receives, so a field renamed, added or dropped on one side fails loudly on the other;
numeric arrays travel out of band; never pickles).

A request carries its ``id``; every reply carries the request's. Worker -> serving
(``ToServing``):

- ``Run``: one ``handle.run``; replied ``Ran`` (version, outputs) or ``Failed``.
- ``Resolve``: (model, version, label) the serving view cannot answer; replied ``Resolved``
  with the ``VersionView`` the manager picks, or ``Failed`` with the manager's error.
- ``Forward``: (environ, body) of an HTTP request the worker forwards; replied ``Answer``
  for a whole answer, or ``Start``, ``Chunk``..., ``End`` for a stream. ``Cancel``: the
  client went away; the stream is closed.
- ``GrpcCall``: a gRPC call the worker forwards, with its client's peer (who may use shared
  memory is judged by it); replied ``GrpcDone`` (the response's
  bytes) or ``GrpcStatus`` (code name, details, trailing metadata).
- ``Observe``: request metrics, one message per loop tick, sent before the answers of that
  tick leave.
- ``Stats``: the worker's HTTP figures and memory, every second.

Serving -> worker (``ToWorker``): the replies above, and the pushes ``ViewPush`` (a
``ServingView``), ``ConfigPush`` (a ``Config``, at start and after a reload) and ``Drain``
(timeout seconds: stop accepting, finish, exit). ``Eof`` is what a worker's link hears when
the serving process is gone; it never crosses.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Union

import msgspec
import numpy as np

from runtimes import SignatureInfo, TensorSpec

from appliance.core import config as config_mod
from appliance.core import errors
from appliance.core.config import Config
from appliance.fronts.view import ModelView, ServingView, VersionView



class Message(msgspec.Struct, tag_field="k", forbid_unknown_fields=True):
    """Every message: tagged with its kind (the class's ``tag``)."""


class Tensor(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    name: str
    dtype: str  # numpy's dtype.str, "O" for strings
    shape: list[int] | None
    tensor_name: str


class Signature(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    name: str
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]
    method_name: str


class Version(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    version: int
    path: str
    platform: str
    reads_examples: bool
    signatures: dict[str, Signature]


class Model(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    labels: dict[str, int]
    versions: list[Version]
    serving: int | None
    route_headers: list[str]


class Metadata(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """gRPC metadata: text entries, and binary ones (a "-bin" key's value is bytes; msgspec
    takes no union of str and bytes). Each key's entries keep their order."""

    text: list[tuple[str, str]]
    binary: list[tuple[str, bytes]]


def metadata(pairs: Iterable[tuple[str, str | bytes]]) -> Metadata:
    text: list[tuple[str, str]] = []
    binary: list[tuple[str, bytes]] = []
    for key, value in pairs:
        if isinstance(value, bytes):
            binary.append((key, value))
        else:
            text.append((key, value))
    return Metadata(text, binary)


def pairs(data: Metadata) -> list[tuple[str, str | bytes]]:
    return [*data.text, *data.binary]


class Observation(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One request's metrics, as ``RequestMetrics.observe_request`` takes them."""

    model: str
    api: str
    status: int | str
    seconds: float
    entrypoint: str


# -- worker -> serving -------------------------------------------------------------------------------
class Run(Message, tag="run"):
    """One ``handle.run``: the request as the client named the version, the signature, the
    inputs, and the version they were decoded for."""

    id: int
    model: str
    version: int | None
    label: str | None
    route_headers: dict[str, str | None]
    signature: str
    inputs: dict[str, np.ndarray]
    decoded_version: int


class Resolve(Message, tag="resolve"):
    id: int
    model: str
    version: int | None
    label: str | None


class Forward(Message, tag="forward"):
    id: int
    environ: dict[str, str]  # the text values of a WSGI environ (``plain_environ``)
    body: bytes


class GrpcCall(Message, tag="grpc"):
    id: int
    method: str
    request: bytes
    metadata: Metadata
    seconds_left: float | None
    peer: str  # the worker's client, as grpc's context.peer() names it


class Cancel(Message, tag="cancel"):
    stream: int  # the id of the ``Forward``, ``Run`` or ``GrpcCall`` whose client went away


class Observe(Message, tag="observe"):
    observations: list[Observation]


Figure = int | float | bool | str | None  # a server's counter or setting (``initial_stats``)


class Stats(Message, tag="stats"):
    pid: int
    rss_bytes: int
    http: dict[str, Figure]  # the HTTP server's counters and settings, by name
    served: int
    imported: list[str]  # which of the heavy modules it holds
    grpc: dict[str, int] | None = None  # the gRPC port's counters


# -- serving -> worker ------------------------------------------------------------------------------
class Ran(Message, tag="ran"):
    id: int
    version: int
    outputs: dict[str, np.ndarray]


class Resolved(Message, tag="resolved"):
    id: int
    version: Version


class Failed(Message, tag="failed"):
    """An error: its class in appliance/core/errors.py, message and retry_after."""

    id: int
    error: str
    message: str
    retry_after: float | None


class Answer(Message, tag="answer"):
    id: int
    status: str
    headers: list[tuple[str, str]]
    body: bytes


class Start(Message, tag="start"):
    id: int
    status: str
    headers: list[tuple[str, str]]


class Chunk(Message, tag="chunk"):
    id: int
    data: bytes


class End(Message, tag="end"):
    id: int


class GrpcDone(Message, tag="grpc-done"):
    id: int
    response: bytes


class GrpcStatus(Message, tag="grpc-status"):
    id: int
    code: str  # a grpc.StatusCode's name
    details: str
    trailing: Metadata


class ViewPush(Message, tag="view"):
    generation: int
    models: dict[str, Model]


class ConfigPush(Message, tag="config"):
    config: dict[str, Any]  # dataclasses.asdict of a Config: checked by config.from_dict, key by key


class Drain(Message, tag="drain"):
    timeout: float


class Eof(Message, tag="eof"):
    """(never sent) The serving process is gone."""


ToServing = Union[Run, Resolve, Forward, GrpcCall, Cancel, Observe, Stats]
Request = Union[Run, Resolve, Forward, GrpcCall]  # what asks for replies (it carries their id)
Reply = Union[Ran, Resolved, Failed, Answer, Start, Chunk, End, GrpcDone, GrpcStatus]
Push = Union[ViewPush, ConfigPush, Drain, Eof]
ToWorker = Union[Ran, Resolved, Failed, Answer, Start, Chunk, End, GrpcDone, GrpcStatus, ViewPush, ConfigPush, Drain]
REPLIES = (Ran, Resolved, Failed, Answer, Start, Chunk, End, GrpcDone, GrpcStatus)
LAST_REPLIES = (End, Failed, Answer)  # what ends a stream's replies


# -- errors ------------------------------------------------------------------------------------
def failed(ident: int, exc: BaseException) -> Failed:
    """An error as a reply; a foreign one becomes a 500's text."""
    if isinstance(exc, errors.ApplianceError):
        return Failed(ident, type(exc).__name__, exc.message, exc.retry_after)
    return Failed(ident, "ApplianceError", f"{type(exc).__name__}: {exc}", None)


def error_of(reply: Failed) -> errors.ApplianceError:
    cls = getattr(errors, reply.error, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ApplianceError)):
        cls = errors.ApplianceError
    exc = cls.__new__(cls)
    errors.ApplianceError.__init__(exc, reply.message)
    exc.retry_after = reply.retry_after
    if isinstance(exc, errors.ConfigError):
        exc.key = ""
    return exc


def unexpected(reply: Reply) -> errors.ApplianceError:
    """The error a reply stands for: its own if ``Failed``, else a reply of the wrong kind."""
    if isinstance(reply, Failed):
        return error_of(reply)
    return errors.ApplianceError(f"the serving process replied {type(reply).__name__} out of turn")


# -- the serving view ----------------------------------------------------------------------------
def _tensor(spec: TensorSpec) -> Tensor:
    return Tensor(spec.name, spec.dtype.str if spec.dtype.kind != "O" else "O",
                  None if spec.shape is None else list(spec.shape), spec.tensor_name)


def _spec(data: Tensor) -> TensorSpec:
    dtype = np.dtype(object if data.dtype == "O" else data.dtype)
    return TensorSpec(data.name, dtype, None if data.shape is None else tuple(data.shape), data.tensor_name)


def _signature(sig: SignatureInfo) -> Signature:
    return Signature(sig.name, {k: _tensor(v) for k, v in sig.inputs.items()},
                     {k: _tensor(v) for k, v in sig.outputs.items()}, sig.method_name)


def _signature_info(data: Signature) -> SignatureInfo:
    return SignatureInfo(data.name, {k: _spec(v) for k, v in data.inputs.items()},
                         {k: _spec(v) for k, v in data.outputs.items()}, data.method_name)


def version_plain(view: VersionView) -> Version:
    return Version(view.version, view.path, view.platform, view.reads_examples,
                   {k: _signature(v) for k, v in view.signatures.items()})


def version_from_plain(data: Version) -> VersionView:
    return VersionView(data.version, data.path, data.platform, data.reads_examples,
                       {k: _signature_info(v) for k, v in data.signatures.items()})


def view_plain(view: ServingView) -> ViewPush:
    return ViewPush(view.generation, {
        name: Model(dict(m.labels), [version_plain(v) for v in m.versions.values()], m.serving, list(m.route_headers))
        for name, m in view.models.items()})


def view_from_plain(data: ViewPush) -> ServingView:
    out = {}
    for name, model in data.models.items():
        views = [version_from_plain(v) for v in model.versions]
        out[name] = ModelView(model.labels, {v.version: v for v in views}, model.serving, tuple(model.route_headers))
    return ServingView(data.generation, out)


# -- the config ------------------------------------------------------------------------------------
def config_plain(config: Config) -> ConfigPush:
    return ConfigPush(dataclasses.asdict(config))


def config_from_plain(data: ConfigPush) -> Config:
    return config_mod.from_dict(data.config)


def plain_environ(environ: Mapping[str, object]) -> dict[str, str]:
    """What of a WSGI environ crosses: its text values (the URL scheme among them; no streams)."""
    return {k: v for k, v in environ.items() if isinstance(v, str)}
