"""What several commands share: the bucket from ``--bucket``, the signing key, the admin
token, the one-line failure of a bucket command, an HTTP error's text.

Only the standard library at import time (``appliance --help`` builds every parser);
each helper imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

BUCKET_HELP = "bucket URL: s3://bucket/prefix, file:///path or https://host/prefix"


def source(args: argparse.Namespace) -> Any:
    """The bucket of ``--bucket`` (and ``--s3-endpoint-url`` where the command has it)."""
    from sync.source import open_source

    return open_source(args.bucket, getattr(args, "s3_endpoint_url", "") or "")


def signing_key(path: str | None) -> Any:
    """The Ed25519 private key of ``--sign-key``, or None when the command was given none."""
    from sync.manifest import load_private_key

    return load_private_key(path) if path else None


def admin_token(args: argparse.Namespace) -> str | None:
    """The admin token from ``--token-file``, else as the service finds its own ([security]
    of ``--config``, or the ``admin-token`` credential when run inside the unit)."""
    if getattr(args, "token_file", None):
        with open(args.token_file) as f:
            return f.read().strip() or None
    import os

    from appliance.api.auth import client_admin_token
    from appliance.core.config_file import load as load_config

    config = load_config(getattr(args, "config", None), {"state_dir": getattr(args, "state", None)})
    token = client_admin_token(config.security)
    local = os.path.join(config.state_dir, "admin-token")  # the embedded default's (commands/serve.py)
    if token is None and os.access(local, os.R_OK):
        with open(local) as f:
            token = f.read().strip() or None
    return token


def error_text(exc: Any) -> str:
    """The ``error`` of a JSON error body of an ``urllib.error.HTTPError``, else its reason."""
    try:
        return str(json.loads(exc.read()).get("error", exc.reason))
    except (ValueError, AttributeError, OSError):
        return str(exc.reason)


def guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A bucket command: a refusal, an unreachable bucket or a bad value is one line on
    stderr (``appliance <command>: refused|error: ...``) and exit status 1, no traceback."""
    def wrapped(args: argparse.Namespace) -> int:
        from sync.errors import Refused, SyncError

        try:
            return int(fn(args))
        except (SyncError, ValueError, OSError) as exc:
            kind = "refused" if isinstance(exc, Refused) else "error"
            print(f"appliance {args.command}: {kind}: {exc}", file=sys.stderr)
            return 1
    return wrapped
