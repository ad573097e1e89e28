"""Subcommands: ``publish``, ``channel set``, ``keygen``, ``fleet``, ``sync``, ``rollback``.

Added to ``appliance`` by ``add_commands(subparsers)``. Each command imports what it needs
(boto3 only through the S3 source, urllib's HTTP client only for ``sync``) when it runs;
the helpers shared with ``appliance rollout`` are in appliance/commands/common.py.
``appliance fleet --model M`` is the rollout summary of appliance/commands/rollout.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from appliance.commands.common import BUCKET_HELP, admin_token, error_text, guarded, signing_key
from appliance.commands.common import source as bucket


def cmd_publish(args: argparse.Namespace) -> int:
    from sync.publisher import publish

    doc = publish(bucket(args), args.model, args.directory, args.version, args.channel or "",
                  signing_key(args.sign_key), args.publisher or "", args.expires_days, args.compat or [])
    size = sum(f["size"] for f in doc["files"])
    print(f"published {args.model} version {doc['version']} ({len(doc['files'])} files, {size} bytes"
          f"{', signed' if 'signature' in doc else ''}){f' on channel {args.channel}' if args.channel else ''}")
    return 0


def cmd_channel_set(args: argparse.Namespace) -> int:
    from sync.publisher import set_channel

    doc = set_channel(bucket(args), args.model, args.channel, args.version, signing_key(args.sign_key),
                      args.expires_days)
    print(f"{args.model} channel {args.channel} -> version {doc['version']}{' (signed)' if 'signature' in doc else ''}")
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
    if getattr(args, "model", None):  # one model's rollout: versions, waves, promotions, aborts
        from appliance.commands import rollout

        return rollout.cmd_fleet(args)
    from sync.publisher import fleet

    reports = fleet(bucket(args))
    if args.json:
        print(json.dumps(reports, indent=2))
        return 0
    for r in reports:
        models = ", ".join(f"{n}:{m.get('serving_version')}" for n, m in (r.get("models") or {}).items())
        age = time.time() - float(r.get("last_sync") or 0)
        print(f"{r.get('device_id', '?'):24} {'healthy' if r.get('healthy') else 'UNHEALTHY':9} "
              f"v{r.get('software_version', '?'):8} synced {age:6.0f} s ago  {models or '-'}"
              f"{'  error: ' + r['last_error'] if r.get('last_error') else ''}")
    print(f"{len(reports)} devices")
    return 0


def cmd_sync(args: argparse.Namespace) -> int:
    """Ask the running service on this device to poll the bucket now (an admin endpoint:
    the admin token is sent as the config file or the unit's credential gives it)."""
    import urllib.error
    import urllib.request

    headers = {}
    token = admin_token(args)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(args.url.rstrip("/") + "/api/sync", data=b"", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            status = json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 403 without a token, 409 without a bucket: the service says why
        print(f"the service refused: {exc.code} {error_text(exc)}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"cannot reach the service at {args.url}: {exc}", file=sys.stderr)
        return 1
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
    args.timeout = 120
    return cmd_sync(args) if not args.no_sync else 0


def add_commands(sub: Any) -> None:
    bucket_help = BUCKET_HELP
    p = sub.add_parser("publish", help="upload a model version to the bucket (MANIFEST.json last)")
    p.add_argument("directory", help="the version directory (saved_model.pb + variables/ and/or model.tflite)")
    p.add_argument("--bucket", required=True, help=bucket_help)
    p.add_argument("--model", required=True)
    p.add_argument("--version", type=int, help="integer version (default: the next one)")
    p.add_argument("--channel", help="also point this channel at the new version")
    p.add_argument("--sign-key", help="Ed25519 private key (appliance keygen) to sign the manifest")
    p.add_argument("--publisher", help="recorded in the manifest (default user@host)")
    p.add_argument("--expires-days", type=float, default=365, help="devices refuse it after this (0: never)")
    p.add_argument("--compat", action="append", help="a tag the device must offer (tflite, x86_64, cuda...)")
    p.add_argument("--s3-endpoint-url", help="S3 endpoint (else AWS_ENDPOINT_URL / the AWS config)")
    p.set_defaults(func=guarded(cmd_publish))

    channel = sub.add_parser("channel", help="channel pointers").add_subparsers(dest="channel_command", required=True)
    c = channel.add_parser("set", help="point a channel at a published version")
    c.add_argument("--bucket", required=True, help=bucket_help)
    c.add_argument("--model", required=True)
    c.add_argument("--channel", required=True)
    c.add_argument("--version", type=int, required=True)
    c.add_argument("--sign-key", help="Ed25519 private key; needed when devices have sync.public_key")
    c.add_argument("--expires-days", type=float, default=365)
    c.add_argument("--s3-endpoint-url")
    c.set_defaults(func=guarded(cmd_channel_set), command="channel set")

    k = sub.add_parser("keygen", help="write an Ed25519 key pair (OUT.key, OUT.pub)")
    k.add_argument("--out", default="appliance-signing", help="file name prefix")
    k.add_argument("--force", action="store_true")
    k.set_defaults(func=guarded(cmd_keygen))

    f = sub.add_parser("fleet", help="list the devices' reports in the bucket")
    f.add_argument("--bucket", required=True, help=bucket_help)
    f.add_argument("--json", action="store_true")
    f.add_argument("--s3-endpoint-url")
    f.add_argument("--model", help="summarise this model's rollout (versions, waves, aborts)")
    f.add_argument("--channel", default="stable", help="with --model: the channel to read")
    f.set_defaults(func=guarded(cmd_fleet))

    s = sub.add_parser("sync", help="make the running service poll the bucket now")
    s.add_argument("--url", default="http://127.0.0.1:8501", help="the service on this device")
    s.add_argument("--timeout", type=float, default=120)
    s.add_argument("--config", help="TOML config file whose [security] gives the admin token")
    s.add_argument("--token-file", help="a file holding the admin token")
    s.add_argument("--state", help="the service's state directory, whose admin-token the embedded default made")
    s.set_defaults(func=guarded(cmd_sync))

    r = sub.add_parser("rollback", help="pin a model to an older version kept on disk")
    r.add_argument("--model", required=True)
    r.add_argument("--to", type=int, help="the version (default: the one below the newest on disk)")
    r.add_argument("--clear", action="store_true", help="remove the pin")
    r.add_argument("--config", help="TOML config file (for state_dir)")
    r.add_argument("--state", help="state directory")
    r.add_argument("--url", default="http://127.0.0.1:8501", help="the service to tell (POST /api/sync)")
    r.add_argument("--no-sync", action="store_true", help="only write the pin")
    r.add_argument("--token-file", help="a file holding the admin token (for the poll)")
    r.set_defaults(func=guarded(cmd_rollback))
