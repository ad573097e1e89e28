"""Bearer tokens (appliance/api/auth.py) on the real service, and the gRPC interceptor on a real
gRPC server: admin endpoints need the admin token and are off without one (403 that says
how to turn them on); inference and read scopes are open or protected by their own token;
health probes stay open; tokens come from the config, a file, or a systemd credential;
a reload re-reads them; /api/status never shows a secret."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from appliance.api import auth
from appliance.core.config import ConfigError, KServeConfig, SecurityConfig
from appliance.core.config_file import load as load_config

ADMIN = "admin-" + "a1" * 16
INFER = "infer-" + "b2" * 16
READ = "read-" + "c3" * 16
BUCKET_SECRET = "hunter2-bucket-password"
MODEL = "mlp"
BODY = json.dumps({"instances": [[0.1] * 64]})


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def write_config(path: Path, models: Path, inference_token: str, read_file: Path, extra: str = "") -> None:
    path.write_text(f'models_dir = "{models}"\n[discovery]\nenabled = false\n'
                    f'[security]\nadmin_token_file = "admin-token"\ninference_token = "{inference_token}"\n'
                    f'read_token_file = "{read_file}"\n{extra}')


@pytest.fixture(scope="module")
def models(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("auth-models")
    shutil.copytree(models_dir / "keras_mlp_tflite", base / MODEL)
    return base


@pytest.fixture(scope="module")
def guarded(module_server: Any, models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A server with all three tokens: admin from a systemd credential, inference from the
    config, read from an absolute file path."""
    tmp = tmp_path_factory.mktemp("auth")
    creds = tmp / "credentials"
    creds.mkdir()
    (creds / "admin-token").write_text(ADMIN + "\n")
    (tmp / "read.token").write_text(READ)
    config = tmp / "appliance.toml"
    write_config(config, models, INFER, tmp / "read.token")
    server = module_server("--config", str(config), "--backend", "tflite",
                           env={"CREDENTIALS_DIRECTORY": str(creds)})
    server.config_path = config
    server.read_file = tmp / "read.token"
    server.models = models
    yield server


