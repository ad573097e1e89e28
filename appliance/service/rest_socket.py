"""REST on a Unix domain socket (``[server] socket_path``): HTTP over AF_UNIX, as the Docker
API is served, for the apps on the device itself (``curl --unix-socket PATH http://localhost/...``).

Who may call is the file's to decide: the socket is made with ``[server] socket_mode`` (0660 by
default) and ``socket_group``, set before it listens, so no client can connect through a wider
mode in between. The inference and admin tokens still apply: it is the same app as the TCP port's.

Served by the serving process itself, on an HTTP server of its own (appliance/transport/http/
server.py, the one-process path, with the same ``[limits]``): a local app's requests reach the
batch queue without the hop through a front worker, and shared-memory requests (appliance/api/
kserve/shared_memory.py) are answered where the regions are. A stale socket file left by a
crash is replaced; a path that is not a socket, or one another process still listens on, stops
start-up with the reason. The file is removed when the service stops.
"""

from __future__ import annotations

import grp
import logging
import os
import socket
import stat
import threading
from typing import TYPE_CHECKING, Any

from appliance.fronts.app import facing, serving_front
from appliance.transport.http.server import HTTPServer

if TYPE_CHECKING:  # for annotations only: the service imports this module
    from appliance.service import Service

log = logging.getLogger("appliance.http")
PART = __name__


def attach(service: Service) -> "RestSocket | None":
    """Listen on ``[server] socket_path`` (None when it is not set); OSError when it cannot."""
    path = service.config.server.socket_path
    if not path:
        return None
    listener = RestSocket(service, path)
    service.hooks.append(listener.on_hook)
    return listener


def unix_listener(path: str, mode: int, group: str = "") -> socket.socket:
    """A listening Unix socket at ``path`` with ``mode`` (and ``group``) set before ``listen``."""
    _clear_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, mode)
        if group:
            try:
                os.chown(path, -1, grp.getgrnam(group).gr_gid)
            except KeyError:
                raise OSError(f"cannot give {path} to group {group!r}: no such group") from None
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def _clear_stale(path: str) -> None:
    """Remove a socket file nobody listens on (a crash's); refuse anything else at ``path``."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise OSError(f"cannot listen on {path}: it exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: left by an earlier run
        return
    finally:
        probe.close()
    raise OSError(f"cannot listen on {path}: another process listens on it")


class RestSocket:
    """The Unix socket's HTTP server, started at once, drained on the service's "stopping"."""

    def __init__(self, service: Service, path: str):
        cfg = service.config
        self.path = path
        sock = unix_listener(path, int(cfg.server.socket_mode, 8), cfg.server.socket_group)
        front = serving_front(service.core, service.app)  # the same front path as the TCP port's
        self.server = HTTPServer(front, "localhost", 0, cfg.server.threads, cfg.server.max_body_bytes,
                                 cfg.limits, None, sock=sock, fast=front, facing=facing(batches=True))
        self.thread = threading.Thread(target=self.server.serve_forever, name="http-unix", daemon=True)
        self.thread.start()
        section = {"path": path, "mode": cfg.server.socket_mode, "group": cfg.server.socket_group or None}
        service.core.add_status("rest_socket", lambda: {**section, **self.server.stats})
        log.info("REST serving on unix:%s (mode %s)", path, cfg.server.socket_mode)

    def on_hook(self, what: str, service: Service) -> None:
        if what == "stopping":
            self.stop(service.config.server.drain_timeout_s)

    def stop(self, grace: float) -> None:
        try:
            self.server.drain(grace)
        finally:
            self.thread.join(10)
            try:
                os.unlink(self.path)
            except OSError:
                pass
