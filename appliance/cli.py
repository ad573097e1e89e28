"""The ``appliance`` command: serve, probe, and the fleet and service tools.

Each subcommand is a small function; heavy modules are imported inside the one that
needs them so ``appliance --help`` and a LiteRT-only device stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from appliance import __version__
from appliance.core.config import BACKEND_CHOICES, Config
from appliance.core.config import load as load_config
from appliance.core.errors import ConfigError

# Modules that add subcommands with ``add_commands(subparsers)``; each imports its heavy
# libraries inside the command function, so building the parser stays cheap.
COMMAND_MODULES = ("appliance.install", "appliance.parts.discovery", "appliance.commands.fleet", "appliance.commands.tfs",
                   "appliance.commands.rollout")
SAMPLE_DIR = os.path.join(os.path.dirname(__file__), "sample_models")


def _serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
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


def _embedded_default(config: Config) -> bool:
    """A configured bucket serves its synced store ``<state>/models``. With no models and no
    bucket: publish the bundled sample into a local-folder bucket ``<state>/bucket`` and
    follow it, so the first run exercises the same path a fleet device does. True when the
    embedded default is in use."""
    store = os.path.join(config.state_dir, "models")
    if config.sync.bucket:
        config.models_dir = config.models_dir or store
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
    config.models_dir = store
    return True


SAMPLE_CURL = "curl -d '{{\"instances\": [1.0, 2.0, 5.0]}}' {url}/v1/models/half_plus_two:predict"


def cmd_serve(args: argparse.Namespace) -> int:
    from appliance.service import main

    overrides = _serve_overrides(args)
    config = load_config(args.config, overrides)
    if _embedded_default(config):
        shown = "localhost" if config.server.host in ("0.0.0.0", "::", "") else config.server.host
        url = f"http://{shown}:{config.server.port}"
        print(f"serving the bundled sample model; status page: {url}/\ntry: {SAMPLE_CURL.format(url=url)}",
              file=sys.stderr, flush=True)
    return main(config, args.config, overrides)


def cmd_probe(args: argparse.Namespace) -> int:
    import runtimes

    from appliance.core import device

    config = load_config(args.config, {"models_dir": args.models})
    info = device.profile(vars(config.runtime.tflite))
    backends = {}
    for name, backend in runtimes.default_backends().items():
        availability = backend.probe(info)
        backends[name] = {"available": availability.available, "reason": availability.reason}
    result: dict[str, Any] = {"device": info, "backends": backends}
    if config.models_dir:
        result["decisions"] = _probe_models(config, info)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return 0
    print(f"device: {info['hostname']} {info['machine']}, {info['cpu_count']} CPUs, {info['memory_mb']} MB, "
          f"GPU: {info.get('gpu_name') or ('yes' if info.get('nvidia_gpu') else 'none')}")
    for name, b in backends.items():
        print(f"  {name:8} {'available' if b['available'] else 'unavailable':12} {b['reason']}")
    for model, decision in result.get("decisions", {}).items():
        print(f"model {model}: {decision['chosen'] or 'NONE'} ({decision['how']}): {decision['reason']}")
    return 0


def _probe_models(config: Config, info: dict[str, Any]) -> dict[str, Any]:
    """Run the real selection (load and time each candidate) for each model's newest version."""
    from appliance.core.manager import Manager, discover_models, versions_on_disk
    from appliance.core.state import StateDB

    db = StateDB(":memory:").open()
    manager = Manager(config, db, info)
    out = {}
    for model in discover_models(config.models_dir, config.model_name):
        versions = versions_on_disk(model.base_path)
        if not versions:
            continue
        version = max(versions)
        decision, servable = manager._select(model.name, model, version, versions[version])
        if servable is not None:
            servable.close()
        out[model.name] = decision.to_dict()
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description="edge-appliance: an on-device model server")
    parser.add_argument("--version", action="version", version=f"edge-appliance {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the service")
    serve.add_argument("--config", help="TOML config file")
    serve.add_argument("--models", help="TF Serving model base directory (DIR/<model>/<version>, or DIR/<version>)")
    serve.add_argument("--model-name", help="model name for a single-model base path (default: default)")
    serve.add_argument("--host", help="address to listen on (default 0.0.0.0)")
    serve.add_argument("--port", type=int, help="REST port (default 8501)")
    serve.add_argument("--backend", choices=BACKEND_CHOICES, help="pin a backend (default auto: measure)")
    serve.add_argument("--state", help="state directory (default: $STATE_DIRECTORY or ~/.local/state/edge-appliance)")
    serve.add_argument("--poll-interval", type=float,
                       help="seconds between scans of the model directory (and bucket polls with --bucket)")
    serve.add_argument("--bucket", help="follow models in s3://bucket/prefix, file:///path or https://host/prefix")
    serve.add_argument("--channel", help="bucket channel to follow (default: the newest committed version)")
    serve.add_argument("--grpc-port", type=int, help="gRPC port (default 8500, TF Serving's; 0: no gRPC)")
    serve.add_argument("--no-discovery", action="store_true", help="do not announce the service with mDNS")
    serve.set_defaults(func=cmd_serve)

    probe = sub.add_parser("probe", help="show the device profile and the backend decision")
    probe.add_argument("--json", action="store_true", help="machine-readable output")
    probe.add_argument("--config", help="TOML config file")
    probe.add_argument("--models", help="also decide (load and time) for each model in this base directory")
    probe.set_defaults(func=cmd_probe)
    for module in COMMAND_MODULES:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:  # an optional part that this install lacks
            if exc.name != module and not module.startswith(exc.name or "\0"):
                raise
            continue
        mod.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"edge-appliance: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
