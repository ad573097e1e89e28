"""appliance/transport/grpc/session.py alone: libnghttp2's callbacks turned into ``Events`` calls,
driven by a real HTTP/2 client (python-hyper's h2, the test extra's) in memory, no socket and no
connection logic. What a gRPC call's bytes become (a stream, its header fields within the
limit, its DATA, its end), what the peer's control frames become (SETTINGS, PING, RST_STREAM,
GOAWAY), and an answer's HEADERS, DATA and trailers pulled through ``read_answer``."""

from __future__ import annotations

from typing import Any

import pytest

h2_config = pytest.importorskip("h2.config")
h2_connection = pytest.importorskip("h2.connection")
h2_events = pytest.importorskip("h2.events")

from appliance.transport.grpc import nghttp2 as ng  # noqa: E402
from appliance.transport.grpc.session import Session, SessionError  # noqa: E402

REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/pkg.Svc/Call"), (b":authority", b"x"),
           (b"content-type", b"application/grpc"), (b"te", b"trailers")]


@pytest.fixture(autouse=True)
def libnghttp2() -> None:
    try:
        ng.load()
    except ng.Missing as exc:
        pytest.skip(f"no libnghttp2: {exc}")


class Recorder:
    """``Events`` that records each call, and answers from ``answers`` (stream id -> bytes)."""

    def __init__(self) -> None:
        self.failed = False
        self.calls: list[tuple[Any, ...]] = []
        self.fields: dict[int, list[tuple[bytes, bytes]]] = {}
        self.answers: dict[int, bytes] = {}
        self.session: Session | None = None

    def on_stream(self, stream_id: int) -> list[tuple[bytes, bytes]] | None:
        self.calls.append(("stream", stream_id))
        return self.fields.setdefault(stream_id, [])

    def on_data(self, stream_id: int, data: Any, length: int) -> None:
        assert self.session is not None
        self.calls.append(("data", stream_id, bytes(self.session.ffi.buffer(data, length))))

    def on_headers(self, stream_id: int, end_stream: bool, size: int) -> None:
        self.calls.append(("headers", stream_id, end_stream, size))

    def on_request_end(self, stream_id: int) -> None:
        self.calls.append(("end", stream_id))

    def on_client_reset(self, stream_id: int) -> None:
        self.calls.append(("reset", stream_id))

    def on_settings(self) -> None:
        self.calls.append(("settings",))

    def on_ping(self) -> None:
        self.calls.append(("ping",))

    def on_goaway(self) -> None:
        self.calls.append(("goaway",))

    def on_window_update(self, stream_id: int) -> None:
        self.calls.append(("window_update",))

    def on_stream_closed(self, stream_id: int) -> None:
        self.calls.append(("closed", stream_id))

    def read_answer(self, stream_id: int, buf: Any, length: int) -> tuple[int, bool]:
        assert self.session is not None
        data = self.answers.pop(stream_id)
        n = min(length, len(data))
        self.session.ffi.memmove(buf, data[:n], n)
        if n < len(data):
            self.answers[stream_id] = data[n:]
            return n, False
        self.session.trailers(stream_id, [(b"grpc-status", b"0")])
        return n, True


def pair(header_limit: int = 16384) -> tuple[Recorder, Session, Any]:
    events = Recorder()
    session = Session(events, {ng.SETTINGS_MAX_CONCURRENT_STREAMS: 100}, 1 << 20, 1000, 100.0, header_limit)
    events.session = session
    client = h2_connection.H2Connection(h2_config.H2Configuration(client_side=True, header_encoding=None))
    client.initiate_connection()
    session.feed(client.data_to_send())
    client.receive_data(session.output())  # the server's SETTINGS, and its ACK of ours
    session.feed(client.data_to_send())  # our ACK of its SETTINGS
    return events, session, client


def test_a_call_becomes_a_stream_its_fields_its_data_and_its_end() -> None:
    events, session, client = pair()
    try:
        client.send_headers(1, REQUEST)
        client.send_data(1, b"\x00\x00\x00\x00\x03abc", end_stream=True)
        session.feed(client.data_to_send())
        calls = [c for c in events.calls if c[0] != "settings"]
        assert [c[0] for c in calls] == ["stream", "headers", "data", "end"], calls
        assert calls[1][:3] == ("headers", 1, False) and calls[1][3] == sum(len(n) + len(v) + 32 for n, v in REQUEST)
        assert calls[2] == ("data", 1, b"\x00\x00\x00\x00\x03abc")
        assert events.fields[1] == REQUEST
        assert ("settings",) in events.calls  # the client's SETTINGS (not its ACK)
    finally:
        session.close()


def test_fields_past_the_header_limit_are_dropped_but_counted() -> None:
    limit = sum(len(n) + len(v) + 32 for n, v in REQUEST)  # counted as SETTINGS_MAX_HEADER_LIST_SIZE counts
    events, session, client = pair(header_limit=limit)
    try:
        client.send_headers(1, [*REQUEST, (b"x-big", b"v" * 300)], end_stream=True)
        session.feed(client.data_to_send())
        (headers,) = [c for c in events.calls if c[0] == "headers"]
        assert headers[2] is True and headers[3] == limit + 5 + 300 + 32  # the whole size, for the connection to refuse
        assert (b"x-big", b"v" * 300) not in events.fields[1] and events.fields[1] == REQUEST
    finally:
        session.close()


def test_an_answer_goes_out_as_headers_data_and_trailers() -> None:
    events, session, client = pair()
    try:
        client.send_headers(1, REQUEST, end_stream=True)
        session.feed(client.data_to_send())
        events.answers[1] = b"\x00\x00\x00\x00\x02ok"
        session.respond(1, [(b":status", b"200"), (b"content-type", b"application/grpc")], with_body=True)
        got = client.receive_data(session.output())
        kinds = [type(e).__name__ for e in got]
        assert kinds[:3] == ["ResponseReceived", "DataReceived", "TrailersReceived"], kinds
        assert got[1].data == b"\x00\x00\x00\x00\x02ok" and (b"grpc-status", b"0") in got[2].headers
        assert ("closed", 1) in events.calls
    finally:
        session.close()


def test_the_peers_control_frames_reach_the_connection() -> None:
    events, session, client = pair()
    try:
        client.send_headers(1, REQUEST)
        client.ping(b"12345678")
        client.reset_stream(1)
        session.feed(client.data_to_send())
        assert [c for c in events.calls if c[0] in ("ping", "reset")] == [("ping",), ("reset", 1)]
        assert session.wants_write()  # the PING's ACK waits in output
        acks = client.receive_data(session.output())
        assert any(isinstance(e, h2_events.PingAckReceived) for e in acks)
        client.close_connection()
        session.feed(client.data_to_send())
        assert events.calls[-1] == ("goaway",)
    finally:
        session.close()


def test_bytes_that_are_not_http2_are_refused_and_close_is_idempotent() -> None:
    events = Recorder()
    session = Session(events, {}, 1 << 20, 1000, 100.0, 16384)
    events.session = session
    with pytest.raises(SessionError):
        session.feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    session.close()
    session.close()
    assert not session.open and session.output() == b"" and not session.wants_io()
    session.feed(b"anything")  # a closed session ignores what still arrives