@pytest.fixture(scope="module")
def open_server(module_server: Any, models: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """No token configured at all (and a bucket URL with a password, to be redacted)."""
    tmp = tmp_path_factory.mktemp("open")
    config = tmp / "appliance.toml"
    config.write_text(f'models_dir = "{models}"\n[discovery]\nenabled = false\n')
    return module_server("--config", str(config), "--backend", "tflite", env={"CREDENTIALS_DIRECTORY": ""})


# -- HTTP, end to end ----------------------------------------------------------------------
def test_health_probes_are_always_open(guarded: Any) -> None:
    assert guarded.get("/healthz").status_code == 200
    assert guarded.get("/readyz").status_code == 200


def test_inference_needs_the_inference_or_admin_token(guarded: Any) -> None:
    url = f"/v1/models/{MODEL}:predict"
    missing = guarded.post(url, BODY)
    assert missing.status_code == 401
    assert missing.headers["WWW-Authenticate"].startswith("Bearer ")
    assert "inference token" in missing.json()["error"]
    wrong = guarded.post(url, BODY, headers=bearer(READ))  # another scope's token is not enough
    assert wrong.status_code == 401 and 'error="invalid_token"' in wrong.headers["WWW-Authenticate"]
    assert guarded.post(url, BODY, headers=bearer(INFER + "x")).status_code == 401
    assert guarded.get(f"/v1/models/{MODEL}").status_code == 401  # model status is inference scope too
    ok = guarded.post(url, BODY, headers=bearer(INFER))
    assert ok.status_code == 200 and len(ok.json()["predictions"][0]) == 10
    assert guarded.post(url, BODY, headers=bearer(ADMIN)).status_code == 200  # admin is accepted everywhere
    assert guarded.get(f"/v1/models/{MODEL}/metadata", headers=bearer(INFER)).status_code == 200


def test_the_openai_api_is_inference_scope(guarded: Any) -> None:
    """The OpenAI-compatible paths sit in the same route table as :predict and :generate,
    with the same scope; the official client's api_key is the bearer token."""
    body = {"model": MODEL, "prompt": "x"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        for headers in ({}, bearer(READ)):  # no token, another scope's token
            assert guarded.post(path, body, headers=headers).status_code == 401, (path, headers)
    assert guarded.get("/v1/models").status_code == 401
    assert guarded.get("/v1/models", headers=bearer(READ)).status_code == 401
    assert guarded.get("/v1/models", headers=bearer(INFER)).json() == {"object": "list", "data": []}
    passed = guarded.post("/v1/completions", body, headers=bearer(INFER))  # past auth: the mlp cannot generate
    assert passed.status_code == 400 and passed.json()["error"]["param"] == "model"
    openai = pytest.importorskip("openai", reason="the official OpenAI client (the test extra)")
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key=INFER + "x", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with openai.OpenAI(base_url=guarded.url + "/v1", api_key=INFER, max_retries=0) as client:
        assert client.models.list().data == []


def test_read_scope_takes_bearer_or_basic(guarded: Any) -> None:
    for path in ("/api/status", "/monitoring/prometheus/metrics", "/openapi.json", "/"):
        assert guarded.get(path).status_code == 401, path
        assert guarded.get(path, headers=bearer(INFER)).status_code == 401, path
        assert guarded.get(path, headers=bearer(READ)).status_code == 200, path
    page = guarded.get("/")
    challenges = page.headers["WWW-Authenticate"]
    assert "Bearer" in challenges and "Basic" in challenges  # a browser can log in to the page
    basic = base64.b64encode(f"anyone:{READ}".encode()).decode()
    assert guarded.get("/api/status", headers={"Authorization": f"Basic {basic}"}).status_code == 200


def test_admin_endpoints_need_the_admin_token(guarded: Any) -> None:
    for token in (None, INFER, READ, "x" * 40):
        r = guarded.post("/api/reload", b"", headers=bearer(token) if token else {})
        assert r.status_code == 401, (token, r.text)
    # a write to any other path is admin too (fail closed), even one that does not exist
    assert guarded.post("/api/anything-new", b"", headers=bearer(INFER)).status_code == 401
    assert guarded.post("/v1/../api/reload", b"", headers=bearer(INFER)).status_code == 401
    sync = guarded.post("/api/sync", b"", headers=bearer(ADMIN))
    assert sync.status_code == 409 and "sync.bucket" in sync.json()["error"]  # passed auth: no bucket here
    assert guarded.post("/api/reload", b"", headers=bearer(ADMIN)).json() == {"reloaded": True}


def test_status_never_shows_a_secret(guarded: Any) -> None:
    text = guarded.get("/api/status", headers=bearer(READ)).text
    for secret in (ADMIN, INFER, READ):
        assert secret not in text
    status = json.loads(text)
    security = status["config"]["security"]
    assert security["inference_token"] == "***"
    assert security["read_token_file"] == str(guarded.read_file)  # a path is fine to show
    assert status["security"]["scopes"]["admin"].startswith("token (file ")  # the credential, by path
    assert status["security"]["scopes"]["admin"].endswith("/credentials/admin-token)")
    assert status["security"]["scopes"]["inference"] == "token (security.inference_token)"
    assert status["http"]["max_connections"] >= 1 and status["http"]["tls"] is False


def test_reload_rereads_tokens(guarded: Any) -> None:
    new = "rotated-" + "d4" * 16
    write_config(guarded.config_path, guarded.models, new, guarded.read_file)
    try:
        assert guarded.post("/api/reload", b"", headers=bearer(ADMIN)).json() == {"reloaded": True}
        url = f"/v1/models/{MODEL}:predict"
        assert guarded.post(url, BODY, headers=bearer(INFER)).status_code == 401
        assert guarded.post(url, BODY, headers=bearer(new)).status_code == 200
        # a config that does not validate is refused through the API too, and the running one kept
        write_config(guarded.config_path, guarded.models, "short", guarded.read_file)
        refused = guarded.post("/api/reload", b"", headers=bearer(ADMIN))
        assert refused.status_code == 409 and "security.inference_token" in refused.json()["error"]
        assert guarded.post(url, BODY, headers=bearer(new)).status_code == 200
    finally:
        write_config(guarded.config_path, guarded.models, INFER, guarded.read_file)
        guarded.post("/api/reload", b"", headers=bearer(ADMIN))


def test_without_an_admin_token_admin_endpoints_are_off(open_server: Any) -> None:
    for path in ("/api/reload", "/api/sync", f"/api/models/{MODEL}/rollback"):
        r = open_server.post(path, b"", headers=bearer("anything-at-all-here"))
        assert r.status_code == 403, path
        message = r.json()["error"]
        assert "admin endpoints are off" in message and "admin_token_file" in message and "LoadCredential" in message
    # inference and read are open when they have no token of their own
    assert open_server.post(f"/v1/models/{MODEL}:predict", BODY).status_code == 200
    status = open_server.get("/api/status").json()
    assert status["security"]["scopes"] == {"admin": "off", "inference": "open", "read": "open"}


# -- the decision itself -------------------------------------------------------------------
@pytest.mark.parametrize("method,path,scope", [
    ("GET", "/healthz", None), ("GET", "/readyz", None), ("GET", "/v2/health/live", None),
    ("POST", "/v1/models/m:predict", "inference"), ("GET", "/v1/models/m", "inference"),
    ("POST", "/v2/models/m/infer", "inference"), ("GET", "/v2", "inference"),
    ("GET", "/", "read"), ("GET", "/api/status", "read"), ("GET", "/monitoring/prometheus/metrics", "read"),
    ("GET", "/openapi.json", "read"), ("HEAD", "/api/status", "read"),
    ("POST", "/api/sync", "admin"), ("POST", "/api/reload", "admin"), ("POST", "/api/models/m/rollback", "admin"),
    ("DELETE", "/api/status", "admin"), ("PUT", "/", "admin"), ("POST", "/v1/../api/sync", "admin"),
    ("POST", "//api/sync", "admin"), ("GET", "/v1/../api/status", "read"),
])
def test_scope_for(method: str, path: str, scope: str | None) -> None:
    assert auth.scope_for(method, path) == scope


class FakeCore:
    """A core with the config and the status registry auth.py uses (its ``TokenHolder``)."""

    def __init__(self, **security: Any):
        self.config = SimpleNamespace(security=SecurityConfig(**security), kserve=KServeConfig())
        self.sections: dict[str, Any] = {}

    def add_status(self, name: str, provider: Any) -> None:
        self.sections[name] = provider


def fake_core(**security: Any) -> Any:
    return FakeCore(**security)


def test_a_token_file_that_cannot_be_read_closes_its_scope(tmp_path: Path) -> None:
    core = fake_core(inference_token_file=str(tmp_path / "missing"), admin_token_file=str(tmp_path / "empty"))
    (tmp_path / "empty").write_text("\n")
    inference = auth.authorize(core, "inference", "Bearer whatever-token-value")
    assert not inference.allowed and inference.status == 503 and "missing" in inference.message
    admin = auth.authorize(core, "admin", None)
    assert admin.status == 403 and "holds no token" in admin.message
    assert auth.authorize(core, "read", None).allowed  # no read token: open
    assert "error" in core.sections["security"]()["scopes"]["inference"]


def test_credential_name_without_credentials_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    decision = auth.authorize(fake_core(admin_token_file="admin-token"), "admin", "Bearer x")
    assert decision.status == 403 and "CREDENTIALS_DIRECTORY" in decision.message


def test_default_credential_is_picked_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "inference-token").write_text(INFER)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path))
    core = fake_core()
    assert auth.authorize(core, "inference", None).status == 401
    assert auth.authorize(core, "inference", f"bearer {INFER}").allowed  # the scheme is case-insensitive
    assert auth.client_admin_token(SecurityConfig()) is None
    (tmp_path / "admin-token").write_text(ADMIN)
    assert auth.client_admin_token(SecurityConfig()) == ADMIN


