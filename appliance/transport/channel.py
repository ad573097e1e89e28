"""Messages between the serving process and its front workers, over a Unix socketpair.

A message is one ``msgspec.Struct`` of a tagged union the caller declares (the front workers'
are in appliance/fronts/messages.py); this module knows no message, only how one crosses.
Each end decodes for the union it receives: a field unknown to the declaration, one missing
or of another type fails at once (``msgspec.ValidationError`` naming the field), never a
list read by position. Nothing is ever unpickled: what a worker receives cannot run code,
whatever a client managed to put in a request.

A frame on the wire: an 8-byte header (the body's length and its MessagePack part's length,
big-endian u32s), then the body: the message in MessagePack (msgspec's codec), then, each at
an 8-byte aligned offset, the raw bytes of every numeric numpy array in it, out of band (in
the message an array is its dtype, shape and offset; an array of strings travels in the
message as its items). The receiver reads each array with ``np.frombuffer`` on the frame's
own buffer.

User-space copies of an array's bytes, counted by tests/transport/test_channel.py: one on the
sending side (the join of one loop turn's frames into one write), at most one on the
receiving side (a frame that arrived whole in one read is copied out of the read buffer into
its own ``bytes``; a bigger one gets its own buffer as soon as its header is read, and the
kernel reads the rest straight into it), none when decoding. An array given to ``send`` must
not change until the loop's turn ends (the frames leave then). Arrays received are
read-only views of their frame (as ``np.frombuffer`` makes them).

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
import logging
import math
import socket
import struct
import threading
from typing import Any, Callable, Generic, TypeVar, cast

import msgspec
import numpy as np

log = logging.getLogger("appliance.channel")

HEADER = struct.Struct(">II")  # the body's length, its MessagePack part's length
MAX_FRAME = (1 << 32) - 1
ALIGN = 8  # every array's offset in a frame: the strictest alignment of a numpy scalar we send
SCRATCH = 64 * 1024  # the read buffer (resident in every process): smaller frames arrive whole there; a bigger one is read into its own
Part = bytes | bytearray | memoryview
M = TypeVar("M")


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


# -- encoding --------------------------------------------------------------------------------------
class _Arrays(threading.local):
    """The arrays of the frame being encoded on this thread, out of band (``_enc_hook``)."""

    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.size = 0


_arrays = _Arrays()


def _enc_hook(obj: object) -> object:
    if isinstance(obj, np.generic):  # a numpy scalar crosses as a 0-d array: numpy either way
        obj = np.asarray(obj)
    if not isinstance(obj, np.ndarray):
        raise NotImplementedError(f"cannot send a {type(obj).__name__} between processes")
    if obj.dtype.kind == "O":  # strings: their items, in the message
        return ("O", list(obj.shape), obj.ravel().tolist())
    arr = obj if obj.flags.c_contiguous else obj.copy(order="C")  # (ascontiguousarray makes a 0-d array 1-d)
    state = _arrays
    offset = state.size
    if arr.size:
        pad = _aligned(offset) - offset
        if pad:
            state.parts.append(bytes(pad))
            offset += pad
        state.parts.append(arr.reshape(-1).view(np.uint8).data)  # no copy: a view of the array's own bytes
        state.size = offset + arr.nbytes
    return (arr.dtype.str, list(arr.shape), offset)


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def frame_parts(message: msgspec.Struct) -> list[Part]:
    """The parts of ``message``'s frame, the arrays' among them as views of the arrays
    themselves (the caller joins them: the one copy on this side)."""
    state = _arrays
    state.parts, state.size = [], 0
    try:
        main = _encoder.encode(message)
        arrays, size = state.parts, state.size
    finally:
        state.parts, state.size = [], 0
    start = _aligned(len(main))
    body = start + size
    if body > MAX_FRAME:
        raise ValueError(f"a message of {body} bytes is over the channel's frame limit")
    return [HEADER.pack(body, len(main)), main, bytes(start - len(main)), *arrays]


def frame(message: msgspec.Struct) -> bytes:
    """``message``'s whole frame, header included."""
    return b"".join(frame_parts(message))


# -- decoding --------------------------------------------------------------------------------------
class Codec(Generic[M]):
    """Decodes frame bodies into ``kind`` (a Struct or a tagged union of them). Not
    thread-safe: one per channel end, used on its loop (or by ``read_one``)."""

    def __init__(self, kind: Any):  # Any: a union is a typing form, not a type
        self._decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(kind, dec_hook=self._dec_hook)
        self._frame: bytes | bytearray = b""  # the body being decoded, which its arrays view
        self._start = 0

    def decode(self, body: bytes | bytearray, main: int) -> M:
        """The message in ``body`` (a frame's body whose MessagePack part is ``main`` bytes
        long); its arrays are views of ``body``."""
        if not 0 < main <= len(body):
            raise msgspec.ValidationError(f"a frame of {len(body)} bytes says its message is {main}")
        self._frame, self._start = body, _aligned(main)
        try:
            return self._decoder.decode(memoryview(body)[:main])
        finally:
            self._frame = b""

    def _dec_hook(self, kind: type, obj: Any) -> Any:  # Any: msgspec's dec_hook contract (any decoded value in, any out)
        if kind is not np.ndarray:
            raise NotImplementedError(f"no decoder for {kind!r}")
        dtype, shape, data = obj
        if dtype == "O":
            arr = np.empty(len(data), dtype=object)
            arr[:] = data
            return arr.reshape(shape)
        dt = np.dtype(dtype)
        count = math.prod(shape)
        if count == 0:
            return np.empty(shape, dt)
        begin = self._start + int(data)
        if begin + count * dt.itemsize > len(self._frame):
            raise ValueError(f"an array of {count} x {dt} at {begin} runs past its frame ({len(self._frame)} bytes)")
        return np.frombuffer(self._frame, dt, count, begin).reshape(shape)  # a view: the array keeps the frame alive


