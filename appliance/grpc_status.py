"""The service's errors as gRPC status codes, shared by the TF Serving and KServe v2 gRPC
services: ``ApplianceError.grpc_code`` with its message, ``retry-after`` in the trailing
metadata when the error has one, and INTERNAL (logged here, never a traceback to the
client) for anything unexpected."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterator, Mapping

import grpc

from .errors import ApplianceError

log = logging.getLogger("appliance.grpc")


def guarded(fn: Callable[[Any], Any], method: str,
            codes: Mapping[type, str] | None = None) -> Callable[[Any, grpc.ServicerContext], Any]:
    """``fn(request)`` as a gRPC method; ``codes`` overrides the code of an error class
    (TF Serving answers a full batch queue RESOURCE_EXHAUSTED, Triton UNAVAILABLE)."""
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(request)
        except ApplianceError as exc:
            error = exc
        except Exception as exc:
            log.exception("unhandled error in %s", method)
            error = ApplianceError(f"internal error: {type(exc).__name__}")
        code = next((c for kind, c in (codes or {}).items() if isinstance(error, kind)), error.grpc_code)
        if error.retry_after:
            context.set_trailing_metadata((("retry-after", str(int(error.retry_after))),))
        context.abort(getattr(grpc.StatusCode, code, grpc.StatusCode.INTERNAL), error.message)
    return call


@contextlib.contextmanager
def observed(metrics: Any, model: str, api: str) -> Iterator[None]:
    """Count a call in the request metrics as REST does: the status an error maps to."""
    started, status = time.perf_counter(), 200
    try:
        yield
    except Exception as exc:
        status = exc.http_status if isinstance(exc, ApplianceError) else 500
        raise
    finally:
        metrics.observe_request(model, api, status, time.perf_counter() - started)
