"""One HTTP/2 server session of libnghttp2 (appliance/transport/grpc/nghttp2.py), with the
calls the gRPC connection makes and nghttp2's callbacks turned into calls on its ``Events``.

nghttp2 reads bytes (``feed``) and calls back per header, per DATA chunk and per complete
frame; it writes frames when asked (``output``), pulling an answer's DATA through
``Events.read_answer`` as far as the peer's windows allow, then the trailers. Everything that
is protocol (framing, HPACK, stream states, flow-control accounting, the preface and RFC 9113's
checks, SETTINGS and PING acknowledgements) is nghttp2's; what the connection decides (which
calls run, credit for a stream, limits) is in connection.py.

Memory: the session's C memory is freed by ``close`` (idempotent), never by the garbage
collector: the connection calls it when its socket closes. The callbacks find their
connection through a cffi handle that ``close`` drops, so no reference cycle outlives it.

Thread-safety: one thread (the event loop's); callbacks run inside ``feed`` and ``output``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, cast

from _cffi_backend import from_handle as _from_handle, unpack as _unpack  # FFI's own methods wrap these

from appliance.transport.grpc import nghttp2 as ng

if TYPE_CHECKING:
    from types import TracebackType

    import cffi

    class FrameHeader(Protocol):
        """The fields the callbacks read of a ``const nghttp2_frame_hd *`` (cffi ships no types)."""

        type: int
        flags: int
        stream_id: int

    class PointerOut(Protocol):
        """A ``T **`` out-parameter (cffi ships no types): ``out[0]`` is the pointer C wrote."""

        def __getitem__(self, index: int) -> object: ...

    class Flags(Protocol):
        """A ``uint32_t *`` out-parameter (cffi ships no types): ``flags[0] |= ...``."""

        def __getitem__(self, index: int) -> int: ...
        def __setitem__(self, index: int, value: int) -> None: ...

log = logging.getLogger("appliance.grpc")

Header = tuple[bytes, bytes]
OUTBOUND_ACK_LIMIT = 1000  # queued SETTINGS/PING answers before nghttp2 calls it a flood (its default)
MAX_SETTINGS = 32  # entries in one SETTINGS frame (nghttp2's default); RFC 9113 defines 6


class Events(Protocol):
    """What a session tells its connection (connection.py's ``Connection``). ``failed``: the
    connection gave up on the peer; the rest of what ``feed`` was given is not processed.
    No method may call ``Session.output`` (nghttp2 forbids sending from its callbacks).

    ``on_stream`` returns where the new stream's header fields go (appended as (name,
    value) while their sizes, counted as SETTINGS_MAX_HEADER_LIST_SIZE counts them, stay
    within ``header_limit``; the total is passed to ``on_headers``), or None to drop them."""

    failed: bool

    def on_stream(self, stream_id: int) -> list[tuple[bytes, bytes]] | None: ...
    def on_data(self, stream_id: int, data: object, length: int) -> None: ...  # data: a cffi uint8_t *
    def on_headers(self, stream_id: int, end_stream: bool, size: int) -> None: ...
    def on_request_end(self, stream_id: int) -> None: ...
    def on_client_reset(self, stream_id: int) -> None: ...
    def on_settings(self) -> None: ...
    def on_ping(self) -> None: ...
    def on_goaway(self) -> None: ...
    def on_window_update(self, stream_id: int) -> None: ...
    def on_stream_closed(self, stream_id: int) -> None: ...
    def read_answer(self, stream_id: int, buf: object, length: int) -> tuple[int, bool]: ...  # buf: cffi uint8_t *


class SessionError(Exception):
    """nghttp2 refused the peer's bytes (a protocol violation or a flood): close the connection."""