def unframe(codec: Codec[M], data: bytes | bytearray) -> M:
    """The message of one whole frame (header included)."""
    body, main = HEADER.unpack_from(data)
    if len(data) != HEADER.size + body:
        raise msgspec.ValidationError(f"a frame of {len(data)} bytes says it holds {HEADER.size + body}")
    return codec.decode(bytes(memoryview(data)[HEADER.size:]), main)


def read_one(sock: socket.socket, codec: Codec[M]) -> M | None:
    """The next message on a blocking socket, read to its end and no further (so an event
    loop can take the socket over after it); None at EOF."""
    head = _read_exactly(sock, HEADER.size)
    if head is None:
        return None
    size, main = HEADER.unpack(head)
    body = _read_exactly(sock, size)
    return codec.decode(body, main) if body is not None else None


def _read_exactly(sock: socket.socket, size: int) -> bytearray | None:
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            return None
        got += n
    return buf


class BadFrame(Exception):
    """A frame that does not decode, with the messages of the same read decoded before it."""

    def __init__(self, error: Exception, before: list[Any]):  # Any: the reader's message type (M); not generic, an exception
        super().__init__(str(error))
        self.before = before


class Reader(Generic[M]):
    """Frames out of a stream's reads, each byte copied at most once (module docstring):
    ``buffer()`` is where the next read goes, ``filled(n)`` the messages it completed."""

    def __init__(self, codec: Codec[M]):
        self.codec = codec
        self.scratch = bytearray(SCRATCH)
        self.start = self.end = 0  # what of ``scratch`` is read and not yet taken
        self.body: bytearray | None = None  # a frame bigger than one read: read straight into it
        self.got = self.main = 0

    def buffer(self) -> memoryview:
        if self.body is not None:
            return memoryview(self.body)[self.got:]
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.scratch):  # only a header's first bytes can be left here
            self.scratch[:self.end - self.start] = self.scratch[self.start:self.end]
            self.start, self.end = 0, self.end - self.start
        return memoryview(self.scratch)[self.end:]

    def filled(self, n: int) -> list[M]:
        if self.body is not None:
            self.got += n
            if self.got < len(self.body):
                return []
            body, self.body = self.body, None
            return [self.codec.decode(body, self.main)]
        self.end += n
        out: list[M] = []
        try:
            self._frames(out)
        except (msgspec.DecodeError, ValueError) as exc:
            raise BadFrame(exc, out) from exc
        return out

    def _frames(self, out: list[M]) -> None:
        with memoryview(self.scratch) as view:
            while self.end - self.start >= HEADER.size:
                size, main = HEADER.unpack_from(view, self.start)
                begin = self.start + HEADER.size
                have = self.end - begin
                if have < size:  # the rest goes straight into the frame's own buffer
                    self.body, self.got, self.main = bytearray(size), have, main
                    self.body[:have] = view[begin:self.end]
                    self.start = self.end = 0
                    break
                self.start = begin + size
                out.append(self.codec.decode(bytes(view[begin:self.start]), main))


class ChannelProtocol(asyncio.BufferedProtocol, Generic[M]):
    """One end of a worker's channel (module docstring): messages of ``codec``'s union to
    ``on_message``; a frame that does not decode is logged and ends the channel (both ends
    run the same code: it is a bug, and the supervisor replaces the worker)."""

    def __init__(self, codec: Codec[M], on_message: Callable[["ChannelProtocol[M]", M], None],
                 on_lost: Callable[["ChannelProtocol[M]"], None], index: int = 0):
        self.on_message, self.on_lost, self.index = on_message, on_lost, index
        self.reader = Reader(codec)
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._corked: list[Part] = []  # frames of this turn of the loop, written together

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream's: uvloop's is no subclass of asyncio's
        self.loop = asyncio.get_running_loop()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        try:
            messages = self.reader.filled(nbytes)
        except (BadFrame, msgspec.DecodeError, ValueError) as exc:
            for message in exc.before if isinstance(exc, BadFrame) else []:
                self.on_message(self, message)
            log.error("channel %d: a message that does not decode (%s); closing the channel", self.index, exc)
            self.shut()
            return
        for message in messages:
            self.on_message(self, message)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.on_lost(self)

    def send(self, message: msgspec.Struct) -> None:
        """(loop thread) Queue ``message``; dropped when the other end is gone. The frames of
        one turn of the loop (a batch's answers, a burst of requests) leave in one write, at
        the end of the turn: one system call instead of one each."""
        if self.transport is None or self.transport.is_closing():
            return
        self._cork(frame_parts(message))

    def _cork(self, parts: list[Part]) -> None:
        if not self._corked:
            assert self.loop is not None
            self.loop.call_soon(self._uncork)
        self._corked.extend(parts)

    def _uncork(self) -> None:
        corked, self._corked = self._corked, []
        if corked and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(corked))  # the one copy of this side

    def send_threadsafe(self, message: msgspec.Struct) -> None:
        loop = self.loop
        if loop is not None and not loop.is_closed():
            parts = frame_parts(message)  # encoded here, off the loop
            try:
                loop.call_soon_threadsafe(self._write, parts)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _write(self, parts: list[Part]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._cork(parts)

    def shut(self) -> None:
        """(loop thread) Close at once: the worker reads EOF even if the loop stops next."""
        if self.transport is not None:
            sock = self.transport.get_extra_info("socket")
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except (OSError, AttributeError):
                pass
            self.transport.close()
