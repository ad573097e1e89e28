"""The channel between the serving process and its front workers (appliance/transport/channel.py)
with the messages of appliance/fronts/messages.py: declared structs that fail loudly when one
side's fields differ from the other's, and arrays that cross with one user-space copy a side."""

from __future__ import annotations

import asyncio
import re
import socket
from typing import Any

import msgspec
import numpy as np
import pytest

from appliance.fronts import messages as m
from appliance.transport.channel import HEADER, ChannelProtocol, Codec, Reader, frame, frame_parts, unframe


def _root(arr: np.ndarray) -> object:
    """The buffer at the end of an array's base chain: the memory it views."""
    base: object = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base.obj if isinstance(base, memoryview) else base  # numpy wraps a bytearray in a memoryview


def _raw(message: dict[str, Any]) -> bytes:
    """A frame whose MessagePack part is ``message`` as written, with no struct checking it."""
    main = msgspec.msgpack.encode(message)
    return HEADER.pack(len(main), len(main)) + main


def _feed(reader: Reader[m.ToWorker], data: bytes, most: int) -> tuple[list[m.ToWorker], list[memoryview]]:
    """``data`` read as a socket delivers it, at most ``most`` bytes a read: the messages, and
    the buffers the reads went into."""
    out: list[m.ToWorker] = []
    targets, pos = [], 0
    while pos < len(data):
        target = reader.buffer()
        n = min(len(target), most, len(data) - pos)
        target[:n] = data[pos:pos + n]
        targets.append(target)
        pos += n
        out += reader.filled(n)
    return out, targets


RESOLVE = {"k": "resolve", "id": 3, "model": "mlp", "version": None, "label": None}


def test_a_well_formed_message_decodes_to_its_struct() -> None:
    assert unframe(Codec(m.ToServing), _raw(RESOLVE)) == m.Resolve(3, "mlp", None, None)


@pytest.mark.parametrize("change, words", [
    ({"priority": 1}, "Object contains unknown field `priority`"),  # a field one side added
    ({"model": None}, "Expected `str`, got `None` - at `$.model`"),  # a type one side changed
    ({"k": "resolve2"}, "Invalid value 'resolve2' - at `$.k`"),  # a kind the other side has not
])
def test_a_field_changed_on_one_side_fails_by_name(change: dict[str, Any], words: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=re.escape(words)):
        unframe(Codec(m.ToServing), _raw({**RESOLVE, **change}))


def test_a_missing_field_fails_by_name() -> None:
    without = {k: v for k, v in RESOLVE.items() if k != "label"}
    with pytest.raises(msgspec.ValidationError, match="missing required field `label`"):
        unframe(Codec(m.ToServing), _raw(without))


def test_a_message_for_the_other_side_is_refused() -> None:
    """A worker never decodes what only it sends: each side's union is its own."""
    with pytest.raises(msgspec.ValidationError):
        unframe(Codec(m.ToWorker), frame(m.Resolve(3, "mlp", None, None)))


def test_an_array_that_runs_past_its_frame_is_refused() -> None:
    data = bytearray(frame(m.Ran(1, 1, {"y": np.arange(4, dtype=np.float32)})))
    body, main = HEADER.unpack_from(data)
    cut = bytes(data[:-8])
    short = HEADER.pack(body - 8, main) + cut[HEADER.size:]
    with pytest.raises(msgspec.ValidationError, match="runs past its frame"):
        unframe(Codec(m.ToWorker), short)


def test_the_sender_copies_an_array_once() -> None:
    """Encoding copies nothing of an array (its part of the frame is a view of the array
    itself); the one copy is the join of the turn's frames into one write."""
    arr = np.arange(100_000, dtype=np.float32).reshape(1000, 100)
    parts = frame_parts(m.Ran(1, 1, {"y": arr}))
    assert any(np.shares_memory(np.frombuffer(p, np.uint8), arr) for p in parts if len(p))

    writes: list[bytes] = []

    class Transport:
        def is_closing(self) -> bool:
            return False

        def write(self, data: bytes) -> None:
            writes.append(data)

    loop = asyncio.new_event_loop()
    try:
        proto: ChannelProtocol[m.ToServing] = ChannelProtocol(Codec(m.ToServing), lambda *a: None, lambda p: None)
        proto.transport, proto.loop = Transport(), loop  # type: ignore[assignment]  # a recording stand-in for the socket's transport
        proto.send(m.Ran(1, 1, {"y": arr}))
        proto.send(m.End(2))
        loop.call_soon(loop.stop)
        loop.run_forever()
    finally:
        loop.close()
    assert len(writes) == 1 and not np.shares_memory(np.frombuffer(writes[0], np.uint8), arr)  # the one copy
    (ran, end), _ = _feed(Reader(Codec(m.ToWorker)), writes[0], 100_000)
    assert isinstance(ran, m.Ran) and np.array_equal(ran.outputs["y"], arr) and end == m.End(2)


