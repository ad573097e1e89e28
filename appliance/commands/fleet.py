"""Subcommands: ``publish``, ``channel set``, ``keygen``, ``fleet``, ``sync``, ``rollback``.

Added to ``appliance`` by ``add_commands(subparsers)``. Each command imports what it needs
(boto3 only through the S3 source, urllib's HTTP client only for ``sync``) when it runs;
the helpers shared with ``appliance rollout`` are in appliance/commands/common.py.
``appliance fleet`` prints the snapshot of sync/fleet.py (devices, rollouts; ``--json`` as
is), filtered; ``--model M`` adds that model's rollout progress; ``--serve`` runs the
read-only fleet page (appliance/commands/fleet_page.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from appliance.commands.common import BUCKET_HELP, Subcommands, call_service, guarded, service_args, signing_key
from appliance.commands.common import source as bucket
from sync.source import Source


def version_number(text: str) -> int:
    """argparse type of ``--version``: an int64 version number, as TF Serving's."""
    from sync.errors import Refused
    from sync.manifest import check_version_number

    try:
        return check_version_number(text.strip(), "--version")
    except Refused as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def waves_arg(text: str) -> list[dict[str, float]]:
    """``--waves 5:30,25:60,100``: cumulative percent and hold in minutes per wave."""
    waves = []
    for part in text.split(","):
        percent, _, hold = part.strip().partition(":")
        try:
            waves.append({"percent": float(percent), **({"hold_minutes": float(hold)} if hold else {})})
        except ValueError:
            raise argparse.ArgumentTypeError(f"wave {part!r}: write PERCENT[:HOLD_MINUTES], e.g. 5:30,25:60,100") from None
    return waves


def cmd_publish(args: argparse.Namespace) -> int:
    from sync.publisher import publish, repair

    if args.repair:
        if args.version is None:
            print("appliance publish --repair needs --version (the committed version to repair)", file=sys.stderr)
            return 1
        fixed = repair(bucket(args), args.model, args.version, args.directory)
        print(f"re-uploaded {len(fixed)} files of {args.model} version {args.version}; devices that refused it "
              "try again when they see the objects change")
        return 0
    doc = publish(bucket(args), args.model, args.directory, args.version, args.channel or "",
                  signing_key(args.sign_key), args.publisher or "", args.expires_days, args.compat or [],
                  args.api_change or "")
    from sync.manifest import file_entries

    files = file_entries(doc)
    size = sum(n for f in files if isinstance(n := f.get("size"), int))
    print(f"published {args.model} version {doc['version']} ({len(files)} files, {size} bytes"
          f"{', signed' if 'signature' in doc else ''}){f' on channel {args.channel}' if args.channel else ''}")
    return 0


def cmd_channel_set(args: argparse.Namespace) -> int:
    from sync.publisher import set_channel

    threshold = None
    if args.failure_threshold is not None:
        threshold = {"percent": args.failure_threshold, "min_devices": args.min_devices}
    doc = set_channel(bucket(args), args.model, args.channel, args.version, signing_key(args.sign_key),
                      args.expires_days, waves=args.waves, failure_threshold=threshold, on_failure=args.on_failure)
    plan = ""
    if args.waves:
        plan = " in waves " + ", ".join(f"{w['percent']:g}%" + (f" (hold {w['hold_minutes']:g} min)"
                                                                 if w.get("hold_minutes") else "") for w in args.waves)
    print(f"{args.model} channel {args.channel} -> version {doc['version']}{plan}"
          f"{' (signed)' if 'signature' in doc else ''}")
    if threshold is not None:
        print(f"halts at {threshold['percent']:g}% failing devices in the open waves while `appliance rollout watch "
              f"--bucket {args.bucket} --model {args.model} --channel {args.channel}` runs")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from sync.manifest import keygen

    private, public = args.out + ".key", args.out + ".pub"
    if not args.force and (os.path.exists(private) or os.path.exists(public)):
        print(f"{private} or {public} exists; use --force to replace", file=sys.stderr)
        return 1
    keygen(private, public)
    print(f"private key: {private} (keep it on the publishing machine)\npublic key:  {public} "
          "(set sync.public_key to it on every device)")
    return 0


