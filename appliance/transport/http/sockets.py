"""The HTTP server's sockets: listening (alone, or beside other processes on one port with
SO_REUSEPORT), how many connections the descriptor limit allows, and dropping new handshakes
during a drain. Apart from server.py (the server's loop, queue and deadlines) so each file
reads as one job; appliance/fronts/pool.py binds the workers' sockets with these."""

from __future__ import annotations

import ctypes
import logging
import resource
import socket
import struct
import sys

log = logging.getLogger("appliance.http")

FD_RESERVE = 256  # descriptors kept free of HTTP connections: the gRPC port, the state db, model files
SO_ATTACH_FILTER = getattr(socket, "SO_ATTACH_FILTER", 26)
# Classic BPF on the listening socket, run on TCP headers: drop a segment whose flags are SYN
# without ACK (a new handshake), accept everything else (handshakes under way).
_DROP_SYN = [(0x30, 0, 0, 13), (0x54, 0, 0, 0x12), (0x15, 0, 1, 0x02), (0x06, 0, 0, 0), (0x06, 0, 0, 0xFFFFFFFF)]


def listen(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The listening socket of ``host:port`` (a deep accept queue: bursts wait in the kernel).
    ``reuse_port``: one of several processes' sockets on the port, the kernel spreading new
    connections over them (SO_REUSEPORT; the port is held by ``reserve_port``)."""
    return socket.create_server((host, port), family=_family(host), backlog=1024, reuse_port=reuse_port)


def reserve_port(host: str, port: int) -> socket.socket:
    """Hold ``host:port`` for processes that will ``listen(..., reuse_port=True)`` on it: bound
    (so a busy port fails here, and port 0 gets its number), never listening, so the kernel
    gives it no connections. Only processes of this user can join the port, and a port
    where any socket listens (another service's workers among them) is refused first."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:  # EADDRINUSE if anyone listens there,
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # however it joined the port
        probe.bind((host, port))
        port = probe.getsockname()[1]
    return bound_beside(host, port)


def bound_beside(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` beside the port's other SO_REUSEPORT sockets, not listening."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def connection_cap(wanted: int) -> int:
    """``wanted``, or fewer when the descriptor limit is lower (raised to its hard limit first)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard and (hard == resource.RLIM_INFINITY or soft < wanted + 2 * FD_RESERVE):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    room = max(16, soft - 2 * FD_RESERVE) if soft != resource.RLIM_INFINITY else wanted
    if room < wanted:
        log.warning("limits.max_connections = %d, but the descriptor limit is %d: at most %d HTTP connections",
                    wanted, soft, room)
    return min(wanted, room)


def refuse_new_handshakes(sock: socket.socket) -> bool:
    """Drop new SYNs arriving at listener ``sock`` (Linux); False where unsupported."""
    if not sys.platform.startswith("linux") or sock.fileno() < 0 or sock.family == socket.AF_UNIX:
        return False  # (a Unix socket has no SYNs: its listener closes after what is queued is accepted)
    code = b"".join(struct.pack("HBBI", *insn) for insn in _DROP_SYN)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = struct.pack("HL", len(_DROP_SYN), ctypes.addressof(buf))
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, prog)
        return True
    except OSError as exc:
        log.info("cannot filter new connections during the drain (%s); closing the listener directly", exc)
        return False


__all__ = ["FD_RESERVE", "bound_beside", "connection_cap", "listen", "refuse_new_handshakes", "reserve_port"]
