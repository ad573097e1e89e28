"""How a CLI verb finds and calls the running service on this device.

The service is found as it was started: ``--config`` and ``--state`` (else
``$STATE_DIRECTORY``, else ``~/.local/state/edge-appliance``) name its state directory,
whose ``service.json`` (appliance/core/running.py) says where it listens and where its
admin token comes from. ``--url`` overrides the address; without a record the config's
``[server]`` host and port are used.

The admin token: ``--token-file``; else the config's ``[security]`` (token, file, or the
unit's ``admin-token`` credential); else the file the service's record names; else
``<state>/admin-token`` (the embedded default's).

A refusal (401, 403, 409...) or an unreachable service is a ``ServiceError`` whose text
says what was used (URL and where it came from, the token's file) and what to pass
instead. Only the standard library at import time.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.core import running
from appliance.core.json_read import obj, str_or_none
from appliance.core.json_types import JSONObject, ReadJSONObject

if TYPE_CHECKING:
    from appliance.core.config import Config

UNIT_STATE_DIR = "/var/lib/edge-appliance"  # systemd/edge-appliance.service: StateDirectory=edge-appliance


class ServiceError(Exception):
    """The service refused, or could not be reached; the text says what to pass."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class Client:
    """One verb's way to the service: where it is, how it was found, the token it sends
    and where that came from (``from_args``; module docstring). One per command run."""

    url: str
    url_from: str  # how the URL was found, for messages
    state_dir: str
    record: JSONObject | None  # the service's service.json (appliance/core/running.py)
    token: str | None
    token_from: str
    timeout: float = 120.0
    cafile: str | None = None  # the service's own certificate, for https on this machine

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Client":
        from appliance.core.config_file import load as load_config

        config = load_config(getattr(args, "config", None), {"state_dir": getattr(args, "state", None)})
        state_dir = os.path.abspath(config.state_dir)
        record = running.read(state_dir)
        url, url_from = _url(args, config, record, state_dir)
        token, token_from = _token(args, config, record, state_dir)
        cafile = str_or_none(obj((record or {}).get("rest", {})).get("cert_file")) if url.startswith("https:") else None
        return cls(url.rstrip("/"), url_from, state_dir, record, token, token_from,
                   float(getattr(args, "timeout", 120) or 120), cafile)

    def call(self, method: str, path: str, body: bytes = b"") -> Any:
        """The JSON answer of ``method path``; ``ServiceError`` (what to pass) otherwise."""
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url + path, data=body if method != "GET" else None,
                                         method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self._tls()) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise ServiceError(self.refused(exc.code, _error_text(exc)), exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServiceError(f"cannot reach the service at {self.url} ({self.url_from}): {reason}"
                               f"{self.unreachable_hint()}") from None

    def _tls(self) -> ssl.SSLContext | None:
        if not self.url.startswith("https:"):
            return None
        context = ssl.create_default_context()
        if self.cafile and os.access(self.cafile, os.R_OK):
            context.load_verify_locations(self.cafile)  # the device's own (often self-signed) certificate
            context.check_hostname = False  # this machine's loopback address is not in it; the certificate is pinned
        return context

    # -- what to say -------------------------------------------------------------------------
    def refused(self, status: int, text: str) -> str:
        line = f"the service at {self.url} answered {status}: {text}"
        if status in (401, 403) or "token" in text:
            line += f"\n  the admin token sent came from {self.token_from}{self._token_hint()}"
        return line

    def _token_hint(self) -> str:
        recorded = self.record or {}
        there = obj(recorded.get("rest")).get("url")
        wanted = "pass the --state DIR (or --config FILE) that service was started with, or --token-file FILE"
        if there == self.url:
            source = obj(recorded.get("admin_token"))
            where = source.get("file") or source.get("source") or "?"
            return f"\n  that service reads its admin token from {where}; {wanted}"
        if there:
            return f"\n  {self.url} is not the service recorded in {self.state_dir} ({there}): {wanted}"
        return f"\n  no service is recorded in {self.state_dir} (the state directory used): {wanted}"

    def unreachable_hint(self) -> str:
        record_path = running.path_in(self.state_dir)
        if self.record is not None and not running.alive(self.record):
            return (f"\n  the service recorded in {record_path} (pid {self.record.get('pid')}) is not running; "
                    "start it, or pass the --state DIR of the one that runs")
        if self.record is None and self.url_from.startswith("config"):
            hint = (f"\n  no service has recorded itself in {self.state_dir} (no {running.FILE}): pass the "
                    "service's --state DIR (or $STATE_DIRECTORY, --config FILE), or --url URL")
            unit = running.read(UNIT_STATE_DIR)
            if unit is not None and os.path.abspath(UNIT_STATE_DIR) != self.state_dir and running.alive(unit):
                hint += f"\n  the systemd unit's service is recorded in {UNIT_STATE_DIR}: --state {UNIT_STATE_DIR}"
            return hint
        return ""


def _url(args: argparse.Namespace, config: Config, record: ReadJSONObject | None, state_dir: str) -> tuple[str, str]:
    if getattr(args, "url", None):
        return str(args.url), "--url"
    rest = obj(record.get("rest")) if record is not None else obj(None)
    if record is not None and rest.get("url"):
        return str(rest["url"]), f"recorded in {running.path_in(state_dir)} by pid {record.get('pid')}"
    server = config.server
    return running.local_url(server.host, server.port, bool(config.security.tls_cert_file)), \
        "config [server] host and port: the service recorded no address"


def _token(args: argparse.Namespace, config: Config, record: ReadJSONObject | None,
           state_dir: str) -> tuple[str | None, str]:
    """(token, where it came from) in the order of the module docstring."""
    if getattr(args, "token_file", None):
        return _read(args.token_file), f"--token-file {args.token_file}"
    from appliance.api.auth import client_admin_token

    token = client_admin_token(config.security)
    if token:
        return token, "the config's [security] (or the admin-token credential)"
    recorded = str_or_none(obj((record or {}).get("admin_token")).get("file"))
    candidates = [recorded, os.path.join(state_dir, "admin-token")]
    for path in [p for p in candidates if p]:
        if os.access(path, os.R_OK):
            return _read(path), f"the file {path}"
    looked = ", ".join(p for p in candidates if p)
    return None, f"none (no --token-file, nothing in the config's [security], no readable {looked})"


def _read(path: str) -> str | None:
    with open(path) as f:
        return f.read().strip() or None


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read()).get("error", exc.reason))
    except (ValueError, AttributeError, OSError):
        return str(exc.reason)
