"""A request's scheduling hints as data: one frozen object passed along the call.

``RequestContext`` is made where a request arrives (the serving side of the worker link,
appliance/fronts/serving.py; the HTTP server and the lean gRPC server through ``CALL_ALONE``,
below) and handed down explicitly: ``ModelHandle.run(signature, inputs, context)``
(appliance/core/seams.py) -> ``Batcher.submit(signature, inputs, context)``, which picks the
path: a quick model's lone call runs on the caller's loop, a slow model's lone call through
the servable's ``run_wide`` (appliance/core/batcher.py).

What it holds, and only that (issue 46: no field that nothing reads):

- ``alone``: asked (once, when the call reaches the batch queue) whether the call is the only
  one in flight where it arrived: the HTTP server's in-app count, the gRPC connection's calls,
  the serving side's runs from every worker. A function, not a bool: between arrival and the
  queue a call decodes its body, and others may arrive meanwhile; the answer must be the one
  at the queue. None: the caller does not know (a shadow run, a test, a warm-up), never alone.

A deadline and a priority are not fields: the batch queue reads neither (the gRPC deadline is
kept by the call's own context, appliance/transport/grpc/calls.py, and a request's HTTP
deadlines by the server). They join this object when something schedules by them.

``CALL_ALONE`` is the one ambient bridge left, for the entry points whose API families do not
yet hand a per-request object to ``run`` (the lean gRPC server and in-process HTTP fast
routes, which set it per call's task as before): ``from_call()`` turns it into a
``RequestContext`` at the seam (appliance/core/handle.py), and nothing below the seam reads it.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Callable

# Set per call's task by an event-loop server that counts its calls (appliance/transport/http/server.py,
# appliance/transport/grpc/connection.py): read only by ``from_call`` at the seam.
CALL_ALONE: contextvars.ContextVar[Callable[[], bool] | None] = contextvars.ContextVar("call_alone", default=None)


@dataclass(frozen=True, slots=True)
class RequestContext:
    """One request's scheduling hints (module docstring)."""

    alone: Callable[[], bool] | None = None

    def is_alone(self) -> bool:
        """The call is the only one in flight where it arrived, now."""
        return self.alone is not None and self.alone()


NO_CONTEXT = RequestContext()


def from_call() -> RequestContext:
    """The context of a call whose API family passed none: what its server set (``CALL_ALONE``)."""
    alone = CALL_ALONE.get()
    return NO_CONTEXT if alone is None else RequestContext(alone)
