"""libnghttp2, the HTTP/2 library of curl, nginx's predecessors, Apache's mod_http2 and Node,
through cffi's ABI mode: no compiler, no headers, only the shared library every Linux that
has curl already carries (Debian's ``libnghttp2-14``).

Why nghttp2 and not python-hyper's h2: h2 is the same state machine in pure Python and cost
about 90 µs of the server's CPU per unary call (bench/h2_cost.py), more than a whole REST
request; nghttp2 does framing, HPACK, stream states, flow-control accounting and the RFC 9113
checks in C, and the Python left per call is a handful of callbacks (~30 µs in all). Its
flood defences come with it: a bounded queue of PING/SETTINGS answers (``ERR_FLOODED``),
CONTINUATION limits (CVE-2024-28182) and a stream reset rate limit (CVE-2023-44487, in
Debian's 1.52.0-1+deb12u1 and upstream 1.57), under our own bounds in connection.py.

Only the stable, documented API of nghttp2 1.x is declared here (the ``nghttp2_session_*``
calls of nghttp2.h, present since 1.12 unless noted), with structs exactly as nghttp2.h lays
them out. Two pointer types differ from the header where the ABI is the same: a frame is
read through its header (``nghttp2_frame_hd *``, the union's first member) and a header
field's name and value are ``char *`` (``ffi.unpack`` turns those into bytes fastest). ``load()`` returns (ffi, lib), or raises ``Missing`` with what to install.

Where it is looked for: ``$EDGE_APPLIANCE_LIBNGHTTP2`` (a path or a soname) and nothing else
when that is set; else the system's ``libnghttp2.so.14``, what ``ctypes.util.find_library``
finds, and a copy shipped beside the running Python (``<sys.prefix>/lib/nghttp2/``: the OCI
image built on a base without the library carries one there, deploy/Containerfile).

Thread-safety: a session is used by one thread (the event loop's); the library holds no
global state.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from typing import Any

CDEF = """
typedef struct nghttp2_session nghttp2_session;
typedef struct nghttp2_session_callbacks nghttp2_session_callbacks;
typedef struct nghttp2_option nghttp2_option;
typedef struct { size_t length; int32_t stream_id; uint8_t type; uint8_t flags; uint8_t reserved; } nghttp2_frame_hd;
typedef struct { nghttp2_frame_hd hd; uint32_t error_code; } nghttp2_rst_stream;
typedef struct { nghttp2_frame_hd hd; int32_t last_stream_id; uint32_t error_code; uint8_t *opaque_data;
                 size_t opaque_data_len; uint8_t reserved; } nghttp2_goaway;
typedef struct { uint8_t *name; uint8_t *value; size_t namelen; size_t valuelen; uint8_t flags; } nghttp2_nv;
typedef union { int fd; void *ptr; } nghttp2_data_source;
typedef ssize_t (*nghttp2_data_source_read_callback)(nghttp2_session *, int32_t, uint8_t *, size_t, uint32_t *,
                                                      nghttp2_data_source *, void *);
typedef struct { nghttp2_data_source source; nghttp2_data_source_read_callback read_callback; } nghttp2_data_provider;
typedef struct { int32_t settings_id; uint32_t value; } nghttp2_settings_entry;
typedef struct { int age; int version_num; const char *version_str; const char *proto_str; } nghttp2_info;

int nghttp2_session_callbacks_new(nghttp2_session_callbacks **);
void nghttp2_session_callbacks_del(nghttp2_session_callbacks *);
void nghttp2_session_callbacks_set_on_begin_headers_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, const nghttp2_frame_hd *, void *));
void nghttp2_session_callbacks_set_on_header_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, const nghttp2_frame_hd *, const char *, size_t, const char *, size_t, uint8_t,
            void *));
void nghttp2_session_callbacks_set_on_frame_recv_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, const nghttp2_frame_hd *, void *));
void nghttp2_session_callbacks_set_on_data_chunk_recv_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, uint8_t, int32_t, const uint8_t *, size_t, void *));
void nghttp2_session_callbacks_set_on_stream_close_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, int32_t, uint32_t, void *));

int nghttp2_option_new(nghttp2_option **);
void nghttp2_option_del(nghttp2_option *);
void nghttp2_option_set_no_auto_window_update(nghttp2_option *, int);
void nghttp2_option_set_max_outbound_ack(nghttp2_option *, size_t);
void nghttp2_option_set_max_settings(nghttp2_option *, size_t);
void nghttp2_option_set_no_closed_streams(nghttp2_option *, int);
void nghttp2_option_set_stream_reset_rate_limit(nghttp2_option *, uint64_t, uint64_t);

