"""``appliance health``: is the service on this machine ready (or alive)? For probes.

The image's ``HEALTHCHECK`` runs it (deploy/Containerfile): Python's own HTTP client, so the
image needs no curl. Exit 0 when ``GET /readyz`` (``--live``: ``/healthz``) answers 200; else
1, with one line on stderr saying what was asked and what came back (the readiness body names
the models not yet available and the problems).

Where the service is: ``--url``; else the record the service writes in its state directory
(``<state>/service.json``, its ``rest.url``: the port it really listens on, whatever
``serve --port`` said); else the config's ``[server]`` host and port (a wildcard address is
asked on loopback). Only the standard library at import time.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import sys
import urllib.error
import urllib.request

from appliance.commands.common import Subcommands

RECORD = "service.json"  # appliance/core/running.py's record of the running service
LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def add_commands(sub: Subcommands) -> None:
    health = sub.add_parser("health", help="exit 0 when the service on this machine is ready (a probe)")
    health.add_argument("--url", help="the service's URL (default: as recorded in its state directory, "
                        "else the config's [server] host and port)")
    health.add_argument("--state", help="the service's state directory (default: $STATE_DIRECTORY or "
                        "~/.local/state/edge-appliance)")
    health.add_argument("--config", help="the service's TOML config file")
    health.add_argument("--live", action="store_true", help="ask /healthz (alive) instead of /readyz (ready)")
    health.add_argument("--timeout", type=float, default=4.0, help="seconds to wait for the answer (default 4)")
    health.set_defaults(func=cmd_health)


def service_url(args: argparse.Namespace) -> str:
    """Where the service listens, as the module docstring says."""
    if args.url:
        return str(args.url).rstrip("/")
    from appliance.core.config_file import load as load_config

    config = load_config(args.config, {"state_dir": args.state})
    try:
        with open(os.path.join(config.state_dir, RECORD)) as f:
            url = json.load(f)["rest"]["url"]
        if isinstance(url, str) and url:
            return url.rstrip("/")
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no record (an older service, or a read-only state): the config says
    host = LOOPBACK.get(config.server.host, config.server.host)
    scheme = "https" if config.security.tls_cert_file else "http"
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{config.server.port}"


def _unverified() -> ssl.SSLContext:
    """TLS without checking the certificate: the probe asks our own process on this machine,
    whose (often self-signed) certificate does not name the loopback address."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def cmd_health(args: argparse.Namespace) -> int:
    url = service_url(args) + ("/healthz" if args.live else "/readyz")
    context = _unverified() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=args.timeout, context=context) as response:
            print(f"{'alive' if args.live else 'ready'}: {url} answered {response.status}")
            return 0
    except urllib.error.HTTPError as exc:
        body = exc.read(2000).decode("utf-8", "replace").strip()
        print(f"not {'alive' if args.live else 'ready'}: {url} answered {exc.code}: {body}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"not {'alive' if args.live else 'ready'}: cannot reach {url}: {getattr(exc, 'reason', exc)}",
              file=sys.stderr)
    return 1
