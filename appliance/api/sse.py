"""The body of a server-sent-events answer over a token stream (``:generate``, OpenAI).

A WSGI response iterable: subclasses write ``events()`` (the bytes of each event, set
``finished`` before the last); ``close()``, which the WSGI server calls when the response
ends or the client is gone, cancels the stream if it is still running: the core drops it
at its next step and releases its version.
"""

from __future__ import annotations

from typing import Any, Iterator


class StreamBody:
    def __init__(self, stream: Any):
        self.stream = stream  # appliance.core.generation.Stream
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


__all__ = ["StreamBody"]
