"""The REST app's one route table (appliance/api/routes.py) and one error renderer
(appliance/api/errors.py): every route and its scope against the auth rule, TF Serving's
raw-path matching, and every error path answering in the same shape."""

from __future__ import annotations

import gzip
import http.client
import io
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import orjson
import pytest
from flask import Flask

from appliance.api import auth, routes
from appliance.api.app import create_app, routes_of
from appliance.api.routes import ADMIN, INFERENCE, OPEN, READ
from appliance.core.config import Config, SecurityConfig, ServerConfig
from appliance.core.errors import PayloadTooLarge, QueueFull, Unavailable
from appliance.parts import sync_loop

ADMIN_TOKEN = "admin-" + "a1" * 16
INFER_TOKEN = "infer-" + "b2" * 16

# Every entry of the table: (kind, path, methods) -> scope. A new route must be added here,
# so a reviewer sees its scope.
TABLE = {
    ("mount", "/v2/health/*", ("*",)): OPEN,
    ("mount", "/v2/repository/models/*", ("*",)): ADMIN,  # Triton's load/unload ([kserve] model_control_scope)
    ("mount", "/v1/*:generate", ("POST",)): INFERENCE,
    # the OpenAI-compatible API: the three /v1 paths TF Serving answers 400 (appliance/api/openai.py)
    ("mount", "/v1/chat/*", ("*",)): INFERENCE,
    ("mount", "/v1/completions/*", ("*",)): INFERENCE,
    ("mount", "/v1/models/*", ("GET", "HEAD")): INFERENCE,
    ("mount", "/v1/embeddings/*", ("*",)): INFERENCE,
    ("mount", "/v1/responses/*", ("*",)): INFERENCE,
    ("mount", "/v1/audio/*", ("*",)): INFERENCE,
    ("mount", "/v1/images/*", ("*",)): INFERENCE,
    ("mount", "/v1/files/*", ("*",)): INFERENCE,
    ("mount", "/v1/moderations/*", ("*",)): INFERENCE,
    ("mount", "/v1/batches/*", ("*",)): INFERENCE,
    ("mount", "/v1/assistants/*", ("*",)): INFERENCE,
    ("mount", "/v1/threads/*", ("*",)): INFERENCE,
    ("mount", "/v1/fine_tuning/*", ("*",)): INFERENCE,
    ("mount", "/v1/uploads/*", ("*",)): INFERENCE,
    ("mount", "/v1/vector_stores/*", ("*",)): INFERENCE,
    ("mount", "/v1/realtime/*", ("*",)): INFERENCE,
    ("mount", "/v1/conversations/*", ("*",)): INFERENCE,
    ("mount", "/v1/*", ("*",)): INFERENCE,
    ("mount", "/v2/*", ("*",)): INFERENCE,
    ("route", "/static/<path:filename>", ("GET", "HEAD")): READ,
    ("route", "/healthz", ("GET", "HEAD")): OPEN,
    ("route", "/readyz", ("GET", "HEAD")): OPEN,
    ("route", "/api/status", ("GET", "HEAD")): READ,
    ("route", "/monitoring/prometheus/metrics", ("GET", "HEAD")): READ,
    ("route", "/api/models/<model>/rollout/<action>", ("POST",)): ADMIN,
    ("route", "/openapi.json", ("GET", "HEAD")): READ,
    ("route", "/ui/static/<path:filename>", ("GET", "HEAD")): READ,
    ("route", "/", ("GET", "HEAD")): READ,
    ("route", "/api/reload", ("POST",)): ADMIN,
    ("route", "/api/sync", ("POST",)): ADMIN,
    ("route", "/api/models/<model>/rollback", ("POST",)): ADMIN,
}


def build(tmp_path: Path, **security: Any) -> Flask:
    config = Config(state_dir=str(tmp_path / "state"), server=ServerConfig(max_body_bytes=4096),
                    security=SecurityConfig(**security))
    app = create_app(config)
    sync_loop._register_routes(SimpleNamespace(app=app), None, None)  # what attach() adds, without a bucket
    return app


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Flask]:
    app = build(tmp_path, admin_token=ADMIN_TOKEN)
    yield app
    app.extensions["appliance"].db.close()


def test_the_table_lists_every_route_with_its_scope(app: Flask) -> None:
    listed = {(e.kind, e.path, e.methods): e.scope for e in routes_of(app).entries()}
    assert listed == TABLE


