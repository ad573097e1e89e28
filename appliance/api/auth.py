"""Bearer tokens: who may change the device, run models, or read its status.

Three scopes; each route of the REST app's one table (appliance/api/routes.py) carries
one, and every route keeps this rule (``scope_for``, for paths no route takes):

* **admin**: every request that is not a GET/HEAD outside ``/v1/`` and ``/v2/``: sync now,
  rollback, reload, rollout promote/abort, and any state-changing endpoint added later
  (unknown non-GET paths are admin too: fail closed). With no admin token configured,
  admin endpoints are *off*: 403 and how to turn them on. There is no default token.
* **inference**: ``/v1/...`` and ``/v2/...`` (TF Serving and KServe v2: predict,
  metadata, model status) and the gRPC services. Open unless an inference token is set.
* **read**: the status page ``/``, ``/api/status``, ``/monitoring/...``, ``/openapi.json``
  and anything else read-only. Open unless a read token is set.

``/healthz``, ``/readyz`` and ``/v2/health/*`` are always open (probes carry no secrets).
The admin token is accepted for every scope.

Tokens come from ``[security]``: the token itself, or a file (an absolute path, or a name
in systemd's ``$CREDENTIALS_DIRECTORY``, i.e. ``LoadCredential=``); with neither, the
credential ``<scope>-token`` is used when the unit provides one. Files are read when the
running config is first used (start-up) and again after each reload, never per request.
A configured file that cannot be read closes its scope (fail closed) and says why.

Clients send ``Authorization: Bearer <token>``; ``Basic`` with the token as the password
is accepted too, so a browser can open a protected status page. Tokens are compared as
SHA-256 digests with ``hmac.compare_digest``: constant time, and the length leaks nothing.

``authorize(core, scope, header)`` is the one decision; ``AuthLayer`` (the outermost WSGI
layer, appliance/api/app.py) applies it to HTTP with the matched route's scope, and
``grpc_interceptor(core)`` to gRPC (``authorization`` metadata). Refusals are rendered by
appliance/api/errors.py ``render``, like every other error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import threading
import weakref
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable, Protocol
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from appliance.api.errors import render, wsgi_answer
from appliance.api.mounts import ADMIN, INFERENCE, READ, ROUTE_KEY, SAFE_METHODS, SCOPES, rule_scope
from appliance.core.config import Config, SecurityConfig

if TYPE_CHECKING:
    from appliance.core.json_types import ReadJSONValue
    import grpc
    from prometheus_client import Counter

    from appliance.api.grpc_errors import CallContext
    from appliance.api.routes import RouteTable
    from appliance.core.appliance import Appliance

REALM = "edge-appliance"
ADMIN_OFF = ("admin endpoints are off: no admin token is configured. Turn them on with "
             "security.admin_token_file (a file holding the token, or a systemd credential name) or "
             "security.admin_token in the config, or give the unit a credential named admin-token "
             "(LoadCredential=admin-token:/etc/edge-appliance/admin-token), then reload or restart")
# gRPC methods by scope; everything else is inference.
GRPC_OPEN = ("/grpc.health.v1.Health/", "/inference.GRPCInferenceService/ServerLive",
             "/inference.GRPCInferenceService/ServerReady")
MODEL_CONTROL = ("/inference.GRPCInferenceService/RepositoryModelLoad",
                 "/inference.GRPCInferenceService/RepositoryModelUnload")
GRPC_ADMIN = ("/tensorflow.serving.ModelService/HandleReloadConfigRequest", *MODEL_CONTROL)


@dataclass(frozen=True)
class ScopeToken:
    """One scope's credential: a digest, nothing (open / off), or an error (closed)."""

    digest: bytes | None = None
    source: str = ""  # where it came from, for the status page (never the token)
    error: str = ""


NO_TOKEN = ScopeToken()  # a scope with nothing configured (frozen, so one is shared)


@dataclass(frozen=True)
class Tokens:
    scopes: dict[str, ScopeToken] = field(default_factory=dict)

    def summary(self) -> dict[str, str]:
        """Per scope: "token (from ...)", "open", "off" or the error. Safe to show."""
        out = {}
        for scope in SCOPES:
            t = self.scopes.get(scope, ScopeToken())
            out[scope] = (f"error: {t.error}" if t.error else f"token ({t.source})" if t.digest
                          else "off" if scope == ADMIN else "open")
        return out


@dataclass(frozen=True)
class Decision:
    allowed: bool
    status: int = 200  # 401 no/wrong token, 403 admin off, 503 a token file that cannot be read
    message: str = ""
    invalid_token: bool = False  # a token was sent and is wrong (RFC 6750 error="invalid_token")


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _credential_path(name: str) -> str | None:
    directory = os.environ.get("CREDENTIALS_DIRECTORY", "")
    return os.path.join(directory, name) if directory else None


