"""The service's errors as gRPC status codes, shared by the TF Serving and KServe v2 gRPC
services: ``ApplianceError.grpc_code`` with its message, ``retry-after`` in the trailing
metadata when the error has one, and INTERNAL (logged here, never a traceback to the
client) for anything unexpected."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Awaitable, Callable, Iterator, Mapping

import grpc

from appliance.core.errors import ApplianceError
from appliance.core.seams import RequestMetrics

log = logging.getLogger("appliance.grpc")


def guarded(fn: Callable[[Any], Awaitable[Any]], method: str,
            codes: Mapping[type, str] | None = None) -> Callable[[Any, Any], Awaitable[Any]]:
    """``fn(request)``, a coroutine, as a gRPC method served on the server's event loop;
    ``codes`` overrides the code of an error class (TF Serving answers a full batch queue
    RESOURCE_EXHAUSTED, Triton UNAVAILABLE)."""
    async def call(request: Any, context: Any) -> Any:
        try:
            return await fn(request)
        except Exception as exc:
            code, message = _status(exc, method, codes, context)
        await context.abort(code, message)
    return call


def _status(exc: Exception, method: str, codes: Mapping[type, str] | None, context: Any) -> tuple[grpc.StatusCode, str]:
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
    """Count a gRPC call in the request metrics as REST counts a request (the HTTP status its
    error maps to), under ``entrypoint="GRPC"`` as TF Serving labels its gRPC calls."""
    started, status = time.perf_counter(), 200
    try:
        yield
    except Exception as exc:
        status = exc.http_status if isinstance(exc, ApplianceError) else 500
        raise
    finally:
        metrics.observe_request(model, api, status, time.perf_counter() - started, entrypoint="GRPC")