def test_every_route_keeps_the_auth_rule(app: Flask) -> None:
    """A route's scope is the rule's for its path and methods, or stricter (admin)."""
    for entry in routes_of(app).entries():
        sample = entry.path.replace("*", "x").split("<", 1)[0] + ("x" if "<" in entry.path else "")
        for method in entry.methods if entry.methods != ("*",) else ("GET", "POST", "DELETE"):
            assert entry.scope in (auth.scope_for(method, sample), ADMIN), (entry, method)


def test_a_route_weaker_than_the_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="weaker"):
        routes.Route("/api/wipe", methods=["POST"], scope=READ)
    with pytest.raises(ValueError, match="weaker"):
        routes.Route("/v1/anything", methods=["GET"], scope=OPEN)
    assert routes.Route("/api/debug", methods=["GET"], scope=ADMIN).scope == ADMIN  # stricter is fine
    assert routes.Route("/api/new", methods=["PUT"]).scope == ADMIN  # unknown writes: admin by default


def environ(method: str, raw: str, path_info: str | None = None) -> dict[str, Any]:
    from urllib.parse import unquote

    path = raw.partition("?")[0]
    return {"REQUEST_METHOD": method, "REQUEST_URI": raw, "PATH_INFO": path_info or unquote(path),
            "QUERY_STRING": raw.partition("?")[2]}


@pytest.mark.parametrize("method,raw,endpoint,scope", [
    ("POST", "/v1/models/m:predict", "tfserving", INFERENCE),
    ("POST", "/v1/models/m/versions/2:generate", "generate", INFERENCE),
    ("GET", "/v1/models/m:generate", "openai-models", INFERENCE),  # which hands it to TF Serving: 400 Malformed  # TF Serving answers it: 400 Malformed
    ("POST", "/v1/models/m/labels/a/b:generate", "tfserving", INFERENCE),  # not :generate's grammar
    ("POST", "/v1/chat/completions", "openai", INFERENCE),
    ("GET", "/v1/chat/completions", "openai", INFERENCE),  # it answers 405 in OpenAI's shape
    ("POST", "/v1/completions?x=1", "openai", INFERENCE),
    ("GET", "/v1/models", "openai-models", INFERENCE),
    ("HEAD", "/v1/models?x=1", "openai-models", INFERENCE),
    ("POST", "/v1/models", "tfserving", INFERENCE),  # TF Serving's 400 Malformed
    ("GET", "/v1/models/m", "openai-models", INFERENCE),  # hands TF Serving's clients TF Serving's model status
    ("GET", "/v1/models/m:1", "openai-models", INFERENCE),  # models.retrieve of name:version
    ("POST", "/v1/chat/completions/x", "tfserving", INFERENCE),
    ("GET", "/v2", "kserve", INFERENCE),
    ("GET", "/v2/health/ready", "kserve", OPEN),
    ("POST", "/v2/models/m/infer?x=1", "kserve", INFERENCE),
    ("POST", "/v2/repository/index", "kserve", INFERENCE),
    ("POST", "/v2/repository/models/m/load", "kserve", ADMIN),  # one V2API behind both mounts
    # TF Serving matches the undecoded path: still /v1, whatever the name decodes to
    ("POST", "/v1/models/..%2F..%2Fetc:predict", "tfserving", INFERENCE),
    ("GET", "/v1/models/..%2F..%2Fapi%2Fstatus", "openai-models", INFERENCE),  # TF Serving's answer, handed on
    # dot and empty segments as sent: guarded as what they normalise to, answered as sent
    ("POST", "/v1/../api/sync", "tfserving", ADMIN),
    ("GET", "/v1/../api/status", "tfserving", READ),
    ("POST", "//api/sync", "flask", ADMIN),
    ("POST", "/%2E%2E/api/sync", "flask", ADMIN),
    ("GET", "/healthz", "flask", OPEN),
    ("OPTIONS", "/api/status", "flask", ADMIN),
    ("DELETE", "/api/status", "flask", ADMIN),
    ("GET", "/api/sync", "flask", READ),  # 405: nothing runs
    ("GET", "/no/such/page", "flask", READ),
    ("POST", "/no/such/endpoint", "flask", ADMIN),
])
def test_resolve(app: Flask, method: str, raw: str, endpoint: str, scope: str | None) -> None:
    table = routes_of(app)
    handler, found = table.resolve(environ(method, raw))
    names = {id(m.handler): m.name for m in table.mounts}
    assert names.get(id(handler), "flask" if handler is table.fallback else "?") == endpoint
    assert found == scope


