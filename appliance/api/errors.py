"""One error renderer for the REST app: every error answer is ``{"error": "..."}``.

``render(status, message, retry_after, headers)`` is the one function that builds an
error answer: the status line, ``Content-Type: application/json``, ``Content-Length``,
``Retry-After`` (whole seconds, rounded up) when the error is retryable, and the body.
Everything else is a thin face over it:

* ``render_error(exc)``: an exception, by its class (appliance/core/errors.py
  ``http_status``, ``retry_after``); an exception of no class of ours is a 500 "internal
  error: <type>" and is logged with its traceback, never shown to the client.
* ``wsgi_error(exc, start_response)``: the same, answered by a bare WSGI handler (v1, v2,
  :generate, gzip bodies).
* ``flask_error(status, message)`` / ``flask_response(exc)``: the same as a Flask response
  (Flask's error handlers, the parts' endpoints).

TF Serving (``http_rest_api_handler.cc`` ``MakeJsonFromStatus``) and KServe v2 (Triton's
``{"error": ...}``) answer errors in this one shape too.
"""

from __future__ import annotations

import logging
import math
from http import HTTPStatus
from typing import TYPE_CHECKING, Iterable, Sequence
from wsgiref.types import StartResponse

import orjson

from appliance.core.errors import ApplianceError

if TYPE_CHECKING:  # Flask is imported where a response is made (only Flask's callers need it)
    from flask import Response

JSON = "application/json"
Headers = list[tuple[str, str]]
log = logging.getLogger("appliance.api")
_LINES = {code: f"{code} {HTTPStatus(code).phrase}" for code in
          (200, 400, 401, 403, 404, 405, 409, 413, 429, 500, 501, 503, 504)}


def status_line(status: int) -> str:
    return _LINES.get(status) or f"{status} {HTTPStatus(status).phrase}"


def render(status: int, message: str, retry_after: float | None = None,
           headers: Sequence[tuple[str, str]] = ()) -> tuple[int, Headers, bytes]:
    """(status, headers, body) of an error answer. The one place that renders one."""
    body = orjson.dumps({"error": message})
    out = [("Content-Type", JSON), ("Content-Length", str(len(body)))]
    if retry_after:
        out.append(("Retry-After", str(max(1, math.ceil(retry_after)))))
    out.extend(headers)
    return status, out, body


def error_body(message: str) -> tuple[str, bytes]:
    """(Content-Type, body) of an error the HTTP server answers itself (a 408, 413 or 503 it
    writes before any app runs): the same ``{"error": ...}`` shape."""
    return JSON, orjson.dumps({"error": message})


def as_error(exc: BaseException, where: str = "the REST API") -> ApplianceError:
    """``exc`` as one of our errors; anything else is a bug: logged, and a bare 500."""
    if isinstance(exc, ApplianceError):
        return exc
    log.error("unhandled error in %s", where, exc_info=exc)
    return ApplianceError(f"internal error: {type(exc).__name__}")


def render_error(exc: BaseException, where: str = "the REST API") -> tuple[int, Headers, bytes]:
    error = as_error(exc, where)
    return render(error.http_status, error.message, error.retry_after)


def wsgi_answer(start_response: StartResponse, rendered: tuple[int, Headers, bytes],
                method: str = "GET") -> Iterable[bytes]:
    status, headers, body = rendered
    start_response(status_line(status), headers)
    return [body] if method != "HEAD" else []


def wsgi_error(exc: BaseException, start_response: StartResponse, where: str = "the REST API") -> Iterable[bytes]:
    return wsgi_answer(start_response, render_error(exc, where))


def flask_error(status: int, message: str, retry_after: float | None = None,
                headers: Sequence[tuple[str, str]] = ()) -> Response:
    """A Flask ``Response`` of ``render``'s answer (Flask imported here: only its callers need it)."""
    from flask import Response

    code, out, body = render(status, message, retry_after, headers)
    response = Response(body, status=code)
    response.headers.clear()
    for name, value in out:
        response.headers.add(name, value)
    return response


def flask_response(exc: BaseException, where: str = "the REST API") -> Response:
    error = as_error(exc, where)
    return flask_error(error.http_status, error.message, error.retry_after)


__all__ = ["as_error", "error_body", "flask_error", "flask_response", "render", "render_error", "status_line",
           "wsgi_answer", "wsgi_error"]
