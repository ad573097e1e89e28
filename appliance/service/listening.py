"""Where the running service listens, for people and for the CLI.

``attach(service)`` (called once the REST port and gRPC are bound) shows the section
``/api/status`` ``listening`` (REST address and URL, TLS, gRPC addresses and Unix socket,
front workers, where the admin token comes from: never the token) and writes the same
facts, with the pid, to ``<state>/service.json`` (appliance/core/running.py), which
``appliance sync`` and the other verbs that talk to the service read to find it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

from appliance.version import __version__
from appliance.core import running
from appliance.core.json_read import obj, seq
from appliance.core.json_types import JSONObject
from appliance.fronts.pool import Fronts

if TYPE_CHECKING:  # for annotations only: the service imports this module
    from appliance.core.config import Config, SecurityConfig
    from appliance.service import Service

log = logging.getLogger("appliance.service")


def attach(service: Service) -> None:
    service.core.add_status("listening", lambda: listening(service))
    record = {"pid": os.getpid(), "started": service.core.started_at, "written": time.time(),
              "version": __version__, "state_dir": os.path.abspath(service.config.state_dir),
              "config": os.path.abspath(service.config_path) if service.config_path else None,
              **listening(service)}
    path = running.write(service.config.state_dir, record)
    if path is None:
        log.warning("cannot write %s: CLI verbs (appliance sync, rollback) need --url to find this service",
                    running.path_in(service.config.state_dir))


def listening(service: Service) -> JSONObject:
    """The addresses and the token source of ``service`` now (safe to show)."""
    config, server = service.config, service.server
    assert server is not None, "listening() is asked of a started service"
    tls = bool(config.security.tls_cert_file)
    host, port = server.host, server.port
    grpc = obj(service.core.status_of("grpc"))
    workers = server.count if isinstance(server, Fronts) else 0
    return {
        "rest": {"host": host, "port": port, "tls": tls, "url": running.local_url(host, port, tls),
                 "served_by": f"{workers} front workers" if workers else "the serving process",
                 "cert_file": config.security.tls_cert_file or None},
        "rest_socket": getattr(config.server, "socket_path", "") or None,
        "grpc": [str(a) for a in seq(grpc.get("addresses"))],  # bound now (host:port texts)
        "grpc_configured": list(_grpc_configured(config)),
        "workers": workers,
        "admin_token": admin_token_source(config.security),
    }


def _grpc_configured(config: Config) -> list[str]:
    """The gRPC addresses the config asks for (``grpc`` says which are bound)."""
    host = config.server.host or "0.0.0.0"
    wanted = [f"{host}:{config.grpc.port}"] if config.grpc.port else []
    return wanted + ([f"unix:{config.grpc.socket_path}"] if config.grpc.socket_path else [])


def admin_token_source(security: SecurityConfig) -> JSONObject:
    """Where the admin token comes from: ``{"source": ..., "file": path or None}`` (no token:
    source "none", admin endpoints are off)."""
    if security.admin_token:
        return {"source": "config (security.admin_token)", "file": None}
    name = security.admin_token_file
    if name:
        if os.path.isabs(name):
            return {"source": "file", "file": name}
        return {"source": f"credential {name}", "file": _credential(name)}
    credential = _credential("admin-token")
    if credential and os.path.exists(credential):
        return {"source": "credential admin-token", "file": credential}
    return {"source": "none", "file": None}


def _credential(name: str) -> str | None:
    directory = os.environ.get("CREDENTIALS_DIRECTORY", "")
    return os.path.join(directory, name) if directory else None
