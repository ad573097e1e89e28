"""One route table for the REST app: every path, the handler that answers it, its auth scope.

The table is Flask's own ``url_map`` (a werkzeug ``Map``) with ``Route`` as its rule class,
so ``app.add_url_rule(..., scope=ADMIN)`` and ``@blueprint.post(..., scope=ADMIN)`` (the
parts' endpoints) register there with their scope, plus **mounts**: the path families an
API answers itself without Flask (TF Serving's ``/v1``, KServe v2's ``/v2``, ``:generate``,
the OpenAI API's three ``/v1`` paths).

Mounts are matched first, on the raw path, by prefix (appliance/api/mounts.py: the part a
front worker shares, with the scope rule).

Everything else is matched by werkzeug on ``PATH_INFO``, as Flask dispatches it. A path
with a dot segment or an empty segment (``/v1/../api/sync``, ``//api/sync``) is guarded as
the path it normalises to (what a router or proxy in front might make of it) and still
answered as sent: the guard is never weaker than the route a normaliser would reach.

Scopes and the rule every entry keeps are appliance/api/mounts.py's: a route may be
stricter (admin) than the rule, never weaker: ``Route`` and ``RouteTable.mount`` refuse that
when registered.

Thread-safety: routes and mounts are registered while the app is built (before serving);
``resolve`` only reads and may be called from any thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, Rule

from appliance.api.mounts import (ADMIN, INFERENCE, OPEN, OPEN_PATHS, READ, ROUTE_KEY, SAFE_METHODS, SCOPES, Mount,
                                  Mounts, WSGIApp, check_scope, normal, normalise, raw_path, rule_scope)

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

_BY_RULE = object()  # "no scope given": the rule's


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
        check_scope(f"{'|'.join(methods)} {string}", scope, wanted)
        self.scope: str | None = scope

    def get_empty_kwargs(self) -> Any:
        return {**super().get_empty_kwargs(), "scope": self.scope}


@dataclass(frozen=True)
class Entry:
    """One line of ``RouteTable.entries``: what a reviewer (and tests/api/test_routes.py) reads."""

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
        self.mounts = Mounts()

    def mount(self, mount: Mount) -> None:
        self.mounts.add(mount)

    def resolve(self, environ: WSGIEnvironment) -> tuple[WSGIApp, str | None]:
        """(handler, scope) of a request. The hot path: a few prefix tests, no werkzeug."""
        method = environ.get("REQUEST_METHOD", "GET")
        raw = raw_path(environ).partition("?")[0]
        mount = self.mounts.match(method, raw)
        if mount is not None:
            return mount.handler, (mount.scope if normal(raw) else self.scope(method, normalise(raw)))
        path = environ.get("PATH_INFO", "") or "/"
        if not normal(raw) or not normal(path):
            return self.fallback, self.scope(method, normalise(path if normal(raw) else raw))
        return self.fallback, self.scope(method, path)

    def scope(self, method: str, path: str) -> str | None:
        """The scope of ``method path`` (a normal path): its mount's, its route's, or the rule's."""
        mount = self.mounts.match(method, path)
        if mount is not None:
            return mount.scope
        try:
            rule, _ = self.map.bind("localhost").match(path, method, return_rule=True)
        except HTTPException:  # 404, 405, a redirect (strict or merged slashes): no route answers as is
            return rule_scope(method, path)
        if method == "OPTIONS" or not hasattr(rule, "scope"):  # Flask's automatic OPTIONS; its plain static Rule
            return rule_scope(method, path)
        return rule.scope  # type: ignore[no-any-return]  # werkzeug's Rule has no scope: ours (Route) does, hasattr checked above

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        """Dispatch: the handler the outer layer resolved (``ROUTE_KEY``), else resolve now."""
        found = environ.get(ROUTE_KEY)
        handler = found[0] if found is not None else self.resolve(environ)[0]
        return handler(environ, start_response)  # type: ignore[no-any-return]  # the route's handler is a WSGI app of Any

    def entries(self) -> list[Entry]:
        out = [Entry("mount", f"{m.prefix}*{m.suffix}", tuple(sorted(m.methods or ("*",))), m.scope, m.name)
               for m in self.mounts]
        for rule in self.map.iter_rules():
            methods = tuple(sorted((rule.methods or {"GET"}) - {"OPTIONS"}))
            scope = rule.scope if isinstance(rule, Route) else rule_scope(methods[0] if methods else "GET", rule.rule)
            out.append(Entry("route", rule.rule, methods, scope, rule.endpoint))
        return out


__all__ = ["ADMIN", "INFERENCE", "OPEN", "OPEN_PATHS", "READ", "ROUTE_KEY", "SAFE_METHODS", "SCOPES", "Entry",
           "Mount", "Route", "RouteTable", "normal", "raw_path", "rule_scope"]