def cmd_fleet(args: argparse.Namespace) -> int:
    """The fleet from the bucket's reports: filtered rows, rollout progress, or the page."""
    if args.serve:
        from appliance.commands.fleet_page import serve

        return serve(args)
    from sync.fleet import snapshot, without_reports

    source = bucket(args)
    also = (args.model, args.channel) if args.model and args.channel else None
    from sync.listing import cache_for

    cache = cache_for(args.bucket, not args.no_cache)
    view = snapshot(source, cache, args.workers, also=also)
    cache.save()
    if args.register_keys:
        register(source, view)
    rows = [r for r in view["devices"] if row_matches(r, args)]
    rollouts = [p for p in view["rollouts"] if (not args.model or p["model"] == args.model)
                and (not args.channel or p["channel"] == args.channel)]
    if args.json:
        # compact: json's C encoder (an indent falls back to the pure-Python one: seconds at 10,000 rows)
        print(json.dumps({**without_reports(view), "devices": rows, "rollouts": rollouts}, default=str))
        return 0
    print_fleet(view, rows, rollouts, args)
    return 0


def row_matches(row: dict[str, Any], args: argparse.Namespace) -> bool:
    from sync.fleet_view import matches

    return matches(row, args.model or "", args.channel or "", args.version, args.stale, args.unhealthy)


def register(source: Source, view: dict[str, Any]) -> None:
    """Trust on first use, on the operator's word: record the keys of unregistered reports."""
    from sync.report import UNREGISTERED, register_keys

    keys = {r["device_id"]: view["reports"][r["device_id"]]["device_key"] for r in view["devices"]
            if r["trust"] == UNREGISTERED}
    added = register_keys(source, keys)
    for row in view["devices"]:
        if row["device_id"] in keys:
            row["trust"] = "signed"
    print(f"registered the keys of {added} devices in _fleet/device-keys.json", file=sys.stderr)


def print_fleet(view: dict[str, Any], rows: list[dict[str, Any]], rollouts: list[dict[str, Any]],
                args: argparse.Namespace) -> None:
    from appliance.commands.fleet_text import counts_line, device_line, header_line, progress_lines
    from sync.fleet_view import counts

    if args.model:
        for progress in rollouts:
            print("\n".join(progress_lines(progress)))
    if rows:
        print(header_line())
    for row in rows:
        print(device_line(row))
    listing = view["listing"]
    print(counts_line(counts(rows)) + (f" (of {view['counts']['devices']})" if len(rows) != view["counts"]["devices"]
                                       else "") + f"; listed in {listing['seconds']:.2f} s, {listing['fetched']} read, "
          f"{listing['cached']} unchanged")


def cmd_sync(args: argparse.Namespace) -> int:
    """Ask the running service on this device to poll the bucket now (an admin endpoint; the
    service and its admin token are found as appliance/commands/service_client.py says)."""
    status = call_service(args, "POST", "/api/sync")
    print(json.dumps(status, indent=2))
    return 1 if status.get("last_error") else 0


def cmd_rollback(args: argparse.Namespace) -> int:
    """Pin a model to a version kept on disk; the sync loop serves it until --clear."""
    from appliance.core.config_file import load as load_config

    from sync.store import Store, set_pin

    config = load_config(args.config, {"state_dir": args.state})
    store = Store(config.state_dir)
    if args.clear:
        set_pin(config.state_dir, args.model, None)
        print(f"{args.model}: pin removed; the bucket's channel decides again")
    else:
        on_disk = sorted(set(store.versions(args.model)) | set(store.parked(args.model)))
        version = args.to if args.to is not None else store.previous_version(args.model)
        if version not in on_disk:
            print(f"{args.model} version {version} is not on disk (have: {on_disk or 'none'})", file=sys.stderr)
            return 1
        set_pin(config.state_dir, args.model, version)
        print(f"{args.model} pinned to version {version}")
    return cmd_sync(args) if not args.no_sync else 0


