"""The ``appliance`` command: the parser and the dispatch; the verbs live in appliance/commands/.

Each module of ``COMMAND_MODULES`` adds its subcommands with ``add_commands(subparsers)``
and imports only the standard library at module level; what a verb needs (Flask, the
model manager, numpy, boto3, zeroconf ...) it imports when it runs. So ``appliance
--help`` builds every parser without importing the server (tests/commands/test_cli.py checks it).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from appliance.version import __version__
from appliance.core.errors import ConfigError

# In the order ``appliance --help`` lists them.
COMMAND_MODULES = ("appliance.commands.serve", "appliance.commands.probe", "appliance.commands.discover",
                   "appliance.commands.fleet", "appliance.commands.tfs", "appliance.commands.rollout",
                   "appliance.commands.health")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description="edge-appliance: an on-device model server")
    parser.add_argument("--version", action="version", version=f"edge-appliance {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        importlib.import_module(module).add_commands(sub)
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
