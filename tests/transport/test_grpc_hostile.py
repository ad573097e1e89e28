"""Hostile HTTP/2 clients against the service's gRPC port, each bounded (issue 22).

Every attack runs against one real ``appliance serve`` (the MLP on LiteRT, gRPC on), and after
each the same process must answer a normal gRPC Predict and a REST predict, and its RSS must
come back near where it was before the attacks. What is bounded, and the answer a client sees:

- rapid reset (HEADERS then RST_STREAM, over and over): GOAWAY ENHANCE_YOUR_CALM past a rate;
- empty CONTINUATION floods: a bounded number of frames per header block, then GOAWAY;
- PING and SETTINGS floods: a bounded number answered, then GOAWAY ENHANCE_YOUR_CALM;
- a header block larger than the advertised SETTINGS_MAX_HEADER_LIST_SIZE allows: refused
  (GOAWAY) as soon as its size shows, before it is complete, so never decoded;
- connections that never send the preface: closed at ``[grpc] handshake_timeout_s``;
- a client that never opens its window: its answers time out (``stall_timeout_s``) and go;
- descriptor exhaustion through the gRPC port (the service under a descriptor limit of 1024):
  gRPC stops at its own cap, REST and /healthz keep answering, and a new gRPC client still
  gets in (the connection idle longest makes room).

The byte bounds on held answers (per connection and in total, with and without gzip) are
measured at the end, on a server in this process whose methods answer megabytes
(``test_held_answers_are_bounded_and_freed``).
"""

from __future__ import annotations

import contextlib
import gzip
import itertools
import os
import resource
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import hpack
import psutil
import pytest

grpc = pytest.importorskip("grpc")

from appliance.core.memory import trim_heap  # noqa: E402
from tests.support import h2_wire as w  # noqa: E402
from tests.support.servers import free_port, poll_until, spawn  # noqa: E402

PREDICT = "/tensorflow.serving.PredictionService/Predict"
HANDSHAKE_S, STALL_S = 2, 2
GRPC_LIMITS = f"handshake_timeout_s = {HANDSHAKE_S}\nstall_timeout_s = {STALL_S}\n"
RSS_SLACK = 96 << 20  # what the process may keep after an attack (allocator arenas, caches)


def predict_request(rows: int = 1) -> bytes:
    from appliance.protos.tfserving import pb

    request = pb.PredictRequest()
    request.model_spec.name = "mlp"
    tensor = request.inputs["x"]
    tensor.dtype = 1  # DT_FLOAT
    tensor.tensor_shape.dim.add(size=rows)
    tensor.tensor_shape.dim.add(size=64)
    tensor.float_val.extend([0.25] * (64 * rows))
    return bytes(request.SerializeToString())


def config_text(models_dir: Path, grpc_port: int, extra: str = "") -> str:
    return (f"[discovery]\nenabled = false\n[grpc]\nport = {grpc_port}\n{GRPC_LIMITS}{extra}\n"
            f'[[models]]\nname = "mlp"\nbase_path = "{models_dir / "keras_mlp_tflite"}"\nbackend = "tflite"\n')


@pytest.fixture(scope="module")
def service(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = tmp_path_factory.mktemp("hostile") / "appliance.toml"
    port = free_port()
    config.write_text(config_text(models_dir, port))
    srv = module_server("--config", str(config), "--grpc-port", str(port))
    srv.grpc_port = port
    assert_serving(srv)
    assert_serving(srv)
    srv.rss0 = tree_rss(srv.proc.pid)
    return srv


def tree_rss(pid: int) -> int:
    """The service's RSS: its process and its front workers, where gRPC connections land."""
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in (root, *root.children()))


@pytest.fixture()
def attacked(service: Any) -> Iterator[Any]:
    """The service; after the test, the same process still serves and its RSS came back."""
    yield service
    assert service.proc.poll() is None, "the service died"
    assert_serving(service)
    service.wait_for(lambda: tree_rss(service.proc.pid) <= service.rss0 + RSS_SLACK, 60,
                     f"the service's RSS to come back within {RSS_SLACK >> 20} MiB of {service.rss0 >> 20} MiB")


