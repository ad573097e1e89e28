"""The service's error hierarchy; each class maps to one HTTP status and one gRPC code.

    ApplianceError        500  INTERNAL            a bug: never a client's fault
    ├── InvalidArgument   400  INVALID_ARGUMENT    malformed JSON, wrong dtype/shape,
    │   │                                          unknown input, bad signature use, a
    │   │                                          request larger than the batch queue can
    │   │                                          ever hold (permanent, never "retry later")
    │   └── FailedPrecondition  400  FAILED_PRECONDITION  what TF Serving's gRPC calls so
    │                                              (an unknown signature key in Predict)
    ├── PermissionDenied  403  PERMISSION_DENIED   a caller this feature is not for (shared
    │                                              memory from another host)
    ├── NotFound          404  NOT_FOUND           unknown model, version, label, signature
    ├── MethodNotAllowed  405  UNIMPLEMENTED       a known path with the wrong HTTP method
    ├── PayloadTooLarge   413  RESOURCE_EXHAUSTED  body or tensor over a limit
    ├── Unavailable       503  UNAVAILABLE         model not ready (retryable: carries
    │   │                                          ``retry_after`` seconds, default 1)
    │   └── QueueFull     503  UNAVAILABLE         the batch queue is full (retry later)
    ├── Unimplemented     501  UNIMPLEMENTED       a feature this install lacks (names the extra)
    └── ConfigError       500  INTERNAL            a bad config value, naming the key and the
                                                   reason: start-up refused, or a reload refused
                                                   with the running config kept

Columns: ``http_status`` and ``grpc_code`` as the class sets or inherits them (a gRPC
service may override a code per class: appliance/api/grpc_errors.py ``guarded``).
tests/core/test_errors.py reads this tree and compares it with the classes.

Backends raise ``runtimes.InputFailure`` / ``LoadFailure`` / ``MissingDependency``;
``from_runtime`` turns those into this hierarchy at the boundary. ``runtimes`` (and so
numpy) is imported there, on the first failure, not with this module: the CLI imports
``ConfigError`` and must stay cheap.

A message is at most ``MAX_MESSAGE`` characters (its middle cut, said so): an error that quotes
a request's value (a 60 MB JSON string where a number belongs) never echoes the request back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtimes import RuntimeFailure


MAX_MESSAGE = 2048  # characters of an error's message: one quoting a request's value never echoes megabytes


class ApplianceError(Exception):
    http_status = 500
    grpc_code = "INTERNAL"
    retry_after: float | None = None

    def __init__(self, message: str):
        message = _bounded(message)
        super().__init__(message)
        self.message = message


def _bounded(message: str) -> str:
    """``message``, its middle cut past ``MAX_MESSAGE`` (its end keeps the limit or key it names)."""
    if len(message) <= MAX_MESSAGE:
        return message
    head, tail = message[:MAX_MESSAGE * 3 // 4], message[-MAX_MESSAGE // 8:]
    return f"{head} ... ({len(message) - len(head) - len(tail)} characters cut) ... {tail}"


class InvalidArgument(ApplianceError):
    http_status = 400
    grpc_code = "INVALID_ARGUMENT"


class FailedPrecondition(InvalidArgument):
    """A client mistake TF Serving's gRPC API reports as FAILED_PRECONDITION (its REST API
    answers the same mistakes 400)."""

    grpc_code = "FAILED_PRECONDITION"


class PermissionDenied(ApplianceError):
    http_status = 403
    grpc_code = "PERMISSION_DENIED"


class NotFound(ApplianceError):
    http_status = 404
    grpc_code = "NOT_FOUND"


class MethodNotAllowed(ApplianceError):
    http_status = 405
    grpc_code = "UNIMPLEMENTED"


class PayloadTooLarge(ApplianceError):
    http_status = 413
    grpc_code = "RESOURCE_EXHAUSTED"


RETRY_AFTER_S = 1.0  # what a retryable error tells a client to wait, unless it says otherwise


class Unavailable(ApplianceError):
    """Retryable: ``retry_after`` (seconds, default ``RETRY_AFTER_S``) becomes REST's
    ``Retry-After`` and gRPC's ``retry-after`` trailer."""

    http_status = 503
    grpc_code = "UNAVAILABLE"
    retry_after: float | None = RETRY_AFTER_S

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        if retry_after is not None:
            self.retry_after = retry_after


class QueueFull(Unavailable):
    """The batch queue is full: retry later (TF Serving's 'unavailable, retry later')."""

    grpc_code = "UNAVAILABLE"


class Unimplemented(ApplianceError):
    http_status = 501
    grpc_code = "UNIMPLEMENTED"


class ConfigError(ApplianceError):
    """An invalid configuration value: ``key`` names it, the message says why."""

    def __init__(self, key: str, reason: str):
        super().__init__(f"config {key}: {reason}")
        self.key = key


def from_runtime(exc: RuntimeFailure) -> ApplianceError:
    from runtimes import InputFailure, MissingDependency

    if isinstance(exc, InputFailure):
        return InvalidArgument(str(exc))
    if isinstance(exc, MissingDependency):
        return Unimplemented(str(exc))
    return ApplianceError(str(exc))
