"""Request bodies within ``server.max_body_bytes``, plain or compressed (gzip, deflate).

TF Serving inflates a body sent with ``Content-Encoding: gzip`` (any value containing
"gzip", up to 100 MB; net_http's ``auto_uncompress_input``); so does this, and
``Content-Encoding: deflate`` too (tritonclient's ``request_compression_algorithm="deflate"``:
zlib's format as HTTP defines it, raw deflate also taken, as browsers and servers do); the
inflated size counts against ``server.max_body_bytes`` and is checked while inflating, in
bounded steps: a small body that inflates to gigabytes (a zip bomb) costs one step past
the limit, then 413. The HTTP server (appliance/transport/http/server.py) already refuses a raw or chunked body over
the limit before buffering it, and never hands an incomplete body to the app.

``read_body(environ, limit)`` is what the API handlers call. ``GzipBodies`` is the same
as a WSGI layer, for handlers that read ``wsgi.input`` themselves: it inflates a compressed
body, then hands it on as a plain one (no Content-Encoding, the inflated Content-Length).
"""

from __future__ import annotations

import io
import zlib
from typing import TYPE_CHECKING, Callable, Iterable
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from appliance.api.errors import wsgi_error
from appliance.core.errors import ApplianceError, InvalidArgument, PayloadTooLarge

if TYPE_CHECKING:
    from appliance.core.appliance import Appliance

STEP = 256 * 1024  # inflated bytes produced per step: the most a bomb gets past the limit
LIMIT_KEY = "server.max_body_bytes"


def read_body(environ: WSGIEnvironment, limit: int) -> bytes:
    """The request body, inflated when compressed; 413 over ``limit``, 400 for a broken encoding."""
    data = read_raw(environ, limit)
    encoding = content_encoding(environ)
    return inflate(data, limit, encoding) if encoding else data


def read_raw(environ: WSGIEnvironment, limit: int) -> bytes:
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
    return bytes(data)


def content_encoding(environ: WSGIEnvironment) -> str:
    """"gzip", "deflate", "" (none or identity), or 400 for an encoding this server cannot undo."""
    value = environ.get("HTTP_CONTENT_ENCODING", "").strip().lower()
    if not value or value == "identity":
        return ""
    if "gzip" in value:  # as TF Serving matches it
        return "gzip"
    if value == "deflate":
        return "deflate"
    raise InvalidArgument(f"Content-Encoding {value[:64]!r} is not supported; send the body as gzip, deflate "
                          "or uncompressed")


def inflate(data: bytes, limit: int, encoding: str = "gzip") -> bytes:
    """``data`` inflated, at most ``limit`` bytes of it (413 past that, 400 if not ``encoding``)."""
    inflater = zlib.decompressobj(_window_bits(data, encoding))
    out, total, pending = [], 0, data
    try:
        while pending or not inflater.eof:
            chunk = inflater.decompress(pending, STEP)
            pending = inflater.unconsumed_tail
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"{encoding} request body inflates to more than {limit} bytes ({LIMIT_KEY})")
            out.append(chunk)
            if not chunk and not pending:
                break
    except zlib.error as exc:
        raise InvalidArgument(f"Content-Encoding {encoding}, but the body is not valid {encoding} data: {exc}") from None
    if not inflater.eof:
        raise InvalidArgument(f"Content-Encoding {encoding}, but the {encoding} body is truncated")
    return b"".join(out)


def _window_bits(data: bytes, encoding: str) -> int:
    """zlib's window bits for ``encoding``: gzip's header and trailer required; for deflate,
    zlib's two-byte header when the body starts with one (RFC 1950: method 8, a multiple of 31),
    else raw deflate."""
    if encoding == "gzip":
        return 16 + zlib.MAX_WBITS
    if len(data) >= 2 and data[0] & 0x0F == 8 and ((data[0] << 8) | data[1]) % 31 == 0:
        return zlib.MAX_WBITS
    return -zlib.MAX_WBITS


class GzipBodies:
    """WSGI layer: a compressed (gzip, deflate) request body becomes a plain one for the layers inside it.

    Sits inside the authentication layer, so no unauthenticated client gets the server
    to inflate anything. Requests without Content-Encoding pass untouched.
    """

    def __init__(self, app: WSGIApplication, core: "Appliance"):
        self.app: WSGIApplication = app
        self.core = core

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
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


def route_key(environ: WSGIEnvironment) -> Callable[[str], str | None]:
    """The request's header values by name, for the core's sticky canary routing."""
    return lambda header: environ.get("HTTP_" + header.upper().replace("-", "_"))