def assert_serving(service: Any) -> None:
    """A normal gRPC Predict and a REST predict, each answered within a client deadline."""
    with grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}") as ch:
        reply = ch.unary_unary(PREDICT)(predict_request(), timeout=10)
        assert b"probs" in reply
    rest = service.post("/v1/models/mlp:predict", {"instances": [[0.25] * 64]}, timeout=10)
    assert rest.status_code == 200 and len(rest.json()["predictions"][0]) == 10


# The attackers' own addresses (loopback's 127.0.0.0/8): the service budgets control frames and
# abandoned calls per peer address (appliance/transport/grpc/peers.py) and refuses an address
# that went over for as long as its debt takes to refill (a rapid reset's thousands of streams:
# many seconds). Each attack therefore comes from an address of its own, as separate attackers
# would, so one test's debt never closes the next test's connection unread (CI saw that: the
# CONTINUATION flood's connection after the rapid reset test got no frame at all). The probes,
# from 127.0.0.1, are another client, as they would be in the field.
_attackers = itertools.count(2)


def attacker() -> str:
    """A loopback address no earlier attack in this process used (127.0.0.2 to 127.0.255.254)."""
    n = next(_attackers)
    return f"127.0.{n // 254}.{n % 254 + 1}"


def connect(port: int, *, window: int | None = None, source: str | None = None) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source or attacker(), 0))
    sock.sendall(w.PREFACE + (w.settings(INITIAL_WINDOW_SIZE=window) if window is not None else w.settings()))
    return sock


@contextlib.contextmanager
def attacking(port: int, *, window: int | None = None) -> Iterator[tuple[socket.socket, "Reader"]]:
    """A raw HTTP/2 connection and a thread reading everything the server sends on it."""
    with connect(port, window=window) as sock:
        reader = Reader(sock)
        try:
            yield sock, reader
        finally:
            reader.stop()


