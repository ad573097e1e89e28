"""The REST application: ``create_app(config, core)`` builds the Flask app over the core.

Both the service and the tests call ``create_app``. The TF Serving REST API, KServe v2,
token generation, rollouts, gzip bodies and authentication sit as WSGI layers over Flask,
which serves health, status, metrics, OpenAPI and the status page.
"""

from __future__ import annotations

import importlib
from typing import Any

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from appliance import __version__
from appliance.api.openapi import spec as openapi_spec
from appliance.api.tfserving import json_format as tfs_json
from appliance.api.tfserving import rest
from appliance.core.appliance import Appliance
from appliance.core.config import Config
from appliance.core.errors import ApplianceError, InvalidArgument, MethodNotAllowed, NotFound, PayloadTooLarge

# Optional WSGI layers over the app, innermost first ("module:Class", each built as
# ``Class(inner_wsgi_app, core)``): the KServe v2 API, token generation, gzip bodies
# and, outermost so it guards every path, authentication. Rollouts are the core's: every
# API's handle is routed and judged there (appliance/core/rollout.py). A layer whose module this
# install lacks is skipped.
API_LAYERS = ("appliance.api.kserve.rest:V2API", "appliance.api.generate:GenerateAPI",
              "appliance.api.body:GzipBodies", "appliance.api.auth:AuthLayer")
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
        ready = core.ready()
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

    @app.post("/api/models/<model>/rollout/<action>")
    def rollout_decision(model: str, action: str) -> Response:
        if action not in ("promote", "abort") or core.rollouts is None:
            raise NotFound(f"no such resource: POST /api/models/{model}/rollout/{action}")
        return _json(core.rollouts.operator(model, action))

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
