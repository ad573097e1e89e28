"""The service's gRPC port: TF Serving's PredictionService and ModelService
(appliance/tfs_grpc.py) and the KServe v2 GRPCInferenceService (appliance/v2_grpc.py).

``attach(service)`` (before the HTTP server serves) starts one ``grpc.server`` on
``[grpc] port`` (TF Serving's 8500; 0: none) and/or the Unix socket ``[grpc]
socket_path`` (as ``--grpc_socket_path``), with ``max_message_bytes`` both ways (gRPC's 4
MB default is what TF Serving users hit first). The token check of appliance/auth.py runs
as an interceptor. The server stops, after in-flight calls finish (bounded by
``server.drain_timeout_s``), on the service's "stopping" hook. Same process, same manager,
same batchers as REST.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from . import tfs_grpc, v2_grpc

log = logging.getLogger("appliance.grpc")


def attach(service: Any) -> "GRPCServer | None":
    cfg = service.config.grpc
    if not cfg.port and not cfg.socket_path:
        return None
    server = GRPCServer(service)
    server.start()
    service.hooks.append(server.on_hook)
    return server


class GRPCServer:
    def __init__(self, service: Any):
        self.service = service
        self.core = service.core
        cfg = service.config.grpc
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]  # a second server on the same port fails instead of sharing it
        interceptors = []
        try:
            from .auth import grpc_interceptor
        except ImportError:
            pass
        else:
            interceptors.append(grpc_interceptor(self.core))
        # As many handler threads as HTTP workers: each waits on a batch like an HTTP worker does.
        self._pool = ThreadPoolExecutor(max_workers=service.config.server.threads, thread_name_prefix="grpc")
        self.server = grpc.server(self._pool, options=options, interceptors=interceptors)
        tfs_grpc.add_to_server(self.server, self.core)
        v2_grpc.add_to_server(self.server, self.core)
        self.addresses: list[str] = []
        host = service.config.server.host or "0.0.0.0"
        if cfg.port:
            address = f"[{host}]:{cfg.port}" if ":" in host else f"{host}:{cfg.port}"
            bound = self.server.add_insecure_port(address)
            if not bound:
                raise OSError(f"cannot listen for gRPC on {address}")
            self.addresses.append(address.rsplit(":", 1)[0] + f":{bound}")
        if cfg.socket_path:
            if os.path.exists(cfg.socket_path):
                os.unlink(cfg.socket_path)  # a stale socket of an earlier run
            self.server.add_insecure_port(f"unix:{cfg.socket_path}")
            self.addresses.append(f"unix:{cfg.socket_path}")

    def start(self) -> None:
        self.server.start()
        self.core.extras["grpc"] = {"addresses": self.addresses,
                                    "max_message_bytes": self.service.config.grpc.max_message_bytes,
                                    "services": [tfs_grpc.PREDICTION_SERVICE, tfs_grpc.MODEL_SERVICE,
                                                 v2_grpc.SERVICE_NAME]}
        log.info("gRPC serving on %s", ", ".join(self.addresses))

    def on_hook(self, what: str, service: Any) -> None:
        if what == "stopping":
            self.stop(service.config.server.drain_timeout_s)

    def stop(self, grace: float) -> None:
        self.server.stop(grace).wait(grace + 1)
        self._pool.shutdown(wait=False)
