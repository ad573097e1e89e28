"""A request's scheduling hints as data: one frozen object passed along the call.

``RequestContext`` is made where a request arrives and handed down explicitly, never set as
ambient state: ``ModelHandle.run(signature, inputs, context)`` (appliance/core/seams.py) ->
``Batcher.submit(signature, inputs, context)``, which picks the path: a quick model's lone call
runs on the caller's loop, a slow model's lone call through the servable's ``run_wide``
(appliance/core/batcher.py). Where it is made, and how it reaches ``run``:

- the HTTP server's fast routes (appliance/transport/http/server.py): the server puts it in
  the request's WSGI environ under ``ENVIRON_KEY``, data on the request like the ``wsgi.*``
  keys; the REST families read it with ``of_environ``;
- the lean gRPC server (appliance/transport/grpc/calls.py ``Context``): each call's context
  object carries the server's lone-call predicate; the gRPC families read it with
  ``of_grpc``. grpcio's own server has no such attribute: its calls are never alone;
- the serving side of the worker link (appliance/fronts/serving.py): its own, on the
  environ or the gRPC context of each forwarded request.

What it holds, and only that (issue 46: no field that nothing reads):

- ``alone``: asked (once, when the call reaches the batch queue) whether the call is the only
  one in flight where it arrived: the HTTP server's in-app count, the gRPC server's calls,
  the serving side's runs from every worker. A function, not a bool: between arrival and the
  queue a call decodes its body, and others may arrive meanwhile; the answer must be the one
  at the queue. None: the caller does not know (a shadow run, a test, a warm-up, a request on
  the WSGI app's threads, grpcio), never alone.

A deadline and a priority are not fields: the batch queue reads neither (the gRPC deadline is
kept by the call's own context, appliance/transport/grpc/calls.py, and a request's HTTP
deadlines by the server). They join this object when something schedules by them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

# The WSGI environ key of a request's RequestContext (the transport, which cannot import this
# module, spells it the same: appliance/transport/http/wsgi.py CONTEXT_KEY).
ENVIRON_KEY = "appliance.request_context"


@dataclass(frozen=True, slots=True)
class RequestContext:
    """One request's scheduling hints (module docstring)."""

    alone: Callable[[], bool] | None = None

    def is_alone(self) -> bool:
        """The call is the only one in flight where it arrived, now."""
        return self.alone is not None and self.alone()


NO_CONTEXT = RequestContext()


def of_environ(environ: Mapping[str, Any]) -> RequestContext:
    """The context the request's server put in its WSGI environ (none: ``NO_CONTEXT``)."""
    context = environ.get(ENVIRON_KEY)
    return context if isinstance(context, RequestContext) else NO_CONTEXT


def of_grpc(context: object) -> RequestContext:
    """The context of a gRPC call, from its server's call context: the lean server's (and the
    serving side's) ``alone`` predicate; grpcio's context has none (never alone)."""
    alone = getattr(context, "alone", None)
    return NO_CONTEXT if alone is None else RequestContext(alone)