def test_resolve_agrees_with_the_rule_for_every_normal_path(app: Flask) -> None:
    table = routes_of(app)
    for method in ("GET", "HEAD", "POST", "PUT"):
        for path in ("/", "/healthz", "/readyz", "/v1", "/v1/models/m", "/v2", "/v2/health/live",
                     "/api/status", "/api/sync", "/api/reload", "/api/models/m/rollback", "/openapi.json",
                     "/monitoring/prometheus/metrics", "/api/models/m/rollout/promote", "/x"):
            assert table.resolve(environ(method, path))[1] in (auth.scope_for(method, path), ADMIN), (method, path)


# -- every error path, one shape ---------------------------------------------------------------
class DownManager:
    """A manager whose every model is loading: each API's request gets Unavailable."""

    def __getattr__(self, name: str) -> Any:
        def unavailable(*args: Any, **kwargs: Any) -> Any:
            raise Unavailable("m is still loading")
        return unavailable


def call(app: Flask, method: str, path: str, body: bytes = b"", **headers: str) -> tuple[int, dict[str, str], bytes]:
    env = environ(method, path)
    env.update({"wsgi.input": io.BytesIO(body), "CONTENT_LENGTH": str(len(body)), "SERVER_NAME": "localhost",
                "SERVER_PORT": "80", "wsgi.url_scheme": "http", "SERVER_PROTOCOL": "HTTP/1.1",
                "wsgi.errors": io.StringIO()})
    env.update({"HTTP_" + k.upper(): v for k, v in headers.items()})
    got: dict[str, Any] = {}

    def start_response(status: str, response_headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        got["status"], got["headers"] = int(status.split()[0]), response_headers

    chunks = app(env, start_response)
    data = b"".join(chunks)
    getattr(chunks, "close", lambda: None)()
    names = [k for k, _ in got["headers"] if k != "WWW-Authenticate"]  # (challenges may come twice)
    assert len(names) == len(set(names)), got["headers"]
    return got["status"], dict(got["headers"]), data


def assert_error(answer: tuple[int, dict[str, str], bytes], status: int, retry: bool = False) -> str:
    code, headers, body = answer
    assert code == status, body
    assert headers["Content-Type"] == "application/json"
    assert int(headers["Content-Length"]) == len(body)
    parsed = orjson.loads(body)
    assert list(parsed) == ["error"] and isinstance(parsed["error"], str) and parsed["error"]
    assert headers.get("Retry-After") == ("1" if retry else None), headers
    return str(parsed["error"])


def test_every_error_path_renders_through_the_one_renderer(tmp_path: Path) -> None:
    app = build(tmp_path, admin_token=ADMIN_TOKEN, inference_token=INFER_TOKEN)
    core = app.extensions["appliance"]

    @app.post("/api/test/busy", scope=ADMIN)  # a part's route raising a retryable error
    def busy() -> Any:
        raise QueueFull("the queue is full")

    @app.post("/api/test/upload", scope=ADMIN)
    def upload() -> Any:
        from flask import request
        return {"size": len(request.get_data())}

    @app.get("/api/test/bug", scope=READ)
    def bug() -> Any:
        raise KeyError("oops")

    admin, infer = {"AUTHORIZATION": f"Bearer {ADMIN_TOKEN}"}, {"AUTHORIZATION": f"Bearer {INFER_TOKEN}"}
    try:
        core.manager = DownManager()
        body = b'{"instances": [[1.0]]}'
        # 503 + Retry-After from the error class, on every API
        assert_error(call(app, "GET", "/v1/models/m", **infer), 503, retry=True)
        assert_error(call(app, "POST", "/v1/models/m:predict", body, **infer), 503, retry=True)
        assert_error(call(app, "GET", "/v2/models/m", **infer), 503, retry=True)
        assert_error(call(app, "POST", "/v1/models/m:generate", b'{"input_ids": [1]}', **infer), 503, retry=True)

        assert_error(call(app, "POST", "/api/test/busy", **admin), 503, retry=True)
        # TF Serving's grammar, byte for byte
        assert assert_error(call(app, "POST", "/v1/models/m:explain", body, **infer), 400) == \
            "Malformed request: POST /v1/models/m:explain"
        assert_error(call(app, "GET", "/v2/nothing", **infer), 404)
        assert_error(call(app, "PUT", "/v2/models/m/infer", **infer), 405)
        assert_error(call(app, "POST", "/v1/models/m:predict", b"x" * 5000, **infer), 413)
        assert_error(call(app, "POST", "/v2/models/m/infer", b"x" * 5000, **infer), 413)
        bomb = gzip.compress(b"0" * 100_000)
        assert_error(call(app, "POST", "/v1/models/m:predict", bomb, CONTENT_ENCODING="gzip", **infer), 413)
        # Flask's 404 / 405 / 413 and an unexpected exception
        assert assert_error(call(app, "GET", "/no/such/page"), 404) == "no such resource: GET /no/such/page"
        assert_error(call(app, "GET", "/api/sync"), 405)
        assert_error(call(app, "POST", "/api/test/upload", b"x" * 5000, **admin), 413)
        assert assert_error(call(app, "GET", "/api/test/bug"), 500) == "internal error: KeyError"
        # auth: 401 (no token, wrong token), 403 (admin off: see the open app below)
        code, headers, _ = call(app, "POST", "/v1/models/m:predict", body)
        assert_error((code, headers, _), 401)
        assert headers["WWW-Authenticate"].startswith('Bearer realm="edge-appliance", scope="inference"')
        assert headers["Cache-Control"] == "no-store"
        assert_error(call(app, "POST", "/api/sync", AUTHORIZATION="Bearer wrong-token-wrong-token"), 401)
        # the parts' routes: 409 with nothing to sync
        assert "nothing to sync" in assert_error(call(app, "POST", "/api/sync", **admin), 409)
        assert_error(call(app, "POST", "/api/models/m/rollback", **admin), 409)
    finally:
        core.manager = None
        core.db.close()
    open_app = build(tmp_path / "open")
    try:
        assert "admin endpoints are off" in assert_error(call(open_app, "POST", "/api/reload"), 403)
        head = call(open_app, "HEAD", "/api/reload")  # a HEAD has no route there: read scope, Flask's 405
        assert head[0] == 405 and head[2] == b""
    finally:
        open_app.extensions["appliance"].db.close()


def test_retryable_errors_default_to_one_second() -> None:
    assert Unavailable("x").retry_after == 1 and QueueFull("x").retry_after == 1
    assert Unavailable("x", retry_after=5).retry_after == 5
    assert PayloadTooLarge("x").retry_after is None


# -- the encoded path, end to end --------------------------------------------------------------
def raw_request(port: int, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send ``target`` exactly as written (no client-side normalising or quoting)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest(method, target, skip_accept_encoding=True)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_an_encoded_path_is_tf_servings_not_an_admin_endpoint(start_server: Any, models_dir: Path,
                                                               tmp_path: Path) -> None:
    """TF Serving matches ``(?i)/v1/.*`` and its grammar on the undecoded path, then decodes the
    model name (http_server.cc Dispatch, http_rest_api_util.cc ParseModelInfo/DecodeArg): a
    predict of model ``../../etc`` is 404 Servable not found, never the admin scope's 403."""
    models = tmp_path / "models"
    shutil.copytree(models_dir / "keras_mlp_tflite", models / "mlp")
    config = tmp_path / "appliance.toml"
    config.write_text(f'models_dir = "{models}"\n[discovery]\nenabled = false\n')  # no admin token: admin off
    server = start_server("--config", str(config), "--backend", "tflite", env={"CREDENTIALS_DIRECTORY": ""})
    body = b'{"instances": [[0.0]]}'
    status, data = raw_request(server.port, "POST", "/v1/models/..%2F..%2Fetc:predict", body)
    assert status == 404, data
    assert orjson.loads(data)["error"].startswith("Servable not found for request:")
    assert "../../etc" in orjson.loads(data)["error"]
    status, data = raw_request(server.port, "GET", "/v1/models/..%2F..%2Fapi%2Fsync")
    assert status == 404 and b"admin" not in data, data
    # a literal dot segment is still guarded as what it normalises to, and answered by TF Serving's grammar
    status, data = raw_request(server.port, "POST", "/v1/../api/sync", body)
    assert status == 403 and b"admin endpoints are off" in data, data
    status, data = raw_request(server.port, "POST", "/v1/models/mlp/extra:predict", body)
    assert status == 400 and orjson.loads(data) == {"error": "Malformed request: POST /v1/models/mlp/extra:predict"}
