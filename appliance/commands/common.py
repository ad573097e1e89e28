"""What several commands share: the bucket from ``--bucket``, the signing key, the one-line
failure of a bucket command, an HTTP error's text, and how a verb finds and calls the
running service (``service_args``, ``call_service``; appliance/commands/service_client.py).

Only the standard library at import time (``appliance --help`` builds every parser);
each helper imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Callable, TypeAlias

if TYPE_CHECKING:  # the key types, for annotations: cryptography is imported where keys are used
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from sync.source import Source

# What ``add_commands`` of each command module is given: ``parser.add_subparsers()`` (appliance/cli.py).
Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

BUCKET_HELP = "bucket URL: s3://bucket/prefix, file:///path or https://host/prefix"


def source(args: argparse.Namespace) -> Source:
    """The bucket of ``--bucket`` (and ``--s3-endpoint-url`` where the command has it)."""
    from sync.open_source import open_source

    return open_source(args.bucket, getattr(args, "s3_endpoint_url", "") or "")


def signing_key(path: str | None) -> Ed25519PrivateKey | None:
    """The Ed25519 private key of ``--sign-key``, or None when the command was given none."""
    from sync.manifest import load_private_key

    return load_private_key(path) if path else None


def service_args(parser: argparse.ArgumentParser, timeout: float = 120) -> None:
    """The options of a verb that talks to the running service: how it is found (its state
    directory's record, as the service was started) and how it is authorised."""
    parser.add_argument("--state", help="the service's state directory (default: $STATE_DIRECTORY or "
                        "~/.local/state/edge-appliance, as `appliance serve`); its service.json says where it listens")
    parser.add_argument("--config", help="the service's TOML config file (its state_dir, port and [security])")
    parser.add_argument("--url", help="the service's URL (default: as recorded in the state directory)")
    parser.add_argument("--token-file", help="a file holding the admin token (default: as the service finds it)")
    parser.add_argument("--timeout", type=float, default=timeout)


def call_service(args: argparse.Namespace, method: str, path: str, body: bytes = b"") -> Any:
    """``method path`` on the running service as ``args`` find it; the JSON answer. A
    refusal or an unreachable service raises ``ServiceError`` saying what to pass."""
    from appliance.commands.service_client import Client

    return Client.from_args(args).call(method, path, body)


def guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A bucket or service command: a refusal, an unreachable bucket or service or a bad
    value is said on stderr (``appliance <command>: refused|error: ...``, then what to pass)
    with exit status 1, no traceback."""
    def wrapped(args: argparse.Namespace) -> int:
        from appliance.commands.service_client import ServiceError
        from sync.errors import Refused, SyncError

        try:
            return int(fn(args))
        except (SyncError, ServiceError, ValueError, OSError) as exc:
            refused = isinstance(exc, Refused) or getattr(exc, "status", None) is not None
            kind = "refused" if refused else "error"
            print(f"appliance {args.command}: {kind}: {exc}", file=sys.stderr)
            return 1
    return wrapped
