"""Raw HTTP/2 for tests that must send what no well-behaved client sends (RFC 9113 frames
written by hand, HPACK through the ``hpack`` library): tests/transport/test_h2_grpc.py and
tests/transport/test_grpc_hostile.py. Loopback only."""

from __future__ import annotations

import socket
import struct

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
# error codes (RFC 9113 section 7)
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0, 1, 3, 6, 7, 8
ENHANCE_YOUR_CALM = 0xB
# settings (RFC 9113 section 6.5.2)
INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE, MAX_CONCURRENT_STREAMS = 0x4, 0x5, 0x6, 0x3


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


class LinearHuffman:
    """HPACK's Huffman code (RFC 7541 5.2), byte for byte what ``hpack``'s own ``HuffmanEncoder``
    writes, in linear time: that one shifts one big integer per input byte, quadratic, and a
    0.9 MB header value took its test (test_grpc_hostile's oversized header block) 270 s of CPU
    at load 10. ``encoder()`` is an ``hpack.Encoder`` that codes with this one."""

    def __init__(self) -> None:
        from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

        self.codes = [format(code, f"0{bits}b") for code, bits in zip(REQUEST_CODES, REQUEST_CODES_LENGTH)]

    def encode(self, data: bytes | None) -> bytes:
        if not data:
            return b""
        bits = "".join([self.codes[byte] for byte in data])
        bits += "1" * (-len(bits) % 8)  # padded with the EOS code's leading ones
        return int(bits, 2).to_bytes(len(bits) // 8, "big")


def encoder() -> hpack.Encoder:
    """An ``hpack.Encoder`` whose Huffman coding takes linear time (``LinearHuffman``)."""
    made = hpack.Encoder()
    made.huffman_coder = LinearHuffman()  # type: ignore[assignment]
    return made


def settings(**values: int) -> bytes:
    """A SETTINGS frame: settings(INITIAL_WINDOW_SIZE=0) by the names above."""
    codes = {"INITIAL_WINDOW_SIZE": INITIAL_WINDOW_SIZE, "MAX_FRAME_SIZE": MAX_FRAME_SIZE,
             "MAX_HEADER_LIST_SIZE": MAX_HEADER_LIST_SIZE, "MAX_CONCURRENT_STREAMS": MAX_CONCURRENT_STREAMS}
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", codes[k], v) for k, v in values.items()))


def read_frame(sock: socket.socket) -> tuple[int, int, int, bytes] | None:
    """The next frame (type, flags, stream, payload); None once the server closed the connection."""
    head = _read(sock, 9)
    if head is None:
        return None
    length = int.from_bytes(head[:3], "big")
    payload = _read(sock, length) if length else b""
    if payload is None:
        return None
    return head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF, payload


def _read(sock: socket.socket, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        try:
            chunk = sock.recv(n - len(out))
        except (ConnectionResetError, BrokenPipeError):
            return None
        if not chunk:
            return None
        out += chunk
    return out


def request_headers(encoder: hpack.Encoder, port: int, path: str = "/t.Test/Echo",
                    extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    return encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                           (":authority", f"127.0.0.1:{port}"), ("content-type", "application/grpc"),
                           ("te", "trailers"), *extra])


def message(payload: bytes, compressed: bool = False) -> bytes:
    """One length-prefixed gRPC message."""
    return bytes((int(compressed),)) + len(payload).to_bytes(4, "big") + payload


def goaway_code(frames: list[tuple[int, int, int, bytes]]) -> int | None:
    """The error code of the first GOAWAY among ``frames``, None if there is none."""
    for kind, _, _, payload in frames:
        if kind == GOAWAY:
            return int.from_bytes(payload[4:8], "big")
    return None


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """sendall, False once the server has closed the connection (what a flood ends in)."""
    try:
        sock.sendall(data)
        return True
    except (BrokenPipeError, ConnectionResetError):
        return False


def frames_until_closed(sock: socket.socket, stop: int | None = None) -> list[tuple[int, int, int, bytes]]:
    """Every frame until the server closes the connection (or a frame of type ``stop``)."""
    frames = []
    while (f := read_frame(sock)) is not None:
        frames.append(f)
        if f[0] == stop:
            break
    return frames


def frames_until_ping(sock: socket.socket, data: bytes = b"") -> list[tuple[int, int, int, bytes]]:
    """Send ``data`` and a PING, then return every frame until a second PING's acknowledgement
    (or until the server closes the connection): by then every frame the server sent while it
    processed ``data`` has arrived (servers send PING answers ahead of what they had queued,
    but in the same write). Answers of calls still running may come later."""
    frames: list[tuple[int, int, int, bytes]] = []
    for marker, before in ((b"syncone1", data), (b"synctwo2", b"")):
        sock.sendall(before + frame(PING, 0, 0, marker))
        while (f := read_frame(sock)) is not None:
            if f[0] == PING and f[1] & ACK and f[3] in (b"syncone1", b"synctwo2"):
                if f[3] == marker:
                    break
                continue
            frames.append(f)
        else:
            break
    return frames


def stream_end(sock: socket.socket, stream_id: int) -> list[tuple[int, int, int, bytes]]:
    """Every frame until ``stream_id`` ends (RST_STREAM, or HEADERS with END_STREAM) or the
    server closes the connection."""
    frames = []
    while (f := read_frame(sock)) is not None:
        frames.append(f)
        if f[2] == stream_id and (f[0] == RST_STREAM or (f[0] == HEADERS and f[1] & END_STREAM)):
            break
    return frames
