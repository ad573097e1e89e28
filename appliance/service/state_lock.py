"""One service per state directory: the state database, the model store and the event log
belong to one process. ``lock_state_dir`` takes an exclusive ``flock`` on
``<state>/service.lock`` (held until the process exits; the kernel drops it even after
``kill -9``) and writes the holder's pid there for the message a second service prints.
"""

from __future__ import annotations

import fcntl
import logging
import os
from typing import IO

log = logging.getLogger("appliance.service")


class StateDirBusy(Exception):
    """Another live service holds the state directory."""


def lock_state_dir(state_dir: str) -> IO[str] | None:
    """The open, locked lock file (keep a reference for as long as the service runs), or
    None where the directory cannot hold one (read-only state: served without the lock)."""
    path = os.path.join(state_dir, "service.lock")
    try:
        os.makedirs(state_dir, exist_ok=True)
        f = open(path, "a+")
    except OSError as exc:
        log.warning("cannot create %s (%s): a second service on this state directory would not be refused",
                    path, exc.strerror)
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise StateDirBusy(f"another edge-appliance (pid {holder}) is serving the state directory {state_dir}; "
                           "stop it, or give this one its own with --state DIR") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f
