"""What a part reads of the running service (appliance/service/__init__.py ``Service``), as a
``Protocol``: the service is the layer above the parts, so they name its face, not its class.

A part is attached with ``attach(host)`` before the HTTP server serves (``server`` is bound
then, ``server.port`` known) and hears the service's lifecycle through ``hooks``
(``hook(what, host)``: "started", "reloading", "reloaded", "reload_failed", "stopping",
"stopped"). It reports trouble through ``core.report_problem`` and shows itself through
``core.add_status``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from appliance.core.config import Config

if TYPE_CHECKING:
    from flask import Flask

    from appliance.core.appliance import Appliance


class Listening(Protocol):
    """The REST port as the service holds it (the HTTP server, or the front workers' pool)."""

    @property
    def host(self) -> str: ...

    @property
    def port(self) -> int: ...


class Host(Protocol):
    @property
    def config(self) -> Config: ...

    @property
    def core(self) -> "Appliance": ...

    @property
    def app(self) -> "Flask": ...

    @property
    def server(self) -> Listening | None: ...

    @property
    def hooks(self) -> list[Callable[[str, "Host"], None]]: ...

    @property
    def reload_error(self) -> str: ...

    def request_reload(self) -> None: ...


Hook = Callable[[str, Host], None]