int nghttp2_session_server_new2(nghttp2_session **, const nghttp2_session_callbacks *, void *, const nghttp2_option *);
void nghttp2_session_del(nghttp2_session *);
ssize_t nghttp2_session_mem_recv(nghttp2_session *, const uint8_t *, size_t);
ssize_t nghttp2_session_mem_send(nghttp2_session *, const char **);  /* const uint8_t **: char, so cffi's unpack gives bytes */
int nghttp2_session_want_read(nghttp2_session *);
int nghttp2_session_want_write(nghttp2_session *);
int nghttp2_session_consume_connection(nghttp2_session *, size_t);
int nghttp2_session_set_local_window_size(nghttp2_session *, uint8_t, int32_t, int32_t);
int32_t nghttp2_session_get_stream_remote_window_size(nghttp2_session *, int32_t);
int32_t nghttp2_session_get_remote_window_size(nghttp2_session *);
uint32_t nghttp2_session_get_remote_settings(nghttp2_session *, int);
int32_t nghttp2_session_get_last_proc_stream_id(nghttp2_session *);
int nghttp2_session_resume_data(nghttp2_session *, int32_t);
int nghttp2_session_terminate_session(nghttp2_session *, uint32_t);

int nghttp2_submit_settings(nghttp2_session *, uint8_t, const nghttp2_settings_entry *, size_t);
int nghttp2_submit_response(nghttp2_session *, int32_t, const nghttp2_nv *, size_t, const nghttp2_data_provider *);
int nghttp2_submit_trailer(nghttp2_session *, int32_t, const nghttp2_nv *, size_t);
int nghttp2_submit_rst_stream(nghttp2_session *, uint8_t, int32_t, uint32_t);
int nghttp2_submit_window_update(nghttp2_session *, uint8_t, int32_t, int32_t);
int nghttp2_submit_goaway(nghttp2_session *, uint8_t, int32_t, uint32_t, const uint8_t *, size_t);
int nghttp2_submit_shutdown_notice(nghttp2_session *);
const char *nghttp2_strerror(int);
nghttp2_info *nghttp2_version(int);
"""

# frame types, flags, settings, error codes (RFC 9113) and nghttp2's own values (nghttp2.h)
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7, 0x8
FLAG_END_STREAM, FLAG_ACK = 0x1, 0x1
SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 0x2, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, REFUSED_STREAM, CANCEL, ENHANCE_YOUR_CALM = 0x0, 0x1, 0x2, 0x7, 0x8, 0xB
NV_FLAG_NO_COPY = 0x2 | 0x4  # NGHTTP2_NV_FLAG_NO_COPY_NAME | NO_COPY_VALUE: our constants outlive the call
DATA_FLAG_EOF, DATA_FLAG_NO_END_STREAM = 0x1, 0x2
ERR_DEFERRED = -508
ERR_TEMPORAL_CALLBACK_FAILURE = -521
ERR_CALLBACK_FAILURE = -902
ERR_FLOODED = -904
LIBRARY = "libnghttp2.so.14"
MIN_VERSION = 0x010C00  # 1.12.0: nghttp2_session_set_local_window_size


class Missing(RuntimeError):
    """libnghttp2 cannot be used here: the message says what to install or configure."""


_loaded: tuple[Any, Any] | None = None


def load() -> tuple[Any, Any]:
    """(ffi, lib), loaded once per process; ``Missing`` naming the fix when it cannot be."""
    global _loaded
    if _loaded is None:
        _loaded = _load()
    return _loaded


def _load() -> tuple[Any, Any]:
    try:
        import cffi
    except ImportError as exc:  # cryptography's own dependency: only a broken install lacks it
        raise Missing("the lean gRPC server needs cffi (pip install cffi)") from exc
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    lib = None
    for name in candidates():
        try:
            lib = ffi.dlopen(name)
            break
        except OSError:
            continue
    if lib is None:
        raise Missing(f"{LIBRARY} was not found (looked for {', '.join(candidates())}): install libnghttp2 "
                      "(Debian/Ubuntu: apt-get install libnghttp2-14; Alpine: apk add nghttp2-libs), "
                      "or set [grpc] transport = \"grpcio\"")
    info = lib.nghttp2_version(0)
    if info == ffi.NULL or info.version_num < MIN_VERSION:
        found = ffi.string(info.version_str).decode() if info != ffi.NULL else "unknown"
        raise Missing(f"libnghttp2 {found} is older than 1.12.0: upgrade it, or set [grpc] transport = \"grpcio\"")
    return ffi, lib


def candidates() -> list[str]:
    """Where the library is looked for, in order (module docstring)."""
    chosen = os.environ.get("EDGE_APPLIANCE_LIBNGHTTP2")
    if chosen:
        return [chosen]
    found = ctypes.util.find_library("nghttp2")
    return [LIBRARY, *([found] if found else []), os.path.join(sys.prefix, "lib", "nghttp2", LIBRARY)]


def version() -> str:
    """The loaded library's version, as nghttp2 reports it (``/api/status`` shows it)."""
    ffi, lib = load()
    return str(ffi.string(lib.nghttp2_version(0).version_str).decode())


def has_reset_rate_limit() -> bool:
    """Whether this libnghttp2 exports ``nghttp2_option_set_stream_reset_rate_limit`` (the
    CVE-2023-44487 fix: upstream 1.57, and distributions' backports)."""
    _, lib = load()
    try:
        lib.nghttp2_option_set_stream_reset_rate_limit
    except AttributeError:
        return False
    return True
