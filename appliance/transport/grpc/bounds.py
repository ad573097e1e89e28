"""The bounds a hostile or broken client meets on one gRPC connection, per connection and per
peer address: the server's sweep (the handshake deadline, a socket that takes nothing, streams
that move no byte, answers left without flow-control credit) and the budgets of client resets
and control frames (limits.py; peers.py for the address's). Part of connection.py's
``Connection`` (it inherits ``Bounds``), kept apart as the policing it is.

A request or answer that moves no byte for ``stall_timeout_s`` is reset and freed; an answer
with no credit to go out for ``send_stall_timeout_s`` sooner, counted against its address as
an abandoned call. Client resets are rate-limited per connection and over the whole server
(limits.py), and control frames and abandoned streams per peer address over all its
connections (peers.py: the ``guard``), so an attacker that reconnects before a connection's
budget runs out still meets one; a connection refused for it is closed at once, and what it
had sent but we had not read is dropped by the kernel, not processed.

Thread-safety: everything here runs on the server's event loop thread.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from appliance.transport.grpc import nghttp2 as ng

if TYPE_CHECKING:
    from appliance.transport.grpc.admission import Stream
    from appliance.transport.grpc.limits import Limits, TokenBucket
    from appliance.transport.grpc.peers import Guard
    from appliance.transport.grpc.server_side import ServerSide
    from appliance.transport.grpc.session import Session

log = logging.getLogger("appliance.grpc")

# A stream's window grown while its call runs: grpc-core's BDP probing sends a WINDOW_UPDATE for
# every open stream at once when its estimate moves. The first few a stream are free.
STREAM_UPDATES_FREE = 8


class Bounds:
    """The sweep and the budgets of one connection (connection.py ``Connection`` sets the
    attributes below, defines the methods declared under TYPE_CHECKING and inherits these)."""

    server: ServerSide
    limits: Limits
    session: Session | None
    streams: dict[int, Stream]
    guard: Guard | None  # its peer address's budgets, over all its connections (peers.py)
    resets: TokenBucket  # client resets on this connection
    control: TokenBucket  # PING, SETTINGS and WINDOW_UPDATE frames for nothing on this connection
    updates_due: int  # WINDOW_UPDATE frames our own DATA has earned
    peer: str
    opened: float
    paused_since: float
    handshaken: bool
    paused: bool
    failed: bool

    if TYPE_CHECKING:  # connection.py's
        def reset(self, stream: Stream, code: int) -> None: ...
        def fail(self, code: int, message: str) -> None: ...
        def close_now(self) -> None: ...
        def abort(self) -> None: ...

    # -- budgets (nghttp2's events, session.Events) -----------------------------------------
    def on_client_reset(self, stream_id: int) -> None:
        """RST_STREAM from the client: its stream's call is cancelled (on_stream_closed);
        past the reset budgets, the connection ends."""
        if self.failed:
            return
        if not self.resets.take():
            self.fail(ng.ENHANCE_YOUR_CALM, "too many streams reset by the client (rapid reset)")
        elif not self.server.resets.take():
            self.server.count("reset_budget_refusals")
            self.fail(ng.ENHANCE_YOUR_CALM, "too many streams reset by clients on this server (rapid reset)")
        elif self.guard is not None and (reason := self.guard.abandoned()):
            self.over_budget(reason)

    def on_window_update(self, stream_id: int) -> None:
        """Credit a client gives is free where it is owed or usual: a stream's first few
        (its window grown while the call runs), and one a DATA frame of ours earned (read and
        acknowledged). Beyond those, credit with no answer of ours waiting for it is a control
        frame for nothing."""
        stream = self.streams.get(stream_id) if stream_id else None
        if stream is not None and stream.updates < STREAM_UPDATES_FREE:
            stream.updates += 1
        elif self.updates_due > 0:
            self.updates_due -= 1
        elif not any(stream.pending is not None for stream in self.streams.values()):
            self.control_frame("WINDOW_UPDATE")

    def control_frame(self, what: str, peer: bool = True) -> None:
        """Against the connection's budget, then (``peer``) its peer address's (peers.py)."""
        if not self.control.take():
            self.fail(ng.ENHANCE_YOUR_CALM, f"too many {what} frames")
        elif peer and self.guard is not None and not self.failed and (reason := self.guard.control_frame()):
            self.over_budget(reason)

    def over_budget(self, reason: str) -> None:
        """Its peer address is past a budget (peers.py): GOAWAY ENHANCE_YOUR_CALM, closed."""
        self.server.count("peer_budget_refusals")
        self.fail(ng.ENHANCE_YOUR_CALM, reason)

    # -- housekeeping (the server's sweep, once a second) -----------------------------------
    def sweep(self, now: float) -> None:
        limits = self.limits
        if not self.handshaken and now - self.opened > limits.handshake_timeout_s:
            log.info("gRPC connection from %s closed: no HTTP/2 preface and SETTINGS within %g s",
                     self.peer, limits.handshake_timeout_s)
            self.close_now()
            return
        if self.paused and now - self.paused_since > limits.stall_timeout_s:
            log.info("gRPC connection from %s closed: it has read nothing for %g s", self.peer,
                     limits.stall_timeout_s)
            self.server.count("stalled_connections")
            self.abort()
            return
        for stream in list(self.streams.values()):
            # a request held back for the worker's bytes (admit) is waiting for us, not stalled
            moving = stream.pending is not None or (not stream.dispatched and (stream.admitted or stream.need is None)) \
                or (stream.streaming is not None and stream.streaming.moving(stream))
            if moving and now - stream.last > limits.stall_timeout_s:
                self.reset(stream, ng.CANCEL)
                self.server.count("stalled_streams")
            elif stream.pending is not None and now - stream.last > limits.send_stall_timeout_s \
                    and self.session is not None and self.session.stream_window(stream.id) <= 0:
                self.send_stalled(stream)
                if self.failed:
                    return

    def send_stalled(self, stream: Stream) -> None:
        """Its answer has waited ``send_stall_timeout_s`` for credit the client never gave (a
        zero-window stall): reset and freed, and counted against its address as a call
        abandoned (peers.py), so a client that stalls every answer is refused at the accept."""
        self.reset(stream, ng.CANCEL)
        self.server.count("send_stalled_streams")
        if self.guard is not None and (reason := self.guard.abandoned()):
            self.over_budget(f"{reason} (answers left without flow-control credit)")