@pytest.mark.parametrize("toml,key", [
    ('admin_token = "short"', "security.admin_token"),
    ('admin_token = "0123456789abcdef0"\nadmin_token_file = "x"', "security.admin_token"),
    ('tls_cert_file = "/c.pem"', "security.tls_key_file"),
    ('tls_client_ca_file = "/ca.pem"', "security.tls_client_ca_file"),
    ('tls_min_version = "TLSv1.0"', "security.tls_min_version"),
])
def test_bad_security_config_names_the_key(tmp_path: Path, toml: str, key: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f"[security]\n{toml}\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert key in str(err.value)


# -- gRPC ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["lean", "grpcio"])
def test_grpc_interceptor_applies_the_tokens(kind: str) -> None:
    import grpc

    from appliance.transport.grpc.aio_server import AioServer
    from appliance.transport.grpc.h2_server import LeanServer

    core = fake_core(inference_token=INFER)
    async def ok(request: bytes, context: Any) -> bytes:
        return b"ok:" + request

    echo = grpc.unary_unary_rpc_method_handler(ok)
    handlers = grpc.method_handlers_generic_handler("tensorflow.serving.PredictionService", {"Predict": echo})
    health = grpc.method_handlers_generic_handler("grpc.health.v1.Health", {"Check": echo})
    admin = grpc.method_handlers_generic_handler("tensorflow.serving.ModelService",
                                                 {"HandleReloadConfigRequest": echo})
    # either of the service's gRPC servers ([grpc] transport)
    server = (LeanServer if kind == "lean" else AioServer)(2, interceptors=[auth.grpc_interceptor(core)])
    server.add_generic_rpc_handlers((handlers, health, admin))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            def call(method: str, token: str | None = None) -> Any:
                stub = channel.unary_unary(method)
                metadata = (("authorization", f"Bearer {token}"),) if token else None
                try:
                    return stub(b"x", metadata=metadata, timeout=10)
                except grpc.RpcError as exc:
                    return exc.code(), exc.details()

            predict = "/tensorflow.serving.PredictionService/Predict"
            assert call(predict, INFER) == b"ok:x"
            code, details = call(predict)
            assert code == grpc.StatusCode.UNAUTHENTICATED and "inference token" in details
            assert call(predict, READ)[0] == grpc.StatusCode.UNAUTHENTICATED
            assert call("/grpc.health.v1.Health/Check") == b"ok:x"  # probes stay open
            code, details = call("/tensorflow.serving.ModelService/HandleReloadConfigRequest", INFER)
            assert code == grpc.StatusCode.PERMISSION_DENIED and "admin endpoints are off" in details
    finally:
        server.stop(None)


# -- rollback through the API (fleet sync from a folder bucket) ------------------------------
def test_rollback_endpoint_pins_and_unpins(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    from sync.publisher import publish
    from sync.open_source import open_source
    from tests.support.servers import free_port
    from tests.support.sync_scenario import device_config

    folder = tmp_path / "bucket"
    bucket = open_source(f"file://{folder}")
    tflite = str(models_dir / "keras_mlp_tflite" / "1")
    publish(bucket, MODEL, tflite, 1, channel="stable")
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "admin-token").write_text(ADMIN)
    port = free_port()
    config = device_config(tmp_path, port, f"file://{folder}")
    server = start_server("--config", str(config), "--backend", "tflite", port=port,
                          env={"CREDENTIALS_DIRECTORY": str(creds)})

    def serving() -> Any:
        return server.status()["models"].get(MODEL, {}).get("serving_version")

    server.wait_for(lambda: serving() == 1, 60, "version 1 serving")
    publish(bucket, MODEL, tflite, 2, channel="stable")
    server.wait_for(lambda: serving() == 2, 60, "version 2 serving")
    url = f"/api/models/{MODEL}/rollback"
    assert server.post(url, b"").status_code == 401  # an admin endpoint
    assert server.post(url, {"version": 7}, headers=bearer(ADMIN)).status_code == 409  # not on disk: says so
    assert server.post(url, {"version": "1"}, headers=bearer(ADMIN)).status_code == 400
    pinned = server.post(url, b"", headers=bearer(ADMIN))  # default: the version below the newest
    assert pinned.status_code == 200 and pinned.json()["pinned"] == 1
    server.wait_for(lambda: serving() == 1, 60, "the rollback to version 1")
    cleared = server.post(url, {"clear": True}, headers=bearer(ADMIN))
    assert cleared.status_code == 200 and cleared.json()["pinned"] is None
    server.wait_for(lambda: serving() == 2, 60, "version 2 again once unpinned")
    assert server.post("/api/sync", b"", headers=bearer(ADMIN)).json()["targets"] == {MODEL: 2}