def _read_token_file(path: str) -> tuple[str, str]:
    """(token, error) from a file whose whole content (stripped) is the token."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read(4096).strip()
    except (OSError, UnicodeDecodeError) as exc:
        return "", f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}"
    if len(token) < 16:
        return "", f"{path} holds {'no token' if not token else 'a token shorter than 16 characters'}"
    return token, ""


def _resolve(security: SecurityConfig, scope: str) -> ScopeToken:
    token = getattr(security, f"{scope}_token", "")
    if token:
        return ScopeToken(_digest(token), f"security.{scope}_token")
    name = getattr(security, f"{scope}_token_file", "")
    if name:
        path = name if os.path.isabs(name) else _credential_path(name)
        if path is None:
            return ScopeToken(error=f"security.{scope}_token_file = {name!r} is a credential name but "
                                    "$CREDENTIALS_DIRECTORY is not set (LoadCredential= in the unit)")
        value, error = _read_token_file(path)
        return ScopeToken(error=f"security.{scope}_token_file: {error}") if error else \
            ScopeToken(_digest(value), f"file {path}")
    path = _credential_path(f"{scope}-token")
    if path and os.path.exists(path):
        value, error = _read_token_file(path)
        return ScopeToken(error=f"credential {scope}-token: {error}") if error else \
            ScopeToken(_digest(value), f"credential {scope}-token")
    return ScopeToken()


def load_tokens(security: SecurityConfig) -> Tokens:
    """Every scope's token from a ``SecurityConfig`` (reads the token files)."""
    return Tokens({scope: _resolve(security, scope) for scope in SCOPES})


class _Cache:
    """The tokens of the running config; re-read when a reload replaces ``core.config``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.security: SecurityConfig | None = None
        self.tokens = Tokens()


class TokenHolder(Protocol):
    """What the token check reads of a core: the running config, and where it shows the
    tokens' state (the serving process's ``Appliance``; a front worker's ``RemoteCore``)."""

    @property
    def config(self) -> Config: ...

    def add_status(self, name: str, provider: Callable[[], ReadJSONValue]) -> None: ...


_caches_lock = threading.Lock()
_caches: "weakref.WeakKeyDictionary[TokenHolder, _Cache]" = weakref.WeakKeyDictionary()  # per core: dies with it


def tokens_for(core: TokenHolder) -> Tokens:
    cache = _caches.get(core)
    if cache is None:
        with _caches_lock:
            cache = _caches.setdefault(core, _Cache())
    security = core.config.security
    if cache.security is not security:  # first use, or a reload installed a new config
        with cache.lock:
            if cache.security is not security:
                cache.tokens = load_tokens(security)
                cache.security = security
                tokens, tls = cache.tokens, bool(security.tls_cert_file)
                core.add_status("security", lambda: {"scopes": tokens.summary(), "tls": tls})
    return cache.tokens


def presented_token(header: str | None) -> str | None:
    """The token in an Authorization header: ``Bearer <t>``, or ``Basic`` with ``<t>`` as password."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer":
        return value or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None


def authorize(core: TokenHolder, scope: str | None, authorization_header: str | None) -> Decision:
    """May a request with this Authorization header use ``scope``? (None: an open path.)"""
    if scope is None:
        return Decision(True)
    tokens = tokens_for(core)
    own = tokens.scopes.get(scope, NO_TOKEN)
    admin = tokens.scopes.get(ADMIN, NO_TOKEN)
    if scope == ADMIN and not admin.digest:
        return Decision(False, 403, f"admin endpoints are off: {admin.error}" if admin.error else ADMIN_OFF)
    if own.error:  # a token is configured for this scope but unusable: closed, and why
        return Decision(False, 503, f"{scope} endpoints are closed: {own.error}")
    if not own.digest:
        return Decision(True)  # an open scope
    token = presented_token(authorization_header)
    if token is None:
        return Decision(False, 401, f"this endpoint needs the {scope} token: send 'Authorization: Bearer <token>'")
    given = _digest(token)
    accepted = [t.digest for t in (own, admin) if t.digest]
    ok = False
    for digest in accepted:  # compare with each, always: no early exit to time
        ok |= hmac.compare_digest(given, digest)
    if ok:
        return Decision(True)
    return Decision(False, 401, f"the bearer token is not valid for {scope} endpoints", invalid_token=True)


def scope_for(method: str, path: str) -> str | None:
    """The scope rule for ``method path`` (None: always open). Unknown writes are admin.

    The rule every route of the table keeps (appliance/api/routes.py ``rule_scope``); a
    request is guarded by its matched route's scope, this rule only for paths no route takes."""
    return rule_scope(method, path)


