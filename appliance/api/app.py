"""The REST application: ``create_app(config, core)`` builds the Flask app over the core.

Both the service and the tests call ``create_app``. One route table (appliance/api/routes.py)
holds every path with its handler and auth scope: Flask's ``url_map`` (health, status,
metrics, OpenAPI, the status page, the parts' admin endpoints) and the mounts of the API
families that skip Flask on the hot path (TF Serving's ``/v1``, KServe v2, ``:generate``,
the OpenAI-compatible ``/v1/chat/completions``, ``/v1/completions``, ``GET /v1/models``).
Around it, outermost first: authentication (the matched route's scope), then gzip bodies.
Every error answer is appliance/api/errors.py's.
"""

from __future__ import annotations

from flask import Flask, Response, request
from werkzeug.exceptions import HTTPException

from appliance.version import __version__
from appliance.api.auth import AuthLayer
from appliance.api.body import GzipBodies
from appliance.api.errors import flask_response
from appliance.api.families import mounts_of
from appliance.api.openapi import spec as openapi_spec
from appliance.api.routes import ADMIN, OPEN, READ, Route, RouteTable
from appliance.api.tfserving import json_format as tfs_json
from appliance.core.appliance import Appliance
from appliance.core.config import Config
from appliance.core.errors import ApplianceError, InvalidArgument, MethodNotAllowed, NotFound, PayloadTooLarge

def create_app(config: Config, appliance: Appliance | None = None) -> Flask:
    """The WSGI app: every REST API, health, status, metrics and the status page."""
    app = Flask("edge-appliance")
    app.url_rule_class = Route  # type: ignore[assignment]  # Flask types it type[Rule]; Route is one, with scope= beside Rule's options. Every rule carries its scope: the url_map is the route table's
    app.config["MAX_CONTENT_LENGTH"] = config.server.max_body_bytes
    core = appliance or Appliance(config)
    app.extensions["appliance"] = core
    _register_service_routes(app, core)
    _register_errors(app)
    try:
        from ui import bp as ui_bp  # the status page, when the ui package is installed
    except ImportError:
        ui_bp = None  # type: ignore[assignment]  # no ui package: no page
    if ui_bp is not None:
        app.register_blueprint(ui_bp)
    table = RouteTable(app.url_map, app.wsgi_app)
    for mount in mounts_of(core):
        table.mount(mount)
    app.extensions["routes"] = table
    app.wsgi_app = AuthLayer(GzipBodies(table, core), core, table)  # type: ignore[method-assign]  # Flask's wsgi_app is a method; replacing it is Flask's documented way to wrap the app
    return app


def routes_of(app: Flask) -> RouteTable:
    """The app's route table (for parts registering blueprints, and for tests)."""
    return app.extensions["routes"]  # type: ignore[no-any-return]  # Flask's extensions dict holds Any


def _json(obj: object, status: int = 200) -> Response:
    return Response(tfs_json.dumps(obj), status=status, mimetype="application/json")


def _register_service_routes(app: Flask, core: Appliance) -> None:
    @app.get("/healthz", scope=OPEN)
    def healthz() -> Response:
        return _json({"status": "alive", "version": __version__})

    @app.get("/readyz", scope=OPEN)
    def readyz() -> Response:
        ready = core.ready()
        body: dict[str, object] = {"ready": ready}
        if core.manager is not None and not ready:
            body["models"] = {n: m["serving_version"] for n, m in core.manager.snapshot().items()}
        problems = core.problems()
        if problems:
            body["problems"] = problems
        return _json(body, 200 if ready else 503)

    @app.get("/api/status", scope=READ)
    def api_status() -> Response:
        return _json(core.status())

    @app.get("/monitoring/prometheus/metrics", scope=READ)
    def metrics() -> Response:
        return Response(core.metrics.render(), mimetype="text/plain; version=0.0.4")

    @app.post("/api/models/<model>/rollout/<action>", scope=ADMIN)
    def rollout_decision(model: str, action: str) -> Response:
        if action not in ("promote", "abort") or core.rollouts is None:
            raise NotFound(f"no such resource: POST /api/models/{model}/rollout/{action}")
        return _json(core.rollouts.operator(model, action))

    @app.get("/openapi.json", scope=READ)
    def openapi() -> Response:
        return _json(openapi_spec(__version__))


def _register_errors(app: Flask) -> None:
    @app.errorhandler(ApplianceError)
    def appliance_error(exc: ApplianceError) -> Response:
        return flask_response(exc)

    @app.errorhandler(HTTPException)
    def http_error(exc: HTTPException) -> Response:
        mapping = {404: NotFound(f"no such resource: {request.method} {request.path}"),
                   405: MethodNotAllowed(f"method {request.method} not allowed on {request.path}"),
                   413: PayloadTooLarge(f"request body is over the limit of {app.config['MAX_CONTENT_LENGTH']} "
                                        "bytes (server.max_body_bytes)")}
        error = mapping.get(exc.code or 500) or InvalidArgument(exc.description or str(exc))
        return flask_response(error)

    @app.errorhandler(Exception)
    def unexpected(exc: Exception) -> Response:
        return flask_response(exc, "a Flask route")  # logged there with its traceback, answered 500
