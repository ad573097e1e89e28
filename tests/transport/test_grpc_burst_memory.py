"""What a burst of abandoned calls leaves behind (issue 47, item 3: "connect, send 100
Predicts, close without reading, again" left the process tree +86 MiB 30 s after).

On a lean gRPC server in this process: connections from 20 addresses each send 100
calls and close unread. Once they are gone, every account is back to 0 (open streams, the
addresses' open streams, held bytes, calls in flight), and the front worker's heartbeat
(appliance/fronts/worker.py ``trim_after_burst``) gives the freed heap back to the OS once:
``heap_trims`` counts it. Before, the worker trimmed only after big calls (held bytes), so
after a burst of small ones glibc kept the freed pages. Loopback only; every socket, the
server and the worker's sockets are closed.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Iterator

import grpc
import hpack
import pytest

from appliance.fronts.worker import TRIM_AFTER_CHURN, TRIM_AFTER_QUIET_CHURN, Worker
from appliance.transport.grpc.h2_server import LeanServer
from appliance.transport.grpc.limits import Limits
from tests.support import h2_wire as w
from tests.support.servers import poll_until

CONNECTIONS, CALLS = 20, 100


@pytest.fixture()
def server() -> Iterator[LeanServer]:
    server = LeanServer(2, limits=Limits())
    table = {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request * 64)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Test", table),))
    server.port = server.add_insecure_port("127.0.0.1:0")  # type: ignore[attr-defined]
    server.start()
    try:
        yield server
    finally:
        server.stop(None)


@pytest.fixture()
def worker() -> Iterator[Worker]:
    channel, listener = socket.socketpair()
    try:
        yield Worker(0, 0, 0, channel, os.getpid(), listener)
    finally:
        channel.close()
        listener.close()


def heartbeat(server: LeanServer, worker: Worker) -> int:
    """One heartbeat's trim check, on the server's loop (as the worker's loop runs it);
    ``heap_trims`` after it."""
    done = threading.Event()

    def beat() -> None:
        worker.trim_after_burst()
        done.set()
    server.loop.call_soon_threadsafe(beat)
    assert done.wait(30), "the server's loop did not run the heartbeat"
    return server.stats.get("heap_trims", 0)


def abandon(port: int, source: str) -> None:
    """The preface, CALLS whole Echo calls, then close without reading a byte."""
    encoder = hpack.Encoder()
    head = w.request_headers(encoder, port, "/t.Test/Echo")
    body = w.message(b"x" * 256)
    with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as sock:
        w.send_quietly(sock, w.PREFACE + w.settings() + b"".join(
            w.frame(w.HEADERS, w.END_HEADERS, s, head) + w.frame(w.DATA, w.END_STREAM, s, body)
            for s in range(1, 2 * CALLS, 2)))


def test_a_burst_of_abandoned_calls_is_freed_and_the_heap_trimmed(server: LeanServer, worker: Worker) -> None:
    worker.grpc = server
    assert heartbeat(server, worker) == 0, "the heap was trimmed with no burst"
    sources = [f"127.2.0.{i + 1}" for i in range(CONNECTIONS)]  # each its own abandon budget (peers.py)
    for source in sources:
        abandon(server.port, source)  # type: ignore[attr-defined]
    assert CONNECTIONS * (CALLS + 1) >= TRIM_AFTER_CHURN

    def accounts() -> dict[str, int]:
        return {"connections": len(server.connections), "open streams": server.open_streams,
                "held bytes": server.held, "calls in flight": server.in_flight,
                "addresses' open streams": sum(server.peers.of(s).streams for s in sources)}
    poll_until(lambda: not any(accounts().values()), 60, "every account to go back to 0 after the burst",
               context=lambda: f"{accounts()}, stats {server.stats}")
    assert server.churn >= TRIM_AFTER_CHURN
    assert heartbeat(server, worker) == 1, "the worker did not trim its heap after the burst"
    assert heartbeat(server, worker) == 1, "trimmed again with no new burst"


def test_connections_that_end_after_the_last_trim_are_trimmed_once_quiet(server: LeanServer, worker: Worker) -> None:
    """An attack's connections all close at its end, after the burst's last trim (2,000 slow
    TLS clients left each worker +33 MiB 30 s after): their ends count, and once a heartbeat
    sees nothing new the tail is trimmed, once."""
    worker.grpc = server
    assert heartbeat(server, worker) == 0, "the heap was trimmed with no burst"
    ends = TRIM_AFTER_QUIET_CHURN  # each connection counts its accept and its end: twice the bar
    for _ in range(ends):
        with socket.create_connection(("127.0.0.1", server.port), timeout=30,  # type: ignore[attr-defined]
                                      source_address=("127.2.1.1", 0)) as sock:
            w.send_quietly(sock, w.PREFACE + w.settings())
    poll_until(lambda: server.churn >= 2 * ends and not server.connections and not server.opening, 60,
               "every connection's accept and end to be counted",
               context=lambda: f"churn {server.churn}, {len(server.connections)} open, {server.opening} opening")
    assert server.churn < TRIM_AFTER_CHURN, "the test must stay under the burst bar to test the tail rule"
    assert heartbeat(server, worker) == 0, "trimmed while connections were still coming"
    assert heartbeat(server, worker) == 1, "a quiet heartbeat after the tail did not trim it"
    assert heartbeat(server, worker) == 1, "trimmed again with nothing new"