class AuthLayer:
    """The outermost WSGI layer: every request passes ``authorize`` before anything else runs.

    The scope is the matched route's (``RouteTable.resolve``); the match is left in the
    environ (``ROUTE_KEY``) so the table dispatches without matching again."""

    def __init__(self, inner: WSGIApplication, core: "Appliance", table: "RouteTable"):
        self.inner: WSGIApplication = inner
        self.core = core
        self.table = table
        self.failures = _failure_counter(core)

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        found = environ[ROUTE_KEY] = self.table.resolve(environ)
        scope = found[1]
        decision = authorize(self.core, scope, environ.get("HTTP_AUTHORIZATION"))
        if decision.allowed:
            return self.inner(environ, start_response)
        if self.failures is not None:
            self.failures.labels(scope=scope or "", status=str(decision.status)).inc()
        method = environ.get("REQUEST_METHOD", "GET")
        return _deny(decision, scope or "", method, environ.get("PATH_INFO", "") or "/", start_response)


def _deny(decision: Decision, scope: str, method: str, path: str,
          start_response: StartResponse) -> Iterable[bytes]:
    headers = [("Cache-Control", "no-store")]
    if decision.status == 401:
        challenge = f'Bearer realm="{REALM}", scope="{scope}"'
        if decision.invalid_token:
            challenge += ', error="invalid_token"'
        headers.append(("WWW-Authenticate", challenge))
        if scope == READ and method in SAFE_METHODS and not path.startswith(("/api/", "/monitoring/")):
            headers.append(("WWW-Authenticate", f'Basic realm="{REALM}", charset="UTF-8"'))  # the page, in a browser
    return wsgi_answer(start_response, render(decision.status, decision.message, headers=headers), method)


def _failure_counter(core: "Appliance") -> Counter | None:
    """edge_appliance_auth_refusals_total{scope,status}: someone knocking shows on a dashboard."""
    registry = getattr(getattr(core, "metrics", None), "registry", None)
    if registry is None:
        return None
    try:
        from prometheus_client import Counter

        return Counter("edge_appliance_auth_refusals", "Requests refused by the token check",
                       ["scope", "status"], registry=registry)
    except (ImportError, ValueError):  # no prometheus_client, or already registered on this core
        return None


# -- gRPC ----------------------------------------------------------------------------------
def grpc_scope(method: str, control_scope: str = ADMIN) -> str | None:
    """The scope of a gRPC method name ("/package.Service/Method"); ``control_scope``: that of
    Triton's model load and unload (``[kserve] model_control_scope``)."""
    if method.startswith(GRPC_OPEN):
        return None
    if method in MODEL_CONTROL:
        return control_scope
    if method in GRPC_ADMIN:
        return ADMIN
    return INFERENCE


def grpc_interceptor(core: TokenHolder) -> object:
    """A ``grpc.aio.ServerInterceptor`` (the gRPC port is a grpc.aio server) applying
    ``authorize`` to each call's ``authorization`` metadata: UNAUTHENTICATED for a missing
    or wrong token, PERMISSION_DENIED for admin methods while admin is off, UNAVAILABLE
    when the scope's token file cannot be read."""
    import grpc  # only where gRPC is served

    codes = {401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED,
             503: grpc.StatusCode.UNAVAILABLE}

    class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped: its base class is Any
        async def intercept_service(
                self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            scope = grpc_scope(details.method, core.config.kserve.model_control_scope)
            header = next((v for k, v in (details.invocation_metadata or ()) if k == "authorization"), None)
            if isinstance(header, bytes):
                header = header.decode("latin-1")
            decision = authorize(core, scope, header)
            handler = await continuation(details)
            if decision.allowed or handler is None:
                return handler
            return _denying_handler(grpc, handler, codes[decision.status], decision.message)

    return TokenInterceptor()


def _denying_handler(grpc: ModuleType, handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
                     message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that aborts every call with ``code``."""

    def deny(request: object, context: CallContext) -> None:
        context.abort(code, message)

    kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler),
             ("unary_stream", grpc.unary_stream_rpc_method_handler),
             ("stream_unary", grpc.stream_unary_rpc_method_handler),
             ("stream_stream", grpc.stream_stream_rpc_method_handler))
    for attr, make in kinds:
        if getattr(handler, attr) is not None:
            return make(deny, request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
    return handler


def client_admin_token(security: SecurityConfig) -> str | None:
    """The admin token as a local client (``appliance sync``/``rollback``) finds it: the
    config's token or file, or the ``admin-token`` credential; None when there is none."""
    for source in (getattr(security, "admin_token", ""),):
        if source:
            return str(source)
    name = getattr(security, "admin_token_file", "") or "admin-token"
    path = name if os.path.isabs(name) else _credential_path(name)
    if path and os.path.exists(path):
        token, error = _read_token_file(path)
        return token or None
    return None
