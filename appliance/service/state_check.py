"""Refuse to start on a state directory that cannot be written, saying why and what to do.

The service tolerates a read-only state by design (appliance/core/state.py: an in-memory
database, the store served as it is, the problem shown on /readyz and the page): a device
keeps serving what it has. Two cases must not start that way, because nothing would work or
the failure would hide until the next restart:

- the embedded default (``appliance serve`` with no models and no bucket), which publishes the
  sample into ``<state>/bucket`` and syncs it into ``<state>/models``: without a writable state
  there is nothing to serve;
- ``EDGE_APPLIANCE_REQUIRE_WRITABLE_STATE=1`` (set by the OCI image, deploy/Containerfile): the
  state directory is a volume whose whole point is that versions survive a restart; a read-only
  or foreign-owned one is a deployment mistake that would otherwise cost a full download at each
  restart and show only on the status page.

``require_writable(path)`` raises ``ConfigError`` (the CLI prints it and exits 2, before any
port is bound) naming the directory, this process's uid/gid, the directory's owner and mode, and
the fix for podman, docker and Kubernetes. No side effect but the directory itself (made when
missing) and a probe file removed at once.
"""

from __future__ import annotations

import errno
import os
import tempfile

from appliance.core.errors import ConfigError

REQUIRE_ENV = "EDGE_APPLIANCE_REQUIRE_WRITABLE_STATE"


def required(embedded_default: bool) -> bool:
    """Whether this start must have a writable state directory (see the module docstring)."""
    return embedded_default or os.environ.get(REQUIRE_ENV, "") not in ("", "0")


def require_writable(path: str) -> None:
    """Return when ``path`` exists (or was made) and a file can be created in it; else raise
    ``ConfigError`` saying why and how to fix it."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError("state_dir", explain(path, exc)) from None


def explain(path: str, exc: OSError) -> str:
    who = f"uid {os.getuid()}, gid {os.getgid()}"
    head = f"{path} cannot be written ({exc.strerror})"
    if exc.errno == errno.EROFS:
        fix = ("it is on a read-only file system: mount a writable volume there (no ':ro' in podman/docker "
               "-v, no readOnly: true in Kubernetes)")
    elif exc.errno in (errno.EACCES, errno.EPERM):
        fix = (f"this process runs as {who}, and {_owner(path)}: give the directory to uid {os.getuid()} "
               f"(on the host: chown -R {os.getuid()}:{os.getgid()} DIR; podman: -v DIR:{path}:U; "
               "a named volume is set up by itself; Kubernetes: an init container that chowns the hostPath)")
    elif exc.errno == errno.ENOENT:
        fix = "a folder above it does not exist and cannot be made: mount a volume there, or pass --state DIR"
    else:
        fix = f"this process runs as {who}"
    why = ("the embedded default publishes its sample model there" if os.environ.get(REQUIRE_ENV, "") in ("", "0")
           else f"{REQUIRE_ENV} is set: the state must persist (versions synced, the state database)")
    return f"{head}: {fix}. ({why}.)"


def _owner(path: str) -> str:
    """Who owns ``path``, or the nearest folder above it that exists."""
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe.rstrip("/")) or "/"
    try:
        st = os.stat(probe)
    except OSError:
        return f"{probe} cannot be looked at"
    return f"{probe} is owned by uid {st.st_uid}, gid {st.st_gid}, mode {st.st_mode & 0o7777:04o}"
