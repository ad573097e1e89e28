"""A front worker answers ``GET /healthz`` itself while the serving process is heard from (its
loop sent the worker something within ``HEARD_S``), and forwards it there otherwise (issue 45:
forwarded during a flood of 1,000 streams, the probe waited for a loop that shares its GIL with
the decode loop; bench/stream_flood.py)."""

from __future__ import annotations

import asyncio
import json
from functools import partial

from appliance.fronts import messages as m
from appliance.fronts.app import FrontApp
from appliance.fronts.link import Link

# The window the test gives the link: far longer than a loaded machine could pause between the
# message and the probe below (the worker's own, fronts/worker.py HEARD_S, is 1 s).
WITHIN_S = 3600.0
FORWARDED = ("200 OK", [("X-Answered-By", "serving")], b'{"status": "alive"}')


async def forwarded(environ: dict[str, object]) -> tuple[str, list[tuple[str, str]], bytes]:
    return FORWARDED


def healthz(app: FrontApp) -> tuple[str, list[tuple[str, str]], bytes]:
    handler = app.route({"REQUEST_METHOD": "GET", "PATH_INFO": "/healthz"})
    assert handler is not None  # on the loop, never behind a thread
    status, headers, body = asyncio.run(handler({}))
    assert isinstance(body, bytes)  # whole, not streamed
    return status, headers, body


def test_worker_answers_healthz_itself_only_while_the_serving_process_is_heard() -> None:
    link = Link(on_push=lambda message: None)
    app = FrontApp(None, [], lambda environ, start_response: [], forwarded,  # type: ignore[arg-type]
                   heard=partial(link.heard_within, WITHIN_S))
    assert healthz(app) == FORWARDED  # nothing heard yet: the serving process answers

    link.on_message(None, m.Answer(7, "200 OK", [], b""))  # any message: its loop turned just now
    status, headers, body = healthz(app)
    assert (status, headers) != FORWARDED[:2]  # answered here
    assert status == "200 OK" and json.loads(body)["status"] == "alive"

    link.on_lost(None)  # the serving process is gone: never answered alive here
    assert healthz(app) == FORWARDED


def test_the_serving_process_answers_healthz_itself() -> None:
    app = FrontApp(None, [], lambda environ, start_response: [], heard=lambda: True)  # type: ignore[arg-type]
    status, _, body = healthz(app)
    assert status == "200 OK" and json.loads(body)["status"] == "alive"
