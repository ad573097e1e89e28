"""A front worker's conversation with the serving process, on the worker's event loop.

Requests with one reply (``call``, awaited on any loop), requests whose replies stream
(``open``, from a thread: replies arrive on a queue), messages with no reply (``send``, any
thread), and pushes (the serving view, a new config, drain), handed to ``on_push``. The channel itself (appliance/transport/channel.py's ``ChannelProtocol``) is
made by the worker on its loop and given to ``attach``; its callbacks are ``on_message``
and ``on_lost``. When the serving process goes away, every waiter fails with Unavailable
and ``on_push`` hears ``("eof", 0, None)``.

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
from typing import Any, Callable, Protocol

from appliance.fronts import messages as m
from appliance.core.errors import Unavailable

log = logging.getLogger("appliance.front")

Message = tuple[str, int, Any]
Reply = tuple[str, Any]
GONE = "the serving process is gone (restarting); retry"


class Channel(Protocol):
    """What ``Link`` needs of its channel: appliance/transport/channel.py ``ChannelProtocol``."""

    def send(self, message: Message) -> None: ...

    def send_threadsafe(self, message: Message) -> None: ...


class Link:
    def __init__(self, on_push: Callable[[Message], None]):
        self.on_push = on_push
        self.loop: asyncio.AbstractEventLoop | None = None
        self.channel: Channel | None = None
        self.gone = False
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Reply] | queue.SimpleQueue[Reply]] = {}
        self._attached = threading.Event()

    def attach(self, loop: asyncio.AbstractEventLoop, channel: Channel) -> None:
        """(loop) The channel is open: calls may go."""
        self.loop, self.channel = loop, channel
        self._attached.set()

    # -- the serving process's side of the conversation (loop) ------------------------------
    def on_message(self, _channel: Any, message: Message) -> None:
        kind, ident, payload = message
        try:
            if ident == 0:
                self.on_push(message)
                return
            waiter = self._waiting.get(ident)
            if isinstance(waiter, asyncio.Future):
                del self._waiting[ident]
                if not waiter.done():
                    waiter.set_result((kind, payload))
            elif waiter is not None:
                if kind in (m.END, m.FAIL, m.ANSWER):
                    del self._waiting[ident]
                waiter.put((kind, payload))
        except Exception:  # one bad message must not end the conversation
            log.exception("front worker: a %r message failed", kind)

    def on_lost(self, _channel: Any) -> None:
        self.gone = True
        waiting, self._waiting = self._waiting, {}
        failure = (m.FAIL, m.error_to_plain(Unavailable(GONE)))
        for waiter in waiting.values():
            if isinstance(waiter, asyncio.Future):
                if not waiter.done():
                    waiter.set_result(failure)
            else:
                waiter.put(failure)
        self.on_push(("eof", 0, None))

    # -- requests ----------------------------------------------------------------------------
    async def call(self, kind: str, payload: Any) -> Reply:
        """Send a request and await its one reply: (kind, payload). On the link's loop without
        a hand-off; on another loop through the link's."""
        if self.loop is not None and asyncio.get_running_loop() is not self.loop:
            try:
                return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._call(kind, payload), self.loop))
            except RuntimeError:  # the link's loop is closed: the worker is stopping
                return (m.FAIL, m.error_to_plain(Unavailable(GONE)))
        return await self._call(kind, payload)

    async def _call(self, kind: str, payload: Any) -> Reply:
        if self.gone or self.channel is None:
            return (m.FAIL, m.error_to_plain(Unavailable(GONE)))
        assert self.loop is not None
        ident = next(self._ids)
        future: asyncio.Future[Reply] = self.loop.create_future()
        self._waiting[ident] = future
        self.channel.send((kind, ident, payload))
        return await future

    def open(self, kind: str, payload: Any) -> tuple[int, queue.SimpleQueue[Reply]]:
        """(any thread but the loop's) Send a request whose replies stream: (its id, the queue
        they arrive on)."""
        replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        ident = next(self._ids)
        if self.gone or not self._attached.wait(30) or self.loop is None:
            replies.put((m.FAIL, m.error_to_plain(Unavailable(GONE))))
            return ident, replies

        def register() -> None:
            if self.gone or self.channel is None:
                replies.put((m.FAIL, m.error_to_plain(Unavailable(GONE))))
                return
            self._waiting[ident] = replies
            self.channel.send((kind, ident, payload))
        try:
            self.loop.call_soon_threadsafe(register)
        except RuntimeError:
            replies.put((m.FAIL, m.error_to_plain(Unavailable(GONE))))
        return ident, replies

    def close_stream(self, ident: int) -> None:
        """(any thread) Stop listening for a stream's replies and tell the serving process."""
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._waiting.pop, ident, None)
            except RuntimeError:
                return
        self.send(m.CANCEL, ident)

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

    def send(self, kind: str, payload: Any) -> None:
        """(any thread) A message with no reply (observations, stats)."""
        channel = self.channel
        if self.gone or channel is None:
            return
        if self._on_loop():
            channel.send((kind, 0, payload))
        else:
            channel.send_threadsafe((kind, 0, payload))

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False
