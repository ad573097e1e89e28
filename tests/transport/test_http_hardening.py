"""The REST server against hostile and careless HTTP/1.1 clients, on real loopback sockets:
hundreds of slow connections do not stall a normal request, idle keep-alive connections are
held cheaply, request smuggling and bad Host headers are refused and the connection closed,
bodies are refused before they are read, and request memory has a total bound. The figures
at full scale (2,000 slow, 10,000 idle) are bench/http_hardening.py's, never timings here."""

from __future__ import annotations

import json
import socket
import time
from typing import Any, Callable

import psutil
import pytest
import requests

from appliance.core.config import LimitsConfig
from appliance.transport.http.server import HTTPServer
from tests.support.servers import echo_app, poll_until


@pytest.fixture
def serve(http_servers: Callable[..., HTTPServer]) -> Callable[..., HTTPServer]:
    def start(**limits: Any) -> HTTPServer:
        return http_servers(echo_app, 2, LimitsConfig(**limits))

    return start


def exchange(port: int, raw: bytes, wait: float = 10) -> tuple[bytes, bool]:
    """Send ``raw``; everything the server answers and whether it then closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(raw)
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except TimeoutError:
            return reply, False
        except ConnectionResetError:
            pass
        return reply, True


def test_hundreds_of_slow_clients_do_not_stall_a_normal_request(serve: Callable[..., HTTPServer]) -> None:
    server = serve(header_timeout_s=60, request_timeout_s=120, idle_timeout_s=120)
    slow = []
    try:
        for i in range(300):  # each holds a partial request: line sent, headers never finished
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nX-Slow-%d: " % i)
            slow.append(s)
        poll_until(lambda: server.stats["connections"] >= 300 or len(server.conns) >= 300, 30,
                   "the 300 slow connections to be open")
        with requests.Session() as session:
            for _ in range(5):
                assert session.post(f"http://127.0.0.1:{server.port}/x", data=b"12345", timeout=30).text == "ok 5"
        assert len(server.conns) >= 300  # still open, still partial: nothing was cut to serve them
    finally:
        for s in slow:
            s.close()


def test_idle_keep_alive_connections_are_held_with_bounded_memory(serve: Callable[..., HTTPServer]) -> None:
    server = serve(idle_timeout_s=120)
    rss0 = psutil.Process().memory_info().rss
    idle = []
    try:
        for _ in range(1000):  # each made one request and stays open, keep-alive, saying nothing
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
            idle.append(s)
        for s in idle:
            s.settimeout(30)
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        assert len(server.conns) == 1000
        grown = psutil.Process().memory_info().rss - rss0  # both ends of every connection: this process
        assert grown < 100 * 1000 * 1024, f"{grown / 1000:.0f} bytes per connection"
        assert requests.get(f"http://127.0.0.1:{server.port}/x", timeout=30).text == "ok 0"
    finally:
        for s in idle:
            s.close()


def test_content_length_with_transfer_encoding_closes_the_connection(serve: Callable[..., HTTPServer]) -> None:
    server = serve()
    smuggled = (b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n")
    reply, closed = exchange(server.port, smuggled)
    assert reply.startswith(b"HTTP/1.1 400") and reply.count(b"HTTP/1.1") == 1 and closed
    assert "Transfer-Encoding" in json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]


@pytest.mark.parametrize("headers", [b"", b"Host: a\r\nHost: b\r\n"])
def test_a_missing_or_duplicate_host_is_refused(serve: Callable[..., HTTPServer], headers: bytes) -> None:
    server = serve()
    reply, closed = exchange(server.port, b"GET /x HTTP/1.1\r\n" + headers + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 400") and closed
    assert "Host" in json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    assert server.stats["bad_host"] == 1
    assert exchange(server.port, b"GET /x HTTP/1.0\r\n\r\n")[0].startswith(b"HTTP/1.1 200")  # 1.0 needs none


def test_a_body_over_the_limit_is_refused_before_it_is_read(serve: Callable[..., HTTPServer]) -> None:
    server = serve()  # the fixture's max_body_bytes: 1 MiB
    reply, closed = exchange(server.port, b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5000000\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413") and closed  # answered with not one body byte sent
    assert "max_body_bytes" in json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
    reply, _ = exchange(server.port, b"GET /x HTTP/1.1\r\nHost: a\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 431")


def test_request_bodies_held_have_a_total_bound(serve: Callable[..., HTTPServer]) -> None:
    server = serve(max_buffered_bytes=1 << 20)
    holder = socket.create_connection(("127.0.0.1", server.port))
    try:  # one request holds 700 kB of its 800 kB body, unfinished
        holder.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 800000\r\n\r\n" + b"b" * 700_000)
        poll_until(lambda: server.buffered >= 700_000, 60, "the first body to be held")
        reply, closed = exchange(server.port, b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 500000\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in reply and closed
        assert "max_buffered_bytes" in json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
        assert requests.post(f"http://127.0.0.1:{server.port}/x", data=b"small", timeout=10).text == "ok 5"
        holder.sendall(b"b" * 100_000)  # the first one completes and is served
        holder.settimeout(10)
        assert holder.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        holder.close()
    poll_until(lambda: server.buffered == 0, 60, "the held bytes to be released")


def test_idle_connections_make_room_at_the_cap(serve: Callable[..., HTTPServer]) -> None:
    server = serve(max_connections=20, idle_timeout_s=120)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(20)]
    try:
        poll_until(lambda: len(server.conns) == 20, 60, "20 idle connections")
        started = time.monotonic()
        assert requests.get(f"http://127.0.0.1:{server.port}/x", timeout=30).text == "ok 0"
        assert time.monotonic() - started < 30 and server.stats["evicted_idle"] >= 1
        assert len(server.conns) <= 20
    finally:
        for s in idle:
            s.close()
