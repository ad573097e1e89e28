"""appliance/transport/http/loop_io.py: the HTTP loop's socket calls that keep the GIL, on real sockets.

They must behave exactly like the socket module's calls they replace (data, end of stream,
"nothing there", a full send buffer, a vanished peer), the loop pass must hand each ready
channel to waitress's handlers like ``wasyncore.poll`` does, and the HTTP server must really
use them for plain TCP (and not for TLS, whose bytes go through OpenSSL)."""

from __future__ import annotations

import ctypes
import errno
import socket
from typing import Any, Callable, Iterator

import pytest
import requests

from appliance.transport.http import loop_io
from appliance.transport.http.server import HTTPServer

pytestmark = pytest.mark.skipif(not loop_io.AVAILABLE, reason="libc socket calls are Linux-only")


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.setblocking(False)
    yield a, b
    a.close()
    b.close()


def test_the_calls_are_made_without_releasing_the_gil() -> None:
    # PyDLL, not CDLL: ctypes releases the GIL around CDLL calls only
    assert isinstance(loop_io._libc, ctypes.PyDLL)


def test_recv_returns_what_arrived_then_raises_when_nothing_is_there(pair: Any) -> None:
    a, b = pair
    b.sendall(b"x" * 5000)
    got = loop_io.recv(a.fileno(), 3000) + loop_io.recv(a.fileno(), 3000)
    assert got == b"x" * 5000
    with pytest.raises(BlockingIOError):
        loop_io.recv(a.fileno(), 100)


def test_recv_returns_empty_at_end_of_stream(pair: Any) -> None:
    a, b = pair
    b.sendall(b"last")
    b.shutdown(socket.SHUT_WR)
    assert loop_io.recv(a.fileno(), 100) == b"last"
    assert loop_io.recv(a.fileno(), 100) == b""


def test_recv_reuses_a_buffer_big_enough_for_larger_reads(pair: Any) -> None:
    a, b = pair
    b.sendall(b"a" * 10)
    assert loop_io.recv(a.fileno(), 16) == b"a" * 10
    b.sendall(bytes(range(256)) * 100)
    got = b""
    while len(got) < 25600:
        got += loop_io.recv(a.fileno(), 65536)
    assert got == bytes(range(256)) * 100


def test_send_takes_what_fits_and_zero_when_the_buffer_is_full(pair: Any) -> None:
    a, b = pair
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    chunk = b"y" * 65536
    sent = [loop_io.send(a.fileno(), chunk) for _ in range(64)]
    assert sent[0] > 0 and sent[-1] == 0  # the peer never reads: the buffers fill up
    assert loop_io.send(a.fileno(), memoryview(chunk)[:10]) == 0  # memoryviews as well
    received = b""
    b.setblocking(False)
    while True:
        try:
            received += b.recv(1 << 20)
        except BlockingIOError:
            break
    assert len(received) == sum(sent) and set(received) == {ord("y")}


def test_send_to_a_vanished_peer_raises_instead_of_killing_the_process(pair: Any) -> None:
    a, b = pair
    b.close()
    with pytest.raises(OSError) as info:
        for _ in range(3):  # the first send may still be accepted by the kernel
            loop_io.send(a.fileno(), b"z" * 1000)
    assert info.value.errno in (errno.EPIPE, errno.ECONNRESET)  # MSG_NOSIGNAL: no SIGPIPE


class _Channel:
    def __init__(self, readable: bool, writable: bool):
        self._r, self._w = readable, writable
        self.accepting = False
        self.events: list[str] = []

    def readable(self) -> bool:
        return self._r

    def writable(self) -> bool:
        return self._w

    def handle_read_event(self) -> None:
        self.events.append("read")

    def handle_write_event(self) -> None:
        self.events.append("write")

    def handle_expt_event(self) -> None:
        self.events.append("expt")

    def handle_error(self) -> None:
        raise


def test_poll_dispatches_the_ready_channels_only(pair: Any) -> None:
    a, b = pair
    c, d = socket.socketpair()
    try:
        reader, idle, writer = _Channel(True, False), _Channel(True, False), _Channel(False, True)
        b.sendall(b"ready")
        loop_io.poll(1.0, {a.fileno(): reader, c.fileno(): idle, d.fileno(): writer})
        assert reader.events == ["read"]  # data waiting
        assert idle.events == []          # nothing sent to c
        assert writer.events == ["write"]  # an empty send buffer
    finally:
        c.close()
        d.close()


def test_poll_waits_in_select_when_nothing_is_ready_and_wakes_on_data(pair: Any) -> None:
    import threading
    a, b = pair
    channel = _Channel(True, False)
    timer = threading.Timer(0.2, lambda: b.sendall(b"late"))
    timer.start()
    try:
        loop_io.poll(30.0, {a.fileno(): channel})  # returns on the data, long before 30 s
    finally:
        timer.join()
    assert channel.events == ["read"]


def test_poll_reports_a_hang_up_as_readable_like_select(pair: Any) -> None:
    a, b = pair
    b.close()
    channel = _Channel(True, False)
    loop_io.poll(1.0, {a.fileno(): channel})
    assert channel.events == ["read"]  # the read then finds the end of stream


def test_the_http_server_reads_and_writes_plain_connections_through_it(
        http_servers: Callable[..., HTTPServer], monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"recv": 0, "send": 0}
    real_recv, real_send = loop_io.recv, loop_io.send

    def counting_recv(fd: int, size: int) -> bytes:
        calls["recv"] += 1
        return real_recv(fd, size)

    def counting_send(fd: int, data: bytes) -> int:
        calls["send"] += 1
        return real_send(fd, data)

    monkeypatch.setattr(loop_io, "recv", counting_recv)
    monkeypatch.setattr(loop_io, "send", counting_send)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        body = environ["wsgi.input"].read()
        start_response("200 OK", [("Content-Type", "application/octet-stream")])
        return [body[::-1]]

    server = http_servers(app)
    body = bytes(range(256)) * 4000  # 1 MB each way: several reads and sends
    with requests.Session() as session:
        for _ in range(3):  # keep-alive: the same connection thrice
            reply = session.post(f"http://127.0.0.1:{server.port}/", data=body, timeout=30)
            assert reply.status_code == 200 and reply.content == body[::-1]
    assert calls["recv"] >= 3 and calls["send"] >= 3
