"""One route table for the REST app: every path, the handler that answers it, its auth scope.

The table is Flask's own ``url_map`` (a werkzeug ``Map``) with ``Route`` as its rule class,
so ``app.add_url_rule(..., scope=ADMIN)`` and ``@blueprint.post(..., scope=ADMIN)`` (the
parts' endpoints) register there with their scope, plus **mounts**: the path families an
API answers itself without Flask (TF Serving's ``/v1``, KServe v2's ``/v2``, ``:generate``,
the OpenAI API's three ``/v1`` paths).

Mounts are matched first, on the *raw* path (undecoded, as sent: ``REQUEST_URI`` without
the query), by prefix: TF Serving's dispatcher matches ``(?i)/v1/.*`` on the undecoded
``uri_path()`` and its handler parses model names out of that (then decodes them), so
``/v1/models/..%2F..%2Fetc:predict`` is a predict of a model named ``../../etc``, not a
path that climbs out of ``/v1``. A prefix test per mount is all the hot path pays.

Everything else is matched by werkzeug on ``PATH_INFO``, as Flask dispatches it. A path
with a dot segment or an empty segment (``/v1/../api/sync``, ``//api/sync``) is guarded as
the path it normalises to (what a router or proxy in front might make of it) and still
answered as sent: the guard is never weaker than the route a normaliser would reach.

Scopes (appliance/api/auth.py ``authorize`` decides): ``OPEN`` (None), ``INFERENCE``,
``READ``, ``ADMIN``. ``rule_scope`` is the rule every entry keeps: ``/healthz``,
``/readyz`` and ``/v2/health/*`` open; ``/v1``, ``/v2`` inference; any other GET/HEAD
read; any other method admin (fail closed). A route may be stricter (admin) than the
rule, never weaker: ``Route`` and ``RouteTable.mount`` refuse that when registered.

Thread-safety: routes and mounts are registered while the app is built (before serving);
``resolve`` only reads and may be called from any thread.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, Rule

OPEN: str | None = None
ADMIN, INFERENCE, READ = "admin", "inference", "read"
SCOPES = (ADMIN, INFERENCE, READ)
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
SAFE_METHODS = frozenset({"GET", "HEAD"})
ROUTE_KEY = "appliance.route"  # environ key: the (handler, scope) resolve found, for the layers inside

WSGIApp = Callable[..., Any]
_BY_RULE = object()  # "no scope given": the rule's


def normal(path: str) -> bool:
    return "/." not in path and "//" not in path


def normalise(path: str) -> str:
    """What a router might make of a path with dot or empty segments."""
    return path if normal(path) else posixpath.normpath(path) + ("/" if path.endswith("/") else "")


def rule_scope(method: str, path: str) -> str | None:
    """The scope rule (module docstring) for ``method path``; paths are normalised first."""
    path = normalise(path)
    if path in OPEN_PATHS or path.startswith("/v2/health/"):
        return OPEN
    if path.startswith(("/v1/", "/v2/")) or path in ("/v1", "/v2"):
        return INFERENCE
    return READ if method.upper() in SAFE_METHODS else ADMIN


def _check(where: str, scope: str | None, wanted: set[str | None]) -> None:
    if scope not in wanted | {ADMIN}:
        raise ValueError(f"route {where}: scope {scope!r} is weaker than the rule's "
                         f"{sorted(map(str, wanted))} (appliance/api/routes.py rule_scope)")


class Route(Rule):
    """A werkzeug ``Rule`` carrying its auth scope (default: the rule's for its methods).

    Flask's ``url_rule_class`` in this app, so ``scope=`` is one more option of
    ``add_url_rule`` and of a blueprint's ``route``/``get``/``post``."""

    def __init__(self, string: str, scope: Any = _BY_RULE, **options: Any):
        super().__init__(string, **options)
        methods = sorted(self.methods or {"GET"})
        sample = string.split("<", 1)[0] + ("x" if "<" in string else "")  # a path this rule matches
        wanted = {rule_scope(m, sample) for m in methods if m != "OPTIONS"} or {READ}
        if scope is _BY_RULE:
            scope = next(iter(wanted)) if len(wanted) == 1 else ADMIN  # mixed reads and writes: the stricter
        _check(f"{'|'.join(methods)} {string}", scope, wanted)
        self.scope: str | None = scope

    def get_empty_kwargs(self) -> Any:
        return {**super().get_empty_kwargs(), "scope": self.scope}


@dataclass(frozen=True)
class Mount:
    """A path family one API answers itself, matched on the raw path by ``prefix``.

    ``prefix`` ends with "/"; the bare prefix without it matches too ("/v2"). ``methods``,
    ``suffix`` and ``pattern``, when set, narrow it (``POST /v1/models/...:generate``).
    ``handler`` is a WSGI app."""

    name: str
    prefix: str
    scope: str | None
    handler: WSGIApp = field(compare=False)
    methods: frozenset[str] | None = None
    suffix: str = ""
    pattern: re.Pattern[str] | None = None  # checked last, only when prefix and suffix matched
    summary: str = ""

    def matches(self, method: str, raw: str) -> bool:
        if not (raw.startswith(self.prefix) or raw == self.prefix[:-1]):
            return False
        if self.suffix and not raw.endswith(self.suffix):
            return False
        if self.methods is not None and method not in self.methods:
            return False
        return self.pattern is None or self.pattern.fullmatch(raw) is not None


@dataclass(frozen=True)
class Entry:
    """One line of ``RouteTable.entries``: what a reviewer (and tests/test_routes.py) reads."""

    kind: str  # "mount" or "route"
    path: str
    methods: tuple[str, ...]
    scope: str | None
    endpoint: str


class RouteTable:
    """Mounts (raw path, by prefix) over a werkzeug ``Map`` (everything else), one scope each.

    ``fallback`` answers what no mount takes: the Flask app inside, which dispatches its
    rules from the same ``Map`` and answers 404/405 for the rest."""

    def __init__(self, url_map: Map, fallback: WSGIApp):
        self.map = url_map
        self.fallback = fallback
        self.mounts: list[Mount] = []

    def mount(self, mount: Mount) -> None:
        sample = mount.prefix + "x" + mount.suffix
        wanted = {rule_scope(m, sample) for m in (mount.methods or ("GET", "POST"))}
        _check(f"{mount.name} {mount.prefix}*{mount.suffix}", mount.scope, wanted)
        self.mounts.append(mount)
        # the most specific first: longer prefixes, and a suffix before none
        self.mounts.sort(key=lambda m: (-len(m.prefix), not m.suffix, m.methods is None))

    def resolve(self, environ: dict[str, Any]) -> tuple[WSGIApp, str | None]:
        """(handler, scope) of a request. The hot path: a few prefix tests, no werkzeug."""
        method = environ.get("REQUEST_METHOD", "GET")
        raw = raw_path(environ).partition("?")[0]
        for mount in self.mounts:
            if mount.matches(method, raw):
                return mount.handler, (mount.scope if normal(raw) else self.scope(method, normalise(raw)))
        path = environ.get("PATH_INFO", "") or "/"
        if not normal(raw) or not normal(path):
            return self.fallback, self.scope(method, normalise(path if normal(raw) else raw))
        return self.fallback, self.scope(method, path)

    def scope(self, method: str, path: str) -> str | None:
        """The scope of ``method path`` (a normal path): its mount's, its route's, or the rule's."""
        for mount in self.mounts:
            if mount.matches(method, path):
                return mount.scope
        try:
            rule, _ = self.map.bind("localhost").match(path, method, return_rule=True)
        except HTTPException:  # 404, 405, a redirect (strict or merged slashes): no route answers as is
            return rule_scope(method, path)
        if method == "OPTIONS" or not hasattr(rule, "scope"):  # Flask's automatic OPTIONS; its plain static Rule
            return rule_scope(method, path)
        return rule.scope  # type: ignore[no-any-return]

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """Dispatch: the handler the outer layer resolved (``ROUTE_KEY``), else resolve now."""
        found = environ.get(ROUTE_KEY)
        handler = found[0] if found is not None else self.resolve(environ)[0]
        return handler(environ, start_response)  # type: ignore[no-any-return]

    def entries(self) -> list[Entry]:
        out = [Entry("mount", f"{m.prefix}*{m.suffix}", tuple(sorted(m.methods or ("*",))), m.scope, m.name)
               for m in self.mounts]
        for rule in self.map.iter_rules():
            methods = tuple(sorted((rule.methods or {"GET"}) - {"OPTIONS"}))
            scope = rule.scope if isinstance(rule, Route) else rule_scope(methods[0] if methods else "GET", rule.rule)
            out.append(Entry("route", rule.rule, methods, scope, rule.endpoint))
        return out


def raw_path(environ: dict[str, Any]) -> str:
    """The path as TF Serving matches it: undecoded when the server gives it, with the query."""
    raw = environ.get("RAW_URI") or environ.get("REQUEST_URI")
    if raw:
        raw = str(raw)
        if not raw.startswith("/") and "://" in raw:  # absolute-form: the part after host and port
            raw = "/" + raw.partition("://")[2].partition("/")[2]
        return raw
    query = environ.get("QUERY_STRING", "")
    return str(environ.get("PATH_INFO", "")) + (f"?{query}" if query else "")


__all__ = ["ADMIN", "INFERENCE", "OPEN", "READ", "SCOPES", "Entry", "Mount", "Route", "RouteTable",
           "raw_path", "rule_scope"]