class Session:
    """One server session (module docstring)."""

    def __init__(self, events: Events, settings: dict[int, int], connection_window: int,
                 reset_burst: int, reset_rate: float, header_limit: int):
        ffi, lib = ng.load()
        self.ffi, self.lib = ffi, lib
        self.events = events
        self.header_limit = header_limit
        self.sink: list[tuple[bytes, bytes]] | None = None  # the header block under way's fields
        self.sink_bytes = 0
        self._handle = ffi.new_handle(self)
        out = ffi.new("nghttp2_session **")
        option = _option(ffi, lib, reset_burst, reset_rate)
        try:
            _check(lib, lib.nghttp2_session_server_new2(out, _callbacks(), self._handle, option[0]))
        finally:
            lib.nghttp2_option_del(option[0])
        self.ptr = out[0]
        self._out = ffi.new("const char **")
        iv = ffi.new("nghttp2_settings_entry[]", [(k, v) for k, v in settings.items()])
        _check(lib, lib.nghttp2_submit_settings(self.ptr, 0, iv, len(settings)))
        _check(lib, lib.nghttp2_session_set_local_window_size(self.ptr, 0, 0, connection_window))

    @property
    def open(self) -> bool:
        return self.ptr is not None

    def close(self) -> None:
        """Free the session (idempotent). Never from inside its own callbacks."""
        if self.ptr is not None:
            self.lib.nghttp2_session_del(self.ptr)
            self.ptr = None
        self._handle = self.events = self.sink = None  # type: ignore[assignment]  # closed: the fields are None only after close, never read then

    # -- bytes in and out --------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        """The peer's bytes; callbacks run meanwhile. SessionError when nghttp2 refuses them
        (its GOAWAY, if any, is then in ``output``)."""
        if self.ptr is None:
            return
        rv = self.lib.nghttp2_session_mem_recv(self.ptr, data, len(data))
        if rv < 0:
            raise SessionError(self.ffi.string(self.lib.nghttp2_strerror(rv)).decode())

    def output(self) -> bytes:
        """Every frame nghttp2 has to send now, answers' DATA as far as windows allow (nghttp2
        hands them over a frame at a time: an answer is three, HEADERS, DATA and trailers)."""
        ptr = self.ptr
        if ptr is None:
            return b""
        send, out = self.lib.nghttp2_session_mem_send, self._out
        n = send(ptr, out)
        if n <= 0:
            return self._sent(n, b"")
        data = _unpack(out[0], n)
        while (n := send(ptr, out)) > 0:
            data += _unpack(out[0], n)
        return self._sent(n, data)

    def _sent(self, n: int, data: bytes) -> bytes:
        if n < 0:
            raise SessionError(self.ffi.string(self.lib.nghttp2_strerror(n)).decode())
        return data

    def wants_write(self) -> bool:
        return self.ptr is not None and bool(self.lib.nghttp2_session_want_write(self.ptr))

    def wants_io(self) -> bool:
        """False once the session is over (GOAWAY both ways, nothing left to send)."""
        ptr = self.ptr
        return ptr is not None and bool(self.lib.nghttp2_session_want_read(ptr)
                                        or self.lib.nghttp2_session_want_write(ptr))

    # -- what the server sends ---------------------------------------------------------------
    def respond(self, stream_id: int, headers: Sequence[Header], with_body: bool) -> None:
        """The answer's headers; with ``with_body`` its DATA follows through
        ``Events.read_answer``, else the headers end the stream (trailers-only)."""
        nva, count, _keep = _nv(self.ffi, headers)
        provider = _provider() if with_body else self.ffi.NULL
        _check(self.lib, self.lib.nghttp2_submit_response(self.ptr, stream_id, nva, count, provider))

    def trailers(self, stream_id: int, headers: Sequence[Header]) -> None:
        """The trailers after an answer's DATA: called from ``Events.read_answer`` as it hands
        over the last bytes (nghttp2 sends them after that DATA, never before)."""
        nva, count, _keep = _nv(self.ffi, headers)
        _check(self.lib, self.lib.nghttp2_submit_trailer(self.ptr, stream_id, nva, count))

    def resume(self, stream_id: int) -> None:
        """More of a streaming answer is ready: nghttp2 asks ``Events.read_answer`` again
        (after it answered ERR_DEFERRED; a stream not deferred is left as it is)."""
        if self.ptr is not None:
            self.lib.nghttp2_session_resume_data(self.ptr, stream_id)

    def reset(self, stream_id: int, code: int) -> None:
        if self.ptr is not None:
            self.lib.nghttp2_submit_rst_stream(self.ptr, 0, stream_id, code)

    def grant(self, stream_id: int, increment: int) -> None:
        """A WINDOW_UPDATE: the stream may send ``increment`` more bytes than it has."""
        _check(self.lib, self.lib.nghttp2_submit_window_update(self.ptr, 0, stream_id, increment))

    def consumed(self, length: int) -> None:
        """Connection-level credit back for bytes taken (nghttp2 batches the WINDOW_UPDATEs)."""
        self.lib.nghttp2_session_consume_connection(self.ptr, length)

    def stream_window(self, stream_id: int) -> int:
        """What the peer lets us send on the stream now (its and the connection's window)."""
        lib = self.lib
        window: int = min(lib.nghttp2_session_get_stream_remote_window_size(self.ptr, stream_id),
                          lib.nghttp2_session_get_remote_window_size(self.ptr))
        return window

    def goaway(self, code: int, message: bytes = b"", graceful: bool = False) -> None:
        """GOAWAY naming the last stream we processed. ``graceful``: streams in flight finish
        and newer ones are refused by nghttp2 itself; else the session ends once it is sent."""
        if self.ptr is None:
            return
        if graceful:
            last = self.lib.nghttp2_session_get_last_proc_stream_id(self.ptr)
            self.lib.nghttp2_submit_goaway(self.ptr, 0, last, code, self.ffi.NULL, 0)
            return
        last = self.lib.nghttp2_session_get_last_proc_stream_id(self.ptr)
        self.lib.nghttp2_submit_goaway(self.ptr, 0, last, code, message, len(message))
        self.lib.nghttp2_session_terminate_session(self.ptr, code)


def _check(lib: Any, rv: int) -> None:  # Any: the dlopen()ed library, a cffi object with no type
    if rv < 0:
        raise SessionError(ng.load()[0].string(lib.nghttp2_strerror(rv)).decode())


_CONSTANT_NV: dict[tuple[Header, ...], tuple[object, int, list[object]]] = {}


def _nv(ffi: cffi.FFI, headers: Sequence[Header]) -> tuple[object, int, list[object]]:
    """An nghttp2_nv array, its length and what must stay alive until it is submitted
    (nghttp2 copies names and values then). A tuple is a constant block (the 200 headers, the
    OK trailers): built once and kept."""
    constant = type(headers) is tuple
    if constant and headers in _CONSTANT_NV:
        return _CONSTANT_NV[headers]
    nva = ffi.new("nghttp2_nv[]", len(headers))
    keep: list[object] = [nva]
    for item, (name, value) in zip(nva, headers):
        n, v = ffi.from_buffer(name), ffi.from_buffer(value)
        keep += (n, v)
        item.name, item.namelen = ffi.cast("uint8_t *", n), len(name)
        item.value, item.valuelen = ffi.cast("uint8_t *", v), len(value)
    built = (nva, len(headers), keep)
    if constant and len(_CONSTANT_NV) < 64:
        _CONSTANT_NV[headers] = built  # type: ignore[index]  # the key is a tuple whenever the block is constant (checked above)
    return built


def _option(ffi: cffi.FFI, lib: Any, reset_burst: int, reset_rate: float) -> PointerOut:
    option: PointerOut = ffi.new("nghttp2_option **")
    _check(lib, lib.nghttp2_option_new(option))
    lib.nghttp2_option_set_no_auto_window_update(option[0], 1)  # credit is ours (connection.py)
    lib.nghttp2_option_set_max_outbound_ack(option[0], OUTBOUND_ACK_LIMIT)
    lib.nghttp2_option_set_max_settings(option[0], MAX_SETTINGS)
    lib.nghttp2_option_set_no_closed_streams(option[0], 1)  # no priority tree of closed streams kept
    if ng.has_reset_rate_limit():  # a backstop behind ours (bounds.py), which names the reason in its GOAWAY
        lib.nghttp2_option_set_stream_reset_rate_limit(option[0], 2 * reset_burst, max(1, int(2 * reset_rate)))
    return option


# -- nghttp2's callbacks: one set per process, each finding its connection by the handle --------
_CALLBACKS: Any = None
_PROVIDER: Any = None


def _provider() -> object:
    global _PROVIDER
    if _PROVIDER is None:
        ffi, _ = ng.load()
        _PROVIDER = ffi.new("nghttp2_data_provider *")
        _PROVIDER.read_callback = _callbacks.read  # type: ignore[attr-defined]  # a function attribute holding the C callback alive
    return _PROVIDER


def _callbacks() -> object:
    """The nghttp2_session_callbacks of every session (made once)."""
    global _CALLBACKS
    if _CALLBACKS is not None:
        return _CALLBACKS
    ffi, lib = ng.load()
    failed = ng.ERR_CALLBACK_FAILURE
    # cffi is untyped: its decorator, typed here, takes a callback and gives C's pointer to it
    callback = cast(Callable[..., Callable[[Callable[..., int]], object]], ffi.callback)

    from_handle, unpack = _from_handle, _unpack  # callbacks run per header: no wrapper call in between

    # a bug of ours: one connection pays
    def on_error(exception: type[BaseException], value: BaseException, traceback: TracebackType | None) -> None:
        log.error("gRPC connection callback failed", exc_info=(exception, value, traceback))

    @callback("int(nghttp2_session *, const nghttp2_frame_hd *, void *)", error=failed, onerror=on_error)
    def on_begin_headers(session: object, hd: FrameHeader, user_data: object) -> int:
        s = from_handle(user_data)
        s.sink = s.events.on_stream(hd.stream_id) if hd.type == ng.HEADERS else None
        s.sink_bytes = 0
        return 0

    @callback("int(nghttp2_session *, const nghttp2_frame_hd *, const char *, size_t, const char *, "
                  "size_t, uint8_t, void *)", error=failed, onerror=on_error)
    def on_header(session: object, hd: FrameHeader, name: object, namelen: int, value: object, valuelen: int,
                  flags: int, user_data: object) -> int:
        s = from_handle(user_data)
        size = s.sink_bytes = s.sink_bytes + namelen + valuelen + 32  # RFC 9113 6.5.2's count
        sink = s.sink
        if sink is not None and size <= s.header_limit:
            sink.append((unpack(name, namelen), unpack(value, valuelen)))
        return 0

    @callback("int(nghttp2_session *, const nghttp2_frame_hd *, void *)", error=failed, onerror=on_error)
    def on_frame(session: object, hd: FrameHeader, user_data: object) -> int:
        s = from_handle(user_data)
        kind, conn = hd.type, s.events
        if kind == ng.DATA:
            if hd.flags & ng.FLAG_END_STREAM:
                conn.on_request_end(hd.stream_id)
            return 0
        if kind == ng.HEADERS:
            s.sink = None
            conn.on_headers(hd.stream_id, bool(hd.flags & ng.FLAG_END_STREAM), s.sink_bytes)
            return 0
        if kind == ng.RST_STREAM:
            conn.on_client_reset(hd.stream_id)
        elif kind == ng.SETTINGS:
            if not hd.flags & ng.FLAG_ACK:
                conn.on_settings()
        elif kind == ng.PING:
            if not hd.flags & ng.FLAG_ACK:
                conn.on_ping()
        elif kind == ng.GOAWAY:
            conn.on_goaway()
        elif kind == ng.WINDOW_UPDATE:
            conn.on_window_update(hd.stream_id)
        return failed if conn.failed else 0

    @callback("int(nghttp2_session *, uint8_t, int32_t, const uint8_t *, size_t, void *)", error=failed,
                  onerror=on_error)
    def on_data(session: object, flags: int, stream_id: int, data: object, length: int, user_data: object) -> int:
        from_handle(user_data).events.on_data(stream_id, data, length)
        return 0

    @callback("int(nghttp2_session *, int32_t, uint32_t, void *)", error=failed, onerror=on_error)
    def on_close(session: object, stream_id: int, code: int, user_data: object) -> int:
        from_handle(user_data).events.on_stream_closed(stream_id)
        return 0

    @callback("ssize_t(nghttp2_session *, int32_t, uint8_t *, size_t, uint32_t *, nghttp2_data_source *, void *)",
                  error=failed, onerror=on_error)
    def read(session: object, stream_id: int, buf: object, length: int, data_flags: Flags, source: object,
             user_data: object) -> int:
        n: int
        n, last = from_handle(user_data).events.read_answer(stream_id, buf, length)
        if last:  # the trailers follow this DATA (read_answer submitted them)
            data_flags[0] |= ng.DATA_FLAG_EOF | ng.DATA_FLAG_NO_END_STREAM
        return n

    out = ffi.new("nghttp2_session_callbacks **")
    _check(lib, lib.nghttp2_session_callbacks_new(out))
    cbs = out[0]
    lib.nghttp2_session_callbacks_set_on_begin_headers_callback(cbs, on_begin_headers)
    lib.nghttp2_session_callbacks_set_on_header_callback(cbs, on_header)
    lib.nghttp2_session_callbacks_set_on_frame_recv_callback(cbs, on_frame)
    lib.nghttp2_session_callbacks_set_on_data_chunk_recv_callback(cbs, on_data)
    lib.nghttp2_session_callbacks_set_on_stream_close_callback(cbs, on_close)
    _callbacks.read = read  # type: ignore[attr-defined]  # the data provider's, kept alive with the rest
    _callbacks.keep = (on_begin_headers, on_header, on_frame, on_data, on_close)  # type: ignore[attr-defined]  # a function attribute holding the C callbacks alive
    _CALLBACKS = cbs
    return cbs