def test_the_receiver_copies_an_array_at_most_once() -> None:
    """A frame that arrives in one read is copied once, out of the read buffer into its own
    bytes, which the decoded array views; a frame bigger than one read gets its own buffer when
    its header arrives, and the reads after that go straight into it (no copy at all)."""
    small = np.arange(10, dtype=np.int64)
    reader: Reader[m.ToWorker] = Reader(Codec(m.ToWorker))
    data = frame(m.Ran(1, 1, {"y": small}))
    reader.buffer()[:len(data)] = data
    (ran,) = reader.filled(len(data))
    assert isinstance(ran, m.Ran)
    y = ran.outputs["y"]
    assert isinstance(_root(y), bytes) and not np.shares_memory(y, np.frombuffer(reader.scratch, np.uint8))
    assert np.array_equal(y, small)

    big = np.random.default_rng(0).standard_normal((1000, 300)).astype(np.float32)  # 1.2 MB
    data = frame(m.Ran(2, 1, {"y": big}))
    (ran,), targets = _feed(reader, data, 100_000)
    direct = targets[1:]  # the buffers the reads after the first were given: the frame's own
    assert isinstance(ran, m.Ran)
    y = ran.outputs["y"]
    assert np.array_equal(y, big)
    assert all(np.shares_memory(y, np.frombuffer(t, np.uint8)) for t in direct)  # read straight into the array
    root = _root(y)
    assert isinstance(root, bytearray) and len(root) == len(data) - HEADER.size


def test_arrays_cross_a_socket_between_two_loops() -> None:
    """Both ends as the service runs them, on a socketpair: a burst of frames, a big array among
    them, arrive whole and in order, each array a view of its frame."""
    ours, theirs = socket.socketpair()
    got: list[m.ToWorker] = []
    arrays = [np.full((n, 64), n, dtype=np.float32) for n in (1, 3000, 2, 50_000, 1)]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_message(_proto: Any, message: m.ToWorker) -> None:
            got.append(message)
            if len(got) == len(arrays):
                done.set_result(None)

        sender: ChannelProtocol[m.ToServing]
        receiver: ChannelProtocol[m.ToWorker]
        _, sender = await loop.connect_accepted_socket(
            lambda: ChannelProtocol(Codec(m.ToServing), lambda *a: None, lambda p: None), ours)
        _, receiver = await loop.connect_accepted_socket(
            lambda: ChannelProtocol(Codec(m.ToWorker), on_message, lambda p: None), theirs)
        for i, arr in enumerate(arrays):
            sender.send(m.Ran(i, 1, {"y": arr}))
        await asyncio.wait_for(done, 60)  # every frame decoded
        sender.shut()
        receiver.shut()

    asyncio.run(main())
    assert [g.id for g in got if isinstance(g, m.Ran)] == list(range(len(arrays)))
    for g, arr in zip(got, arrays):
        assert isinstance(g, m.Ran)
        assert np.array_equal(g.outputs["y"], arr)
        assert isinstance(_root(g.outputs["y"]), (bytes, bytearray))


def test_a_frame_that_does_not_decode_ends_the_channel_loudly(caplog: pytest.LogCaptureFixture) -> None:
    """Both ends run the same code, so a message that does not decode is a bug: logged by name
    and the channel closed (the worker then exits on EOF and the supervisor replaces it),
    never a half-read message handed on."""
    ours, theirs = socket.socketpair()
    heard: list[object] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        lost: asyncio.Future[None] = loop.create_future()

        def on_lost(_proto: object) -> None:
            if not lost.done():
                lost.set_result(None)

        receiver: ChannelProtocol[m.ToServing]
        _, receiver = await loop.connect_accepted_socket(
            lambda: ChannelProtocol(Codec(m.ToServing), lambda p, msg: heard.append(msg), on_lost), theirs)
        ours.sendall(_raw(RESOLVE) + _raw({**RESOLVE, "id": 4, "priority": 1}) + _raw(RESOLVE))
        await asyncio.wait_for(lost, 30)  # the channel closed itself
        assert receiver.transport is None

    try:
        asyncio.run(main())
    finally:
        ours.close()
    assert heard == [m.Resolve(3, "mlp", None, None)]  # the good frame before it, nothing after
    assert any("does not decode" in r.message and "priority" in r.message for r in caplog.records)
