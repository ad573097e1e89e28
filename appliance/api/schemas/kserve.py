"""The Open Inference Protocol's (KServe v2) infer request, for /openapi.json.

Checked by appliance/api/kserve/rest.py's ``parse_infer_request``, which reads the tensors'
``data`` as numpy (appliance/api/json_arrays.py) and checks declared shapes against the
limits before any data is read; its errors name the input or output. As in Triton, a field
not declared here is ignored. tests/api/test_request_schemas.py sends every field declared
here to the live server (taken) and each with a wrong type (refused).
"""

from __future__ import annotations

from typing import Any

import msgspec


class InferInput(msgspec.Struct, omit_defaults=True):
    """One input: its elements in ``data``, in binary after the JSON header
    (``parameters.binary_data_size``) or in shared memory (``parameters.shared_memory_region``)."""

    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: Any = None  # a flat or nested list of the datatype's JSON values


class RequestedOutput(msgspec.Struct, omit_defaults=True):
    name: str
    parameters: dict[str, Any] | None = None  # binary_data, classification, shared_memory_region


class InferRequest(msgspec.Struct, omit_defaults=True):
    inputs: list[InferInput]
    id: str | None = None
    parameters: dict[str, Any] | None = None  # binary_data_output
    outputs: list[RequestedOutput] | None = None


__all__ = ["InferInput", "InferRequest", "RequestedOutput"]
