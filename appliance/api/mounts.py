"""Mounts and scopes: the part of the route table that needs no web framework.

A **mount** is a path family one API answers itself (TF Serving's ``/v1``, KServe v2's ``/v2``,
``:generate``, the OpenAI API's three ``/v1`` paths), matched on the *raw* path (undecoded, as
sent: ``REQUEST_URI`` without the query), by prefix: TF Serving's dispatcher matches
``(?i)/v1/.*`` on the undecoded ``uri_path()`` and its handler parses model names out of that
(then decodes them), so ``/v1/models/..%2F..%2Fetc:predict`` is a predict of a model named
``../../etc``, not a path that climbs out of ``/v1``. A prefix test per mount is all the hot
path pays.

Scopes (appliance/api/auth.py ``authorize`` decides): ``OPEN`` (None), ``INFERENCE``, ``READ``,
``ADMIN``. ``rule_scope`` is the rule every entry keeps: ``/healthz``, ``/readyz`` and
``/v2/health/*`` open; ``/v1``, ``/v2`` inference; any other GET/HEAD read; any other method
admin (fail closed). A route may be stricter (admin) than the rule, never weaker.

``Mounts`` is what both the serving process's route table (appliance/api/routes.py, over Flask's
``url_map``) and a front worker's front path (appliance/fronts/app.py, no Flask at all) match
requests with: one matching, one scope rule, in both.

Thread-safety: mounts are added while the app is built (before serving); ``match`` only reads.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator
from wsgiref.types import WSGIEnvironment

OPEN: str | None = None
ADMIN, INFERENCE, READ = "admin", "inference", "read"
SCOPES = (ADMIN, INFERENCE, READ)
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
# Probes the HTTP server never sheds under overload (a liveness probe answered 503 gets a busy
# service restarted): ours, and the Open Inference Protocol's server health that KServe's and
# Triton's probes and clients call (Triton never sheds them either).
PROBE_PATHS = OPEN_PATHS | {"/v2/health/live", "/v2/health/ready"}
SAFE_METHODS = frozenset({"GET", "HEAD"})
ROUTE_KEY = "appliance.route"  # environ key: the (handler, scope) resolve found, for the layers inside

WSGIApp = Callable[..., Any]


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


def check_scope(where: str, scope: str | None, wanted: set[str | None]) -> None:
    if scope not in wanted | {ADMIN}:
        raise ValueError(f"route {where}: scope {scope!r} is weaker than the rule's "
                         f"{sorted(map(str, wanted))} (appliance/api/routes.py rule_scope)")


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


class Mounts:
    """The mounts of an app, most specific first; ``match`` finds a request's."""

    def __init__(self) -> None:
        self.mounts: list[Mount] = []

    def add(self, mount: Mount) -> None:
        sample = mount.prefix + "x" + mount.suffix
        wanted = {rule_scope(m, sample) for m in (mount.methods or ("GET", "POST"))}
        check_scope(f"{mount.name} {mount.prefix}*{mount.suffix}", mount.scope, wanted)
        self.mounts.append(mount)
        # the most specific first: longer prefixes, and a suffix before none
        self.mounts.sort(key=lambda m: (-len(m.prefix), not m.suffix, m.methods is None))

    def match(self, method: str, raw: str) -> Mount | None:
        """The mount taking ``method`` on the raw path ``raw`` (no query), or None."""
        for mount in self.mounts:
            if mount.matches(method, raw):
                return mount
        return None

    def __iter__(self) -> Iterator[Mount]:
        return iter(self.mounts)


def raw_path(environ: WSGIEnvironment) -> str:
    """The path as TF Serving matches it: undecoded when the server gives it, with the query."""
    raw = environ.get("RAW_URI") or environ.get("REQUEST_URI")
    if raw:
        raw = str(raw)
        if not raw.startswith("/") and "://" in raw:  # absolute-form: the part after host and port
            raw = "/" + raw.partition("://")[2].partition("/")[2]
        return raw
    query = environ.get("QUERY_STRING", "")
    return str(environ.get("PATH_INFO", "")) + (f"?{query}" if query else "")
