"""An API family answered by one coroutine: what the front path runs on its event loop.

``answer(environ)`` is the whole of a request to the family's mount (TF Serving's ``/v1``,
KServe v2's ``/v2``): (status line, headers, body), errors included, rendered by
appliance/api/errors.py. The HTTP server's front path (appliance/fronts/app.py) awaits it on
its loop, where the model run is awaited too (appliance/core/seams.py): one copy of each
family's decode, error and encode logic, in the serving process and in a front worker alike.

The same object is a WSGI app for what reaches it through the WSGI app instead (a model status
request a front worker forwards, a test client): the coroutine then runs on an event loop of its
own on the calling thread.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterable

Answer = tuple[str, list[tuple[str, str]], bytes]  # status line, headers, body


class AsyncFamily:
    async def answer(self, environ: dict[str, Any]) -> Answer:
        raise NotImplementedError

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        status, headers, body = asyncio.run(self.answer(environ))
        start_response(status, headers)
        return [body] if environ.get("REQUEST_METHOD") != "HEAD" else []
