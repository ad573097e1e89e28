"""The service's errors as gRPC status codes, shared by the TF Serving and KServe v2 gRPC
services: ``ApplianceError.grpc_code`` with its message, ``retry-after`` in the trailing
metadata when the error has one, and INTERNAL (logged here, never a traceback to the
client) for anything unexpected."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Awaitable, Callable, Iterator, Mapping, NoReturn, Protocol, Sequence, TypeVar

import grpc

from appliance.core.errors import ApplianceError
from appliance.core.request_context import RequestContext, of_grpc
from appliance.core.seams import RequestMetrics

log = logging.getLogger("appliance.grpc")

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class CallContext(Protocol):
    """What the services use of a call's context: grpcio's ``grpc.aio.ServicerContext`` and the
    lean server's ``appliance.transport.grpc.calls.Context`` both have it. ``abort`` never
    returns (grpcio's is a coroutine that raises, the lean one raises at once)."""

    def peer(self) -> str: ...

    def abort(self, code: grpc.StatusCode, details: str = ...) -> Awaitable[NoReturn]: ...

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None: ...



def guarded(fn: Callable[[Req], Awaitable[Resp]], method: str,
            codes: Mapping[type, str] | None = None) -> Callable[[Req, CallContext], Awaitable[Resp]]:
    """``fn(request)``, a coroutine, as a gRPC method served on the server's event loop;
    ``codes`` overrides the code of an error class (TF Serving answers a full batch queue
    RESOURCE_EXHAUSTED, Triton UNAVAILABLE)."""
    return _guard(lambda request, context: fn(request), method, codes)


def guarded_run(fn: Callable[[Req, RequestContext], Awaitable[Resp]], method: str,
                codes: Mapping[type, str] | None = None) -> Callable[[Req, CallContext], Awaitable[Resp]]:
    """``guarded`` for a method that runs a model: ``fn(request, context)``, ``context`` the
    call's ``RequestContext``, made of what its server's call context tells
    (appliance/core/request_context.py ``of_grpc``: the lean server's lone-call predicate;
    grpcio tells none, never alone)."""
    return _guard(lambda request, context: fn(request, of_grpc(context)), method, codes)


def _guard(fn: Callable[[Req, CallContext], Awaitable[Resp]], method: str,
           codes: Mapping[type, str] | None) -> Callable[[Req, CallContext], Awaitable[Resp]]:
    """Both wrappers' one body: an error becomes the call's status (``_status``), never a traceback."""
    async def call(request: Req, context: CallContext) -> Resp:
        try:
            return await fn(request, context)
        except Exception as exc:
            code, message = _status(exc, method, codes, context)
        await context.abort(code, message)
    return call


def _status(exc: Exception, method: str, codes: Mapping[type, str] | None,
            context: CallContext) -> tuple[grpc.StatusCode, str]:
    """The status code and message for ``exc`` (its retry-after put in the trailing metadata)."""
    if isinstance(exc, ApplianceError):
        error = exc
    else:
        log.exception("unhandled error in %s", method, exc_info=exc)
        error = ApplianceError(f"internal error: {type(exc).__name__}")
    code = next((c for kind, c in (codes or {}).items() if isinstance(error, kind)), error.grpc_code)
    if error.retry_after:
        context.set_trailing_metadata((("retry-after", str(int(error.retry_after))),))
    return getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL), error.message


@contextlib.contextmanager
def observed(metrics: RequestMetrics, model: str, api: str) -> Iterator[None]:
    """Count a gRPC call in the request metrics under its canonical code (``OK``, the
    error's ``grpc_code``, INTERNAL for a bug) and ``entrypoint="GRPC"``, as TF Serving
    labels its gRPC calls."""
    started, status = time.perf_counter(), "OK"
    try:
        yield
    except Exception as exc:
        status = exc.grpc_code if isinstance(exc, ApplianceError) else "INTERNAL"
        raise
    finally:
        metrics.observe_request(model, api, status, time.perf_counter() - started, entrypoint="GRPC")
