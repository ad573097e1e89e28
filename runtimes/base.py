"""The runtime interface every inference backend implements.

A *backend* (one module per framework) is cheap to construct and does nothing heavy
until asked: ``probe(device)`` says whether it can run on this device and why,
``can_serve(version_dir)`` says which artifact of a version directory it would load,
and ``load(version_dir, options)`` returns a :class:`Servable`.

A *servable* is one loaded model version. ``run(signature, inputs)`` takes and returns
numpy arrays keyed by the signature's input/output names. Thread-safety: ``run`` may be
called from several threads at once; a backend whose framework object is not
thread-safe (a TFLite interpreter) guards or pools it internally. ``close()`` is
idempotent and frees the framework objects; no ``run`` may be in flight when it is
called (the model manager's handles guarantee that).

Optional: ``run_wide(signature, inputs)``, the same call when the caller runs nothing else
beside it (a batch alone, core/batcher.py): a backend whose batch slots each get a share of
the cores may give this one all of them. A backend without it is called with ``run``.

This module imports numpy only: heavy libraries are imported inside each backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

import numpy as np

from .json_types import ReadJSONObject


class RuntimeFailure(Exception):
    """Base of the errors a backend raises. ``code`` is the canonical error code of the
    cause, as TF Serving reports a failed load in a model's status (``DATA_LOSS`` for an
    artifact that does not parse, ``NOT_FOUND`` for one that is missing...); a backend that
    knows the cause passes it, else the class's default stands."""

    code = "UNKNOWN"

    def __init__(self, message: str = "", code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class LoadFailure(RuntimeFailure):
    """A version directory could not be loaded or warmed up by this backend."""

    code = "INVALID_ARGUMENT"


class InputFailure(RuntimeFailure):
    """The inputs handed to ``run`` do not fit the signature (a client's mistake)."""

    code = "INVALID_ARGUMENT"


class MissingDependency(RuntimeFailure):
    """A feature needs a library this device does not have; the message names the extra."""

    code = "FAILED_PRECONDITION"


# TensorFlow's canonical error codes (tensorflow/core/protobuf/error_codes.proto), by number.
CANONICAL_CODES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                   "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
                   "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
                   "UNAUTHENTICATED")


@dataclass(frozen=True)
class TensorSpec:
    """One named input or output of a signature.

    ``shape`` uses -1 for unknown dimensions and is None for unknown rank. ``dtype`` is
    a numpy dtype; strings are ``np.dtype(object)`` holding ``bytes``.
    ``tensor_name`` is the framework's own name (``x:0``), shown in metadata.
    """

    name: str
    dtype: np.dtype
    shape: tuple[int, ...] | None
    tensor_name: str = ""

    @property
    def is_string(self) -> bool:
        return self.dtype == np.dtype(object)

    @property
    def batched(self) -> bool:
        """True when the first dimension can hold any number of rows."""
        return self.shape is None or (len(self.shape) > 0 and self.shape[0] in (-1, None))


@dataclass(frozen=True)
class SignatureInfo:
    """A named entry point of a model: TF Serving's SignatureDef, in numpy terms."""

    name: str
    inputs: Mapping[str, TensorSpec]
    outputs: Mapping[str, TensorSpec]
    method_name: str = "tensorflow/serving/predict"

    @property
    def batchable(self) -> bool:
        """Whether rows of several requests may be concatenated along dimension 0."""
        specs = list(self.inputs.values()) + list(self.outputs.values())
        return bool(self.inputs) and all(s.batched for s in specs)


@dataclass(frozen=True)
class Availability:
    """A backend's answer to ``probe``: can it run here, and why (or why not)."""

    available: bool
    reason: str
    details: ReadJSONObject = field(default_factory=dict)  # shown in the device report (JSON)


class Servable(Protocol):
    """One loaded model version (see module docstring for the contract)."""

    backend: str
    signatures: Mapping[str, SignatureInfo]
    # Capabilities the API layer asks for instead of checking backend names:
    platform: str  # the model format, as KServe v2 metadata names it ("tflite", "tensorflow_savedmodel")
    strict_shapes: bool  # inputs must fit the declared shapes (True) or the backend judges them (False)
    reads_examples: bool  # parses serialized tf.Example inputs (TF Serving's classify and regress)

    def run(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """An inference backend: a name, a probe, an artifact test and a loader."""

    name: str

    def probe(self, device: ReadJSONObject) -> Availability: ...  # the device report (appliance/core/device.py)

    def can_serve(self, version_dir: str) -> str | None:
        """Path of the artifact this backend would load from the directory, or None."""
        ...

    def load(self, version_dir: str, options: ReadJSONObject) -> Servable: ...  # the backend's config section


DEFAULT_SIGNATURE = "serving_default"
