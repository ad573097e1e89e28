"""Socket calls for the HTTP server's loop thread that keep the GIL while they cannot block.

Why: every socket call made through Python's ``socket`` and ``select`` modules releases the
GIL and must take it back when the call returns. While worker threads run CPU-bound Python
(decoding JSON tensors), taking it back waits until the holder is asked to let go: up to
``sys.getswitchinterval()`` (5 ms) per call, the "convoy effect" (bpo-7946). The loop thread
makes several such calls per request (readiness, one or more reads, the response's send), so
under load it reads requests far slower than the workers could serve them, and requests
queue unseen in the kernel's socket buffers (bench/overload_bench.py; a py-spy profile put
95 % of the loop thread in re-taking the GIL after ``recv``).

A non-blocking ``recv``/``send`` or a ``poll`` with a zero timeout never waits, so releasing
the GIL around it buys nothing. Calling libc through ``ctypes.PyDLL`` (which, unlike
``ctypes.CDLL``, does not release the GIL) makes each such call cost microseconds; the loop
thread gives the GIL up only where it may really block: the ``select`` it falls back to
when nothing is ready, and the interpreter's regular switch requests.

Plain TCP sockets only: a TLS socket's bytes go through OpenSSL (``ssl.SSLSocket``). Where
libc cannot be loaded (not Linux/glibc-like), ``AVAILABLE`` is False and callers keep
Python's own socket calls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import sys
import threading
from typing import Any

from waitress import wasyncore

MSG_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0x40)
MSG_NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0x4000)
POLLIN, POLLPRI, POLLOUT = select.POLLIN, select.POLLPRI, select.POLLOUT
POLLERR, POLLHUP, POLLNVAL = select.POLLERR, select.POLLHUP, select.POLLNVAL


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


def _load() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.PyDLL(None, use_errno=True)  # PyDLL: the GIL stays held during each call
        libc.recv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.recv.restype = ctypes.c_ssize_t
        libc.send.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
        libc.send.restype = ctypes.c_ssize_t
        libc.poll.argtypes = [ctypes.POINTER(_PollFd), ctypes.c_ulong, ctypes.c_int]
        libc.poll.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


_libc = _load()
AVAILABLE = _libc is not None
_buffers = threading.local()


def _error() -> OSError:
    code = ctypes.get_errno()
    return OSError(code, os.strerror(code))  # OSError picks the subclass (BlockingIOError, ...)


def recv(fd: int, size: int) -> bytes:
    """Up to ``size`` bytes from socket ``fd`` without waiting: b"" at end of stream;
    OSError (BlockingIOError when nothing is there) as ``socket.recv`` raises it."""
    buf = getattr(_buffers, "buf", None)
    if buf is None or len(buf) < size:
        buf = _buffers.buf = ctypes.create_string_buffer(size)  # reused: one per thread
    n = _libc.recv(fd, buf, size, MSG_DONTWAIT)
    if n < 0:
        raise _error()
    return ctypes.string_at(buf, n)


def send(fd: int, data: bytes) -> int:
    """Send what the socket takes now of ``data``; the count sent (0 if it takes nothing)."""
    if not isinstance(data, bytes):
        data = bytes(data)
    n = _libc.send(fd, data, len(data), MSG_DONTWAIT | MSG_NOSIGNAL)
    if n < 0:
        code = ctypes.get_errno()
        if code in (errno.EAGAIN, errno.EWOULDBLOCK):
            return 0
        raise OSError(code, os.strerror(code))
    return int(n)


def poll(timeout: float, map: dict[int, Any]) -> None:
    """One pass of waitress's loop (``wasyncore.poll``): find the ready channels without
    releasing the GIL; only when none is ready, wait in ``select`` (which releases it)."""
    r: list[int] = []
    w: list[int] = []
    watch: list[tuple[int, int]] = []
    for fd, obj in list(map.items()):
        events = 0
        if obj.readable():
            events = POLLIN | POLLPRI
            r.append(fd)
        if obj.writable() and not obj.accepting:
            events |= POLLOUT
            w.append(fd)
        if events:
            watch.append((fd, events))
    n = len(watch)
    fds = (_PollFd * n)(*watch)
    if n == 0:
        if timeout:
            select.select([], [], [], timeout)  # as wasyncore sleeps: nothing to watch
        return
    ready = _libc.poll(fds, n, 0)
    if ready < 0:
        code = ctypes.get_errno()
        if code == errno.EINTR:
            return
        raise OSError(code, os.strerror(code))
    if ready == 0:  # nothing yet: block, giving the GIL up, as waitress does
        try:
            r, w, e = select.select(r, w, r + [fd for fd in w if fd not in r], timeout)
        except OSError as err:
            if err.args[0] != errno.EINTR:
                raise
            return
    else:
        r, w, e = [], [], []
        for i in range(n):
            slot = fds[i]
            got = slot.revents
            if not got:
                continue
            # select() reports errors and hang-ups as readable: the read then finds them
            if got & (POLLIN | POLLERR | POLLHUP | POLLNVAL):
                r.append(slot.fd)
            if got & POLLOUT:
                w.append(slot.fd)
            if got & POLLPRI:
                e.append(slot.fd)
    for fd in r:
        obj = map.get(fd)
        if obj is not None:
            wasyncore.read(obj)
    for fd in w:
        obj = map.get(fd)
        if obj is not None:
            wasyncore.write(obj)
    for fd in e:
        obj = map.get(fd)
        if obj is not None:
            wasyncore._exception(obj)


def loop(timeout: float, map: dict[int, Any]) -> None:
    """``wasyncore.loop`` with :func:`poll` (select-based where libc is unavailable)."""
    step = poll if AVAILABLE else wasyncore.poll
    while map:
        step(timeout, map)
