"""Zero-window stalls against the lean gRPC server (issue 47: recovery within 2 s of the
attack's end; it took 6.1 s, and gRPC probes from another address were refused during it).

A client that sets SETTINGS_INITIAL_WINDOW_SIZE 0 and never grants credit holds every answer
it asks for. What must hold, on a server in this process:

- its answers are reset at ``send_stall_timeout_s`` (not at ``stall_timeout_s``, which is
  set far beyond the test's waits here), freed, and charged to its address as abandoned calls,
  so an address that stalls more than the abandon budget is sent GOAWAY and refused;
- a slow reader that grants credit a little at a time gets its whole answer, however long
  that takes past the deadline;
- one address holds at most its share of the server's open streams (peers.py
  ``stream_cap``): a client at another address is still answered;
- the deadline is ``[grpc] send_stall_timeout_s``, read from the config file into the lean
  server's ``Limits``; a bad value is refused at load, naming the key.

Attackers connect from their own loopback addresses; every socket and the server are closed.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from pathlib import Path
from typing import Iterator

import grpc
import hpack
import pytest

from appliance.core.config_file import load
from appliance.core.errors import ConfigError
from appliance.transport.grpc.h2_server import LeanServer
from appliance.transport.grpc.limits import Limits, grpc_limits
from appliance.transport.grpc.peers import PEER_ABANDON_BURST, stream_cap
from tests.support import h2_wire as w
from tests.support.servers import poll_until

ANSWER = b"an answer the client must grant credit for"
_addresses = itertools.count(2)
_files = itertools.count()


def address() -> str:
    """A loopback address of its own for each attacker (the per-address budgets)."""
    n = next(_addresses)
    return f"127.1.{n // 254}.{n % 254 + 1}"


@contextlib.contextmanager
def serving(limits: Limits) -> Iterator[tuple[LeanServer, int]]:
    server = LeanServer(2, limits=limits)
    table = {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: ANSWER + request)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Test", table),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield server, port
    finally:
        server.stop(None)


class Reader(threading.Thread):
    """Every frame the server sends on ``sock``, until it closes the connection."""

    def __init__(self, sock: socket.socket):
        super().__init__(name="h2-reader", daemon=True)
        self.sock = sock
        self.frames: list[tuple[int, int, int, bytes]] = []
        self.start()

    def run(self) -> None:
        try:
            while (f := w.read_frame(self.sock)) is not None:
                self.frames.append(f)
        except OSError:
            pass

    def ended(self) -> set[int]:
        """Streams ended: RST_STREAM, or HEADERS with END_STREAM (the trailers)."""
        return {f[2] for f in list(self.frames)
                if f[0] == w.RST_STREAM or (f[0] == w.HEADERS and f[1] & w.END_STREAM)}

    def resets(self, code: int) -> set[int]:
        return {f[2] for f in list(self.frames) if f[0] == w.RST_STREAM and int.from_bytes(f[3], "big") == code}

    def goaway(self) -> int | None:
        return w.goaway_code(list(self.frames))


@contextlib.contextmanager
def stalling(port: int, source: str, calls: int, window: int = 0) -> Iterator[tuple[socket.socket, Reader, list[int]]]:
    """A connection from ``source`` with SETTINGS_INITIAL_WINDOW_SIZE ``window`` sending
    ``calls`` Echo calls; its socket, a reader of what the server sends, the streams."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    encoder = hpack.Encoder()
    streams = [2 * i + 1 for i in range(calls)]
    head = w.request_headers(encoder, port, "/t.Test/Echo")
    body = w.message(b"!")
    sock.sendall(w.PREFACE + w.settings(INITIAL_WINDOW_SIZE=window)
                 + b"".join(w.frame(w.HEADERS, w.END_HEADERS, s, head) + w.frame(w.DATA, w.END_STREAM, s, body)
                            for s in streams))
    reader = Reader(sock)
    try:
        yield sock, reader, streams
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        reader.join(10)


def test_answers_never_granted_credit_are_reset_at_the_send_stall_deadline() -> None:
    """One connection's 50 stalled answers end with RST_STREAM CANCEL at the send stall
    deadline and are freed; the server's accounts empty. Before, they waited for
    ``stall_timeout_s`` (600 s here)."""
    limits = Limits(stall_timeout_s=600, send_stall_timeout_s=1.0)
    with serving(limits) as (server, port), stalling(port, address(), 50) as (_, reader, streams):
        poll_until(lambda: reader.ended() >= set(streams), 30,
                   "every stalled answer to be reset (RST_STREAM) at the send stall deadline",
                   context=lambda: f"stats {server.stats}, held {server.buffered_bytes()}")
        assert reader.resets(w.CANCEL) == set(streams)
        poll_until(lambda: server.open_streams == 0 and server.buffered_bytes() == 0, 10,
                   "the server's open streams and held bytes to go back to 0")
        assert server.stats.get("send_stalled_streams") == len(streams)


def test_an_address_that_stalls_past_its_abandon_budget_is_refused() -> None:
    """Four connections of 100 stalled answers each (more than the address's abandon budget):
    GOAWAY ENHANCE_YOUR_CALM, and its next connection is closed at the accept."""
    source = address()
    limits = Limits(stall_timeout_s=600, send_stall_timeout_s=1.0)
    with serving(limits) as (server, port), contextlib.ExitStack() as stack:
        readers = [stack.enter_context(stalling(port, source, 100))[1] for _ in range(4)]
        assert 4 * 100 > PEER_ABANDON_BURST
        poll_until(lambda: any(r.goaway() == w.ENHANCE_YOUR_CALM for r in readers), 30,
                   "GOAWAY ENHANCE_YOUR_CALM once the address's stalled answers pass its budget",
                   context=lambda: f"stats {server.stats}")
        with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as sock:
            sock.sendall(w.PREFACE + w.settings())
            assert w.read_frame(sock) is None, "a refused address's new connection was served"
        assert server.stats.get("peer_refused_connections", 0) >= 1


