"""A lean closed-loop gRPC unary load generator: raw HTTP/2 over asyncio streams.

    python bench/h2load.py --port P --path /pkg.Service/Method --message-file F [-c 8] [--duration 5]

The gRPC twin of bench/loadgen.py. ``--message-file`` holds an already-serialized protobuf
request. Each of ``c`` clients holds one HTTP/2 connection and makes sequential unary calls
on it (stream ids 1, 3, 5, ...), sending the same pre-built HEADERS+DATA bytes with only the
stream id patched in. Replies are only framed, never HPACK-decoded: a call is OK when its
stream carried a non-empty message and then trailers; a trailers-only reply (how gRPC sends
errors) counts as "grpc-error". grpc.aio spends several times more client CPU per call than
this, and on a 2-core machine that CPU is taken from the server being measured; like
loadgen.py it reports its own CPU next to every figure. Targets must be loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.loadgen import check_loopback, closed_loop  # noqa: E402

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
WINDOW = 2**31 - 1  # the largest window HTTP/2 allows: the server never waits for us
REFILL = WINDOW // 2  # received DATA bytes after which the connection window is topped up again
MAX_FRAME = 16384  # the default SETTINGS_MAX_FRAME_SIZE, which every peer must accept
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0, 1, 3, 4, 6, 7, 8
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
_HEAD = struct.Struct(">IBI")  # (24-bit length << 8 | type), flags, stream id: the 9-byte frame header
_U32 = struct.Struct(">I")
_deadline = getattr(asyncio, "timeout", None)  # 3.11+; on 3.10 each read is bounded instead


class GoAway(Exception):
    """The server is closing the connection: count it and reconnect."""


def _frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return _HEAD.pack(len(payload) << 8 | ftype, flags, sid) + payload


def _hpack_str(s: bytes) -> bytes:
    # String literal without Huffman: 7-bit prefix integer length (RFC 7541 5.1), then the octets.
    n, out = len(s), bytearray()
    if n < 127:
        out.append(n)
    else:
        out.append(127)
        n -= 127
        while n >= 128:
            out.append(n & 0x7F | 0x80)
            n >>= 7
        out.append(n)
    return bytes(out) + s


def _hpack(headers: list[tuple[bytes, bytes]]) -> bytes:
    # "Literal header field without indexing, new name" (0x00): no table state on either side.
    return b"".join(b"\x00" + _hpack_str(k) + _hpack_str(v) for k, v in headers)


def build_request(host: str, port: int, path: str, message: bytes) -> tuple[bytearray, list[int]]:
    """HEADERS + DATA frames for one call, and the offsets of their stream ids to patch per call.

    Our send window is not tracked: the message must fit the server's stream window (64 KiB
    unless it advertises more), and the server's WINDOW_UPDATEs keep its connection window open."""
    block = _hpack([(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
                    (b":authority", f"{host}:{port}".encode()), (b"content-type", b"application/grpc"),
                    (b"te", b"trailers")])
    body = b"\x00" + _U32.pack(len(message)) + message  # gRPC framing: uncompressed flag, length
    frames = [_frame(HEADERS, END_HEADERS, 0, block)]
    for i in range(0, len(body), MAX_FRAME):
        frames.append(_frame(DATA, END_STREAM if i + MAX_FRAME >= len(body) else 0, 0, body[i:i + MAX_FRAME]))
    offsets, at = [], 0
    for f in frames:
        offsets.append(at + 5)
        at += len(f)
    return bytearray(b"".join(frames)), offsets


async def _client(host: str, port: int, path: str, message: bytes, stop: float, record: list[float],
                  errors: dict[str, int], measure_from: float) -> None:
    request, offsets = build_request(host, port, path, message)
    reader = writer = None
    sid = received = 0
    buf, pos = b"", 0
    while time.perf_counter() < stop:
        try:
            if writer is None or sid >= WINDOW - 2:  # stream ids are 31-bit: start over before they run out
                if writer is not None:
                    writer.close()
                reader, writer = await asyncio.open_connection(host, port)
                writer.write(PREFACE + _frame(SETTINGS, 0, 0, struct.pack(">HIHI", 2, 0, 4, WINDOW))
                             + _frame(WINDOW_UPDATE, 0, 0, _U32.pack(WINDOW - 65535)))  # connection window to the max
                sid, received, buf, pos = -1, 0, b"", 0
            sid += 2
            for off in offsets:
                _U32.pack_into(request, off, sid)
            started = time.perf_counter()
            writer.write(request)  # the transport copies what it cannot send now, so patching is safe
            got, outcome = 0, None
            async with _deadline(30) if _deadline else contextlib.nullcontext():
                while outcome is None:
                    while len(buf) - pos >= 9 and outcome is None:
                        head, flags, fsid = _HEAD.unpack_from(buf, pos)
                        end = pos + 9 + (head >> 8)
                        if end > len(buf):
                            break
                        ftype = head & 0xFF
                        if ftype == DATA:
                            received += head >> 8
                            if received > REFILL:  # connection-level flow control; stream windows never run low
                                writer.write(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(received)))
                                received = 0
                            if fsid == sid:
                                got += head >> 8
                        elif ftype == HEADERS and fsid == sid and flags & END_STREAM:
                            # trailers-only is how gRPC reports errors; > 5 bytes: a message, not just its prefix
                            outcome = "ok" if got > 5 else "empty-message" if got else "grpc-error"
                        elif ftype == RST_STREAM and fsid == sid:
                            outcome = "RST_STREAM"
                        elif ftype == SETTINGS and not flags & ACK:
                            writer.write(_frame(SETTINGS, ACK, 0))
                        elif ftype == PING and not flags & ACK:
                            writer.write(_frame(PING, ACK, 0, buf[pos + 9:end]))
                        elif ftype == GOAWAY:
                            raise GoAway()
                        # CONTINUATION, WINDOW_UPDATE and the rest: nothing to do (we never decode HPACK)
                        pos = end
                    if outcome is None:
                        read = reader.read(262144)
                        chunk = await (read if _deadline else asyncio.wait_for(read, 30))
                        if not chunk:
                            raise ConnectionResetError("server closed the connection")
                        buf, pos = buf[pos:] + chunk, 0
            if started >= measure_from:
                if outcome == "ok":
                    record.append(time.perf_counter() - started)
                else:
                    errors[outcome] = errors.get(outcome, 0) + 1
        except (OSError, GoAway, asyncio.TimeoutError) as exc:
            if time.perf_counter() >= measure_from:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            if writer is not None:
                writer.close()
            writer = None
            await asyncio.sleep(0.01)
    if writer is not None:
        writer.close()


async def run(host: str, port: int, path: str, message: bytes, concurrency: int, duration: float,
              warmup: float) -> dict:
    """One closed-loop run; only calls started after ``warmup`` s count, for ``duration`` s."""
    check_loopback(host)
    return await closed_loop(lambda stop, record, errors, measure_from: _client(
        host, port, path, message, stop, record, errors, measure_from), concurrency, duration, warmup)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--path", required=True, help="/package.Service/Method")
    ap.add_argument("--message-file", required=True, help="a serialized protobuf request")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--warmup", type=float, default=2.0)
    a = ap.parse_args(argv)
    message = Path(a.message_file).read_bytes()
    print(json.dumps(asyncio.run(run(a.host, a.port, a.path, message, a.concurrency, a.duration, a.warmup))))


if __name__ == "__main__":
    main()
