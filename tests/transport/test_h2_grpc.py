"""The lean gRPC server (appliance/transport/grpc/h2_server.py: h2's HTTP/2 under our unary
calls) against grpcio's real client, and against raw HTTP/2 frames for what a well-behaved
client never sends (hostile ones: tests/transport/test_grpc_hostile.py).

The service's own RPCs run on it in tests/api/test_grpc_tfs.py and tests/api/test_v2_grpc.py
(tensorflow-serving-api's and tritonclient's stubs); here it serves small echo methods so
that each transport rule (flow control both ways, sizes, deadlines, cancellation, status
and trailers, compression, drain, Unix sockets, hostile framing) is tested on its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import socket
import subprocess
import struct
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import grpc
import hpack
import pytest

from appliance.transport.grpc import connection as h2_conn
from appliance.transport.grpc.h2_server import LeanServer
from appliance.transport.grpc.limits import Limits
from tests.support import h2_wire as h2_grpc
from tests.support.load import scaled
from tests.support.servers import poll_until
from tests.support.h2_wire import frame, read_frame, request_headers

MAX_STREAMS = Limits().max_concurrent_streams

MAX = 8 << 20
MESSAGE = "naïve 100% ✓: the spec's percent-encoding, round trip"


class Methods:
    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.started = threading.Event()

    def echo(self, request: bytes, context: Any) -> bytes:  # a plain function: runs on the pool
        return request

    async def big(self, request: bytes, context: Any) -> bytes:  # a coroutine: runs on the loop
        n = int(request)
        return bytes(range(256)) * (n // 256) + bytes(n % 256)

    async def sleep(self, request: bytes, context: Any) -> bytes:
        self.started.set()
        try:
            await asyncio.sleep(float(request))
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return b"woke"

    def fail(self, request: bytes, context: Any) -> bytes:
        context.set_trailing_metadata((("retry-after", "7"), ("trace-bin", b"\x00\xffraw")))
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, MESSAGE)
        raise AssertionError("abort returned")


def _handlers(methods: Methods) -> grpc.GenericRpcHandler:
    def bad_deserializer(raw: bytes) -> bytes:
        raise ValueError("not this")
    table = {"Echo": grpc.unary_unary_rpc_method_handler(methods.echo),
             "Big": grpc.unary_unary_rpc_method_handler(methods.big),
             "Sleep": grpc.unary_unary_rpc_method_handler(methods.sleep),
             "Fail": grpc.unary_unary_rpc_method_handler(methods.fail),
             "Strict": grpc.unary_unary_rpc_method_handler(methods.echo, request_deserializer=bad_deserializer)}
    return grpc.method_handlers_generic_handler("t.Test", table)


@pytest.fixture()
def served() -> Iterator[tuple[LeanServer, int, Methods]]:
    methods = Methods()
    server = LeanServer(2, [("grpc.max_receive_message_length", MAX), ("grpc.max_send_message_length", MAX)])
    server.add_generic_rpc_handlers((_handlers(methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield server, port, methods
    finally:
        server.stop(None)


def channel(port: int, **extra: Any) -> grpc.Channel:
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=options, **extra)


def rpc_error(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(*args, **kwargs)
    return err.value


def test_messages_larger_than_every_window_go_both_ways(served: Any) -> None:
    _, port, _ = served
    payload = os.urandom(5 << 20)  # over the 64 KiB default windows and our 4 MiB stream window
    with channel(port) as ch:
        assert ch.unary_unary("/t.Test/Echo")(payload, timeout=30) == payload
        big = ch.unary_unary("/t.Test/Big")(b"%d" % (6 << 20), timeout=30)  # over grpcio's receive windows
        assert len(big) == 6 << 20 and big[:256] == bytes(range(256))
        assert ch.unary_unary("/t.Test/Echo")(b"", timeout=10) == b""  # an empty message is a message


def test_more_concurrent_calls_than_streams_allowed(served: Any) -> None:
    _, port, _ = served
    n = MAX_STREAMS + 150  # the client must queue what the server's SETTINGS do not allow
    with channel(port) as ch:
        echo = ch.unary_unary("/t.Test/Echo")
        futures = [echo.future(b"call %d" % i, timeout=60) for i in range(n)]
        assert [f.result() for f in futures] == [b"call %d" % i for i in range(n)]


def test_status_message_and_trailing_metadata_reach_the_client(served: Any) -> None:
    _, port, _ = served
    with channel(port) as ch:
        err = rpc_error(ch.unary_unary("/t.Test/Fail"), b"", timeout=10)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.details() == MESSAGE
        trailers = dict(err.trailing_metadata())
        assert trailers["retry-after"] == "7" and trailers["trace-bin"] == b"\x00\xffraw"
        err = rpc_error(ch.unary_unary("/t.Test/Nope"), b"", timeout=10)
        assert err.code() == grpc.StatusCode.UNIMPLEMENTED
        err = rpc_error(ch.unary_unary("/t.Test/Strict"), b"x", timeout=10)
        assert err.code() == grpc.StatusCode.INTERNAL and "deserializing" in err.details()
        assert ch.unary_unary("/t.Test/Echo")(b"still here", timeout=10) == b"still here"


def test_message_size_limits_both_ways(served: Any) -> None:
    _, port, _ = served
    with channel(port) as ch:
        err = rpc_error(ch.unary_unary("/t.Test/Echo"), bytes(MAX + 1), timeout=30)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"({MAX + 1} vs. {MAX})" in err.details()
        err = rpc_error(ch.unary_unary("/t.Test/Big"), b"%d" % (MAX + 1), timeout=30)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Sent message larger than max" in err.details()
        assert ch.unary_unary("/t.Test/Echo")(bytes(MAX), timeout=30) == bytes(MAX)  # the limit itself passes


def test_deadline_and_cancellation_stop_the_method(served: Any) -> None:
    _, port, methods = served
    with channel(port) as ch:
        sleep = ch.unary_unary("/t.Test/Sleep")
        started = time.monotonic()
        err = rpc_error(sleep, b"30", timeout=0.5)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 10
        assert methods.cancelled.wait(10), "the method kept running past its deadline"
        methods.cancelled.clear()
        methods.started.clear()
        future = sleep.future(b"30", timeout=60)
        assert methods.started.wait(10)
        future.cancel()  # the client resets the stream
        assert methods.cancelled.wait(10), "a cancelled call's method kept running"
        assert sleep(b"0.01", timeout=10) == b"woke"


def test_gzip_compressed_requests(served: Any) -> None:
    _, port, _ = served
    payload = b"squeeze me " * 10000
    with channel(port, compression=grpc.Compression.Gzip) as ch:
        assert ch.unary_unary("/t.Test/Echo")(payload, timeout=10) == payload


def test_unix_socket(tmp_path: Any) -> None:
    path = str(tmp_path / "grpc.sock")
    server = LeanServer(1)
    server.add_generic_rpc_handlers((_handlers(Methods()),))
    server.add_insecure_port(f"unix:{path}")
    server.start()
    try:
        with grpc.insecure_channel(f"unix:{path}") as ch:
            assert ch.unary_unary("/t.Test/Echo")(b"local", timeout=10) == b"local"
    finally:
        server.stop(None)
    assert not os.path.exists(path)


def test_drain_finishes_calls_in_flight_and_refuses_new_ones(served: Any) -> None:
    server, port, methods = served
    with channel(port) as ch:
        future = ch.unary_unary("/t.Test/Sleep").future(b"1", timeout=30)
        assert methods.started.wait(10)
        stopper = threading.Thread(target=server.stop, args=(10,))
        stopper.start()
        assert future.result() == b"woke"
        stopper.join(15)
        assert not stopper.is_alive()
    with channel(port) as ch:
        err = rpc_error(ch.unary_unary("/t.Test/Echo"), b"x", timeout=3)
        assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


# -- raw HTTP/2: what grpcio's client never sends ----------------------------------------------
def test_not_http2_or_oversized_frames_close_only_that_connection(served: Any) -> None:
    _, port, _ = served
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        frames = []
        while (f := read_frame(sock)) is not None:
            frames.append(f)
        assert any(kind == h2_grpc.GOAWAY and payload[4:8] == b"\x00\x00\x00\x01" for kind, _, _, payload in frames)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(h2_grpc.PREFACE + frame(h2_grpc.SETTINGS, 0, 0)
                     + struct.pack(">I", h2_conn.MAX_FRAME + 1)[1:] + bytes((0, 0)) + struct.pack(">I", 1))
        frames = []
        while (f := read_frame(sock)) is not None:
            frames.append(f)
        assert any(kind == h2_grpc.GOAWAY and payload[4:8] == b"\x00\x00\x00\x06" for kind, _, _, payload in frames)
    with channel(port) as ch:
        assert ch.unary_unary("/t.Test/Echo")(b"fine", timeout=10) == b"fine"


def test_a_client_cannot_make_the_server_buffer_without_bound(served: Any) -> None:
    """Streams opened and fed but never finished: a stream gets credit for its whole message
    only once admitted within the connection's budget, so a client that opens every stream
    it may is held to about budget + MAX_STREAMS x STREAM_WINDOW bytes."""
    server, port, _ = served
    budget = MAX + 5 + h2_conn.CONNECTION_WINDOW
    bound = budget + MAX_STREAMS * (h2_conn.STREAM_WINDOW + h2_conn.GRANT_SLACK)
    cap = 4 * bound  # what this client would send if nothing held it back
    encoder = hpack.Encoder()
    window, stream_window, stream_sent = 65535, {}, {}
    sent, current, next_stream = 0, 0, 1
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(h2_grpc.PREFACE + frame(h2_grpc.SETTINGS, 0, 0))
        last_credit = time.monotonic()
        while sent < cap and time.monotonic() - last_credit < 2:
            while select.select([sock], [], [], 0)[0]:
                kind, flags, stream_id, payload = read_frame(sock) or (None, 0, 0, b"")
                assert kind is not None, "the server closed the connection"
                assert kind != h2_grpc.RST_STREAM, "a stream was refused: this client stays within the limits"
                if kind == h2_grpc.WINDOW_UPDATE:
                    last_credit = time.monotonic()
                    if stream_id == 0:
                        window += int.from_bytes(payload, "big")
                    else:
                        stream_window[stream_id] += int.from_bytes(payload, "big")
                elif kind == h2_grpc.SETTINGS and not flags & 1:
                    sock.sendall(frame(h2_grpc.SETTINGS, 1, 0))
            ready = [s for s in stream_window if stream_window[s] > 0 and stream_sent[s] < MAX - 1]
            if not ready and len(stream_window) < MAX_STREAMS:  # each declares MAX bytes, never all sent
                current, next_stream = next_stream, next_stream + 2
                sock.sendall(frame(h2_grpc.HEADERS, h2_grpc.END_HEADERS, current, request_headers(encoder, port)))
                stream_window[current], stream_sent[current] = h2_conn.STREAM_WINDOW, 0
                sock.sendall(frame(h2_grpc.DATA, 0, current, b"\x00" + MAX.to_bytes(4, "big")))
                window, stream_window[current], sent = window - 5, stream_window[current] - 5, sent + 5
                continue
            if not ready or window <= 0:
                select.select([sock], [], [], 0.3)
                continue
            current = ready[0]
            n = min(16384, window, stream_window[current], MAX - 1 - stream_sent[current])
            sock.sendall(frame(h2_grpc.DATA, 0, current, bytes(n)))
            window, stream_window[current] = window - n, stream_window[current] - n
            stream_sent[current] += n
            sent += n
        held = [c.buffered for c in list(server.connections)]
    assert len(stream_window) == MAX_STREAMS  # it did open every stream it may
    assert sent <= bound, "the server gave credit past its budget to a client that never finishes a request"
    assert held and max(held) <= bound


def test_concurrent_large_requests_over_the_budget_take_turns(served: Any) -> None:
    """Four messages near the size limit at once on one connection, more than the budget
    admits together: the waiting ones are admitted as others finish (no deadlock)."""
    server, port, _ = served
    payloads = [os.urandom(MAX - 1024 * i) for i in range(4)]
    with channel(port) as ch:
        echo = ch.unary_unary("/t.Test/Echo")
        for _ in range(3):
            futures = [echo.future(p, timeout=60) for p in payloads]
            assert [f.result() == p for f, p in zip(futures, payloads)] == [True] * 4
            # nothing left admitted or waiting once every call is answered: a leak here is a
            # budget that shrinks until requests wait for ever
            assert [(c.committed, c.waiting, c.buffered) for c in list(server.connections)] == [(0, 0, 0)]


def test_data_past_the_granted_window_is_a_flow_control_error(served: Any) -> None:
    _, port, _ = served
    encoder = hpack.Encoder()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(h2_grpc.PREFACE + frame(h2_grpc.SETTINGS, 0, 0)
                     + frame(h2_grpc.HEADERS, h2_grpc.END_HEADERS, 1, request_headers(encoder, port)))
        # a small declared message, then far more than a new stream's window, ignoring it
        sock.sendall(frame(h2_grpc.DATA, 0, 1, b"\x00\x00\x00\x00\x0a" + bytes(16379)))
        for _ in range(4):
            sock.sendall(frame(h2_grpc.DATA, 0, 1, bytes(16384)))
        # RFC 9113 6.9: a stream error (nghttp2's choice: RST_STREAM) or a connection error (GOAWAY)
        while (f := read_frame(sock)) is not None:
            kind, _, stream_id, payload = f
            if kind in (h2_grpc.RST_STREAM, h2_grpc.GOAWAY):
                break
        assert f is not None, "the server closed the connection without naming the error"
        code = payload[:4] if kind == h2_grpc.RST_STREAM else payload[4:8]
        assert code == b"\x00\x00\x00\x03", f"{kind}: {payload!r}"  # FLOW_CONTROL_ERROR


def test_streams_over_the_limit_are_refused_and_the_header_table_stays_in_step(served: Any) -> None:
    """Streams past the advertised SETTINGS_MAX_CONCURRENT_STREAMS are refused: nghttp2
    answers REFUSED_STREAM while its SETTINGS are not yet acknowledged and PROTOCOL_ERROR
    (GOAWAY) after (h2 did the latter). Clients honour the setting
    (test_more_concurrent_calls_than_streams_allowed), so only a broken one meets it. What
    stays: a header block whose call is refused is still decoded, so a later request that
    refers to the header-table entry it added is understood."""
    _, port, _ = served
    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        blocks = b"".join(frame(h2_grpc.HEADERS, h2_grpc.END_HEADERS, s, request_headers(encoder, port))
                          for s in range(1, 2 * MAX_STREAMS + 2, 2))  # headers only: requests still arriving
        frames = h2_grpc.frames_until_ping(sock, h2_grpc.PREFACE + frame(h2_grpc.SETTINGS, 0, 0) + blocks)
        refused = {f[2] for f in frames if f[0] == h2_grpc.RST_STREAM and f[3] == b"\x00\x00\x00\x07"}
        assert refused == {2 * MAX_STREAMS + 1} or h2_grpc.goaway_code(frames) == h2_grpc.PROTOCOL_ERROR, frames
        assert not any(f[0] == h2_grpc.HEADERS for f in frames), "a stream over the limit was answered"
    probe = (("x-probe", "added-by-a-refused-call"), ("grpc-timeout", "never"))
    encoder = hpack.Encoder()  # a new connection, a new header table
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(h2_grpc.PREFACE + frame(h2_grpc.SETTINGS, 0, 0)
                     + frame(h2_grpc.HEADERS, h2_grpc.END_HEADERS, 1, request_headers(encoder, port, extra=probe))
                     + frame(h2_grpc.DATA, h2_grpc.END_STREAM, 1, b"\x00\x00\x00\x00\x01x"))
        block = request_headers(encoder, port, extra=probe[:1])
        assert len(block) < 12  # every field a reference into the table, x-probe's included
        sock.sendall(frame(h2_grpc.HEADERS, h2_grpc.END_HEADERS, 3, block)
                     + frame(h2_grpc.DATA, h2_grpc.END_STREAM, 3, b"\x00\x00\x00\x00\x05hello"))
        statuses, data = {}, b""
        while len(statuses) < 2:
            kind, flags, stream_id, payload = read_frame(sock) or (None, 0, 0, b"")
            assert kind is not None and kind != h2_grpc.GOAWAY, payload
            if kind == h2_grpc.DATA and stream_id == 3:
                data += payload
            elif kind == h2_grpc.HEADERS:
                fields = dict(decoder.decode(payload))
                if "grpc-status" in fields:
                    statuses[stream_id] = fields["grpc-status"]
        assert statuses == {1: str(grpc.StatusCode.INVALID_ARGUMENT.value[0]), 3: "0"}
        assert data == b"\x00\x00\x00\x00\x05hello"


def test_another_http2_implementation_is_understood(served: Any, tmp_path: Any) -> None:
    """curl's HTTP/2 (nghttp2: its own HPACK encoder, Huffman-coded strings) as the client,
    so the server is not only ever tested against grpcio's framing."""
    curl = shutil.which("curl")
    if curl is None or "HTTP2" not in subprocess.run([curl, "-V"], capture_output=True, text=True).stdout:
        pytest.skip("no curl with HTTP/2 here")
    _, port, _ = served
    message = b"from nghttp2 " * 500
    body = tmp_path / "request.bin"
    body.write_bytes(b"\x00" + len(message).to_bytes(4, "big") + message)
    out = subprocess.run([curl, "-s", "--http2-prior-knowledge", "-X", "POST", "-H", "content-type: application/grpc",
                          "-H", "te: trailers", "-H", "x-custom-header: a value curl Huffman-codes",
                          "--data-binary", f"@{body}", "-o", str(tmp_path / "reply.bin"), "-w", "%{http_version} %{http_code}",
                          f"http://127.0.0.1:{port}/t.Test/Echo"], capture_output=True, text=True, timeout=30)
    assert out.stdout == "2 200", out
    assert (tmp_path / "reply.bin").read_bytes() == body.read_bytes()
    for extra, status in ((["-H", "content-type: text/plain"], "415"), (["-X", "PUT"], "405")):
        # not gRPC at all: an HTTP status, as grpcio answers
        out = subprocess.run([curl, "-s", "--http2-prior-knowledge", "-X", "POST", "-H", "content-type: application/grpc",
                              *extra, "--data-binary", f"@{body}", "-o", "/dev/null", "-w", "%{http_code}",
                              f"http://127.0.0.1:{port}/t.Test/Echo"], capture_output=True, text=True, timeout=30)
        assert out.stdout == status, (extra, out)


