"""A REST API family whose handler is written as steps, served on a thread or an event loop.

``steps(environ)`` is the whole request: a generator that yields each model run
(appliance/core/handle.py ``Run``) and returns ``(status, body, headers)``; ``answer``
frames that as (status line, headers, body). ``SteppedAPI`` gives such a family its three
faces: a WSGI app (``__call__``, the runs on the calling thread), ``dispatch`` (the same,
unframed) and ``answer_async`` (the runs awaited on an event loop: a front worker's fast
path, appliance/fronts/app.py).
"""

from __future__ import annotations

from typing import Any, Callable

from appliance.core.handle import Steps, drive, drive_async

Response = tuple[int, bytes, list[tuple[str, str]]]
Answer = tuple[str, list[tuple[str, str]], bytes]


class SteppedAPI:
    def steps(self, environ: dict[str, Any]) -> Steps[Response]:
        raise NotImplementedError

    @staticmethod
    def answer(status: int, body: bytes, headers: list[tuple[str, str]]) -> Answer:
        raise NotImplementedError

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        status, headers, body = self.answer(*self.dispatch(environ))
        start_response(status, headers)
        return [body]

    def dispatch(self, environ: dict[str, Any]) -> Response:
        return drive(self.steps(environ))

    async def answer_async(self, environ: dict[str, Any]) -> Answer:
        """The answer on an event loop: the model runs awaited."""
        return self.answer(*await drive_async(self.steps(environ)))
