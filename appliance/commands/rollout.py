"""``appliance rollout promote|abort|halt|resume|fleet`` (and ``appliance fleet --model M``,
which appliance/commands/fleet.py hands to ``cmd_fleet`` here).

promote / abort talk to the running service's admin endpoints (the service and its admin
token are found as appliance/commands/service_client.py says). halt / resume write the channel pointer in the
bucket. fleet summarises the device reports under ``_devices/`` for one model.
"""

from __future__ import annotations

import argparse
import collections
import json
from typing import Any

from appliance.commands.common import BUCKET_HELP, call_service, guarded, service_args, signing_key, source


def cmd_decide(args: argparse.Namespace) -> int:
    """Promote or abort the candidate on the running service (found as
    appliance/commands/service_client.py says; 403 without the token, 409 without a candidate)."""
    answer = call_service(args, "POST", f"/api/models/{args.model}/rollout/{args.rollout_command}", b"{}")
    print(json.dumps(answer, indent=2))
    return 0


def cmd_halt(args: argparse.Namespace) -> int:
    from sync.publisher import halt_channel

    halt = args.rollout_command == "halt"
    doc = halt_channel(source(args), args.model, args.channel, signing_key(args.sign_key), halt=halt)
    print(f"{args.model} channel {args.channel} (version {doc['version']}): "
          f"{'halted, no device moves' if halt else 'resumed'}")
    return 0


def summarise(reports: list[dict[str, Any]], model: str, pointer: dict[str, Any] | None) -> dict[str, Any]:
    """Devices per serving version and wave, promotions, aborts with their figures."""
    from sync.waves import admission

    versions: collections.Counter[str] = collections.Counter()
    waves: collections.Counter[str] = collections.Counter()
    promotions: list[dict[str, Any]] = []
    aborts: list[dict[str, Any]] = []
    unreadable: list[str] = []
    for report in reports:
        device = str(report.get("device_id", "?"))
        if "error" in report:
            unreadable.append(device)
            continue
        state = (report.get("models") or {}).get(model)
        if state is None:
            continue
        versions[str(state.get("serving_version"))] += 1
        if pointer is not None and pointer.get("waves"):
            waves[str(admission(device, pointer).wave + 1)] += 1
        for decision in ((report.get("rollouts") or {}).get(model) or {}).get("decisions", []):
            row = {"device_id": device, **decision}
            (promotions if decision.get("action") == "promote" else aborts).append(row)
    return {"model": model, "channel_version": (pointer or {}).get("version"), "halted": bool((pointer or {}).get("halt")),
            "devices_per_version": dict(versions), "devices_per_wave": dict(waves),
            "promotions": promotions, "aborts": aborts, "unreadable_reports": unreadable}


def cmd_fleet(args: argparse.Namespace) -> int:
    from sync.publisher import fleet
    from sync.source import MISSING

    bucket = source(args)
    fetched = bucket.read(f"{args.model}/channels/{args.channel}.json")
    pointer = json.loads(fetched.data) if fetched.status != MISSING else None
    summary = summarise(fleet(bucket), args.model, pointer)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"{args.model}: channel {args.channel} -> version {summary['channel_version']}"
          f"{' (HALTED)' if summary['halted'] else ''}")
    for version, count in sorted(summary["devices_per_version"].items()):
        print(f"  serving version {version}: {count} devices")
    for wave, count in sorted(summary["devices_per_wave"].items()):
        print(f"  wave {wave}: {count} devices")
    print(f"  promotions: {len(summary['promotions'])}")
    for row in summary["aborts"]:
        print(f"  ABORTED on {row['device_id']}: version {row.get('candidate_version')}: {row.get('reason')}")
    return 0


def add_commands(sub: Any) -> None:
    rollout = sub.add_parser("rollout", help="judge, promote, abort or halt model rollouts")
    commands = rollout.add_subparsers(dest="rollout_command", required=True)
    for action in ("promote", "abort"):
        p = commands.add_parser(action, help=f"{action} the candidate version on the running service")
        p.add_argument("--model", required=True)
        service_args(p, timeout=30)
        p.set_defaults(func=guarded(cmd_decide), command=f"rollout {action}")
    for action, text in (("halt", "stop every further device move on a channel"), ("resume", "clear a halt")):
        p = commands.add_parser(action, help=text)
        p.add_argument("--bucket", required=True, help=BUCKET_HELP)
        p.add_argument("--model", required=True)
        p.add_argument("--channel", default="stable")
        p.add_argument("--sign-key", help="Ed25519 private key; needed when devices have sync.public_key")
        p.add_argument("--s3-endpoint-url")
        p.set_defaults(func=guarded(cmd_halt), command=f"rollout {action}")
    f = commands.add_parser("fleet", help="summarise one model's rollout from the device reports")
    f.add_argument("--bucket", required=True, help=BUCKET_HELP)
    f.add_argument("--model", required=True)
    f.add_argument("--channel", default="stable")
    f.add_argument("--json", action="store_true")
    f.add_argument("--s3-endpoint-url")
    f.set_defaults(func=guarded(cmd_fleet), command="rollout fleet")
