"""edge-appliance: an on-device model server that speaks TF Serving's API.

Public surface: ``create_app`` (the WSGI app the service and tests run), ``Appliance``
(the service core), ``load_config``. They are imported on first use, so ``appliance
--help`` and ``import appliance`` stay cheap.
"""

from typing import Any

from appliance.version import __version__

__all__ = ["Appliance", "__version__", "create_app", "load_config"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from appliance.api.app import create_app
        return create_app
    if name == "Appliance":
        from appliance.core.appliance import Appliance
        return Appliance
    if name == "load_config":
        from appliance.core.config_file import load
        return load
    raise AttributeError(f"module 'appliance' has no attribute {name!r}")
