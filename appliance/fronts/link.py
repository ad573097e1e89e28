"""A front worker's conversation with the serving process, on the worker's event loop.

Requests with one reply (``call``, awaited on any loop), requests whose replies stream
(``open``, from a thread: replies arrive on a queue; ``open_here``, on the loop: an
``asyncio.Queue``), messages with no reply (``send``, any
thread), and pushes (the serving view, a new config, drain), handed to ``on_push``. The channel itself (appliance/transport/channel.py's ``ChannelProtocol``) is
made by the worker on its loop and given to ``attach``; its callbacks are ``on_message``
and ``on_lost``. Messages are the structs of appliance/fronts/messages.py: a request
carries its ``id``, its replies the same. When the serving process goes away, every waiter
fails with Unavailable and ``on_push`` hears ``Eof()``.

A reply awaited on the loop costs no thread hand-off: the channel's protocol resolves the
request's future in the loop that awaits it.

Thread-safety: as above; the waiters' table is touched on the loop only, except ``open``'s
registration, which happens there too (through ``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from typing import Callable, Protocol

import msgspec

from appliance.fronts import messages as m
from appliance.core.errors import Unavailable

log = logging.getLogger("appliance.front")

Reply = m.Reply
Request = m.Request
GONE = "the serving process is gone (restarting); retry"


class Channel(Protocol):
    """What ``Link`` needs of its channel: appliance/transport/channel.py ``ChannelProtocol``."""

    def send(self, message: msgspec.Struct) -> None: ...

    def send_threadsafe(self, message: msgspec.Struct) -> None: ...


def _gone(ident: int) -> m.Failed:
    return m.failed(ident, Unavailable(GONE))


class Link:
    def __init__(self, on_push: Callable[[m.Push], None]):
        self.on_push = on_push
        self.loop: asyncio.AbstractEventLoop | None = None
        self.channel: Channel | None = None
        self.gone = False
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Reply] | queue.SimpleQueue[Reply] | asyncio.Queue[Reply]] = {}
        self._attached = threading.Event()
        self.heard_at = -1e9  # when the serving process's last message arrived (monotonic; ``heard_within``)

    def attach(self, loop: asyncio.AbstractEventLoop, channel: Channel) -> None:
        """(loop) The channel is open: calls may go."""
        self.loop, self.channel = loop, channel
        self._attached.set()

    # -- the serving process's side of the conversation (loop) ------------------------------
    def on_message(self, _channel: object, message: m.ToWorker) -> None:
        self.heard_at = time.monotonic()
        try:
            if not isinstance(message, m.REPLIES):
                self.on_push(message)
                return
            ident = message.id
            waiter = self._waiting.get(ident)
            if isinstance(waiter, asyncio.Future):
                del self._waiting[ident]
                if not waiter.done():
                    waiter.set_result(message)
            elif waiter is not None:
                if isinstance(message, m.LAST_REPLIES):
                    del self._waiting[ident]
                if isinstance(waiter, asyncio.Queue):
                    waiter.put_nowait(message)
                else:
                    waiter.put(message)
        except Exception:  # one bad message must not end the conversation
            log.exception("front worker: a %s message failed", type(message).__name__)

    def on_lost(self, _channel: object) -> None:
        self.gone = True
        waiting, self._waiting = self._waiting, {}
        for ident, waiter in waiting.items():
            if isinstance(waiter, asyncio.Future):
                if not waiter.done():
                    waiter.set_result(_gone(ident))
            elif isinstance(waiter, asyncio.Queue):
                waiter.put_nowait(_gone(ident))
            else:
                waiter.put(_gone(ident))
        self.on_push(m.Eof())

    def heard_within(self, seconds: float) -> bool:
        """(the loop) Whether the serving process sent anything in the last ``seconds``: its
        front loop turned then (what it sends leaves at the end of a turn of that loop)."""
        return not self.gone and time.monotonic() - self.heard_at < seconds

    # -- requests ----------------------------------------------------------------------------
    def next_id(self) -> int:
        """(any thread) The id of a new request."""
        return next(self._ids)

    async def call(self, request: Request) -> Reply:
        """Send a request (made with ``next_id()``) and await its one reply. On the link's loop
        without a hand-off; on another loop through the link's."""
        if self.loop is not None and asyncio.get_running_loop() is not self.loop:
            try:
                return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._call(request), self.loop))
            except RuntimeError:  # the link's loop is closed: the worker is stopping
                return _gone(request.id)
        return await self._call(request)

    async def _call(self, request: Request) -> Reply:
        if self.gone or self.channel is None:
            return _gone(request.id)
        assert self.loop is not None
        future: asyncio.Future[Reply] = self.loop.create_future()
        self._waiting[request.id] = future
        self.channel.send(request)
        try:
            return await future
        except asyncio.CancelledError:  # the caller's client went away: the serving process stops the work
            if self._waiting.pop(request.id, None) is not None and not self.gone and self.channel is not None:
                self.channel.send(m.Cancel(request.id))
            raise

    def open(self, request: Request) -> queue.SimpleQueue[Reply]:
        """(any thread but the loop's) Send a request whose replies stream: the queue they
        arrive on."""
        replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        ident = request.id
        if self.gone or not self._attached.wait(30) or self.loop is None:
            replies.put(_gone(ident))
            return replies

        def register() -> None:
            if self.gone or self.channel is None:
                replies.put(_gone(ident))
                return
            self._waiting[ident] = replies
            self.channel.send(request)
        try:
            self.loop.call_soon_threadsafe(register)
        except RuntimeError:
            replies.put(_gone(ident))
        return replies

    def open_here(self, request: Request) -> "asyncio.Queue[Reply]":
        """(the link's loop) Send a request whose replies stream: the queue they arrive on,
        awaited on the loop (no thread waits for them)."""
        replies: asyncio.Queue[Reply] = asyncio.Queue()
        if self.gone or self.channel is None:
            replies.put_nowait(_gone(request.id))
            return replies
        self._waiting[request.id] = replies
        self.channel.send(request)
        return replies

    def close_stream(self, ident: int) -> None:
        """(any thread) Stop listening for a stream's replies and tell the serving process."""
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._waiting.pop, ident, None)
            except RuntimeError:
                return
        self.send(m.Cancel(ident))

    def soon(self, fn: Callable[[], None]) -> None:
        """(any thread) ``fn()`` on the link's loop, after what runs there now (once the channel
        is attached; dropped before)."""
        loop = self.loop
        if loop is None:
            return
        if self._on_loop():
            loop.call_soon(fn)
        else:
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:  # the loop closed: the worker is stopping
                pass

    def send(self, message: m.Observe | m.Stats | m.Cancel) -> None:
        """(any thread) A message with no reply (observations, stats, a stream's end)."""
        channel = self.channel
        if self.gone or channel is None:
            return
        if self._on_loop():
            channel.send(message)
        else:
            channel.send_threadsafe(message)

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False
