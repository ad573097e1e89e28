"""An API family answered by one coroutine: what the front path runs on its event loop.

``answer(environ)`` is the whole of a request to the family's mount (TF Serving's ``/v1``,
KServe v2's ``/v2``, ``:generate``, OpenAI's completions): (status line, headers, body), errors
included, rendered by appliance/api/errors.py. The body is bytes, or for a streamed answer
(server-sent events of a token stream) an async iterator of its chunks (``Streamed``): the
HTTP server writes each as it comes and closes the iterator early when the client is gone,
which cancels the stream (appliance/core/token_streams.py). The HTTP server's front path
(appliance/fronts/app.py) awaits it on its loop, where the model run is awaited too
(appliance/core/seams.py): one copy of each family's decode, error and encode logic, in the
serving process and in a front worker alike.

The same object is a WSGI app for what reaches it through the WSGI app instead (a request the
token check refused, a test client): the coroutine then runs on an event loop of its own on the
calling thread, a streamed answer chunk by chunk on that loop.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator, Iterable, Iterator

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIEnvironment

Answer = tuple[str, list[tuple[str, str]], bytes]  # status line, headers, body
Streamed = tuple[str, list[tuple[str, str]], AsyncIterator[bytes]]  # status line, headers, the chunks


class AsyncFamily:
    async def answer(self, environ: WSGIEnvironment) -> Answer | Streamed:
        raise NotImplementedError

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        loop = asyncio.new_event_loop()
        try:
            status, headers, body = loop.run_until_complete(self.answer(environ))
        except BaseException:
            loop.close()
            raise
        start_response(status, headers)
        if isinstance(body, bytes):
            loop.close()
            return [body] if environ.get("REQUEST_METHOD") != "HEAD" else []
        return _Chunks(loop, body)


class _Chunks:
    """A streamed answer as a WSGI iterable, driven on its own loop; ``close`` ends it early."""

    def __init__(self, loop: asyncio.AbstractEventLoop, chunks: AsyncIterator[bytes]):
        self.loop, self.chunks = loop, chunks

    def __iter__(self) -> Iterator[bytes]:
        while not self.loop.is_closed():
            try:
                yield self.loop.run_until_complete(anext(self.chunks))
            except StopAsyncIteration:
                return

    def close(self) -> None:
        if self.loop.is_closed():
            return
        try:
            closer = getattr(self.chunks, "aclose", None)
            if closer is not None:
                self.loop.run_until_complete(closer())
        finally:
            self.loop.close()


async def close_chunks(chunks: AsyncIterator[bytes]) -> None:
    """End a streamed answer early (its generator's ``finally`` cancels what it streams)."""
    closer = getattr(chunks, "aclose", None)
    if closer is not None:
        await closer()
