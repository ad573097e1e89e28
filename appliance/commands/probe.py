"""``appliance probe [--json] [--models DIR]``: the device profile, which backends can run
here and why, and (with ``--models``) the real selection for each model's newest version."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from appliance.core.config import Config


def add_commands(sub: Any) -> None:
    probe = sub.add_parser("probe", help="show the device profile and the backend decision")
    probe.add_argument("--json", action="store_true", help="machine-readable output")
    probe.add_argument("--config", help="TOML config file")
    probe.add_argument("--models", help="also decide (load and time) for each model in this base directory")
    probe.set_defaults(func=cmd_probe)


def cmd_probe(args: argparse.Namespace) -> int:
    import runtimes

    from appliance.core import device
    from appliance.core.config_file import load as load_config

    config = load_config(args.config, {"models_dir": args.models})
    info = device.profile(vars(config.runtime.tflite))
    backends = {}
    for name, backend in runtimes.default_backends().items():
        availability = backend.probe(info)
        backends[name] = {"available": availability.available, "reason": availability.reason}
    result: dict[str, Any] = {"device": info, "backends": backends}
    if config.models_dir:
        result["decisions"] = probe_models(config, info)
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


def probe_models(config: Config, info: dict[str, Any]) -> dict[str, Any]:
    """Run the real selection (load and time each candidate) for each model's newest version."""
    from appliance.core.manager import Manager
    from appliance.core.sources import discover_models, versions_on_disk
    from appliance.core.state import StateDB

    db = StateDB(":memory:").open()
    manager = Manager(config, db, info)
    out = {}
    for model in discover_models(config.models_dir, config.model_name):
        versions = versions_on_disk(model.base_path)
        if not versions:
            continue
        version = max(versions)
        decision, servable = manager.select_backend(model.name, model, version, versions[version])
        if servable is not None:
            servable.close()
        out[model.name] = decision.to_dict()
    return out
