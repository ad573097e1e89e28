"""The body of a server-sent-events answer over a token stream (``:generate``, OpenAI).

A WSGI response iterable: subclasses write ``events()`` (the bytes of each event, set
``finished`` before the last); ``close()``, which the WSGI server calls when the response
ends or the client is gone, cancels the stream if it is still running: the core drops it
at its next step and releases its version.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

GONE_KEY = "appliance.client_gone"  # environ: a callable, True once the client went away (the transport sets it)


def client_gone(environ: dict[str, Any]) -> Callable[[], bool]:
    """Whether the request's client is gone, for an answer that writes nothing until it is
    whole (a non-streamed completion): the HTTP server, or the front worker's link, puts the
    callable in the environ; without one the answer runs to its end."""
    gone = environ.get(GONE_KEY)
    return gone if callable(gone) else (lambda: False)


class StreamBody:
    def __init__(self, stream: Any):
        self.stream = stream  # appliance.core.streams.Stream
        self.finished = False
        self._events = self.events()

    def events(self) -> Iterator[bytes]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        return next(self._events)

    def close(self) -> None:
        if not self.finished:
            self.stream.cancel()


__all__ = ["GONE_KEY", "StreamBody", "client_gone"]