def test_a_slow_reader_that_grants_credit_gets_its_whole_answer() -> None:
    """Stream window 1 byte, 1 more granted every 0.1 s: the answer (49 bytes with its prefix)
    takes about 5 s in all, over twice the send stall deadline, but bytes keep moving, so it
    is never reset."""
    limits = Limits(stall_timeout_s=600, send_stall_timeout_s=2.0)
    with serving(limits) as (server, port), stalling(port, address(), 1, window=1) as (sock, reader, streams):
        stop = threading.Event()

        def grant() -> None:
            while not stop.wait(0.1):
                with contextlib.suppress(OSError):
                    sock.sendall(w.frame(w.WINDOW_UPDATE, 0, streams[0], (1).to_bytes(4, "big")))
        granter = threading.Thread(target=grant, daemon=True)
        granter.start()
        try:
            poll_until(lambda: reader.ended() >= set(streams), 60, "the slow reader's answer to end")
        finally:
            stop.set()
            granter.join(10)
        data = b"".join(f[3] for f in reader.frames if f[0] == w.DATA)
        assert not reader.resets(w.CANCEL), f"a reader that granted credit was reset: {server.stats}"
        assert data[5:] == ANSWER + b"!"
        assert not server.stats.get("send_stalled_streams")


def test_one_address_holds_at_most_its_share_of_the_open_streams() -> None:
    """An address whose three connections hold 100 stalled calls each keeps ``stream_cap`` of
    them open (the rest REFUSED_STREAM); a client at another address is still answered. Before,
    it took the whole ``max_open_streams`` and every other client was refused."""
    limits = Limits(stall_timeout_s=600, send_stall_timeout_s=600, max_open_streams=200)
    cap = stream_cap(limits.max_open_streams, limits.max_concurrent_streams)
    assert cap < limits.max_open_streams
    with serving(limits) as (server, port), contextlib.ExitStack() as stack:
        source = address()
        held = [stack.enter_context(stalling(port, source, 100)) for _ in range(3)]
        poll_until(lambda: all(len({f[2] for f in r.frames if f[0] in (w.HEADERS, w.RST_STREAM)}) == len(s)
                               for _, r, s in held), 30, "every attacking stream answered or refused",
                   context=lambda: f"stats {server.stats}, open {server.open_streams}")
        assert server.open_streams == cap
        assert sum(len(r.resets(w.REFUSED_STREAM)) for _, r, _ in held) == 300 - cap
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert channel.unary_unary("/t.Test/Echo")(b"?", timeout=20) == ANSWER + b"?"


def limits_from_file(tmp_path: Path, grpc_table: str) -> Limits:
    """The lean server's bounds from a config file's ``[grpc]`` table, built as the service
    builds them (appliance/service/grpc_port.py, appliance/fronts/worker.py: ``grpc_limits``)."""
    path = tmp_path / f"appliance-{next(_files)}.toml"
    path.write_text("[grpc]\n" + grpc_table)
    return grpc_limits(load(str(path), {"state_dir": str(tmp_path / "state")}).grpc, 0)


def test_the_send_stall_key_sets_the_servers_deadline(tmp_path: Path) -> None:
    """``[grpc] send_stall_timeout_s = 1.0`` in the file: that server resets a zero-window
    reader's answers, while one configured with 600, whose reader has stalled since before,
    still holds every one of its answers (both ``stall_timeout_s = 600``)."""
    short = limits_from_file(tmp_path, "stall_timeout_s = 600.0\nsend_stall_timeout_s = 1.0\n")
    patient_limits = limits_from_file(tmp_path, "stall_timeout_s = 600.0\nsend_stall_timeout_s = 600.0\n")
    assert (short.send_stall_timeout_s, patient_limits.send_stall_timeout_s) == (1.0, 600.0)
    assert limits_from_file(tmp_path, "").send_stall_timeout_s == Limits().send_stall_timeout_s  # one default
    with serving(patient_limits) as (patient, patient_port), \
            stalling(patient_port, address(), 10) as (_, patient_reader, held):
        poll_until(lambda: patient.open_streams == len(held) and patient.buffered_bytes() > 0, 30,
                   "the 600 s server to hold its zero-window reader's answers",
                   context=lambda: f"stats {patient.stats}, open {patient.open_streams}")
        with serving(short) as (server, port), stalling(port, address(), 10) as (_, reader, streams):
            poll_until(lambda: reader.ended() >= set(streams), 30,
                       "the 1 s server to reset every stalled answer (RST_STREAM)",
                       context=lambda: f"stats {server.stats}, held {server.buffered_bytes()}")
            assert reader.resets(w.CANCEL) == set(streams)
            assert server.stats.get("send_stalled_streams") == len(streams)
        assert not patient_reader.ended(), f"the 600 s server reset a stalled answer: {patient.stats}"
        assert patient.open_streams == len(held) and not patient.stats.get("send_stalled_streams")


@pytest.mark.parametrize("value", ["0.0", "-1.0", "nan", '"5"'])
def test_a_bad_send_stall_timeout_is_refused_at_load_naming_the_key(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        limits_from_file(tmp_path, f"send_stall_timeout_s = {value}\n")
    assert info.value.key == "grpc.send_stall_timeout_s"
    assert "grpc.send_stall_timeout_s" in str(info.value)
