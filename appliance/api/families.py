"""The API families of the REST app, each a module whose ``mounts(core)`` returns the path
families it answers itself (appliance/api/mounts.py): TF Serving's REST API, KServe v2, token
generation and the OpenAI-compatible API beside it (which takes three /v1 paths TF Serving
answers 400). A module may also hold ``OPENAPI_PATHS``, merged into ``/openapi.json``.
Rollouts are the core's: every family's handle is routed and judged there
(appliance/core/rollout.py). A family whose module this install lacks is skipped.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from appliance.api.mounts import Mount

if TYPE_CHECKING:
    from appliance.core.appliance import Appliance

API_MOUNTS = ("appliance.api.tfserving.rest:mounts", "appliance.api.kserve.rest:mounts",
              "appliance.api.generate:mounts", "appliance.api.openai:mounts")


def mounts_of(core: "Appliance") -> list[Mount]:
    out = []
    for spec in API_MOUNTS:
        module_name, _, function = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:  # the module exists but something it needs is missing: say so
                raise
            continue
        out += getattr(module, function)(core)
    return out
