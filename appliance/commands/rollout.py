"""``appliance rollout promote|abort|halt|resume|watch|controller|fleet``.

promote / abort talk to the running service's admin endpoints (the service and its admin
token are found as appliance/commands/service_client.py says). halt / resume write the channel
pointer in the bucket. watch follows a rollout from the device reports and halts it at the
channel's failure threshold (sync/rollout_guard.py); controller enforces it by itself, rolling
back or halting as the pointer's ``on_failure`` says. fleet is ``appliance fleet --model M --channel C``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from appliance.commands.common import BUCKET_HELP, Subcommands, call_service, guarded, service_args, signing_key, source


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


def cmd_fleet(args: argparse.Namespace) -> int:
    """``appliance fleet --model M --channel C``: the rollout's progress and its devices."""
    from appliance.commands.fleet import cmd_fleet as fleet

    for name, default in (("version", None), ("stale", False), ("unhealthy", False), ("register_keys", False),
                          ("workers", 16), ("no_cache", False), ("serve", False)):
        setattr(args, name, getattr(args, name, default))
    return fleet(args)


def cmd_watch(args: argparse.Namespace) -> int:
    """Follow a rollout; halt its channel when the failure threshold is reached. Exit 0 when
    every device is on the target, 3 when this watch halted it (or found it halted)."""
    from appliance.commands.fleet_text import progress_lines
    from sync.listing import cache_for
    from sync.rollout_guard import watch_round

    bucket, cache, last = source(args), cache_for(args.bucket, not args.no_cache), ""
    while True:
        round_ = watch_round(bucket, args.model, args.channel, cache, signing_key(args.sign_key))
        cache.save()
        text = "\n".join(progress_lines(round_.progress))
        if text != last:
            print(time.strftime("%Y-%m-%d %H:%M:%S %z ") + text, flush=True)
            last = text
        if round_.progress["halted"]:
            return 3
        if args.once or (round_.done and not args.follow):
            return 0
        time.sleep(args.interval)


def cmd_controller(args: argparse.Namespace) -> int:
    """Enforce one channel's rollout with nobody watching: every ``--interval`` seconds judge it
    as ``watch`` does and, at the failure threshold, do what the pointer's ``on_failure`` says
    (roll back to the last good version, or halt). Runs until stopped (a systemd unit, a
    Kubernetes Deployment); ``--once`` for a timer or a CronJob. Safe to run twice: a rolled-back
    or halted channel has nothing left to act on. A round whose bucket read fails is retried at
    the next interval (the controller never exits for an outage)."""
    from appliance.commands.fleet_text import progress_lines
    from sync.errors import SyncError
    from sync.listing import cache_for
    from sync.rollout_guard import control_round

    bucket, cache, last = source(args), cache_for(args.bucket, not args.no_cache), ""
    key = signing_key(args.sign_key)
    while True:
        try:
            round_ = control_round(bucket, args.model, args.channel, cache, key)
            cache.save()
            text = "\n".join(progress_lines(round_.progress))
        except SyncError as exc:
            text = f"could not judge the rollout this round (retrying in {args.interval:g} s): {exc}"
        if text != last:
            print(time.strftime("%Y-%m-%d %H:%M:%S %z ") + text, flush=True)
            last = text
        if args.once:
            return 0
        time.sleep(args.interval)


def add_commands(sub: Subcommands) -> None:
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
    f = commands.add_parser("fleet", help="one model's rollout from the device reports (appliance fleet --model)")
    f.add_argument("--bucket", required=True, help=BUCKET_HELP)
    f.add_argument("--model", required=True)
    f.add_argument("--channel", default="stable")
    f.add_argument("--json", action="store_true")
    f.add_argument("--s3-endpoint-url")
    f.set_defaults(func=guarded(cmd_fleet), command="rollout fleet")
    w = commands.add_parser("watch", help="follow a rollout and halt it at its channel's failure threshold")
    w.add_argument("--bucket", required=True, help=BUCKET_HELP)
    w.add_argument("--model", required=True)
    w.add_argument("--channel", default="stable")
    w.add_argument("--sign-key", help="Ed25519 private key to sign the halt; needed when devices have sync.public_key")
    w.add_argument("--interval", type=float, default=10.0, help="seconds between looks (default 10)")
    w.add_argument("--once", action="store_true", help="look once (for a timer or CI) and exit")
    w.add_argument("--follow", action="store_true", help="keep watching after every device is on the target")
    w.add_argument("--no-cache", action="store_true")
    w.add_argument("--s3-endpoint-url")
    w.set_defaults(func=guarded(cmd_watch), command="rollout watch")
    c = commands.add_parser("controller", help="enforce a channel's failure threshold by itself: roll back or halt "
                                               "(one per channel; systemd/ and deploy/ ship it)")
    c.add_argument("--bucket", required=True, help=BUCKET_HELP)
    c.add_argument("--model", required=True)
    c.add_argument("--channel", default="stable")
    c.add_argument("--sign-key", help="Ed25519 private key to sign its pointer writes; needed when devices have "
                                      "sync.public_key")
    c.add_argument("--interval", type=float, default=30.0, help="seconds between rounds (default 30)")
    c.add_argument("--once", action="store_true", help="one round and exit (a timer or a Kubernetes CronJob)")
    c.add_argument("--no-cache", action="store_true")
    c.add_argument("--s3-endpoint-url")
    c.set_defaults(func=guarded(cmd_controller), command="rollout controller")
