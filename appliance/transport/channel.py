"""Messages between the serving process and its front workers, over a Unix socketpair.

A message is a tuple ``(kind, id, payload)``. On the wire: a 4-byte big-endian length and
the message in MessagePack (the ``msgpack`` library), with numpy arrays as an extension
type: a numeric array travels as its dtype, shape and raw buffer (one copy, no per-element
work); an array of strings as its shape and its items. Payloads are plain data (strings,
numbers, bytes, lists, dicts and arrays): the two ends turn their own objects into that
(appliance/fronts/messages.py). Nothing is ever unpickled: what a worker receives
cannot run code, whatever a client managed to put in a request.

Why a socket and not shared memory: what the hand-off costs beside a request's decode was
measured (bench/RESULTS.md, "Every core"): a CNN request's 110 kB tensor crosses in tens of
microseconds, its JSON decode costs a millisecond. A shared-memory ring would save a copy
and add a second synchronisation protocol; the socket also tells each side at once when
the other dies (EOF), which the supervisor relies on.

Both ends are a ``ChannelProtocol`` on an event loop (the serving process's front service,
a worker's HTTP loop): ``send`` in the loop thread, ``send_threadsafe`` from others.
``read_one`` reads a worker's first message (its config) before its loop exists.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Callable

import msgpack
import numpy as np

Message = tuple[str, int, Any]
HEADER = 4
MAX_FRAME = (1 << 32) - 1
NUMBERS, STRINGS = 1, 2  # extension type codes: a numeric array, an array of bytes/str


def _default(obj: Any) -> Any:
    if isinstance(obj, np.generic):  # a numpy scalar crosses as a 0-d array: numpy either way
        obj = np.asarray(obj)
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind == "O":
            return msgpack.ExtType(STRINGS, msgpack.packb([list(obj.shape), obj.ravel().tolist()], use_bin_type=True))
        arr = obj if obj.flags.c_contiguous else obj.copy(order="C")  # (ascontiguousarray makes a 0-d array 1-d)
        data = memoryview(arr).cast("B") if arr.size else b""
        return msgpack.ExtType(NUMBERS, msgpack.packb([arr.dtype.str, list(arr.shape), data], use_bin_type=True))
    raise TypeError(f"cannot send a {type(obj).__name__} between processes")


def _ext(code: int, data: bytes) -> Any:
    if code == NUMBERS:
        dtype, shape, buf = msgpack.unpackb(data, raw=False)
        return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
    if code == STRINGS:
        shape, items = msgpack.unpackb(data, raw=False)
        arr = np.empty(len(items), dtype=object)
        arr[:] = items
        return arr.reshape(shape)
    return msgpack.ExtType(code, data)


def frame(message: Message) -> bytes:
    return b"".join(frame_parts(message))


def frame_parts(message: Message) -> tuple[bytes, bytes]:
    """(length header, body) of ``message``: joined once with the other frames of a write."""
    data = msgpack.packb(message, default=_default, use_bin_type=True)
    if len(data) > MAX_FRAME:
        raise ValueError(f"a message of {len(data)} bytes is over the channel's frame limit")
    return len(data).to_bytes(HEADER, "big"), data


def unframe(data: bytes | memoryview) -> Message:
    kind, ident, payload = msgpack.unpackb(data, ext_hook=_ext, raw=False, strict_map_key=False)
    return kind, ident, payload


def read_one(sock: socket.socket) -> Message | None:
    """The next message on a blocking socket, read to its end and no further (so an event
    loop can take the socket over after it); None at EOF."""
    head = _read_exactly(sock, HEADER)
    if head is None:
        return None
    body = _read_exactly(sock, int.from_bytes(head, "big"))
    return unframe(body) if body is not None else None


def _read_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class Frames:
    """Reassembles frames from the chunks a stream delivers."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        buf = self.buf
        buf += data
        out: list[Message] = []
        start = 0
        with memoryview(buf) as view:  # frames read in place (msgpack copies what it keeps)
            while len(buf) - start >= HEADER:
                size = int.from_bytes(view[start:start + HEADER], "big")
                end = start + HEADER + size
                if len(buf) < end:
                    break
                out.append(unframe(view[start + HEADER:end]))
                start = end
        if start:
            del buf[:start]
        return out


class ChannelProtocol(asyncio.Protocol):
    """The serving process's end of one worker's channel (module docstring)."""

    def __init__(self, on_message: Callable[["ChannelProtocol", Message], None],
                 on_lost: Callable[["ChannelProtocol"], None], index: int = 0):
        self.on_message, self.on_lost, self.index = on_message, on_lost, index
        self.frames = Frames()
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._corked: list[bytes] = []  # frames of this turn of the loop, written together

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        for message in self.frames.feed(data):
            self.on_message(self, message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.on_lost(self)

    def send(self, message: Message) -> None:
        """(loop thread) Queue ``message``; dropped when the other end is gone. The frames of
        one turn of the loop (a batch's answers, a burst of requests) leave in one write, at
        the end of the turn: one system call instead of one each."""
        if self.transport is None or self.transport.is_closing():
            return
        if not self._corked:
            assert self.loop is not None
            self.loop.call_soon(self._uncork)
        self._corked.extend(frame_parts(message))

    def _uncork(self) -> None:
        corked, self._corked = self._corked, []
        if corked and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(corked))

    def send_threadsafe(self, message: Message) -> None:
        loop = self.loop
        if loop is not None and not loop.is_closed():
            data = frame_parts(message)  # encoded here, off the loop
            try:
                loop.call_soon_threadsafe(self._write, data)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _write(self, parts: tuple[bytes, bytes]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            if not self._corked:
                self.loop.call_soon(self._uncork)  # type: ignore[union-attr]
            self._corked.extend(parts)

    def shut(self) -> None:
        """(loop thread) Close at once: the worker reads EOF even if the loop stops next."""
        if self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except (OSError, AttributeError):
                pass
            self.transport.close()
