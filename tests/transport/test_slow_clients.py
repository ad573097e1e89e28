"""Slow and stuck clients (slowloris) against the real HTTP server on real sockets: headers
sent byte by byte and bodies that never finish are cut at their deadline (408, connection
closed) although bytes keep arriving, they never hold a worker thread, other clients are
served meanwhile, and the number of open connections stays bounded."""

from __future__ import annotations

import json
import select
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import requests

from appliance.core.config import LimitsConfig
from appliance.fronts.app import facing
from appliance.transport.http.server import HTTPServer
from tests.support.servers import echo_app, poll_until

SLACK_S = 15.0  # generous: a loaded CI box; the point is "cut", not "cut on time"


@pytest.fixture
def serve(http_servers: Callable[..., HTTPServer]) -> Callable[..., HTTPServer]:
    def start(threads: int = 2, **limits: Any) -> HTTPServer:
        return http_servers(echo_app, threads, LimitsConfig(**limits))

    return start


class Trickler(threading.Thread):
    """One slow client: sends ``payload`` one byte every ``interval`` s (forever, if it is
    longer than the test) and records what the server answers and when it closes."""

    def __init__(self, port: int, payload: bytes, interval: float = 0.1):
        super().__init__(name="trickler", daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.payload, self.interval = payload, interval
        self.reply = b""
        self.closed_after: float | None = None
        self.started = time.monotonic()

    def run(self) -> None:
        i = 0
        try:
            while time.monotonic() - self.started < 40:
                if i < len(self.payload):
                    self.sock.sendall(self.payload[i:i + 1])
                    i += 1
                readable, _, _ = select.select([self.sock], [], [], self.interval)
                if readable:
                    data = self.sock.recv(65536)
                    if not data:
                        break
                    self.reply += data
        except OSError:  # reset after the server's 408: keep what had arrived before the reset
            self._drain()
        self.closed_after = time.monotonic() - self.started
        self.sock.close()

    def _drain(self) -> None:
        """What the kernel still holds for us: a thread descheduled past the server's linger
        (a loaded box) sends into the reset first, but the 408 is already in its buffer."""
        self.sock.setblocking(False)
        try:
            while data := self.sock.recv(65536):
                self.reply += data
        except OSError:
            pass

    def status(self) -> int:
        return int(self.reply[9:12]) if self.reply.startswith(b"HTTP/1.1 ") else 0


def endless_headers(port: int) -> bytes:
    return f"POST /x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode() + b"X-Pad: " + b"a" * 100_000


def endless_body(port: int) -> bytes:
    return (f"POST /x HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 100000\r\n\r\n").encode() + b"b" * 100_000


def test_slowloris_is_cut_at_the_deadlines_while_others_are_served(serve: Callable[..., HTTPServer]) -> None:
    # two worker threads, 30 slow clients: they never hold a worker, so others are served
    server = serve(threads=2, max_connections=100, idle_timeout_s=60, header_timeout_s=1.5, request_timeout_s=3)
    slow_headers = [Trickler(server.port, endless_headers(server.port)) for _ in range(15)]
    # headers arrive quickly (each byte 2 ms apart); the body then trickles and never ends
    slow_bodies = [Trickler(server.port, endless_body(server.port), interval=0.002) for _ in range(15)]
    for t in slow_headers + slow_bodies:
        t.start()
    with requests.Session() as session:
        served = [session.post(f"http://127.0.0.1:{server.port}/x", data=b"12345", timeout=10).text
                  for _ in range(40)]
    assert served == ["ok 5"] * 40
    for t in slow_headers + slow_bodies:
        t.join(3 + SLACK_S)
        assert not t.is_alive(), "a slow connection was never closed"
        assert t.status() == 408
    header_reply = json.loads(slow_headers[0].reply.split(b"\r\n\r\n", 1)[1])
    body_reply = json.loads(slow_bodies[0].reply.split(b"\r\n\r\n", 1)[1])
    assert "request headers" in header_reply["error"] and "limits.header_timeout_s" in header_reply["error"]
    assert "request body" in body_reply["error"] and "limits.request_timeout_s" in body_reply["error"]
    # the byte-by-byte clients were still sending (an idle timer would never have fired: 60 s)
    assert all(t.closed_after is not None and t.closed_after < 60 for t in slow_headers)
    assert server.stats["cut_header_timeout"] >= 15 and server.stats["cut_request_timeout"] >= 15
    assert requests.get(f"http://127.0.0.1:{server.port}/x", timeout=10).text == "ok 0"


def test_connections_are_bounded_and_queued_clients_are_served_after(serve: Callable[..., HTTPServer]) -> None:
    # 12 s to cut a hog: room, on a loaded box (a CI worker beside a TensorFlow build), to see
    # all five held before the first is cut
    server = serve(threads=2, max_connections=5, idle_timeout_s=12, header_timeout_s=12, request_timeout_s=15)
    hogs = [Trickler(server.port, endless_headers(server.port), interval=0.2) for _ in range(5)]
    for t in hogs:
        t.start()
    poll_until(lambda: server.stats["connections"] >= 5 or len(server.conns) >= 5,
               60, "the five slow connections to be accepted")
    result: dict[str, Any] = {}

    def normal() -> None:
        result["text"] = requests.get(f"http://127.0.0.1:{server.port}/x", timeout=30).text

    waiting = threading.Thread(target=normal)
    waiting.start()
    # more clients that connect and say nothing: they queue in the kernel too, then idle out
    extra = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
    peak = 0
    while waiting.is_alive():
        peak = max(peak, len(server.conns) + server.opening)
        time.sleep(0.02)
    waiting.join()
    for s in extra:
        s.close()
    assert result["text"] == "ok 0"  # served once the slow ones were cut
    assert peak <= 5  # never more than max_connections open
    for t in hogs:
        t.join(12 + SLACK_S)
        assert t.status() == 408


def test_a_connection_that_sends_nothing_is_closed(serve: Callable[..., HTTPServer]) -> None:
    server = serve(idle_timeout_s=1, header_timeout_s=1, request_timeout_s=2)
    silent = socket.create_connection(("127.0.0.1", server.port))
    silent.settimeout(2 + SLACK_S)
    assert silent.recv(100) == b""  # closed by the server, nothing said
    silent.close()


def test_the_service_applies_its_limits(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    """``[limits]`` from the config file reach the service's server; the cut shows in /api/status."""
    base = tmp_path / "models"
    shutil.copytree(models_dir / "keras_mlp_tflite", base / "mlp")
    config = tmp_path / "limits.toml"
    config.write_text(f'models_dir = "{base}"\n[discovery]\nenabled = false\n'
                      "[limits]\nmax_connections = 20\nheader_timeout_s = 1.0\nrequest_timeout_s = 2.0\n")
    server = start_server("--config", str(config), "--backend", "tflite")
    slow = [Trickler(server.port, endless_headers(server.port), interval=0.2) for _ in range(3)]
    for t in slow:
        t.start()
    body = json.dumps({"instances": [[0.1] * 64]})
    for _ in range(10):
        assert server.post("/v1/models/mlp:predict", body).status_code == 200
    for t in slow:
        t.join(2 + SLACK_S)
        assert t.status() == 408
    # front workers report their figures every second: wait for the cut to show
    server.wait_for(lambda: server.status()["http"]["cut_header_timeout"] >= 3, 30, "the three cuts in /api/status")
    assert server.status()["http"]["max_connections"] == 20


def test_requests_that_waited_too_long_for_a_worker_are_shed_with_retry_after() -> None:
    """Overload at the door: one worker busy 0.5 s per request, queue wait limit 0.2 s. Every
    request queued behind it has waited longer than that when a worker picks it up: it gets
    503 + Retry-After without running the app; health probes are never shed."""
    ran: list[str] = []

    def slow_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        ran.append(environ["PATH_INFO"])
        if environ["PATH_INFO"] == "/work":
            time.sleep(0.5)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"done"]

    server = HTTPServer(slow_app, "127.0.0.1", 0, 1, 1024, limits=LimitsConfig(max_queue_wait_s=0.2), facing=facing())
    loop = threading.Thread(target=server.serve_forever, name="http-under-test")
    loop.start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        replies: list[requests.Response] = []

        def call(path: str) -> None:
            replies.append(requests.get(url + path, timeout=30))

        first = threading.Thread(target=call, args=("/work",))
        first.start()
        poll_until(lambda: ran, 10, "the first request to occupy the worker")
        probes = ["/healthz", "/v2/health/live", "/v2/health/ready"]
        queued = [threading.Thread(target=call, args=(p,)) for p in ["/work"] * 4 + probes]
        for t in queued:
            t.start()
        for t in [first, *queued]:
            t.join(30)
        by_status = sorted((r.status_code, r.url.rsplit("/", 1)[1]) for r in replies)
        assert {(200, "healthz"), (200, "live"), (200, "ready")} <= set(by_status)
        shed = [r for r in replies if r.status_code == 503]
        assert shed and all(r.headers["Retry-After"] == "1" and "max_queue_wait_s" in r.json()["error"] for r in shed)
        assert ran.count("/work") == 5 - len(shed)  # a shed request never reached the app
        assert server.stats["shed_overload"] == len(shed)
    finally:
        server.close()
        loop.join(10)
