"""``appliance discover [--timeout S] [--json] [--interface NAME_OR_ADDR]``: the appliances
that answer on the LAN (mDNS/DNS-SD), found by appliance/parts/discovery.py's ``browse``.

zeroconf (and the discovery part) is imported when the command runs, not when the parser
is built.
"""

from __future__ import annotations

import argparse
import json

from appliance.commands.common import Subcommands


def add_commands(sub: Subcommands) -> None:
    discover = sub.add_parser("discover", help="find appliances on the LAN (mDNS/DNS-SD)")
    discover.add_argument("--timeout", type=float, default=3.0, help="seconds to listen (default 3)")
    discover.add_argument("--json", action="store_true", help="machine-readable output")
    discover.add_argument("--interface", action="append", default=[], metavar="NAME_OR_ADDR",
                          help="browse on this interface only (repeatable; default all)")
    discover.set_defaults(func=cmd_discover)


def cmd_discover(args: argparse.Namespace) -> int:
    from appliance.parts.discovery import browse

    found = browse(args.timeout, args.interface or None)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    if not found:
        print(f"no appliance answered within {args.timeout:g} s")
        return 0
    for item in found:
        print(f"{item['name']}  {item['url']}  id {item['id']}  v{item['version']}  "
              f"backend {item['backend'] or '-'}")
        print(f"  addresses: {', '.join(item['addresses'])}  port {item['port']}")
        print(f"  models: {', '.join(f'{m}@{v}' if v is not None else m for m, v in item['versions'].items()) or '-'}")
    return 0
