"""Receiving flow control and the bytes a gRPC connection holds for calls: which waiting
stream gets credit, and the account every bound on memory reads. Part of connection.py's
``Connection`` (it inherits ``Admission``), kept apart as the accounting it is; the stream's
state (``Stream``) lives here with it.

Flow control, receiving: a new stream may send the initial window (64 KiB); once its
message's length prefix is in, the stream is *admitted* (oldest first) while the messages
admitted on the connection fit a budget (the largest message + ``CONNECTION_WINDOW``) and
the held bytes below allow, and gets credit for its whole message at once (a stream that
does not fit waits without credit; the server looks at it again as held bytes fall). The
oldest waiting stream is always admitted when none is and the worker holds nothing, so
requests that together exceed the budgets take turns. The connection window is given back
as bytes arrive (connection.py): the streams' credit is what bounds memory.

Held bytes (``Limits.max_connection_buffer_bytes``, ``max_buffer_bytes``): a request from
its admission (its bytes arriving) until its method returns (its decoded form lives that
long), plus answers not yet written: everything a connection keeps for calls, in one account
that ``held_bytes`` shows. Admission waits on it; an answer, or a gzip request (the largest
message until inflated), that would pass either bound is answered RESOURCE_EXHAUSTED
(connection.py).

Thread-safety: everything here runs on the server's event loop thread.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Sequence

from appliance.transport.grpc.calls import OK_TRAILERS

if TYPE_CHECKING:
    from appliance.transport.grpc import streams
    from appliance.transport.grpc.limits import Limits
    from appliance.transport.grpc.server_side import ServerSide
    from appliance.transport.grpc.session import Session

STREAM_WINDOW = 65535  # the initial stream window, which we leave as it is
CONNECTION_WINDOW = 16 << 20
GRANT_SLACK = 16384  # over a message's own size: room for padding


class Stream:
    __slots__ = ("id", "headers", "header_bytes", "body", "granted", "need", "admitted", "dispatched",
                 "answered", "message_bytes", "pending", "trailers", "task", "timer", "last", "streaming", "updates")

    def __init__(self, stream_id: int):
        self.id = stream_id
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_bytes = 0
        self.body = bytearray()
        self.granted = STREAM_WINDOW  # the credit it has had in all
        self.need: int | None = None  # its message's size with the prefix, once the prefix is in
        self.admitted = self.dispatched = self.answered = False  # answered: headers submitted
        self.message_bytes = 0  # its request message, held while the method runs
        self.pending: memoryview | None = None  # the answer's bytes not yet handed to nghttp2
        self.trailers: Sequence[tuple[bytes, bytes]] = OK_TRAILERS
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.last = time.monotonic()  # when a byte of it last moved
        self.streaming: streams.StreamCall | None = None  # a bidirectional-streaming call's messages
        self.updates = 0  # WINDOW_UPDATEs the client sent for it (STREAM_UPDATES_FREE of them are free)


class Admission:
    """Admission and the held-bytes account of one connection (connection.py ``Connection``
    sets the attributes below and inherits the methods)."""

    server: ServerSide
    limits: Limits
    session: Session | None
    streams: dict[int, Stream]
    held: int  # requests admitted until their methods return + answers not yet written
    committed: int  # the sizes of the admitted requests still arriving
    waiting: int  # streams whose size is known, not admitted yet

    # -- receiving -------------------------------------------------------------------------
    def admit(self) -> None:
        """Admit waiting streams, oldest first, while their messages fit the budget (always
        one when none is admitted), giving each credit for its whole message."""
        budget = self.server.max_receive + 5 + CONNECTION_WINDOW
        for stream in self.streams.values():
            if not self.waiting:
                return
            if stream.admitted or stream.need is None or stream.need < 0 or stream.dispatched:
                continue
            if self.committed and self.committed + stream.need > budget:
                continue
            if not self.room_for(stream.need):  # credit withheld until the worker holds less (readmit)
                self.server.held_back = True
                continue
            stream.admitted = True
            self.waiting -= 1
            self.committed += stream.need
            self.hold(stream.need)  # what it sends is held from now: the worker's bytes count it
            if stream.need > stream.granted:
                increment = stream.need + GRANT_SLACK - stream.granted
                assert self.session is not None
                self.session.grant(stream.id, increment)
                stream.granted += increment

    def release(self, stream: Stream) -> None:
        """A stream's request leaves the connection's accounts (handed to its call, answered
        or reset): its bytes and its admission; waiting streams may be admitted now."""
        need = stream.need
        if need == -1:
            return  # released already
        stream.body = bytearray()
        stream.need = -1  # accounted for, before admit() looks at the streams again
        if stream.admitted:
            stream.admitted = False
            self.committed -= need or 0
            self.hold(-(need or 0))
            self.admit()
        elif need is not None and need >= 0:
            self.waiting -= 1

    # -- held bytes ------------------------------------------------------------------------
    def may_hold(self, size: int) -> bool:
        limits = self.limits
        return (self.held + size <= limits.max_connection_buffer_bytes
                and self.server.held + size <= limits.max_buffer_bytes)

    def full_message(self) -> str:
        return (f"this connection holds {self.held} bytes of calls and unread answers, all connections "
                f"{self.server.held} ([grpc] max_connection_buffer_bytes = {self.limits.max_connection_buffer_bytes}, "
                f"max_buffer_bytes = {self.limits.max_buffer_bytes}): read the answers, or retry later")

    def room_for(self, size: int) -> bool:
        """Whether a request of ``size`` may be sent to us now: it fits what this connection
        and the worker may hold; when the worker holds nothing, one always may (requests
        larger than the budget take turns)."""
        return self.server.held == 0 or self.may_hold(size)

    def hold(self, size: int) -> None:
        self.held += size
        self.server.held += size
        if size < 0 and self.server.held_back:
            self.server.readmit_soon()  # streams held back for the worker's bytes may be admitted now

    def unhold_message(self, stream: Stream) -> None:
        if stream.message_bytes:
            self.hold(-stream.message_bytes)
            stream.message_bytes = 0
