"""Bidirectional-streaming calls on the lean gRPC server (appliance/transport/grpc/streams.py)
against grpcio's real client, and against raw HTTP/2 frames for the credit rules: a stream's
messages stay bounded while its method does not take them.

The service's own stream (Triton's ModelStreamInfer through tritonclient) runs in
tests/api/test_v2_grpc.py and tests/peers/test_triton_examples.py.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from typing import Any, AsyncIterator, Iterator

import grpc
import hpack
import pytest

from appliance.transport.grpc import streams
from appliance.transport.grpc.h2_server import LeanServer
from tests.support import h2_wire as w

MAX = 8 << 20


class Methods:
    def __init__(self) -> None:
        self.release = threading.Event()  # Hold takes no message until it is set

    async def echo(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for request in requests:
            if request == b"fail":
                context.set_trailing_metadata((("why", "asked"),))
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "asked to fail")
            yield request

    async def hold(self, requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        async for request in requests:
            yield request[:8]


@pytest.fixture()
def served() -> Iterator[tuple[LeanServer, int, Methods]]:
    methods = Methods()
    server = LeanServer(2, [("grpc.max_receive_message_length", MAX), ("grpc.max_send_message_length", MAX)])
    table = {"Echo": grpc.stream_stream_rpc_method_handler(methods.echo),
             "Hold": grpc.stream_stream_rpc_method_handler(methods.hold),
             "Unary": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Test", table),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield server, port, methods
    finally:
        methods.release.set()
        server.stop(None)


def channel(port: int) -> grpc.Channel:
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=options)


def test_each_answer_arrives_before_the_client_half_closes(served: Any) -> None:
    """One message in, its answer out, on a stream that stays open: a real dialogue."""
    _, port, _ = served
    import queue

    outgoing: queue.Queue[bytes | None] = queue.Queue()
    with channel(port) as ch:
        answers = ch.stream_stream("/t.Test/Echo")(iter(outgoing.get, None), timeout=60)
        for i in range(5):
            outgoing.put(b"turn %d" % i)
            assert next(answers) == b"turn %d" % i  # answered while the stream is still open
        outgoing.put(None)
        assert list(answers) == []
        assert answers.code() == grpc.StatusCode.OK


def test_messages_larger_than_the_window_and_many_of_them(served: Any) -> None:
    """Credit comes back as messages are taken: more bytes than any window, both ways, and a
    message larger than the stream's window gets credit for all of it."""
    _, port, _ = served
    big = os.urandom(3 << 20)
    small = [os.urandom(40_000) for _ in range(40)]  # 1.6 MB in all, over the 64 KiB window
    with channel(port) as ch:
        got = list(ch.stream_stream("/t.Test/Echo")(iter([big, *small, b""]), timeout=60))
    assert got == [big, *small, b""]


def test_a_status_after_answers_reaches_the_client(served: Any) -> None:
    _, port, _ = served
    with channel(port) as ch:
        call = ch.stream_stream("/t.Test/Echo")(iter([b"one", b"fail", b"never"]), timeout=60)
        assert next(call) == b"one"
        with pytest.raises(grpc.RpcError) as err:
            next(call)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and err.value.details() == "asked to fail"
    assert dict(err.value.trailing_metadata())["why"] == "asked"


def test_an_empty_stream_and_unary_calls_beside_it(served: Any) -> None:
    _, port, _ = served
    with channel(port) as ch:
        assert list(ch.stream_stream("/t.Test/Echo")(iter([]), timeout=30)) == []
        assert ch.unary_unary("/t.Test/Unary")(b"plain", timeout=30) == b"plain"
        with pytest.raises(grpc.RpcError) as err:
            list(ch.stream_stream("/t.Test/Nope")(iter([b"x"]), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _data_frames(data: bytes) -> bytes:
    """DATA frames of at most 16 KiB (the default frame size: the client never acked ours)."""
    return b"".join(w.frame(w.DATA, 0, 1, data[i:i + 16384]) for i in range(0, len(data), 16384))


def test_no_credit_while_the_method_takes_nothing(served: Any) -> None:
    """Raw frames: messages up to the stream's 64 KiB window arrive while the method takes
    none, and no WINDOW_UPDATE lets the client send more, not even for a larger message whose
    head is in; once the method takes them, credit comes back (the large message's whole size
    among it) and each is answered."""
    server, port, methods = served
    enc = hpack.Encoder()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        sock.sendall(w.PREFACE + w.settings(INITIAL_WINDOW_SIZE=1 << 20)
                     + w.frame(w.HEADERS, w.END_HEADERS, 1, w.request_headers(enc, port, "/t.Test/Hold")))
        chunk, big = os.urandom(10_000), w.message(os.urandom(200_000))
        small = b"".join(w.message(chunk) for _ in range(6))  # 60,030 bytes
        head = big[:streams.STREAM_WINDOW - len(small)]  # the large message's prefix: the window's rest
        frames = w.frames_until_ping(sock, _data_frames(small + head))
        assert not [f for f in frames if f[0] == w.WINDOW_UPDATE and f[2] == 1], frames
        assert server.held >= 6 * len(chunk)  # the six messages wait for the method, counted as held
        methods.release.set()
        want, frames, answers = w.message(chunk[:8]) * 6, [], b""
        while len(answers) < len(want) and (f := w.read_frame(sock)) is not None:
            frames.append(f)
            answers += f[3] if f[0] == w.DATA and f[2] == 1 else b""
        assert answers == want
        credit = sum(int.from_bytes(f[3], "big") for f in frames if f[0] == w.WINDOW_UPDATE and f[2] == 1)
        assert credit >= len(big) - len(head), "credit for the whole large message once the others are taken"
        sock.sendall(_data_frames(big[len(head):]) + w.frame(w.DATA, w.END_STREAM, 1))
        end = w.stream_end(sock, 1)
    finally:
        sock.close()
    assert b"".join(f[3] for f in end if f[0] == w.DATA and f[2] == 1) == w.message(big[5:13])
    assert end[-1][0] == w.HEADERS and end[-1][1] & w.END_STREAM  # the status, in trailers
