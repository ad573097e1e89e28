"""Budgets per peer address, over every connection a peer opens to this process (issue 47,
items 3 and 4): what a per-connection bound misses when the client reconnects just before it.

Two budgets per address (the host, never the port: a reconnect keeps the host):

- **control frames** it makes us answer or read for nothing: PING, SETTINGS, and WINDOW_UPDATE
  while none of its answers is being sent. A call answered gives four back (as the
  per-connection bucket does, limits.py), so grpcio's BDP and keepalive pings with calls
  never drain it;
- **abandoned streams**: streams it resets itself, streams still open (a call running or
  an answer not read) when it closes the connection: "send 100 calls, close, again", and
  streams whose answers it never takes (no flow-control credit for ``send_stall_timeout_s``:
  zero-window stalls, bounds.py ``sweep``).

And a cap, not a budget: the streams a peer address may hold **open at once** on this process
(``stream_cap``: an eighth of ``Limits.max_open_streams``, at least one connection's
SETTINGS_MAX_CONCURRENT_STREAMS). Past it a new stream is refused (REFUSED_STREAM, which
clients retry), so one address that never reads its answers cannot take the server-wide
``max_open_streams`` from everyone else (gRPC probes from another address were refused 28 of
29 times during a zero-window attack before it).

Past either, the peer is *refused*: its connection is closed with GOAWAY ENHANCE_YOUR_CALM at
the frame that passed the budget, and every new connection from it is closed as soon as it
is accepted, before a byte of it is read (no TLS, no HTTP/2 session made for it), until the
budget has refilled. What a
refused peer keeps sending costs an accept and a close. A peer's debt is counted below zero
(down to minus the burst), so an attacker that sends a burst at once stays refused for as long
as the burst takes to refill, not one token's time. Other peers are not touched.

Behind NAT or a proxy many clients share one address: the rates are far above what well-
behaved clients send (a few pings a second and an occasional cancel each), so it takes many
clients misbehaving together behind one address to be refused. The table is bounded
(``MAX_PEERS``): past it the peer seen longest ago with no connection open is forgotten.

Thread-safety: the server's event loop only (one table per process: each front worker counts
its own connections).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from appliance.transport.grpc.limits import ANSWER_EARNS, TokenBucket

log = logging.getLogger("appliance.grpc")

# Control frames per peer address, all its connections: 5x the per-connection burst (limits.py
# CONTROL_BURST), refilled at 5x its rate. A flood of 190 PINGs a connection, reconnecting,
# meets it within a few connections.
PEER_CONTROL_BURST, PEER_CONTROL_RATE = 1000, 50.0
# Streams abandoned per peer address: two connections' worth of 100 concurrent calls left
# behind, then one every 50 ms. A client whose calls time out cancels far fewer.
PEER_ABANDON_BURST, PEER_ABANDON_RATE = 256, 20.0
MAX_PEERS = 4096


class Budget(TokenBucket):
    """A token bucket whose tokens may go into debt (down to ``-burst``): ``charge`` always
    counts; ``short`` says whether the bucket is below one token."""

    __slots__ = ()

    def charge(self, n: int = 1) -> bool:
        """Take ``n``; False when the bucket was short of them (the peer is over its budget)."""
        self._refill()
        enough = self.tokens >= n
        self.tokens = max(-self.burst, self.tokens - n)
        return enough

    def short(self) -> bool:
        self._refill()
        return self.tokens < 1

    def full(self) -> bool:
        self._refill()
        return self.tokens >= self.burst


# The share of ``Limits.max_open_streams`` one peer address may hold open at once.
PEER_STREAM_SHARE = 8


def stream_cap(max_open_streams: int, max_concurrent_streams: int) -> int:
    """Streams one peer address may hold open at once on this process."""
    return max(max_concurrent_streams, max_open_streams // PEER_STREAM_SHARE)


class Peer:
    __slots__ = ("control", "abandoned", "connections", "refusals", "streams")

    def __init__(self) -> None:
        self.control = Budget(PEER_CONTROL_BURST, PEER_CONTROL_RATE)
        self.abandoned = Budget(PEER_ABANDON_BURST, PEER_ABANDON_RATE)
        self.connections = 0  # open now, on this process
        self.refusals = 0  # connections refused at their start, in all
        self.streams = 0  # open now, on all its connections

    def refused(self) -> str:
        """Why a new connection from this peer is refused now; "" when it is not."""
        if self.control.short():
            return (f"too many control frames (PING, SETTINGS, WINDOW_UPDATE) from this address "
                    f"(more than {PEER_CONTROL_BURST} at once, {PEER_CONTROL_RATE:g} a second)")
        if self.abandoned.short():
            return (f"too many calls abandoned (reset, or left open at close) from this address "
                    f"(more than {PEER_ABANDON_BURST} at once, {PEER_ABANDON_RATE:g} a second)")
        return ""


class Guard:
    """One connection's face on its peer's budgets (connection.py, bounds.py). Each method returns why
    the connection must end now ("" when it need not); the connection then fails with GOAWAY
    ENHANCE_YOUR_CALM."""

    __slots__ = ("peer", "counted")

    def __init__(self, peer: Peer):
        self.peer, self.counted = peer, True
        peer.connections += 1

    def control_frame(self) -> str:
        if self.peer.control.charge():
            return ""
        return self.peer.refused() or "too many control frames from this address"

    def answered(self) -> None:
        """A call answered earns its control frames back (limits.py ANSWER_EARNS)."""
        self.peer.control.give(ANSWER_EARNS)

    def abandoned(self, streams: int = 1) -> str:
        """``streams`` reset by the client, or left open when it closed the connection."""
        if not streams or self.peer.abandoned.charge(streams):
            return ""
        return self.peer.refused() or "too many calls abandoned from this address"

    def stream_opened(self, cap: int) -> bool:
        """A new stream from this peer: False (not counted) when it holds ``cap`` open already."""
        if self.peer.streams >= cap:
            return False
        self.peer.streams += 1
        return True

    def stream_closed(self) -> None:
        self.peer.streams -= 1

    def closed(self) -> None:
        if self.counted:
            self.counted = False
            self.peer.connections -= 1


class Peers:
    """The budgets of every peer address this process has heard from lately."""

    def __init__(self, max_peers: int = MAX_PEERS):
        self.table: OrderedDict[str, Peer] = OrderedDict()
        self.max_peers = max_peers

    def of(self, host: str) -> Peer:
        """The peer at ``host`` (made on first sight; the table stays within ``max_peers``)."""
        peer = self.table.get(host)
        if peer is None:
            peer = self.table[host] = Peer()
            if len(self.table) > self.max_peers:
                self._forget()
        else:
            self.table.move_to_end(host)
        return peer

    def _forget(self) -> None:
        """Forget the peer seen longest ago with no open connection and a full budget, else
        the one seen longest ago with none open (its debt is lost: bounded memory comes first)."""
        idle = [host for host, p in self.table.items() if not p.connections]
        for host in idle:
            peer = self.table[host]
            if peer.control.full() and peer.abandoned.full():
                del self.table[host]
                return
        if idle:
            del self.table[idle[0]]

    def refuse(self, peername: object) -> str:
        """Why a connection just accepted from ``peername`` must be closed unread ("" when
        it may go on). Called at the accept, before anything is made for it: what a refused
        peer keeps sending costs an accept and a close."""
        peer = self.of(host_of(peername))
        reason = peer.refused()
        if reason:
            peer.refusals += 1
            if not peer.refusals & (peer.refusals - 1):  # 1, 2, 4, 8...: logged ever more rarely
                log.info("gRPC connection from %s refused (%d so far): %s", host_of(peername), peer.refusals, reason)
        return reason

    def guard(self, peername: object) -> Guard:
        """The budgets' guard for a connection from ``peername`` (a socket's peer name)."""
        return Guard(self.of(host_of(peername)))


def host_of(peername: object) -> str:
    """The address part of a socket's peer name ("" for a Unix socket's peer, which is the
    local host: its budget is shared by every local client)."""
    if isinstance(peername, tuple) and peername:
        return str(peername[0])
    return ""
