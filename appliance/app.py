"""Wiring: ``Appliance`` owns the parts, ``create_app(config)`` builds the Flask app.

Both the service and the tests call ``create_app``. Constructors do no I/O and start no
threads; ``Appliance.start()`` opens the state database, profiles the device and starts
the model manager; ``close()`` drains and stops. Both are idempotent.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import sys
import threading
import time
from typing import Any

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

import runtimes

from . import __version__
from . import device as device_mod
from . import rest, tfs_json
from .config import Config
from .errors import ApplianceError, InvalidArgument, MethodNotAllowed, NotFound, PayloadTooLarge
from .manager import Manager
from .metrics import Metrics
from .openapi import spec as openapi_spec
from .state import StateDB

# Optional WSGI layers over the app, innermost first ("module:Class", each built as
# ``Class(inner_wsgi_app, core)``): the KServe v2 API, token generation, rollout routing
# and, outermost so it guards every path, authentication. A layer whose module this
# install lacks is skipped.
API_LAYERS = ("appliance.v2_rest:V2API", "appliance.generate_api:GenerateAPI",
              "appliance.rollout:RolloutLayer", "appliance.body_limits:GzipBodies", "appliance.auth:AuthLayer")
# /api/status and the page never show a secret: a string under a key naming one is "***"
# (a *_file key is a path and stays visible, its content never is), and any URL in any
# string loses its password and the values of signing/credential query parameters.
PUBLIC_STATUS_KEYS = ("token", "password", "passwd", "secret", "credential", "credentials", "private_key",
                      "api_key", "access_key", "secret_key", "authorization")  # key name endings
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/@\s:]*):[^/@\s]*@")
_SECRET_QUERY = re.compile(r"(?i)([?&](?:x-amz-signature|x-amz-credential|x-amz-security-token|signature|sig|"
                           r"token|access_token|password|secret|key|api_key)=)[^&#\s\"']*")
# Heavy libraries a technician (and the small-device tests) want to know are loaded or not.
HEAVY_MODULES = ("tensorflow", "ai_edge_litert", "tflite_runtime", "boto3", "zeroconf", "cryptography")


class Appliance:
    """The service core: config, device profile, state db, model manager, metrics."""

    def __init__(self, config: Config, backends: dict[str, runtimes.Backend] | None = None):
        self.config = config
        self.backends = backends
        self.metrics = Metrics()
        self.db = StateDB(os.path.join(config.state_dir, "state.db"))
        self.device: dict[str, Any] = {}
        self.device_id = ""
        self.manager: Manager | None = None
        self.started_at = time.time()
        self._lock = threading.Lock()
        self.extras: dict[str, Any] = {}  # status contributions of optional parts (sync, discovery)
        self.db.subscribe(self.metrics.on_event)  # edge_appliance_events_total{kind}

    def start(self) -> "Appliance":
        with self._lock:
            if self.manager is not None:
                return self
            self.db.open()
            self.device = device_mod.profile(vars(self.config.runtime.tflite))
            self.device_id = device_mod.device_id(self.config.state_dir)
            self.manager = Manager(self.config, self.db, self.device, self.backends, metrics=self.metrics)
            self.metrics.bind(lambda: self.manager.snapshot() if self.manager else {}, self.config.state_dir)
            self.db.event("service_start", f"edge-appliance {__version__} starting on {self.device['hostname']}",
                          device_id=self.device_id)
            self.manager.start()
        return self

    def close(self) -> None:
        with self._lock:
            manager, self.manager = self.manager, None
        if manager is not None:
            manager.close(self.config.server.drain_timeout_s)
            self.db.event("service_stop", "edge-appliance stopped")
        self.db.close()

    def problems(self) -> list[str]:
        """What is wrong but not fatal: a damaged or read-only state database, a part that
        failed to start. Shown by /readyz, /api/status and the page."""
        return [*self.db.problems, *self.extras.get("problems", [])]

    def status(self) -> dict[str, Any]:
        """The snapshot behind /api/status and the status page (no secrets)."""
        assert self.manager is not None
        models = self.manager.snapshot()
        for name, model in models.items():
            model["requests"] = self.metrics.window.summary(name)
        return redact({
            "service": {"name": "edge-appliance", "version": __version__, "device_id": self.device_id,
                        "uptime_s": round(time.time() - self.started_at, 1), "ready": self.manager.ready(),
                        "last_poll": self.manager.last_poll,
                        "imported": [m for m in HEAVY_MODULES if m in sys.modules]},
            "device": {**self.device, **device_mod.live_figures(self.config.state_dir)},
            "config": _public_config(self.config),
            "models": models,
            "events": self.db.recent(50),
            **self.extras,
            "problems": self.problems(),
        })


def _public_config(config: Config) -> dict[str, Any]:
    return redact(dataclasses.asdict(config))


def _secret_key(key: str) -> bool:
    return key.lower().endswith(PUBLIC_STATUS_KEYS)  # admin_token, not max_new_tokens or tls_key_file


def redact(value: Any) -> Any:
    """``value`` (status, config) with secrets masked: see PUBLIC_STATUS_KEYS."""
    if isinstance(value, dict):
        return {k: ("***" if isinstance(k, str) and _secret_key(k) and isinstance(v, str) and v else redact(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str) and ("=" in value or "@" in value):
        return _SECRET_QUERY.sub(r"\1***", _URL_PASSWORD.sub(r"\1:***@", value))
    return value


def create_app(config: Config, appliance: Appliance | None = None) -> Flask:
    """The WSGI app: TF Serving REST API, health, status, metrics and the status page."""
    app = Flask("edge-appliance")
    app.config["MAX_CONTENT_LENGTH"] = config.server.max_body_bytes
    core = appliance or Appliance(config)
    app.extensions["appliance"] = core
    app.wsgi_app = rest.V1API(app.wsgi_app, core)  # type: ignore[method-assign]  # /v1 skips Flask
    _register_service_routes(app, core)
    _register_errors(app)
    try:
        from ui import bp as ui_bp  # the status page, when the ui package is installed
    except ImportError:
        ui_bp = None
    if ui_bp is not None:
        app.register_blueprint(ui_bp)
    for layer in API_LAYERS:
        module_name, _, class_name = layer.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:  # the layer exists but something it needs is missing: say so
                raise
            continue
        app.wsgi_app = getattr(module, class_name)(app.wsgi_app, core)  # type: ignore[method-assign]
    return app


def _json(obj: Any, status: int = 200) -> Response:
    return Response(tfs_json.dumps(obj), status=status, mimetype="application/json")


def _register_service_routes(app: Flask, core: Appliance) -> None:
    @app.get("/healthz")
    def healthz() -> Response:
        return _json({"status": "alive", "version": __version__})

    @app.get("/readyz")
    def readyz() -> Response:
        ready = core.manager is not None and core.manager.ready()
        body: dict[str, Any] = {"ready": ready}
        if core.manager is not None and not ready:
            body["models"] = {n: m["serving_version"] for n, m in core.manager.snapshot().items()}
        problems = core.problems()
        if problems:
            body["problems"] = problems
        return _json(body, 200 if ready else 503)

    @app.get("/api/status")
    def api_status() -> Response:
        return _json(core.status())

    @app.get("/monitoring/prometheus/metrics")
    def metrics() -> Response:
        return Response(core.metrics.render(), mimetype="text/plain; version=0.0.4")

    @app.get("/openapi.json")
    def openapi() -> Response:
        return _json(openapi_spec(__version__))


def _register_errors(app: Flask) -> None:
    @app.errorhandler(ApplianceError)
    def appliance_error(exc: ApplianceError) -> Response:
        return rest.error_response(exc)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        mapping = {404: NotFound(f"no such resource: {request.method} {request.path}"),
                   405: MethodNotAllowed(f"method {request.method} not allowed on {request.path}"),
                   413: PayloadTooLarge(f"request body is over the limit of {app.config['MAX_CONTENT_LENGTH']} "
                                        "bytes (server.max_body_bytes)")}
        error = mapping.get(exc.code or 500) or InvalidArgument(exc.description or str(exc))
        return rest.error_response(error)

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> Response:
        app.logger.exception("unhandled error")
        return rest.error_response(ApplianceError(f"internal error: {type(exc).__name__}"))
