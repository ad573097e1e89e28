"""What the gRPC server bounds against hostile or broken clients, and the token bucket it
bounds floods and rapid reset with. Frame sizes, CONTINUATION floods, the size of a header
field and the connection preface are libnghttp2's to check (appliance/transport/grpc/
nghttp2.py); what it allows is bounded here and in bounds.py.

The values come from ``[grpc]`` (appliance/core/config.py ``GRPCConfig``, documented there and
in systemd/appliance.toml); the rates below are the ones mature HTTP/2 stacks chose after the
2019 flood advisories and the 2023 rapid-reset attack, and are not configured.
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.transport.http.sockets import FD_RESERVE

if TYPE_CHECKING:
    from typing import Protocol

    class GrpcBounds(Protocol):
        """What ``grpc_limits`` reads of the ``[grpc]`` table (core's GRPCConfig; transport may
        not import core)."""

        @property
        def max_concurrent_streams(self) -> int: ...
        @property
        def max_metadata_size(self) -> int: ...
        @property
        def max_connections(self) -> int: ...
        @property
        def handshake_timeout_s(self) -> float: ...
        @property
        def stall_timeout_s(self) -> float: ...
        @property
        def send_stall_timeout_s(self) -> float: ...
        @property
        def max_connection_buffer_bytes(self) -> int: ...
        @property
        def max_buffer_bytes(self) -> int: ...
        @property
        def max_open_streams(self) -> int: ...

log = logging.getLogger("appliance.grpc")

MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Per server. ``max_connection_buffer_bytes`` and ``max_buffer_bytes`` bound the bytes a
    connection, and all of them together, hold for calls: requests from the credit given for
    them until their methods return, and answers not yet taken by the client (its window
    closed, or its socket not read)."""

    max_concurrent_streams: int = 100  # SETTINGS_MAX_CONCURRENT_STREAMS (grpc.max_concurrent_streams)
    max_metadata_size: int = 16 * 1024  # SETTINGS_MAX_HEADER_LIST_SIZE (grpc.max_metadata_size)
    max_connections: int = 1024  # open at once; at the cap the one idle longest makes room
    handshake_timeout_s: float = 10.0  # preface and SETTINGS within this of the accept
    stall_timeout_s: float = 30.0  # a request or answer that moves no byte this long is reset
    # An answer the client gives no flow-control credit for (its window at 0: zero-window
    # stalls) this long is reset, and counted against its address as an abandoned call
    # (peers.py). A slow reader that grants credit now and then moves bytes and is never hit.
    send_stall_timeout_s: float = 5.0  # ([grpc] send_stall_timeout_s)
    max_connection_buffer_bytes: int = 96 * MIB
    max_buffer_bytes: int = 512 * MIB
    # Streams open on every connection together: what a client that never reads its answers
    # (zero windows) or never finishes its requests can make us keep, whatever the number of
    # connections it opens. Past it a new stream is refused (REFUSED_STREAM: clients retry).
    max_open_streams: int = 4096


# Rapid reset (CVE-2023-44487): streams the client opens and resets itself cost us work and
# send nothing back. nghttp2's answer: a bucket of 1000 resets refilled at 33 a second, then
# GOAWAY ENHANCE_YOUR_CALM. A client that cancels now and then never comes near it.
RESET_BURST, RESET_RATE = 1000, 33.0
# ... and the same attack from a client that reconnects before a connection's bucket is empty
# (900 resets a connection, then a new one): one bucket for the whole server. Once it is empty
# every connection that resets a stream is closed at its first reset, and what it had sent
# and we had not read is dropped unprocessed, so the attack's backlog costs nothing after it
# ends. Cancellations of well-behaved clients (a few a second at most) never empty it.
SERVER_RESET_BURST, SERVER_RESET_RATE = 2000, 200.0
# PING and SETTINGS frames each make us send an acknowledgement (the 2019 flood advisories,
# CVE-2019-9512/9515). grpcio's keepalive and BDP pings are a few a second at most, and a ping
# that comes with calls earns its token back (as gRPC's own servers reset their ping strikes
# when data flows), so only a flood drains the bucket.
CONTROL_BURST, CONTROL_RATE = 200, 10.0
# What an answered call earns back: the frames a client may send for it (grpcio: a BDP ping,
# and WINDOW_UPDATEs for the stream and the connection after the answer's DATA, when no
# other answer is left to send and so they count as control frames).
ANSWER_EARNS = 4


class TokenBucket:
    """``take()`` is False once more than ``burst`` were taken faster than ``rate`` a second."""

    __slots__ = ("tokens", "burst", "rate", "last")

    def __init__(self, burst: int, rate: float):
        self.tokens, self.burst, self.rate = float(burst), float(burst), rate
        self.last = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now

    def take(self) -> bool:
        self._refill()
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def give(self, n: int = 1) -> None:
        self.tokens = min(self.burst, self.tokens + n)


def connection_share(wanted: int, rest_connections: int) -> int:
    """``wanted``, or what the descriptor limit leaves after REST's connections and FD_RESERVE."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = max(16, soft - rest_connections - FD_RESERVE)
    if room < wanted:
        log.warning("grpc.max_connections = %d, but the descriptor limit is %d and REST may hold %d: "
                    "at most %d gRPC connections", wanted, soft, rest_connections, room)
    return min(wanted, room)


def grpc_limits(cfg: GrpcBounds, rest_connections: int) -> Limits:
    """The transport's bounds from ``[grpc]`` (one process's share of them, for a front worker)."""
    return Limits(max_concurrent_streams=cfg.max_concurrent_streams, max_metadata_size=cfg.max_metadata_size,
                  max_connections=connection_share(cfg.max_connections, rest_connections),
                  handshake_timeout_s=cfg.handshake_timeout_s, stall_timeout_s=cfg.stall_timeout_s,
                  send_stall_timeout_s=cfg.send_stall_timeout_s,
                  max_connection_buffer_bytes=cfg.max_connection_buffer_bytes, max_buffer_bytes=cfg.max_buffer_bytes,
                  max_open_streams=cfg.max_open_streams)
