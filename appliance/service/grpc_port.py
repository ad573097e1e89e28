"""The service's gRPC port: TF Serving's PredictionService and ModelService
(appliance/api/tfserving/grpc_service.py) and the KServe v2 GRPCInferenceService (appliance/api/kserve/grpc_service.py).

Binding: a port (or socket) that cannot be bound raises ``OSError`` naming the address and
the reason, and the service exits with it (TF Serving's ``Failed to BuildAndStart gRPC
server``) -- unless ``[grpc] bind_retry``: then ``attach`` reports gRPC down (critical: the
device is not ready, the page shows it), returns, and a thread retries with backoff until
the port is bound or the service stops.

``attach(service)`` (before the HTTP server serves) starts one server on ``[grpc] port``
(TF Serving's 8500; 0: none) and/or the Unix socket ``[grpc] socket_path`` (as
``--grpc_socket_path``), with ``max_message_bytes`` both ways (gRPC's 4 MB default is what
TF Serving users hit first). The token check of appliance/api/auth.py runs as an interceptor.
The server stops, after in-flight calls finish (bounded by ``server.drain_timeout_s``), on
the service's "stopping" hook. Same process, same manager, same batchers as REST.

Which server: ``[grpc] transport``. "lean" (the default) is appliance/transport/grpc/h2_server.py,
unary gRPC over libnghttp2 (appliance/transport/grpc/nghttp2.py, through cffi), on one event loop,
with the ``[grpc]`` bounds on hostile clients; with front workers ([server] workers > 1) the TCP port
is theirs (appliance/fronts/grpc_front.py: each worker serves it on its own loop) and only the Unix
socket stays here. "grpcio" is grpcio's ``grpc.aio`` server (appliance/transport/grpc/aio_server.py),
the fallback, and what "lean" becomes where libnghttp2 cannot be loaded (``transport_of``). Both
take the same generic handlers and interceptor, so the services do not know which one runs them. Why not grpcio by default:
its per-call machinery cost more server CPU than the whole REST path on a small device
(bench/RESULTS.md). Why an event loop and not ``grpc.server``'s threads: each hand-off
between threads is a GIL switch; on the loop a call's Python work (decode, queue, encode)
runs in one place, Predict awaits its batch (appliance/core/batcher.py ``submit``), and one
wake-up answers the whole batch. Methods written as plain functions (metadata, status,
reload, Classify/Regress) run on a thread pool of ``server.threads``.

Descriptors: REST takes its connections first (appliance/transport/http/server.py leaves
2 x FD_RESERVE of the descriptor limit free); gRPC's ``max_connections`` is cut to what is
left after REST's cap and FD_RESERVE for the state db and model files, so connections to the
gRPC port can never take the descriptors REST and /healthz need.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

from appliance.api.auth import grpc_interceptor
from appliance.api.kserve import grpc_service as v2_grpc
from appliance.api.tfserving import grpc_service as tfs_grpc
from appliance.fronts.pool import Fronts
from appliance.core.grpc_tls import GRPCTLS, grpc_tls
from appliance.transport.grpc import nghttp2
from appliance.transport.grpc.aio_server import AioServer
from appliance.transport.grpc.h2_server import LeanServer
from appliance.transport.grpc.limits import grpc_limits

if TYPE_CHECKING:  # for annotations only: the service imports this module
    from appliance.core.config import GRPCConfig
    from appliance.service import Service

log = logging.getLogger("appliance.grpc")
PART = __name__  # the name gRPC's problem is reported under (appliance/service/__init__.py API_PARTS)
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 30.0


def attach(service: Service) -> "GRPCServer | None":
    """Bind and start gRPC; OSError when it cannot bind, or, with ``bind_retry``, None and a
    retrying thread (module docstring)."""
    cfg = service.config.grpc
    if not cfg.port and not cfg.socket_path:
        return None
    tls = grpc_tls(service.config)  # a bad certificate or SSLConfig stops start-up here, by its key
    if isinstance(service.server, Fronts) and cfg.port and transport_of(cfg)[0] == "lean" \
            and _to_workers(service, cfg, tls):
        if not cfg.socket_path:
            return None
        cfg = dataclasses.replace(cfg, port=0)  # the Unix socket stays here
    try:
        return _bind(service, cfg)
    except OSError as exc:
        if not cfg.bind_retry:
            raise
        service.core.report_problem(PART, f"{exc}; retrying ([grpc] bind_retry)", critical=True)
        log.warning("%s; retrying with backoff ([grpc] bind_retry)", exc)
        threading.Thread(target=_retry, args=(service,), name="grpc-bind-retry", daemon=True).start()
        return None


def transport_of(cfg: GRPCConfig) -> tuple[str, str]:
    """The gRPC server to run and why: ``[grpc] transport``, except that "lean" without a
    usable libnghttp2 falls back to grpcio (``GRPCServer.start`` logs it once; a ``fallback``
    problem in ``/api/status`` and on the page, appliance/core/problems.py)."""
    if cfg.transport != "lean":
        return cfg.transport, ""
    try:
        nghttp2.load()
    except nghttp2.Missing as exc:
        return "grpcio", str(exc)
    return "lean", ""


def _to_workers(service: Service, cfg: GRPCConfig, tls: GRPCTLS | None) -> bool:
    """The TCP port to the front workers (appliance/fronts/pool.py); False when it is busy
    and ``bind_retry`` says to retry here, OSError when busy without it."""
    host = service.config.server.host or "0.0.0.0"
    fronts = service.server
    assert isinstance(fronts, Fronts)  # attach() sends only a service with front workers here
    try:
        port = fronts.serve_grpc(host, cfg.port)
    except OSError as exc:
        if cfg.bind_retry:
            return False
        address = f"[{host}]:{cfg.port}" if ":" in host else f"{host}:{cfg.port}"
        raise OSError(f"cannot listen for gRPC on {address}: {(exc.strerror or str(exc)).lower()}") from exc
    services = [tfs_grpc.PREDICTION_SERVICE, tfs_grpc.MODEL_SERVICE, v2_grpc.SERVICE_NAME]
    section = {"addresses": [f"{host}:{port}"], "transport": "lean", "served_by": "front workers",
               "max_message_bytes": cfg.max_message_bytes, "services": services,
               "http2": f"libnghttp2 {nghttp2.version()}", **(tls.describe() if tls else {"tls": False})}
    service.core.add_status("grpc", lambda: {**section, **fronts.grpc_stats()})
    log.info("gRPC served by the front workers on %s:%d", host, port)
    return True


def _bind(service: Service, cfg: GRPCConfig | None = None) -> "GRPCServer":
    server = GRPCServer(service, cfg)
    server.start()
    service.hooks.append(server.on_hook)
    return server


def _retry(service: Service) -> None:
    """Bind again at 0.5, 1, 2 ... 30 s intervals until bound or the service stops."""
    stopped = threading.Event()
    service.hooks.append(lambda what, _: stopped.set() if what == "stopping" else None)
    wait = RETRY_FIRST_S
    while not stopped.wait(wait) and not service.stopping:
        try:
            server = _bind(service)
        except OSError as exc:
            service.core.report_problem(PART, f"{exc}; retrying in {min(wait * 2, RETRY_MAX_S):g} s", critical=True)
            wait = min(wait * 2, RETRY_MAX_S)
            continue
        if stopped.is_set() or service.stopping:  # the drain began meanwhile: its hook has run
            server.stop(0)
            return
        service.core.report_problem(PART, None)
        log.info("gRPC bound after retrying: %s", ", ".join(server.addresses))
        return


class GRPCServer:
    def __init__(self, service: Service, cfg: GRPCConfig | None = None):
        self.service = service
        self.core = service.core
        cfg = cfg or service.config.grpc
        options = [("grpc.max_receive_message_length", cfg.max_message_bytes),
                   ("grpc.max_send_message_length", cfg.max_message_bytes),
                   ("grpc.so_reuseport", 0)]  # a second server on the same port fails instead of sharing it
        interceptors = [grpc_interceptor(self.core)]
        # As many pool threads as HTTP workers: a method run there waits on a batch like an HTTP worker.
        threads = service.config.server.threads
        rest = getattr(service.server, "max_connections", 0)
        limits = grpc_limits(cfg, rest)
        self.transport, self.fallback = transport_of(cfg)
        self.tls = grpc_tls(service.config)
        if self.transport == "lean":  # it tells each call whether it is alone (core/request_context.py of_grpc)
            self.server: Any = LeanServer(threads, options, interceptors, tells_alone=True, limits=limits)
        else:  # grpcio's names for the bounds it has
            options += [("grpc.max_concurrent_streams", cfg.max_concurrent_streams),
                        ("grpc.max_metadata_size", cfg.max_metadata_size),
                        ("grpc.server_handshake_timeout_ms", int(cfg.handshake_timeout_s * 1000))]
            self.server = AioServer(threads, options, interceptors)
        tfs_grpc.add_to_server(self.server, self.core)
        v2_grpc.add_to_server(self.server, self.core)
        self.addresses: list[str] = []
        try:
            self._listen(service.config.server.host or "0.0.0.0", cfg)
        except BaseException:
            self.server.stop(None)  # no loop thread left behind by a port that failed
            raise

    def _listen(self, host: str, cfg: GRPCConfig) -> None:
        if cfg.port:
            address = f"[{host}]:{cfg.port}" if ":" in host else f"{host}:{cfg.port}"
            try:
                bound = self._add_tcp_port(address)
            except RuntimeError as exc:
                raise OSError(f"cannot listen for gRPC on {address}: {exc.__cause__ or exc}") from exc
            if not bound:
                raise OSError(f"cannot listen for gRPC on {address}: the port is in use or not available")
            self.addresses.append(address.rsplit(":", 1)[0] + f":{bound}")
        if cfg.socket_path:
            if os.path.exists(cfg.socket_path):
                os.unlink(cfg.socket_path)  # a stale socket of an earlier run
            try:
                self.server.add_insecure_port(f"unix:{cfg.socket_path}")
            except RuntimeError as exc:
                raise OSError(f"cannot listen for gRPC on unix:{cfg.socket_path}: {exc.__cause__ or exc}") from exc
            self.addresses.append(f"unix:{cfg.socket_path}")

    def _add_tcp_port(self, address: str) -> int:
        """The TCP port, over TLS when ``[grpc]`` says so (the Unix socket never is)."""
        tls = self.tls
        if tls is None:
            return int(self.server.add_insecure_port(address))
        if self.transport == "lean":
            return int(self.server.add_secure_port(address, tls.context))
        import grpc

        credentials = grpc.ssl_server_credentials([(tls.private_key, tls.cert_chain)], root_certificates=tls.client_ca,
                                                  require_client_auth=tls.require_client_certificate)
        return int(self.server.add_secure_port(address, credentials))

    def start(self) -> None:
        self.server.start()
        section: dict[str, Any] = {
            "addresses": self.addresses, "transport": self.transport,
            "max_message_bytes": self.service.config.grpc.max_message_bytes,
            "services": [tfs_grpc.PREDICTION_SERVICE, tfs_grpc.MODEL_SERVICE, v2_grpc.SERVICE_NAME],
            **(self.tls.describe() if self.tls else {"tls": False})}
        if self.fallback:
            section["lean_unavailable"] = self.fallback
            log.warning("the lean gRPC server cannot run: %s; serving gRPC with grpcio instead", self.fallback)
        elif self.transport == "lean":
            section["http2"] = f"libnghttp2 {nghttp2.version()}"
        server = self.server
        if isinstance(server, LeanServer):  # live figures: connections, bytes held, what was refused
            section["max_connections"] = server.limits.max_connections

            def status() -> dict[str, Any]:
                # called from the HTTP threads: dict.copy() runs under the GIL in one step
                return {**section, "connections": len(server.connections), "held_bytes": server.held,
                        **server.stats.copy()}
            self.core.add_status("grpc", status)
        else:
            self.core.add_status("grpc", lambda: section)
        log.info("gRPC serving on %s", ", ".join(self.addresses))

    def on_hook(self, what: str, service: Service) -> None:
        if what == "stopping":
            self.stop(service.config.server.drain_timeout_s)

    def stop(self, grace: float) -> None:
        self.server.stop(grace)
