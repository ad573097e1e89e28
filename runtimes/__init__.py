"""Inference backends behind one interface, and the per-device selection among them.

Registry: backend name -> class. Importing this package imports numpy only; TensorFlow,
LiteRT and LiteRT-LM are imported by a backend when it loads a model.
"""

from __future__ import annotations

from .base import (
    CANONICAL_CODES,
    DEFAULT_SIGNATURE,
    Availability,
    Backend,
    InputFailure,
    LoadFailure,
    MissingDependency,
    RuntimeFailure,
    Servable,
    SignatureInfo,
    TensorSpec,
)
from .select import Decision, select, synthetic_bytes, synthetic_inputs
from .litertlm import LiteRTLMBackend, TextServable
from .litertlm import Request as TextRequest
from .tf_cpu import TFCPUBackend
from .tf_gpu import TFGPUBackend
from .tflite import TFLiteBackend

# The one registry of backends, in the order shown to users (appliance/core/config.py's
# BACKEND_CHOICES repeats the names so that reading the config needs no numpy; a test
# holds the two together).
BACKENDS: dict[str, type] = {"tf-gpu": TFGPUBackend, "tf-cpu": TFCPUBackend, "tflite": TFLiteBackend,
                             "litertlm": LiteRTLMBackend}
BACKEND_NAMES = tuple(BACKENDS)


def default_backends() -> dict[str, Backend]:
    """A fresh instance of every backend."""
    return {name: cls() for name, cls in BACKENDS.items()}


__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "CANONICAL_CODES",
    "DEFAULT_SIGNATURE",
    "Availability",
    "Backend",
    "Decision",
    "InputFailure",
    "LoadFailure",
    "MissingDependency",
    "RuntimeFailure",
    "Servable",
    "SignatureInfo",
    "TensorSpec",
    "TextRequest",
    "TextServable",
    "default_backends",
    "select",
    "synthetic_bytes",
    "synthetic_inputs",
]
