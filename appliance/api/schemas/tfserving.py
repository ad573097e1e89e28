"""TF Serving's REST request bodies (appliance/api/tfserving/rest.py), for /openapi.json.

The checks stay in TF Serving's parser (appliance/api/tfserving/json_format.py): its error
texts are the protocol's (TF Serving's ``json_tensor.cc``), and the hot path reads the body
once, big arrays as numpy (appliance/api/json_arrays.py). As in TF Serving, a field not
declared here is ignored, not refused. tests/api/test_request_schemas.py sends every field
declared here to the live server (taken) and each with a wrong type (refused).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType


class PredictRequest(msgspec.Struct, omit_defaults=True):
    """``:predict``: ``instances`` (row format) or ``inputs`` (columnar), exactly one."""

    signature_name: str = ""
    instances: list[Any] | UnsetType = UNSET
    inputs: Any = UNSET  # a tensor (a list, or a scalar) or an object of named tensors


class ExamplesRequest(msgspec.Struct, omit_defaults=True):
    """``:classify`` and ``:regress``: tf.Example features as JSON objects."""

    examples: list[dict[str, Any]]
    signature_name: str = ""
    context: dict[str, Any] | UnsetType = UNSET  # features common to every example


__all__ = ["ExamplesRequest", "PredictRequest"]
