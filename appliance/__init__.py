"""edge-appliance: an on-device model server that speaks TF Serving's API.

Public surface: ``create_app`` (the WSGI app the service and tests run), ``Appliance``
(the service core), ``load_config``.
"""

__version__ = "0.1.0"

from .app import Appliance, create_app  # noqa: E402
from .config import load as load_config  # noqa: E402

__all__ = ["Appliance", "__version__", "create_app", "load_config"]
