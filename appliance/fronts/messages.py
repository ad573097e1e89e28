"""Message kinds between front workers and the serving process, and their payloads as plain
data (what appliance/transport/channel.py sends: strings, numbers, bytes, lists, dicts,
numpy arrays; never pickles).

Each message is ``(kind, id, payload)``. ``id`` pairs a reply with its request (0 for
pushes). Worker -> serving:

- ``RUN``: a ``RunRequest``; replied ``DONE`` (version, outputs) or ``FAIL``.
- ``RESOLVE``: (model, version, label) the serving view cannot answer; replied ``DONE``
  with the ``VersionView`` the manager picks, or ``FAIL`` with the manager's error.
- ``WSGI``: (environ, body) of a request the worker forwards; replied ``ANSWER`` (status,
  headers, body) for a whole answer, or ``START`` (status, headers), ``CHUNK`` bytes...,
  ``END`` for a stream. ``CANCEL``: the client went away; the stream is closed.
- ``GRPC``: [method, request bytes, metadata, seconds left, the client's peer] of a gRPC call
  the worker forwards; replied ``DONE`` [response bytes] or ``STATUS`` [code name, details, trailing
  metadata].
- ``OBSERVE``: request metrics (a list of [model, api, status, seconds, entrypoint]), one
  message per loop tick, sent before the answers of that tick leave.
- ``STATS``: the worker's HTTP figures and memory, every second.

Serving -> worker: ``VIEW`` (a ``ServingView``), ``CONFIG`` (a ``Config``, at start and
after a reload), ``DRAIN`` (timeout seconds: stop accepting, finish, exit).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from runtimes import SignatureInfo, TensorSpec

from appliance.core import config as config_mod
from appliance.core import errors
from appliance.core.config import Config
from appliance.fronts.view import ModelView, ServingView, VersionView

RUN, RESOLVE, DONE, FAIL = "run", "resolve", "done", "fail"
WSGI, ANSWER, START, CHUNK, END, CANCEL = "wsgi", "answer", "start", "chunk", "end", "cancel"
OBSERVE, STATS, VIEW, CONFIG, DRAIN = "observe", "stats", "view", "config", "drain"
GRPC, STATUS = "grpc", "status"


@dataclass(frozen=True)
class RunRequest:
    """One ``handle.run``: the request as the client named the version, the signature, the
    inputs, and the version they were decoded for."""

    model: str
    version: int | None
    label: str | None
    route_headers: Mapping[str, str | None]
    signature: str
    inputs: Mapping[str, np.ndarray]
    decoded_version: int

    def plain(self) -> list[Any]:
        return [self.model, self.version, self.label, dict(self.route_headers), self.signature, dict(self.inputs),
                self.decoded_version]

    @classmethod
    def from_plain(cls, data: list[Any]) -> "RunRequest":
        return cls(*data)


# -- errors ------------------------------------------------------------------------------------
def error_to_plain(exc: BaseException) -> list[Any]:
    """An error as [class name, message, retry_after]; a foreign one becomes a 500's text."""
    if isinstance(exc, errors.ApplianceError):
        return [type(exc).__name__, exc.message, exc.retry_after]
    return ["ApplianceError", f"{type(exc).__name__}: {exc}", None]


def error_from_plain(data: list[Any]) -> errors.ApplianceError:
    name, message, retry_after = data
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ApplianceError)):
        cls = errors.ApplianceError
    exc = cls.__new__(cls)
    errors.ApplianceError.__init__(exc, message)
    exc.retry_after = retry_after
    if isinstance(exc, errors.ConfigError):
        exc.key = ""
    return exc


# -- the serving view ----------------------------------------------------------------------------
def _spec_plain(spec: TensorSpec) -> list[Any]:
    return [spec.name, spec.dtype.str if spec.dtype.kind != "O" else "O",
            None if spec.shape is None else list(spec.shape), spec.tensor_name]


def _spec(data: list[Any]) -> TensorSpec:
    name, dtype, shape, tensor_name = data
    return TensorSpec(name, np.dtype(object if dtype == "O" else dtype), None if shape is None else tuple(shape),
                      tensor_name)


def _signature_plain(sig: SignatureInfo) -> list[Any]:
    return [sig.name, {k: _spec_plain(v) for k, v in sig.inputs.items()},
            {k: _spec_plain(v) for k, v in sig.outputs.items()}, sig.method_name]


def _signature(data: list[Any]) -> SignatureInfo:
    name, inputs, outputs, method = data
    return SignatureInfo(name, {k: _spec(v) for k, v in inputs.items()}, {k: _spec(v) for k, v in outputs.items()},
                         method)


def version_plain(view: VersionView) -> list[Any]:
    return [view.version, view.path, view.platform, view.reads_examples,
            {k: _signature_plain(v) for k, v in view.signatures.items()}]


def version_from_plain(data: list[Any]) -> VersionView:
    version, path, platform, reads_examples, signatures = data
    return VersionView(version, path, platform, reads_examples, {k: _signature(v) for k, v in signatures.items()})


def view_plain(view: ServingView) -> list[Any]:
    return [view.generation, {name: [dict(m.labels), [version_plain(v) for v in m.versions.values()], m.serving,
                                     list(m.route_headers)] for name, m in view.models.items()}]


def view_from_plain(data: list[Any]) -> ServingView:
    generation, models = data
    out = {}
    for name, (labels, versions, serving, headers) in models.items():
        views = [version_from_plain(v) for v in versions]
        out[name] = ModelView(labels, {v.version: v for v in views}, serving, tuple(headers))
    return ServingView(generation, out)


# -- the config ------------------------------------------------------------------------------------
def config_plain(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_from_plain(data: dict[str, Any]) -> Config:
    return config_mod.from_dict(data)


def plain_environ(environ: Mapping[str, Any]) -> dict[str, Any]:
    """What of a WSGI environ crosses: its text values (the URL scheme among them; no streams)."""
    return {k: v for k, v in environ.items() if isinstance(v, str)}