class Reader(threading.Thread):
    """Reads every frame the server sends on ``sock`` until it closes the connection, so a
    flood's sender never blocks on the answers piling up unread."""

    def __init__(self, sock: socket.socket):
        super().__init__(name="h2-reader", daemon=True)
        self.sock, self.frames = sock, []
        self.ended = ""  # why reading stopped: waiting for more frames is pointless then
        self.start()

    def run(self) -> None:
        try:
            while (f := w.read_frame(self.sock)) is not None:
                self.frames.append(f)
            self.ended = f"the server closed the connection after {len(self.frames)} frames"
        except OSError as exc:  # the test closed the socket, or its read timed out: the test reports what is missing
            self.ended = f"reading stopped after {len(self.frames)} frames: {exc!r}"

    def stop(self) -> None:
        """Shut the socket (which wakes a blocked recv) and join."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.join(10)

    def count(self, kind: int, flags: int | None = None) -> int:
        return sum(1 for f in list(self.frames) if f[0] == kind and (flags is None or f[1] & flags == flags))


def test_rapid_reset_gets_goaway(attacked: Any) -> None:
    encoder = hpack.Encoder()
    pairs = 20000
    with attacking(attacked.grpc_port) as (sock, reader):
        sent = 0
        for first in range(1, 2 * pairs, 2 * 200):  # 200 HEADERS + RST_STREAM pairs per write
            burst = b"".join(w.frame(w.HEADERS, w.END_HEADERS, s, w.request_headers(encoder, 0, PREDICT))
                             + w.frame(w.RST_STREAM, 0, s, w.CANCEL.to_bytes(4, "big"))
                             for s in range(first, min(first + 2 * 200, 2 * pairs), 2))
            if not w.send_quietly(sock, burst):
                break
            sent += 200
        if sent == pairs:  # every pair went through: this PING's answer says the server read them all
            w.send_quietly(sock, w.frame(w.PING, 0, 0, b"lastping"))
        poll_until(lambda: w.goaway_code(reader.frames) is not None or reader.count(w.PING, w.ACK), 60,
                   "a GOAWAY, or the answer to the PING sent after every pair")
        reader.join(30)
        assert w.goaway_code(reader.frames) == w.ENHANCE_YOUR_CALM, f"{sent} streams opened and reset, no GOAWAY"
        last = next(int.from_bytes(f[3][:4], "big") for f in reader.frames if f[0] == w.GOAWAY)
        assert last < pairs, f"the server took {(last + 1) // 2} of {pairs} reset streams before its GOAWAY"


def test_empty_continuation_flood_gets_goaway(attacked: Any) -> None:
    encoder = hpack.Encoder()
    block = w.request_headers(encoder, 0, PREDICT)
    with attacking(attacked.grpc_port) as (sock, reader):
        ok = w.send_quietly(sock, w.frame(w.HEADERS, 0, 1, block[:4]))
        for _ in range(100):  # 100 x 100 empty CONTINUATION frames, one header block
            if not ok or not w.send_quietly(sock, w.frame(w.CONTINUATION, 0, 1) * 100):
                break
        # the rest of the block and the request: a server that took the flood answers it
        w.send_quietly(sock, w.frame(w.CONTINUATION, w.END_HEADERS, 1, block[4:])
                       + w.frame(w.DATA, w.END_STREAM, 1, w.message(predict_request())))
        poll_until(lambda: w.goaway_code(reader.frames) is not None
                   or reader.count(w.HEADERS, w.END_STREAM), 60, "a GOAWAY or the call's answer",
                   context=lambda: "--- server log (tail)\n" + attacked.log_text()[-3000:], alive=lambda: reader.ended)
        assert w.goaway_code(reader.frames) in (w.PROTOCOL_ERROR, w.ENHANCE_YOUR_CALM)
        assert not reader.count(w.HEADERS), "the request after 10,000 empty CONTINUATION frames was answered"


@pytest.mark.parametrize("kind", ["PING", "SETTINGS"])
def test_ping_and_settings_floods_get_goaway(attacked: Any, kind: str) -> None:
    n = 20000
    one = w.frame(w.PING, 0, 0, b"12345678") if kind == "PING" else w.frame(w.SETTINGS, 0, 0)
    ack_kind = w.PING if kind == "PING" else w.SETTINGS
    with attacking(attacked.grpc_port) as (sock, reader):
        for _ in range(n // 500):
            if not w.send_quietly(sock, one * 500):
                break
        poll_until(lambda: w.goaway_code(reader.frames) is not None or reader.count(ack_kind, w.ACK) >= n, 60,
                   f"a GOAWAY, or all {n} {kind} frames acknowledged")
        assert w.goaway_code(reader.frames) == w.ENHANCE_YOUR_CALM
        assert reader.count(ack_kind, w.ACK) < n // 4, "the flood was mostly answered"


def test_oversized_headers_refused_before_the_block_is_complete(attacked: Any) -> None:
    """A 1 MB HEADERS frame, its first 64 KiB sent: the server refuses it from its declared
    size, not after Huffman-decoding a megabyte."""
    value = os.urandom(48).hex() * 10000  # Huffman-coded by the encoder: ~0.9 MB of block
    headers = [(":method", "POST"), (":path", PREDICT), ("x-big", value)]
    # hpack's own Huffman coder takes minutes over 0.9 MB (quadratic): the linear one writes the
    # same bytes, as a shorter value of the same kind shows
    short = [*headers[:2], ("x-big", value[:4000])]
    assert w.encoder().encode(short, huffman=True) == hpack.Encoder().encode(short, huffman=True)
    block = w.encoder().encode(headers, huffman=True)
    assert len(block) > 500_000
    with connect(attacked.grpc_port) as sock:
        first = w.read_frame(sock)
        assert first is not None and first[0] == w.SETTINGS
        advertised = {int.from_bytes(first[3][i:i + 2], "big"): int.from_bytes(first[3][i + 2:i + 6], "big")
                      for i in range(0, len(first[3]), 6)}
        assert w.MAX_HEADER_LIST_SIZE in advertised and advertised[w.MAX_HEADER_LIST_SIZE] < len(block)
        head = w.frame(w.HEADERS, w.END_HEADERS, 1, block)
        sock.sendall(head[:9 + 65536])  # the rest of the frame is never sent
        frames = w.frames_until_closed(sock, w.GOAWAY)
        assert w.goaway_code(frames) is not None, "no GOAWAY for a header block over the advertised size"


def test_connections_without_a_preface_are_closed(attacked: Any) -> None:
    source = attacker()  # one attacker, forty connections
    socks = [socket.create_connection(("127.0.0.1", attacked.grpc_port), timeout=60, source_address=(source, 0))
             for _ in range(40)]
    try:
        for sock in socks[::2]:
            sock.sendall(w.PREFACE[:10])  # a partial preface is no better
        for sock in socks:
            assert w.frames_until_closed(sock) is not None  # returns once the server closed it
            assert sock.recv(1) == b""
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.parametrize("compressed", [False, True])
def test_a_client_that_never_opens_its_window(attacked: Any, compressed: bool) -> None:
    """SETTINGS_INITIAL_WINDOW_SIZE 0 and no WINDOW_UPDATE ever: no answer's DATA can be sent.
    Each call ends anyway: by RST_STREAM once it has stalled ``stall_timeout_s``, or refused
    (RESOURCE_EXHAUSTED) when its connection already holds all the answers it may."""
    encoder = hpack.Encoder()
    request = predict_request(8)
    body = w.message(gzip.compress(request), compressed=True) if compressed else w.message(request)
    extra = (("grpc-encoding", "gzip"),) if compressed else ()
    streams = list(range(1, 100, 2))
    with attacking(attacked.grpc_port, window=0) as (sock, reader):
        sock.sendall(b"".join(w.frame(w.HEADERS, w.END_HEADERS, s, w.request_headers(encoder, 0, PREDICT, extra))
                              + w.frame(w.DATA, w.END_STREAM, s, body) for s in streams))

        def ended() -> set[int]:
            return {f[2] for f in list(reader.frames)
                    if f[0] == w.RST_STREAM or (f[0] == w.HEADERS and f[1] & w.END_STREAM)}
        poll_until(lambda: ended() >= set(streams), 60, "every stalled call to end (RST_STREAM or trailers)")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_descriptor_exhaustion_through_grpc_leaves_rest_up(models_dir: Path, tmp_path: Path, workers: str) -> None:
    """The service under a descriptor limit of 1024; a client opens gRPC connections until no
    more are accepted. REST, /healthz and a new gRPC client are still served. With front
    workers each process has its own descriptors and keeps its own share."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 3000:
        pytest.skip(f"this test opens ~2000 sockets; the descriptor limit here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    port, grpc_port = free_port(), free_port()
    config = tmp_path / "appliance.toml"
    config.write_text(config_text(models_dir, grpc_port))
    cmd = ["prlimit", "--nofile=1024:1024", sys.executable, "-m", "appliance.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--state", str(tmp_path / "state"), "--config", str(config), "--no-discovery",
           "--workers", workers]
    server = spawn(cmd, port, tmp_path / "state", tmp_path / "server.log")
    server.grpc_port = grpc_port
    attackers: list[socket.socket] = []
    try:
        assert_serving(server)
        rss0 = tree_rss(server.proc.pid)
        while len(attackers) < 2000:
            sock = socket.socket()
            sock.settimeout(1)
            try:
                sock.connect(("127.0.0.1", grpc_port))
                sock.sendall(w.PREFACE + w.settings())
            except OSError:  # the server's accept queue is full: as far as this client gets
                sock.close()
                break
            attackers.append(sock)
        assert len(attackers) > 300, "the client could not open more connections than gRPC's share"
        assert server.get("/healthz", timeout=10).status_code == 200
        assert_serving(server)
        grpc_status = server.status()["grpc"]
        processes = int(workers) if grpc_status.get("served_by") == "front workers" else 1
        # 1024 descriptors a process: REST may hold 512 (server.py leaves 2 x 256 free), files keep 256
        assert grpc_status["max_connections"] <= 256 * processes, grpc_status
        assert grpc_status["connections"] <= 256 * processes, grpc_status
        # the new client got in by eviction (front workers report their figures each second)
        server.wait_for(lambda: server.status()["grpc"].get("evicted_idle", 0) > 0, 30, "an eviction in /api/status")
        for sock in attackers:
            sock.close()
        attackers.clear()
        assert_serving(server)
        server.wait_for(lambda: tree_rss(server.proc.pid) <= rss0 + RSS_SLACK, 60, "RSS back near its level")
        assert "Traceback" not in server.log_text()
    finally:
        for sock in attackers:
            sock.close()
        server.stop()


# -- the byte bounds, on the server itself -------------------------------------------------------
MIB = 1 << 20


def test_held_answers_are_bounded_and_freed() -> None:
    """Two connections that never open their windows ask for 4 MiB answers, 40 calls each: with
    gzip (a few bytes that inflate to 4 MiB, echoed) and without (a method that answers 4 MiB).
    Unbounded, the server would hold 320 MiB; it holds at most its per-connection and total
    bounds, refuses the rest (RESOURCE_EXHAUSTED), and frees all of it once they stall."""
    from appliance.transport.grpc.h2_server import LeanServer
    from appliance.transport.grpc.limits import Limits

    per_connection, total = 24 * MIB, 40 * MIB
    limits = Limits(stall_timeout_s=STALL_S, max_connection_buffer_bytes=per_connection, max_buffer_bytes=total)
    options = [("grpc.max_receive_message_length", 8 * MIB), ("grpc.max_send_message_length", 8 * MIB)]
    server = LeanServer(2, options, limits=limits)

    async def big(request: bytes, context: Any) -> bytes:
        return bytes(int(request))

    table = {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
             "Big": grpc.unary_unary_rpc_method_handler(big)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Test", table),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    me = psutil.Process()
    rss0 = me.memory_info().rss
    streams = list(range(1, 81, 2))
    socks = []
    stack = contextlib.ExitStack()
    try:
        for compressed in (False, True):
            encoder = hpack.Encoder()
            sock, reader = stack.enter_context(attacking(port, window=0))
            socks.append((sock, reader))
            if compressed:
                body = w.message(gzip.compress(bytes(4 * MIB)), compressed=True)
                head = w.request_headers(encoder, port, "/t.Test/Echo", (("grpc-encoding", "gzip"),))
            else:
                body, head = w.message(b"%d" % (4 * MIB)), w.request_headers(encoder, port, "/t.Test/Big")
            sock.sendall(b"".join(w.frame(w.HEADERS, w.END_HEADERS, s, head) + w.frame(w.DATA, w.END_STREAM, s, body)
                                  for s in streams))

        def answered(reader: Reader) -> set[int]:  # calls the server has finished: answer held, or refused
            return {f[2] for f in list(reader.frames) if f[0] == w.HEADERS}
        for _, reader in socks:
            poll_until(lambda: answered(reader) >= set(streams), 60, "every call to be answered or refused")
        held = server.buffered_bytes()
        grown = me.memory_info().rss - rss0
        assert held <= total, f"{held} bytes of answers held, over the total bound {total}"
        assert grown <= total + 48 * MIB, f"RSS grew {grown >> 20} MiB holding answers nobody reads"
        refused = sum(reader.count(w.HEADERS, w.END_STREAM) for _, reader in socks)
        assert refused >= 2 * len(streams) - total // (4 * MIB), "answers over the bound were not refused"

        def ended(reader: Reader) -> set[int]:
            return {f[2] for f in list(reader.frames)
                    if f[0] == w.RST_STREAM or (f[0] == w.HEADERS and f[1] & w.END_STREAM)}
        for _, reader in socks:
            poll_until(lambda: ended(reader) >= set(streams), 60, "the stalled answers to time out")
        poll_until(lambda: server.buffered_bytes() == 0, 30, "the server's accounts to empty")
        # The answers must be unreferenced, not merely unaccounted: with the bytes freed, the
        # heap's trim gives their pages back (no gc.collect: a connection must not wait for the
        # cyclic collector). Without the trim, whether freed heap returns to the OS depends on
        # what else this pytest worker allocated before, which made the check flaky.
        def came_back() -> bool:
            trim_heap()
            return me.memory_info().rss <= rss0 + 32 * MIB
        poll_until(came_back, 30, "this process's RSS to come back (freed answers trimmed)")
    finally:
        stack.close()
        server.stop(None)


@pytest.mark.parametrize("key, value, why", [
    ("max_concurrent_streams", 0, "between 1 and 65536"),
    ("max_metadata_size", 100, "between 1024"),
    ("handshake_timeout_s", 0, "positive"),
    ("stall_timeout_s", -1, "positive"),
    ("max_connections", 0, "between 1"),
    ("max_connection_buffer_bytes", 1 << 20, "max_message_bytes + 5"),
    ("max_buffer_bytes", 1 << 20, "at least max_connection_buffer_bytes"),
])
def test_grpc_bounds_are_validated(tmp_path: Path, key: str, value: int, why: str) -> None:
    from appliance.core.config import ConfigError
    from appliance.core.config_file import load

    path = tmp_path / "appliance.toml"
    path.write_text(f"[grpc]\n{key} = {value}\n")
    with pytest.raises(ConfigError) as err:
        load(str(path))
    assert f"grpc.{key}" in str(err.value) and why in str(err.value)
