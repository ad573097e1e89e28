"""Request bodies within ``server.max_body_bytes``, plain or gzip-compressed.

TF Serving inflates a body sent with ``Content-Encoding: gzip`` (any value containing
"gzip", up to 100 MB; net_http's ``auto_uncompress_input``); so does this, but the
inflated size counts against ``server.max_body_bytes`` and is checked while inflating, in
bounded steps: a small body that inflates to gigabytes (a zip bomb) costs one step past
the limit, then 413. The HTTP server (appliance/transport/http/server.py) already refuses a raw or chunked body over
the limit before buffering it, and never hands an incomplete body to the app.

``read_body(environ, limit)`` is what the API handlers call. ``GzipBodies`` is the same
as a WSGI layer, for handlers that read ``wsgi.input`` themselves: it inflates a gzip
body, then hands it on as a plain one (no Content-Encoding, the inflated Content-Length).
"""

from __future__ import annotations

import io
import zlib
from typing import TYPE_CHECKING, Any, Callable, Iterable

from appliance.api.errors import wsgi_error
from appliance.core.errors import ApplianceError, InvalidArgument, PayloadTooLarge

if TYPE_CHECKING:
    from appliance.core.appliance import Appliance

STEP = 256 * 1024  # inflated bytes produced per step: the most a bomb gets past the limit
LIMIT_KEY = "server.max_body_bytes"


def read_body(environ: dict[str, Any], limit: int) -> bytes:
    """The request body, inflated when gzip; 413 over ``limit``, 400 for a broken encoding."""
    data = read_raw(environ, limit)
    return inflate(data, limit) if content_encoding(environ) == "gzip" else data


def read_raw(environ: dict[str, Any], limit: int) -> bytes:
    """The request body as sent (no inflation); 413 over ``limit``."""
    length = environ.get("CONTENT_LENGTH")
    try:
        size = int(length) if length else None
    except ValueError:
        raise InvalidArgument(f"Content-Length {length!r} is not a number") from None
    if size is not None and size > limit:
        raise PayloadTooLarge(f"request body of {size} bytes is over the limit of {limit} bytes ({LIMIT_KEY})")
    stream = environ["wsgi.input"]
    data = stream.read(size) if size is not None else stream.read(limit + 1)
    if len(data) > limit:
        raise PayloadTooLarge(f"request body is over the limit of {limit} bytes ({LIMIT_KEY})")
    return data


def content_encoding(environ: dict[str, Any]) -> str:
    """"gzip", "" (none or identity), or 400 for an encoding this server cannot undo."""
    value = environ.get("HTTP_CONTENT_ENCODING", "").strip().lower()
    if not value or value == "identity":
        return ""
    if "gzip" in value:  # as TF Serving matches it
        return "gzip"
    raise InvalidArgument(f"Content-Encoding {value!r} is not supported; send the body as gzip or uncompressed")


def inflate(data: bytes, limit: int) -> bytes:
    """``data`` gunzipped, at most ``limit`` bytes of it (413 past that, 400 if not gzip)."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip header and trailer required
    out, total, pending = [], 0, data
    try:
        while pending or not inflater.eof:
            chunk = inflater.decompress(pending, STEP)
            pending = inflater.unconsumed_tail
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"gzip request body inflates to more than {limit} bytes ({LIMIT_KEY})")
            out.append(chunk)
            if not chunk and not pending:
                break
    except zlib.error as exc:
        raise InvalidArgument(f"Content-Encoding gzip, but the body is not valid gzip data: {exc}") from None
    if not inflater.eof:
        raise InvalidArgument("Content-Encoding gzip, but the gzip body is truncated")
    return b"".join(out)


class GzipBodies:
    """WSGI layer: a gzip request body becomes a plain one for the layers inside it.

    Sits inside the authentication layer, so no unauthenticated client gets the server
    to inflate anything. Requests without Content-Encoding pass untouched.
    """

    def __init__(self, app: Callable[..., Any], core: "Appliance"):
        self.app = app
        self.core = core

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not environ.get("HTTP_CONTENT_ENCODING"):
            return self.app(environ, start_response)
        try:
            body = read_body(environ, self.core.config.server.max_body_bytes)
        except ApplianceError as exc:
            return wsgi_error(exc, start_response)
        environ.pop("HTTP_CONTENT_ENCODING", None)
        environ["CONTENT_LENGTH"] = str(len(body))
        environ["wsgi.input"] = io.BytesIO(body)
        return self.app(environ, start_response)


def route_key(environ: dict[str, Any]) -> Callable[[str], str | None]:
    """The request's header values by name, for the core's sticky canary routing."""
    return lambda header: environ.get("HTTP_" + header.upper().replace("-", "_"))
