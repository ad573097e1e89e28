"""The serving process's side of the seams (appliance/core/seams.py): the manager's own
handles and version states, for the API families of ``Appliance``. Both look the manager up
at each call: it exists between the core's ``start()`` and ``close()`` only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

from appliance.core.errors import Unavailable
from appliance.core.seams import ModelHandle, RouteKey, VersionStatus

if TYPE_CHECKING:
    from appliance.core.manager import Manager

STOPPED = "the service is not running (starting or stopping); retry"


class LocalHandles:
    """``HandleSource``: ``Manager.handle``, the request side of the manager."""

    def __init__(self, manager: "Callable[[], Manager | None]"):
        self._manager = manager

    async def handle(self, name: str, version: int | None = None, label: str | None = None,
                     route_key: RouteKey | None = None) -> ModelHandle:
        manager = self._manager()
        if manager is None:
            raise Unavailable(STOPPED)
        return manager.handle(name, version, label, route_key)


class LocalStates:
    """``ModelStates``: ``Manager.version_states``."""

    def __init__(self, manager: "Callable[[], Manager | None]"):
        self._manager = manager

    def version_states(self, name: str, version: int | None = None,
                       label: str | None = None) -> Sequence[VersionStatus]:
        manager = self._manager()
        if manager is None:
            raise Unavailable(STOPPED)
        return manager.version_states(name, version, label)
