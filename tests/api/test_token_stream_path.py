"""Token streams on the one async path (issue 45): ``:generate`` and OpenAI's completions are
answered on the front path's event loop, in the front workers and in the serving process, so a
request waits in its model's queue and streams without holding a thread.

Against the real ``appliance serve`` on its defaults (front workers: one per CPU), with the
official ``openai`` client: a burst of 200 concurrent requests to one model is answered whole
(before: 64 of 200, the rest 503 from the HTTP server's 32 threads and ``limits.max_queue_wait_s``),
streamed and whole answers agree; a client that leaves mid-stream, or while its request waits in
the queue, stops its generation, as ``/api/status`` and the Prometheus page show. Every wait is
on a condition the server shows, never on time.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from tests.api.test_generate import gen_models  # noqa: F401  (the session fixture)
from tests.support.servers import ROOT

pytestmark = pytest.mark.timeout(600)  # a burst on a loaded 2-core box; above every wait inside

TINY_CHAT = ROOT / "scripts" / "tiny_chat"  # the prebuilt 377 KiB chat model (real tokenizer.json)
BURST = 200
MAX_TOKENS = 60  # gen_slow (64 positions, a 1-token prompt): seconds of work, a stream still runs when its client leaves


def _generation(server: Any) -> dict[str, Any]:
    return server.status()["generation"]  # type: ignore[no-any-return]


def _metric(server: Any, prefix: str) -> float | None:
    for line in server.get("/monitoring/prometheus/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return None


async def _burst(url: str) -> list[Any]:
    """BURST requests at once, half streamed; no client retries (a refusal would be seen)."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "hi"}]

    async def whole() -> Any:
        answer = await client.chat.completions.create(model="chat", messages=messages, max_tokens=8,
                                                      temperature=0)
        return answer.choices[0].message.content, answer.usage.completion_tokens, answer.choices[0].finish_reason

    async def streamed() -> Any:
        text, finish, usage = [], None, None
        stream = await client.chat.completions.create(model="chat", messages=messages, max_tokens=8,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return "".join(text), usage, finish

    try:
        return await asyncio.gather(*[(whole if i % 2 else streamed)() for i in range(BURST)],
                                    return_exceptions=True)
    finally:
        await client.close()


def test_a_burst_of_200_is_answered_on_the_defaults(start_server: Any, tmp_path: Path) -> None:
    pytest.importorskip("openai", reason="the official openai client (the test extra)")
    shutil.copytree(TINY_CHAT, tmp_path / "models" / "chat" / "1")
    srv = start_server("--models", str(tmp_path / "models"))  # the defaults: front workers, the cache budget
    if (os.cpu_count() or 1) > 1:
        assert len(srv.status()["workers"]) > 1  # the requests do go through the front workers
    answers = asyncio.run(_burst(srv.url))
    failed = [a for a in answers if isinstance(a, BaseException)]
    assert not failed, f"{len(failed)} of {BURST} failed, e.g. {failed[0]!r}"
    # greedy: every answer, streamed or whole, is the same text with the same counts
    assert len(set(answers)) == 1, set(answers)
    text, tokens, finish = answers[0]
    assert 1 <= tokens <= 8 and finish in ("stop", "length") and isinstance(text, str)
    srv.wait_for(lambda: _generation(srv)["active_streams"] == 0, 60, "the burst's streams to end")
    status = _generation(srv)
    assert status["requests_waiting"] == 0 and status["streams_started"] == BURST, status
    assert _metric(srv, 'edge_appliance_generation_requests_waiting{model_name="chat"}') == 0.0
    assert _metric(srv, 'edge_appliance_generation_queue_wait_seconds_count{model_name="chat"}') is not None


@pytest.fixture
def slow_model(gen_models: Path, tmp_path: Path) -> Path:  # noqa: F811
    base = tmp_path / "models"
    shutil.copytree(gen_models / "gen_slow", base / "gen_slow")
    return base


def _stream(server: Any) -> requests.Response:
    return requests.post(f"{server.url}/v1/completions", stream=True, timeout=120, json={
        "model": "gen_slow", "prompt": "t", "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0})


def _events(response: requests.Response) -> Iterator[str]:
    assert response.status_code == 200, response.text
    return (line for line in response.iter_lines(decode_unicode=True) if line.startswith("data: "))


@pytest.mark.parametrize("workers", ["default", "1"])
def test_a_client_gone_mid_stream_stops_its_generation(start_server: Any, slow_model: Path, workers: str) -> None:
    """The SSE writer on the loop closes the stream's chunks when the client is gone, which
    cancels the stream (in a worker: ``Cancel`` to the serving process, whose task ends)."""
    srv = start_server("--models", str(slow_model), *([] if workers == "default" else ["--workers", workers]))
    response = _stream(srv)
    events = _events(response)
    next(events)
    next(events)  # generating
    assert _generation(srv)["active_streams"] == 1
    response.close()  # the client goes away
    srv.wait_for(lambda: _generation(srv)["active_streams"] == 0, 60, "the stream to be cancelled")
    status = _generation(srv)
    assert status["streams_cancelled"] == 1 and status["tokens_generated"] < MAX_TOKENS, status
    assert _metric(srv, 'edge_appliance_generation_streams_total{finish_reason="cancelled",model_name="gen_slow"}') \
        == 1.0


@pytest.mark.parametrize("workers", ["2", "1"])
def test_a_client_gone_while_queued_leaves_the_queue(start_server: Any, slow_model: Path, tmp_path: Path,
                                                     workers: str) -> None:
    """With one stream allowed, a second request waits in the model's queue (shown in
    ``/api/status`` and Prometheus); its client leaving takes it out of the queue at once (the
    front worker's ``Cancel`` cancels the awaited reservation; in one process the waiting
    request looks at its socket), while the running stream is held (the test hook freezes the
    decode loops: its length never races the check); the running stream is untouched."""
    config = tmp_path / "appliance.toml"
    config.write_text(f'models_dir = "{slow_model}"\n[generation]\nmax_streams = 1\n')
    srv = start_server("--config", str(config), "--workers", workers, env={"EDGE_APPLIANCE_TEST_HOOKS": "1"})
    running = _stream(srv)
    events = _events(running)
    next(events)
    _toggle_freeze(srv, "frozen")  # the running stream stays running until released below
    queued = _stream_pending(srv)
    srv.wait_for(lambda: _generation(srv)["requests_waiting"] == 1, 60, "the second request to wait in the queue")
    assert _metric(srv, 'edge_appliance_generation_requests_waiting{model_name="gen_slow"}') == 1.0
    assert _generation(srv)["waiting_per_model"] == {"gen_slow": 1}
    queued.close()  # the waiting client goes away
    srv.wait_for(lambda: _generation(srv)["requests_waiting"] == 0, 60, "the gone request to leave the queue")
    status = _generation(srv)
    assert status["active_streams"] == 1 and status["streams_started"] == 1, status  # never admitted
    _toggle_freeze(srv, "running again")
    running.close()
    srv.wait_for(lambda: _generation(srv)["active_streams"] == 0, 60, "the running stream to end")


ROW_BYTES = 4 * 64 * 2 * 16 * 4  # gen_slow's cache row: [batch, 4, 64, 2, 16] float32 (tests/support/genmodel.py)


def test_streams_run_while_their_cache_fits_and_the_next_waits(start_server: Any, slow_model: Path,
                                                                tmp_path: Path) -> None:
    """``generation.cache_memory_mb`` set to two of gen_slow's cache rows: two streams run, the
    third waits in the model's queue (not refused) while both hold their rows (the decode loops
    held by the test hook), then runs when one ends; ``/api/status`` and Prometheus show the
    bytes held and the total."""
    config = tmp_path / "appliance.toml"
    config.write_text(f'models_dir = "{slow_model}"\n[generation]\ncache_memory_mb = {2 * ROW_BYTES / (1 << 20)}\n')
    srv = start_server("--config", str(config), env={"EDGE_APPLIANCE_TEST_HOOKS": "1"})
    running = [_stream(srv) for _ in range(2)]
    for response in running:
        next(_events(response))
    _toggle_freeze(srv, "frozen")
    status = _generation(srv)
    assert status["cache_bytes_used"] == status["cache_bytes_total"] == 2 * ROW_BYTES, status
    assert status["cache_bytes_per_model"] == {"gen_slow": 2 * ROW_BYTES}
    assert [v["cache_bytes_per_stream"] for v in status["versions"]] == [ROW_BYTES]
    assert _metric(srv, 'edge_appliance_generation_cache_bytes{model_name="gen_slow"}') == 2 * ROW_BYTES
    assert _metric(srv, "edge_appliance_generation_cache_limit_bytes") == 2 * ROW_BYTES
    third = _stream_pending(srv)
    try:
        srv.wait_for(lambda: _generation(srv)["requests_waiting"] == 1, 60, "the third request to wait for room")
        assert _generation(srv)["streams_started"] == 2
        _toggle_freeze(srv, "running again")
        running[0].close()  # one stream ends: its row frees
        srv.wait_for(lambda: _generation(srv)["streams_started"] == 3, 60, "the third request to be admitted")
        assert _generation(srv)["requests_waiting"] == 0
        answer = third.makefile("rb").read1(65536)  # its answer begins
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    finally:
        third.close()
        running[1].close()
    srv.wait_for(lambda: _generation(srv)["active_streams"] == 0, 60, "every stream to end")
    assert _generation(srv)["cache_bytes_used"] == 0
    assert _metric(srv, 'edge_appliance_generation_cache_bytes{model_name="gen_slow"}') == 0.0


def _toggle_freeze(server: Any, state: str) -> None:
    """SIGUSR1 (EDGE_APPLIANCE_TEST_HOOKS): decode loops held before their next step, or released."""
    import signal

    before = server.log_text().count(f"batchers {state}")
    server.proc.send_signal(signal.SIGUSR1)  # handled asynchronously: wait for its log line
    server.wait_for(lambda: server.log_text().count(f"batchers {state}") > before, 30, f"the decode loops {state}")


def _stream_pending(server: Any) -> Any:
    """A streamed request whose answer has not begun (it waits in the queue): a raw socket."""
    import json
    import socket

    data = json.dumps({"model": "gen_slow", "prompt": "the model ", "max_tokens": 2, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock
