"""Message kinds between front workers and the serving process, and how an error crosses.

Each message is ``(kind, id, payload)`` (appliance/transport/channel.py). ``id`` pairs a
reply with its request (0 for pushes). Worker -> serving:

- ``RUN``: a ``RunRequest``; replied ``DONE`` (version, outputs), ``FAIL`` or ``STALE``
  (the ``VersionView`` of the version that would answer, whose signature differs).
- ``RESOLVE``: (model, version, label) the serving view cannot answer; replied ``DONE``
  with the ``VersionView`` the manager picks, or ``FAIL`` with the manager's error.
- ``WSGI``: (environ, body) of a request the worker forwards; replied ``ANSWER`` (status,
  headers, body) for a whole answer, or ``START`` (status, headers), ``CHUNK`` bytes...,
  ``END`` for a stream. ``CANCEL``: the client went away; the stream is closed.
- ``OBSERVE``: request metrics the worker took since its last one (a list of tuples).
- ``STATS``: the worker's HTTP figures and memory, every second.

Serving -> worker: ``VIEW`` (a ``ServingView``), ``CONFIG`` (a ``Config``, after a
reload), ``DRAIN`` (timeout seconds: stop accepting, finish, exit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from appliance.core import errors

RUN, RESOLVE, DONE, FAIL, STALE = "run", "resolve", "done", "fail", "stale"
WSGI, ANSWER, START, CHUNK, END, CANCEL = "wsgi", "answer", "start", "chunk", "end", "cancel"
OBSERVE, STATS, VIEW, CONFIG, DRAIN = "observe", "stats", "view", "config", "drain"


@dataclass(frozen=True)
class RunRequest:
    """One ``handle.run``: the request as the client named the version, the version and
    signature fingerprint the inputs were decoded against, and the inputs."""

    model: str
    version: int | None
    label: str | None
    route_headers: Mapping[str, str | None]
    signature: str
    inputs: Mapping[str, np.ndarray]
    decoded_version: int
    decoded_fingerprint: int


def error_to_wire(exc: BaseException) -> tuple[str, str, float | None]:
    """An error as (class name, message, retry_after); a foreign one becomes a 500's text."""
    if isinstance(exc, errors.ApplianceError):
        return type(exc).__name__, exc.message, exc.retry_after
    return "ApplianceError", f"{type(exc).__name__}: {exc}", None


def error_from_wire(wire: tuple[str, str, float | None]) -> errors.ApplianceError:
    name, message, retry_after = wire
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ApplianceError)):
        cls = errors.ApplianceError
    exc = cls.__new__(cls)
    errors.ApplianceError.__init__(exc, message)
    exc.retry_after = retry_after
    if cls is errors.ConfigError:
        exc.key = ""
    return exc


def plain_environ(environ: Mapping[str, Any]) -> dict[str, Any]:
    """What of a WSGI environ crosses: its text values (the URL scheme among them; no streams)."""
    return {k: v for k, v in environ.items() if isinstance(v, str)}