def test_a_call_reset_during_drain_does_not_hold_the_drain(served: Any) -> None:
    """The client resets its only call while the server drains and keeps the connection
    open: the drain ends then, not after its grace."""
    server, port, methods = served
    encoder = hpack.Encoder()
    block = encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", "/t.Test/Sleep"),
                            (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc")])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(h2_grpc.PREFACE + frame(h2_grpc.SETTINGS, 0, 0)
                     + frame(h2_grpc.HEADERS, h2_grpc.END_HEADERS, 1, block)
                     + frame(h2_grpc.DATA, h2_grpc.END_STREAM, 1, b"\x00\x00\x00\x00\x0260"))
        assert methods.started.wait(10)
        stopper = threading.Thread(target=server.stop, args=(60,))
        started = time.monotonic()
        stopper.start()
        while (f := read_frame(sock)) is not None and f[0] != h2_grpc.GOAWAY:
            pass  # the drain has begun
        sock.sendall(frame(h2_grpc.RST_STREAM, 0, 1, (8).to_bytes(4, "big")))  # CANCEL, connection kept open
        stopper.join(30)
        assert not stopper.is_alive() and time.monotonic() - started < 20, "the drain waited out its grace"
        assert methods.cancelled.wait(10)


# -- other clients: grpc-js, nghttp2's h2load, grpcio's keepalive -------------------------------
GRPC_JS_CACHE = Path(os.environ.get("EDGE_GRPC_JS_DIR", Path.home() / ".cache" / "edge-appliance" / "grpc-js"))


