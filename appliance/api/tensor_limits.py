"""``limits.max_tensor_elements`` for every API that takes tensors in a request.

One limit, checked at two points so that a hostile request never costs more memory than
its own bytes:

* before a JSON body is parsed (``check_body_values``): orjson turns each number into a
  Python object (10^7 numbers: +436 MB), so a body that holds more values than the limit
  allows, plus a small envelope of names and shapes, is refused from one C-speed pass over
  its bytes (``count_values``, appliance/api/json_rows.py). Short bodies skip the pass: each value needs two bytes.
* once the tensors are known (``check_elements`` on decoded arrays, ``check_element_count``
  on the elements a request declares, before any array of that size exists).

Either way the answer is ``InvalidArgument`` (400 / INVALID_ARGUMENT) naming the key and
the count. Used by TF Serving's REST JSON (appliance/api/tfserving/json_format.py) and by
KServe v2 over REST (JSON and binary tensors) and gRPC (appliance/api/kserve/).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from appliance.api import json_rows
from appliance.core.errors import InvalidArgument

if TYPE_CHECKING:  # for annotations only: the service imports this module
    from appliance.core.config import LimitsConfig

KEY = "limits.max_tensor_elements"
ENVELOPE_VALUES = 16  # values a TF Serving request carries besides its tensors (signature_name, ...)


def check_body_values(body: bytes, limits: LimitsConfig, envelope: int = ENVELOPE_VALUES) -> None:
    """Refuse a JSON ``body`` holding more than ``limits.max_tensor_elements + envelope``
    values, before it is parsed."""
    allowed = limits.max_tensor_elements + envelope
    if (len(body) + 1) // 2 <= allowed:  # too short to hold more: no pass over it
        return
    values = count_values(body)
    if values > allowed:
        raise InvalidArgument(f"the request holds {values} JSON values, over the limit of "
                              f"{limits.max_tensor_elements} tensor elements ({KEY})")


def check_elements(inputs: Mapping[str, np.ndarray], limits: LimitsConfig) -> None:
    """Decoded inputs, all together, within the limit."""
    check_element_count(sum(arr.size for arr in inputs.values()), limits)


def check_element_count(total: int, limits: LimitsConfig, detail: str = "") -> None:
    """``total`` elements (decoded, or declared by shapes before decoding) within the limit;
    ``detail`` says where they come from, in the error."""
    if total > limits.max_tensor_elements:
        raise InvalidArgument(f"the request's tensors hold {total} elements{detail}, over the limit of "
                              f"{limits.max_tensor_elements} ({KEY})")


def count_values(body: bytes) -> int:
    """The number of non-container values in ``body`` (appliance/api/json_rows.py counts them)."""
    return json_rows.count_values(body)