def add_commands(sub: Subcommands) -> None:
    bucket_help = BUCKET_HELP
    p = sub.add_parser("publish", help="upload a model version to the bucket (MANIFEST.json last)")
    p.add_argument("directory", help="the version directory (saved_model.pb + variables/ and/or model.tflite)")
    p.add_argument("--bucket", required=True, help=bucket_help)
    p.add_argument("--model", required=True)
    p.add_argument("--version", type=version_number, help="integer version, 0 to 2^63-1 (default: the next one)")
    p.add_argument("--repair", action="store_true",
                   help="re-upload the files of committed --version from DIRECTORY (which must match its manifest)")
    p.add_argument("--channel", help="also point this channel at the new version")
    p.add_argument("--sign-key", help="Ed25519 private key (appliance keygen) to sign the manifest")
    p.add_argument("--publisher", help="recorded in the manifest (default user@host)")
    p.add_argument("--expires-days", type=float, default=365, help="devices refuse it after this (0: never)")
    p.add_argument("--compat", action="append", help="a tag the device must offer (tflite, x86_64, cuda...)")
    p.add_argument("--api-change", metavar="WHY", help="this version may serve less than the one before it "
                   "(a signature, input or output dropped or changed); devices refuse such a version without it")
    p.add_argument("--s3-endpoint-url", help="S3 endpoint (else AWS_ENDPOINT_URL / the AWS config)")
    p.set_defaults(func=guarded(cmd_publish))

    channel = sub.add_parser("channel", help="channel pointers").add_subparsers(dest="channel_command", required=True)
    c = channel.add_parser("set", help="point a channel at a published version")
    c.add_argument("--bucket", required=True, help=bucket_help)
    c.add_argument("--model", required=True)
    c.add_argument("--channel", required=True)
    c.add_argument("--version", type=version_number, required=True)
    c.add_argument("--waves", type=waves_arg, help="staged rollout: cumulative PERCENT[:HOLD_MINUTES] per wave, "
                                                   "e.g. 5:30,25:60,100 (docs/rollouts.md)")
    c.add_argument("--failure-threshold", type=float, metavar="PERCENT",
                   help="act when this share of the devices in the open waves refuse or fail the version "
                        "(judged by `appliance rollout controller` or `watch`)")
    c.add_argument("--on-failure", choices=("rollback", "halt"),
                   help="what `appliance rollout controller` does at the threshold: point the channel back at the "
                        "version it replaces (every device returns to it) or halt it (default halt)")
    c.add_argument("--min-devices", type=int, default=1,
                   help="with --failure-threshold: devices that must have reported on the version first (default 1)")
    c.add_argument("--sign-key", help="Ed25519 private key; needed when devices have sync.public_key")
    c.add_argument("--expires-days", type=float, default=365)
    c.add_argument("--s3-endpoint-url")
    c.set_defaults(func=guarded(cmd_channel_set), command="channel set")

    k = sub.add_parser("keygen", help="write an Ed25519 key pair (OUT.key, OUT.pub)")
    k.add_argument("--out", default="appliance-signing", help="file name prefix")
    k.add_argument("--force", action="store_true")
    k.set_defaults(func=guarded(cmd_keygen))

    f = sub.add_parser("fleet", help="the devices' reports in the bucket: status, rollouts, the fleet page")
    f.add_argument("--bucket", required=True, help=bucket_help)
    f.add_argument("--json", action="store_true", help="the snapshot as JSON (schema: docs/fleet.md)")
    f.add_argument("--s3-endpoint-url")
    f.add_argument("--model", help="devices with this model, and its rollout's progress")
    f.add_argument("--channel", help="devices following this channel (with --model: that channel's rollout)")
    f.add_argument("--version", type=version_number, help="devices serving this version (of --model, or of any model)")
    f.add_argument("--stale", action="store_true", help="devices whose last report is older than three heartbeats")
    f.add_argument("--unhealthy", action="store_true", help="devices unhealthy, degraded, unreadable or untrusted")
    f.add_argument("--register-keys", action="store_true",
                   help="trust the keys of signed reports whose device has none registered yet")
    f.add_argument("--workers", type=int, default=16, help="reports read at once (default 16)")
    f.add_argument("--no-cache", action="store_true", help="read every report (not only those changed since the last run)")
    f.add_argument("--serve", action="store_true", help="serve the read-only fleet page (Ctrl-C stops it)")
    f.add_argument("--host", default="127.0.0.1", help="with --serve: the address (default loopback only)")
    f.add_argument("--port", type=int, default=8600, help="with --serve: the port (0: any free one)")
    f.add_argument("--refresh", type=float, default=10.0, help="with --serve: seconds between reads of the bucket")
    f.set_defaults(func=guarded(cmd_fleet))

    s = sub.add_parser("sync", help="make the running service poll the bucket now")
    service_args(s)
    s.set_defaults(func=guarded(cmd_sync))

    r = sub.add_parser("rollback", help="pin a model to an older version kept on disk")
    r.add_argument("--model", required=True)
    r.add_argument("--to", type=int, help="the version (default: the one below the newest on disk)")
    r.add_argument("--clear", action="store_true", help="remove the pin")
    r.add_argument("--no-sync", action="store_true", help="only write the pin")
    service_args(r)  # the pin goes into --state; the service found there is told to poll
    r.set_defaults(func=guarded(cmd_rollback))
