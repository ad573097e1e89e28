"""``appliance serve``: run the service, with the bundled sample when nothing is configured.

``embedded_default(config)`` is also what ``appliance tfs`` uses: the same first run
whichever start-up line a user types.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from appliance.core.config import Config

SAMPLE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "sample_models")
SAMPLE_CURL = "curl -d '{{\"instances\": [1.0, 2.0, 5.0]}}' {url}/v1/models/half_plus_two:predict"


class _BackendChoices:
    """``appliance.core.config.BACKEND_CHOICES``, read when argparse checks or shows a value:
    importing the config module (its dataclasses) costs more than building every parser, and
    ``appliance --help`` needs neither."""

    def _names(self) -> tuple[str, ...]:
        from appliance.core.config import BACKEND_CHOICES

        return BACKEND_CHOICES

    def __contains__(self, value: object) -> bool:
        return value in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())


def add_commands(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the service")
    serve.add_argument("--config", help="TOML config file")
    serve.add_argument("--models", help="TF Serving model base directory (DIR/<model>/<version>, or DIR/<version>)")
    serve.add_argument("--model-name", help="model name for a single-model base path (default: default)")
    serve.add_argument("--host", help="address to listen on (default 0.0.0.0)")
    serve.add_argument("--port", type=int, help="REST port (default 8501)")
    serve.add_argument("--backend", choices=_BackendChoices(), metavar="BACKEND",
                       help="pin a backend: %(choices)s (default auto: measure)")
    serve.add_argument("--state", help="state directory (default: $STATE_DIRECTORY or ~/.local/state/edge-appliance)")
    serve.add_argument("--poll-interval", type=float,
                       help="seconds between scans of the model directory (and bucket polls with --bucket)")
    serve.add_argument("--bucket", help="follow models in s3://bucket/prefix, file:///path or https://host/prefix")
    serve.add_argument("--channel", help="bucket channel to follow (default: the newest committed version)")
    serve.add_argument("--grpc-port", type=int, help="gRPC port (default 8500, TF Serving's; 0: no gRPC)")
    serve.add_argument("--no-discovery", action="store_true", help="do not announce the service with mDNS")
    serve.set_defaults(func=cmd_serve)


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config overrides of ``appliance serve``'s flags (None: not given, the file decides)."""
    return {
        "server.host": args.host,
        "server.port": args.port,
        "runtime.backend": args.backend,
        "models_dir": args.models,
        "model_name": args.model_name,
        "state_dir": args.state,
        "poll_interval_s": args.poll_interval,
        "discovery.enabled": False if args.no_discovery else None,
        "grpc.port": args.grpc_port,
        "sync.bucket": args.bucket,
        "sync.channel": args.channel,
        "sync.poll_interval_s": args.poll_interval if args.bucket else None,
    }


def embedded_default(config: Config) -> bool:
    """A configured bucket serves its synced store ``<state>/models``. With no models and no
    bucket: publish the bundled sample into a local-folder bucket ``<state>/bucket`` and
    follow it, so the first run exercises the same path a fleet device does. True when the
    embedded default is in use."""
    if config.sync.bucket:  # the sync part serves its store <state>/models (appliance/parts/sync_loop.py)
        return False
    if config.models or config.models_dir:
        return False
    from sync.publisher import publish
    from sync.source import open_source

    bucket = os.path.join(config.state_dir, "bucket")
    os.makedirs(bucket, exist_ok=True)
    source = open_source(f"file://{bucket}")
    for name in sorted(os.listdir(SAMPLE_DIR)):
        for version in sorted(os.listdir(os.path.join(SAMPLE_DIR, name)), key=int):
            if source.read(f"{name}/{version}/MANIFEST.json").status == 404:
                publish(source, name, os.path.join(SAMPLE_DIR, name, version), int(version), expires_days=0)
    config.sync.bucket = f"file://{bucket}"
    return True


def cmd_serve(args: argparse.Namespace) -> int:
    from appliance.core.config import load as load_config
    from appliance.service import main

    overrides = serve_overrides(args)
    config = load_config(args.config, overrides)
    if embedded_default(config):
        shown = "localhost" if config.server.host in ("0.0.0.0", "::", "") else config.server.host
        url = f"http://{shown}:{config.server.port}"
        print(f"serving the bundled sample model; status page: {url}/\ntry: {SAMPLE_CURL.format(url=url)}",
              file=sys.stderr, flush=True)
    return main(config, args.config, overrides)
