"""``appliance probe [--json] [--models DIR]``: the device profile, which backends can run
here and why, and (with ``--models``) the real selection for each model's newest version."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from appliance.commands.common import Subcommands

if TYPE_CHECKING:
    from appliance.core.json_types import JSONObject
    from appliance.core.config import Config


def add_commands(sub: Subcommands) -> None:
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
        print(f"model {model} version {decision['version']}: {decision['chosen'] or 'NONE'} ({decision['how']}): "
              f"{decision['reason']}")
        for artifact, error in decision["broken_artifacts"].items():
            print(f"  not whole: {artifact} did not load ({error})")
    return 0


def probe_models(config: Config, info: JSONObject) -> JSONObject:
    """Run the real trial (load every artifact, time each candidate, warm the choice up, in a
    child process as the service does) for each model's newest version: its decision record,
    with whether the version is whole (``ok``, ``code``, ``reason``, ``artifacts``)."""
    import runtimes

    from appliance.core import device
    from appliance.core.ledger import Ledger
    from appliance.core.loader import LoadEnv, Loader
    from appliance.core.sources import discover_models, versions_on_disk

    env = LoadEnv(config, info, runtimes.default_backends(), Ledger({}), device.fingerprint(info))
    out: JSONObject = {}
    for model in discover_models(config.models_dir, config.model_name):
        versions = versions_on_disk(model.base_path)
        if not versions:
            continue
        version = max(versions)
        verdict = Loader(env, model, version, versions[version]).trial(fresh=True)
        decision = verdict.get("decision") or {"chosen": None, "how": "none", "reason": verdict.get("reason")}
        broken = {n: a.get("error") for n, a in (verdict.get("artifacts") or {}).items() if not a.get("ok")}
        out[model.name] = {**decision, "version": version, "whole": bool(verdict.get("ok")) and not broken,
                           "broken_artifacts": broken, **{k: verdict[k] for k in ("code", "artifacts") if k in verdict}}
    return out
