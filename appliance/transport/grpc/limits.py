"""What the gRPC server bounds against hostile or broken clients, and the two small tools it
bounds them with: a token bucket (floods and rapid reset) and a look at frame headers before h2
parses them (header blocks larger than advertised, frames larger than allowed).

The values come from ``[grpc]`` (appliance/core/config.py ``GRPCConfig``, documented there and
in systemd/appliance.toml); the rates below are the ones mature HTTP/2 stacks chose after the
2019 flood advisories and the 2023 rapid-reset attack, and are not configured.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass

from appliance.transport.http.server import FD_RESERVE

MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Per server. ``max_connection_buffer_bytes`` and ``max_buffer_bytes`` bound the bytes a
    connection, and all of them together, hold for calls: request messages handed to methods
    and answers not yet taken by the client (its window closed, or its socket not read)."""

    max_concurrent_streams: int = 100  # SETTINGS_MAX_CONCURRENT_STREAMS (grpc.max_concurrent_streams)
    max_metadata_size: int = 16 * 1024  # SETTINGS_MAX_HEADER_LIST_SIZE (grpc.max_metadata_size)
    max_connections: int = 1024  # open at once; at the cap the one idle longest makes room
    handshake_timeout_s: float = 10.0  # preface and SETTINGS within this of the accept
    stall_timeout_s: float = 30.0  # a request or answer that moves no byte this long is reset
    max_connection_buffer_bytes: int = 96 * MIB
    max_buffer_bytes: int = 512 * MIB


# Rapid reset (CVE-2023-44487): streams the client opens and resets itself cost us work and
# send nothing back. nghttp2's answer: a bucket of 1000 resets refilled at 33 a second, then
# GOAWAY ENHANCE_YOUR_CALM. A client that cancels now and then never comes near it.
RESET_BURST, RESET_RATE = 1000, 33.0
# PING and SETTINGS frames each make us send an acknowledgement (the 2019 flood advisories,
# CVE-2019-9512/9515). grpcio's keepalive and BDP pings are a few a second at most, and a ping
# that comes with calls earns its token back (as gRPC's own servers reset their ping strikes
# when data flows), so only a flood drains the bucket.
CONTROL_BURST, CONTROL_RATE = 200, 10.0


class TokenBucket:
    """``take()`` is False once more than ``burst`` were taken faster than ``rate`` a second."""

    __slots__ = ("tokens", "burst", "rate", "last")

    def __init__(self, burst: int, rate: float):
        self.tokens, self.burst, self.rate = float(burst), float(burst), rate
        self.last = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def give(self) -> None:
        self.tokens = min(self.burst, self.tokens + 1)


HEADERS, CONTINUATION, END_HEADERS = 0x1, 0x9, 0x4
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
PROTOCOL_ERROR, FRAME_SIZE_ERROR, ENHANCE_YOUR_CALM = 0x1, 0x6, 0xB
# Huffman codes are at most 30 bits for a byte: a header list within the advertised size is at
# most 3.75 times as long encoded, so nothing a conforming client sends is refused here.
HUFFMAN_GROWTH = 4


class FrameGuard:
    """Reads only the 9-byte frame headers of what arrives, before h2 does.

    Why: h2 checks a frame's length only once the whole frame is buffered, and joins a header
    block's frames (up to 64 CONTINUATIONs) before hpack decodes it; hpack checks the header
    list's size only after each field is decoded. A 1 MB Huffman-coded field would be buffered
    and decoded first. Here a frame over ``max_frame`` and a header block over
    ``HUFFMAN_GROWTH`` x ``max_header_list`` are refused as soon as their headers arrive, and
    a connection that does not start with the preface is refused here too (h2 raises before
    it can queue a GOAWAY for that). ``feed`` returns (HTTP/2 error code, problem), or None;
    it keeps the few bytes of a header split across reads."""

    __slots__ = ("max_frame", "max_block", "skip", "partial", "block", "preface")

    def __init__(self, max_frame: int, max_header_list: int):
        self.max_frame, self.max_block = max_frame, HUFFMAN_GROWTH * max_header_list
        self.skip = len(PREFACE)  # bytes still to pass before the next frame header
        self.partial = b""
        self.block = 0  # bytes of the header block under way
        self.preface: bytes | None = b""  # as much of it as has arrived

    def feed(self, data: bytes) -> tuple[int, str] | None:
        n, pos = len(data), self.skip
        if self.preface is not None:
            self.preface += bytes(data[:len(PREFACE) - len(self.preface)])
            if not PREFACE.startswith(self.preface):
                return PROTOCOL_ERROR, "not an HTTP/2 connection preface"
            if len(self.preface) == len(PREFACE):
                self.preface = None
        while pos < n:
            if self.partial or n - pos < 9:
                take = 9 - len(self.partial)
                self.partial += bytes(data[pos:pos + take])
                pos = min(n, pos + take)
                if len(self.partial) < 9:
                    break
                head, at = self.partial, 0
                self.partial = b""
            else:
                head, at = data, pos
                pos += 9
            length = int.from_bytes(head[at:at + 3], "big")
            if length > self.max_frame:
                return FRAME_SIZE_ERROR, f"a frame of {length} bytes, over the {self.max_frame} advertised"
            if head[at + 3] in (HEADERS, CONTINUATION):
                self.block += length
                if self.block > self.max_block:
                    return ENHANCE_YOUR_CALM, f"a header block of {self.block} bytes or more, over {self.max_block}"
                if head[at + 4] & END_HEADERS:
                    self.block = 0
            pos += length
        self.skip = pos - n
        return None


def connection_share(wanted: int, rest_connections: int) -> int:
    """``wanted``, or what the descriptor limit leaves after REST's connections and FD_RESERVE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = max(16, soft - rest_connections - FD_RESERVE)
    if room < wanted:
        logging.getLogger("appliance.grpc").warning("grpc.max_connections = %d, but the descriptor limit is %d and REST may hold %d: "
                    "at most %d gRPC connections", wanted, soft, rest_connections, room)
    return min(wanted, room)