def grpc_js_modules() -> Path:
    """Where @grpc/grpc-js is installed (scripts/test.sh installs it there, outside the tree;
    installed here the same way when missing). Skips only without node and npm."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are needed for the grpc-js client (Debian: apt-get install nodejs npm)")
    modules = GRPC_JS_CACHE / "node_modules"
    if not (modules / "@grpc" / "grpc-js").is_dir():
        GRPC_JS_CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(GRPC_JS_CACHE), GRPC_JS_PACKAGE],
                       check=True, capture_output=True, timeout=scaled(600))
    return modules


GRPC_JS_PACKAGE = "@grpc/grpc-js@^1.14"  # scripts/test.sh installs the same


@pytest.mark.timeout(900)  # npm's 600 s on the first run, then the calls
def test_grpc_js_client(served: Any) -> None:
    """Node's gRPC (its HTTP/2 is Node's nghttp2): sizes over every window, 200 concurrent
    calls, status and trailers, a deadline, gzip."""
    modules = grpc_js_modules()
    _, port, _ = served
    out = subprocess.run(["node", str(Path(__file__).resolve().parents[1] / "support" / "grpc_js_client.js"), str(port)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "NODE_PATH": str(modules)})
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["small"] and result["big"] and result["gzip"], result
    assert result["concurrent"] == 200, result
    assert result["fail"] == {"code": grpc.StatusCode.FAILED_PRECONDITION.value[0], "details": MESSAGE,
                              "retryAfter": "7"}, result
    assert result["deadline"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], result


def test_nghttp2_h2load(served: Any, tmp_path: Path) -> None:
    """nghttp2's own load generator (Debian's nghttp2-client, installed by scripts/test.sh):
    4 connections, 32 streams in flight on each, every answer a 200 with the echoed body."""
    h2load = shutil.which("h2load")
    if h2load is None:
        pytest.skip("no h2load here (Debian: apt-get install nghttp2-client; scripts/test.sh installs it)")
    _, port, _ = served
    body = tmp_path / "request.bin"
    body.write_bytes(b"\x00" + (300).to_bytes(4, "big") + os.urandom(300))
    out = subprocess.run([h2load, "-n", "4000", "-c", "4", "-m", "32", "-H", "content-type: application/grpc",
                          "-H", "te: trailers", "-d", str(body), f"http://127.0.0.1:{port}/t.Test/Echo"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "4000 succeeded, 0 failed, 0 errored" in out.stdout, out.stdout[-3000:]
    assert "status codes: 4000 2xx" in out.stdout, out.stdout[-3000:]


def test_grpcio_keepalive_pings_keep_the_connection(served: Any) -> None:
    """grpcio pinging every 200 ms (keepalive, also between calls): answered, never taken
    for a flood, and the connection still serves calls."""
    server, port, _ = served
    options = [("grpc.keepalive_time_ms", 200), ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_pings_without_data", 0)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as ch:
        echo = ch.unary_unary("/t.Test/Echo")
        assert echo(b"first", timeout=10) == b"first"
        poll_until(lambda: server.stats.get("pings", 0) >= 10, 60, "ten keepalive pings")
        assert echo(b"still", timeout=10) == b"still"
        assert not server.stats.get("refused_connections")


def test_metadata_with_nul_cr_or_lf_is_refused(served: Any) -> None:
    """A value carrying CR LF never reaches a service's logs or answers: nghttp2 refuses the
    malformed request (RFC 9113 8.2.1: RST_STREAM PROTOCOL_ERROR), and calls.py would answer
    INVALID_ARGUMENT to whatever got past it. The connection serves on."""
    _, port, _ = served
    encoder, decoder = hpack.Encoder(), hpack.Decoder()
    block = request_headers(encoder, port, extra=(("x-note", "one\r\nx-injected: two"),))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(h2_grpc.PREFACE + frame(h2_grpc.SETTINGS, 0, 0) + frame(h2_grpc.HEADERS, h2_grpc.END_HEADERS, 1, block)
                     + frame(h2_grpc.DATA, h2_grpc.END_STREAM, 1, h2_grpc.message(b"hello")))
        frames = h2_grpc.stream_end(sock, 1)
        fields: dict[str, str] = {}
        for kind, _, stream_id, payload in frames:
            if kind == h2_grpc.HEADERS and stream_id == 1:
                fields.update(decoder.decode(payload))
        reset = [f[3] for f in frames if f[0] == h2_grpc.RST_STREAM and f[2] == 1]
        if reset:
            assert reset[0] == b"\x00\x00\x00\x01" and "grpc-status" not in fields
        else:
            assert fields["grpc-status"] == str(grpc.StatusCode.INVALID_ARGUMENT.value[0])
            assert "x-note" in fields["grpc-message"]
        fine = request_headers(encoder, port)
        sock.sendall(frame(h2_grpc.HEADERS, h2_grpc.END_HEADERS, 3, fine)
                     + frame(h2_grpc.DATA, h2_grpc.END_STREAM, 3, h2_grpc.message(b"hello")))
        frames = h2_grpc.stream_end(sock, 3)
        assert b"hello" in b"".join(f[3] for f in frames if f[0] == h2_grpc.DATA and f[2] == 3)


def test_our_settings_are_in_force(served: Any) -> None:
    """Once a client acknowledged our SETTINGS, a frame as large as the advertised
    SETTINGS_MAX_FRAME_SIZE is taken; and a header list over the advertised
    SETTINGS_MAX_HEADER_LIST_SIZE (yet under the frame guard's bound) is answered
    RESOURCE_EXHAUSTED, its fields decoded but never kept."""
    _, port, _ = served
    payload = os.urandom(h2_conn.MAX_FRAME - 5)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        encoder = hpack.Encoder()
        first = read_frame(sock)
        assert first is not None and first[0] == h2_grpc.SETTINGS
        sock.sendall(h2_grpc.PREFACE + h2_grpc.settings(INITIAL_WINDOW_SIZE=1 << 30) + frame(h2_grpc.SETTINGS, h2_grpc.ACK, 0)
                     + frame(h2_grpc.WINDOW_UPDATE, 0, 0, (1 << 30).to_bytes(4, "big"))  # the answer's room
                     + frame(h2_grpc.HEADERS, h2_grpc.END_HEADERS, 1, request_headers(encoder, port))
                     + frame(h2_grpc.DATA, 0, 1, h2_grpc.message(payload)[:5]))
        credit = 65535 - 5
        while credit < len(payload):  # the whole message's credit comes once its prefix is in
            kind, _, stream_id, body = read_frame(sock) or (None, 0, 0, b"")
            assert kind is not None and kind != h2_grpc.GOAWAY, body
            if kind == h2_grpc.WINDOW_UPDATE and stream_id == 1:
                credit += int.from_bytes(body, "big")
        sock.sendall(frame(h2_grpc.DATA, h2_grpc.END_STREAM, 1, payload))  # one frame of 1 MiB - 5
        data = b""
        while len(data) < len(payload) + 5:
            kind, _, stream_id, body = read_frame(sock) or (None, 0, 0, b"")
            assert kind is not None and kind != h2_grpc.GOAWAY, body
            data += body if kind == h2_grpc.DATA else b""
        assert data == h2_grpc.message(payload)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        big = request_headers(hpack.Encoder(), port, extra=(("x-big", "v" * (Limits().max_metadata_size + 1024)),))
        sock.sendall(h2_grpc.PREFACE + frame(h2_grpc.SETTINGS, 0, 0) + frame(h2_grpc.HEADERS, h2_grpc.END_HEADERS, 1, big))
        frames = h2_grpc.stream_end(sock, 1)
        fields = dict(hpack.Decoder().decode(b"".join(f[3] for f in frames if f[0] == h2_grpc.HEADERS)))
        assert fields.get("grpc-status") == str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]), frames
        assert "SETTINGS_MAX_HEADER_LIST_SIZE" in fields["grpc-message"]


def test_window_updates_a_client_owes_or_usually_sends_are_never_taken_for_a_flood(served: Any) -> None:
    """grpc-core grows the window of every open stream at once as its bandwidth estimate moves,
    and acknowledges what it read. 100 calls running (Sleep), each stream's window grown three
    times before any answer: 300 WINDOW_UPDATEs, over the connection's control-frame burst
    (limits.py CONTROL_BURST), with no answer of ours waiting. Then every answer acknowledged.
    None of it is a flood: no GOAWAY (grpcio's own client got "too many WINDOW_UPDATE frames"
    with 250 calls on one connection under load)."""
    _, port, _ = served
    encoder = hpack.Encoder()
    ids = [2 * i + 1 for i in range(MAX_STREAMS)]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(h2_grpc.PREFACE + frame(h2_grpc.SETTINGS, 0, 0) + b"".join(
            frame(h2_grpc.HEADERS, h2_grpc.END_HEADERS, sid, request_headers(encoder, port, "/t.Test/Sleep"))
            + frame(h2_grpc.DATA, h2_grpc.END_STREAM, sid, h2_grpc.message(b"1")) for sid in ids))
        grown = b"".join(frame(h2_grpc.WINDOW_UPDATE, 0, sid, (65535).to_bytes(4, "big")) for sid in ids)
        frames = h2_grpc.frames_until_ping(sock, grown * 3)
        assert h2_grpc.goaway_code(frames) is None
        for sid in ids:
            if not any(f[2] == sid and f[0] == h2_grpc.HEADERS and f[1] & h2_grpc.END_STREAM for f in frames):
                frames += h2_grpc.stream_end(sock, sid)
        data = [f for f in frames if f[0] == h2_grpc.DATA]
        assert len(data) == MAX_STREAMS and h2_grpc.goaway_code(frames) is None
        acks = b"".join(frame(h2_grpc.WINDOW_UPDATE, 0, 0, len(p).to_bytes(4, "big")) for _, _, _, p in data)
        assert h2_grpc.goaway_code(h2_grpc.frames_until_ping(sock, acks * 2)) is None
