"""``appliance serve``: run the service, with the bundled sample when nothing is configured.

``embedded_default(config)`` is also what ``appliance tfs`` uses: the same first run
whichever start-up line a user types.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Iterator

from appliance.commands.common import Subcommands
from appliance.core.json_read import obj
from appliance.core.json_types import ReadJSONObject

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


def add_commands(sub: Subcommands) -> None:
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
    serve.add_argument("--workers", type=int,
                       help="front worker processes for HTTP and JSON (default 0: one per CPU; 1: one process)")
    serve.set_defaults(func=cmd_serve)


def serve_overrides(args: argparse.Namespace) -> dict[str, object]:  # config key -> a flag's value (None: unset)
    """The config overrides of ``appliance serve``'s flags (None: not given, the file decides)."""
    return {
        "server.host": args.host,
        "server.port": args.port,
        "server.workers": args.workers,
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


def uses_embedded_default(config: Config) -> bool:
    """No bucket, no models: ``embedded_default`` will serve the bundled sample."""
    return not (config.sync.bucket or config.models or config.models_dir)


def embedded_default(config: Config) -> bool:
    """A configured bucket serves its synced store ``<state>/models``. With no models and no
    bucket: publish the bundled sample into a local-folder bucket ``<state>/bucket`` and
    follow it, so the first run exercises the same path a fleet device does. True when the
    embedded default is in use."""
    if not uses_embedded_default(config):  # a bucket's synced store, or the models configured
        return False
    from sync.publisher import publish
    from sync.open_source import open_source

    bucket = os.path.join(config.state_dir, "bucket")
    os.makedirs(bucket, exist_ok=True)
    source = open_source(f"file://{bucket}")
    for name in sorted(os.listdir(SAMPLE_DIR)):
        for version in sorted(os.listdir(os.path.join(SAMPLE_DIR, name)), key=int):
            if source.read(f"{name}/{version}/MANIFEST.json").status == 404:
                publish(source, name, os.path.join(SAMPLE_DIR, name, version), int(version), expires_days=0)
    config.sync.bucket = f"file://{bucket}"
    _local_admin_token(config)
    return True


def _local_admin_token(config: Config) -> None:
    """The embedded default's admin token: made once into ``<state>/admin-token`` (mode
    0600), so the operator on this machine can run ``appliance sync`` and ``rollback``
    (they read it, commands/common.py) while remote callers still need the token."""
    if config.security.admin_token or config.security.admin_token_file:
        return
    import secrets

    path = os.path.abspath(os.path.join(config.state_dir, "admin-token"))  # a relative path would name a credential
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError:  # a read-only state folder: admin endpoints stay off, as without a token
        return
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    config.security.admin_token_file = path


def quick_start_lines(config: Config, url: str, status: ReadJSONObject) -> list[str]:
    """What the embedded default prints once it is ready: what serves, a request to try,
    where the bucket is and how to publish to it."""
    models = [(name, obj(m)) for name, m in sorted(obj(status.get("models")).items())]
    served = ", ".join(f"{name} v{m['serving_version']}" for name, m in models
                       if m.get("serving_version") is not None) or "nothing yet"
    bucket = config.sync.bucket
    every = f"{config.sync.poll_interval_s:g} s"
    return [f"serving {served} from the local bucket {bucket} (polled every {every}); status page: {url}/",
            f"try:     {SAMPLE_CURL.format(url=url)}",
            f"publish: {_command()} publish --bucket {bucket} "
            "--model half_plus_two path/to/version/  (a version folder: saved_model.pb and/or model.tflite)"]


def cmd_serve(args: argparse.Namespace) -> int:
    from appliance.core.config_file import load as load_config
    from appliance.fronts.zygote import start_early

    overrides = serve_overrides(args)
    config = load_config(args.config, overrides)
    start_early(config)  # the front workers' zygote: forked before a thread or the service exists
    from appliance.service import main, state_check

    if state_check.required(uses_embedded_default(config)):
        state_check.require_writable(config.state_dir)  # ConfigError: said, exit 2, nothing bound yet
    banner = (lambda url, status: quick_start_lines(config, url, status)) if embedded_default(config) else None
    return main(config, args.config, overrides, banner)


def _command() -> str:
    """How to run ``appliance`` here: the venv's own script when there is one (a quick start
    has not put it on PATH), else the bare name."""
    script = os.path.join(os.path.dirname(sys.executable), "appliance")
    return script if os.path.exists(script) else "appliance"
