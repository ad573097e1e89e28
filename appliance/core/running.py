"""The record of the service running on a state directory: ``<state>/service.json``.

The service writes it once it listens (``write``): its pid, when it started, the address
a client on this machine reaches its REST API at (a wildcard listen address becomes the
loopback one), its gRPC addresses, its config file, and where its admin token comes from
(a path or a credential name: never the token). The CLI verbs that talk to the running
service (``appliance sync``, ``rollback``, ``rollout promote|abort``) read it (``read``)
from the same ``--state`` / ``$STATE_DIRECTORY`` / config the service was started with,
so they find it on whatever port it runs. The record stays after the service stops; a
reader checks ``alive``.

Only the standard library: the CLI imports this without the server.
"""

from __future__ import annotations

import json
import os
import tempfile
from appliance.core.json_types import JSONObject, ReadJSONObject

FILE = "service.json"
WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def path_in(state_dir: str) -> str:
    return os.path.join(state_dir, FILE)


def local_url(host: str, port: int, tls: bool = False) -> str:
    """How a client on this machine reaches ``host:port``."""
    host = WILDCARDS.get(host, host)
    return f"{'https' if tls else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"


def write(state_dir: str, record: ReadJSONObject) -> str | None:
    """Replace ``<state>/service.json`` atomically (mode 0644: it holds no secret); the
    path, or None where it cannot be written (a read-only state directory; a record that is
    not JSON): the service runs on without it."""
    target = path_in(state_dir)
    try:
        fd, tmp = tempfile.mkstemp(prefix=".service-", dir=state_dir)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except (OSError, TypeError, ValueError):
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return None
    return target


def read(state_dir: str) -> JSONObject | None:
    """The record in ``state_dir``, or None when there is none (or it is unreadable)."""
    try:
        with open(path_in(state_dir)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    found: JSONObject | None = record if isinstance(record, dict) else None  # json.load's object
    return found


def alive(record: ReadJSONObject) -> bool:
    """Whether the process that wrote ``record`` still runs (a pid reused since is not told
    apart; the client's request then says more)."""
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (the unit's)
        return True
    return True
