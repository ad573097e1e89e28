"""What a generative request holds, and for how long (issue 35), against the real
``appliance serve``: a whole (non-streamed) answer whose client goes away stops generating,
in one process and through the front workers; a request over the limits waits in its model's
queue and is answered when a stream ends (issue 45); with no wait allowed
(``generation.queue_timeout_s = 0``) one model's streams never shut another model out
(``generation.reserved_streams_per_model``), and a model's own cap
(``generation.max_streams_per_model``) refuses with its name.

Model: genmodel's ``gen_slow`` (tests/support/genmodel.py: a generate_step SavedModel with a
character vocabulary, extra work per step and no cache bound, so a 200-token answer runs for seconds),
copied twice for two models. Every wait is on a condition the server shows (``/api/status``
``generation``, the Prometheus page), never on time.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from appliance.core.config import GenerationConfig
from appliance.core.errors import Unavailable
from appliance.core.stream_limits import StreamLimits
from tests.api.test_generate import gen_models  # noqa: F401  (the session fixture)

# Its waits (a server that builds or converts its model first, a burst) reach past the default
# 300 s: the pytest timeout sits above every wait inside it (tests/test_timeouts.py).
pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 200  # gen_slow (a generate_step without a cache) has no context bound: seconds of work


def _generation(server: Any) -> dict[str, Any]:
    return server.status()["generation"]  # type: ignore[no-any-return]


def _post_and_hold(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """A request sent on a raw socket whose answer is not read: closing it is the client going away."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("workers", ["default", "1"])
def test_a_whole_answer_stops_generating_when_its_client_goes_away(start_server: Any, gen_models: Path,  # noqa: F811
                                                                    tmp_path: Path, workers: str) -> None:
    """``default``: front workers (one per CPU; the worker notices the closed socket and sends
    CANCEL to the serving process); ``1``: the single-process server. Without the check the
    answer runs to its MAX_TOKENS (seconds) and counts as finished, not cancelled."""
    base = tmp_path / "models"
    shutil.copytree(gen_models / "gen_slow", base / "gen_slow")
    args = ["--models", str(base)] + ([] if workers == "default" else ["--workers", workers])
    srv = start_server(*args)
    if workers == "default" and (os.cpu_count() or 1) > 1:
        assert len(srv.status()["workers"]) > 1  # the request does go through a front worker
    sock = _post_and_hold(srv.port, "/v1/completions", {"model": "gen_slow", "prompt": "the model ",
                                                        "max_tokens": MAX_TOKENS, "temperature": 0})
    srv.wait_for(lambda: _generation(srv)["active_streams"] == 1, 60, "the completion to be generating")
    sock.close()  # the client goes away before its answer is whole
    srv.wait_for(lambda: _generation(srv)["active_streams"] == 0, 60, "the completion to stop")
    status = _generation(srv)
    assert status["streams_cancelled"] == 1 and status["tokens_generated"] < MAX_TOKENS, status
    metrics = srv.get("/monitoring/prometheus/metrics").text
    assert 'edge_appliance_generation_streams_total{finish_reason="cancelled",model_name="gen_slow"} 1.0' in metrics
    # the service still answers whole completions to clients that stay
    answer = srv.post("/v1/completions", {"model": "gen_slow", "prompt": "the model ", "max_tokens": 2})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


# -- stream limits -----------------------------------------------------------------------------
@pytest.fixture
def two_models(start_server: Any, gen_models: Path, tmp_path: Path) -> Any:  # noqa: F811
    base = tmp_path / "models"
    shutil.copytree(gen_models / "gen_slow", base / "busy")
    shutil.copytree(gen_models / "gen_slow", base / "other")
    config = tmp_path / "appliance.toml"
    config.write_text(f'models_dir = "{base}"\n[generation]\nmax_streams = 4\nreserved_streams_per_model = 2\n'
                      'queue_timeout_s = 0\n')  # refused at once, not queued: what this fixture's test is about
    return start_server("--config", str(config))


def _stream(server: Any, model: str) -> requests.Response:
    return requests.post(f"{server.url}/v1/completions", stream=True, timeout=60, json={
        "model": model, "prompt": "the model ", "max_tokens": MAX_TOKENS, "stream": True})


def _generating(response: requests.Response) -> Iterator[str]:
    """The stream's events, its first one read (it runs). Keep the iterator: dropping it closes
    the connection (urllib3), which is the client going away."""
    assert response.status_code == 200, response.text
    events = (line for line in response.iter_lines(decode_unicode=True) if line.startswith("data: "))
    next(events)
    return events


def test_one_busy_model_never_shuts_another_out(two_models: Any) -> None:
    """With one pool (generation.max_streams), 24 streams on one model made every other
    generative model answer 503 for 53 s. Now the busy model gets the pool less what the
    other needs to reach its reserve; the other model's streams start while it is saturated."""
    srv, held, reading = two_models, [], []
    try:
        for _ in range(2):
            held.append(_stream(srv, "busy"))
            reading.append(_generating(held[-1]))
        refused = _stream(srv, "busy")  # 2 of 4 are kept for "other", which runs none
        assert refused.status_code == 503 and refused.headers["Retry-After"]
        assert "generation.reserved_streams_per_model" in refused.json()["error"]["message"]
        for _ in range(2):  # the other model is not shut out while "busy" is saturated
            held.append(_stream(srv, "other"))
            reading.append(_generating(held[-1]))
        running = _generation(srv)["streams_per_model"]
        assert running == {"busy": 2, "other": 2}, running  # "busy" was still saturated meanwhile
        full = _stream(srv, "other")
        assert full.status_code == 503 and "generation.max_streams = 4" in full.json()["error"]["message"]
    finally:
        for response in held:
            response.close()
    srv.wait_for(lambda: _generation(srv)["active_streams"] == 0, 60, "the held streams to end")


def test_requests_over_the_limit_wait_for_a_stream(start_server: Any, gen_models: Path,  # noqa: F811
                                                  tmp_path: Path) -> None:
    """A burst is queued, not refused (vLLM's, llama.cpp's and Ollama's behaviour): with one
    stream allowed, six requests of ~2.4 s each (30 gen_slow steps) sent at once are all
    answered, the later ones after waiting in the model's queue (before: one answer, five 503s)."""
    base = tmp_path / "models"
    shutil.copytree(gen_models / "gen_slow", base / "gen")
    config = tmp_path / "appliance.toml"
    config.write_text(f'models_dir = "{base}"\n[generation]\nmax_streams = 1\n')
    srv = start_server("--config", str(config))
    answers: list[requests.Response] = []

    def one() -> None:
        answers.append(requests.post(f"{srv.url}/v1/completions", timeout=300,
                                     json={"model": "gen", "prompt": "the model ", "max_tokens": 30}))

    burst = [threading.Thread(target=one) for _ in range(6)]
    for thread in burst:
        thread.start()
    for thread in burst:
        thread.join(timeout=300)
    assert not any(t.is_alive() for t in burst), "a request never ended"
    assert [a.status_code for a in answers] == [200] * 6, [a.text for a in answers if a.status_code != 200]
    assert all(a.json()["usage"]["completion_tokens"] == 30 for a in answers)
    metrics = srv.get("/monitoring/prometheus/metrics").text
    waited = [line for line in metrics.splitlines()
              if line.startswith('edge_appliance_generation_queue_wait_seconds_count{model_name="gen"}')]
    assert waited and float(waited[0].split()[-1]) >= 1, waited  # they did wait: one stream at a time
    assert 'edge_appliance_generation_requests_waiting{model_name="gen"} 0.0' in metrics
    status = _generation(srv)
    assert status["requests_waiting"] == 0 and status["waiting_per_model"] == {}


class _Config:
    def __init__(self, **kw: float):
        self.value = GenerationConfig(**kw)

    def __call__(self) -> GenerationConfig:
        return self.value


def test_the_admission_rule() -> None:
    """StreamLimits alone, with no wait allowed: the reserve (kept only for models below it),
    the pool, the cap."""
    lock = threading.Lock()
    limits = StreamLimits(_Config(max_streams=6, reserved_streams_per_model=2, queue_timeout_s=0),
                          lambda: ["a", "b", "c"], lock)

    def admit(on: StreamLimits, model: str, count: int = 1) -> None:
        with lock:  # its contract: under the caller's lock
            on.admit(model, count)

    limits.refresh()
    admit(limits, "a", 2)  # 6 - 2 kept for b - 2 kept for c = 2 for a
    with pytest.raises(Unavailable, match="reserved_streams_per_model"):
        admit(limits, "a")
    admit(limits, "b", 2)  # a has its reserve's worth: only c's 2 are kept back
    with pytest.raises(Unavailable, match="reserved_streams_per_model"):
        admit(limits, "b")
    admit(limits, "c", 2)
    with pytest.raises(Unavailable, match="generation.max_streams = 6"):
        admit(limits, "c")
    limits.leave("a")
    limits.leave("a")
    with pytest.raises(Unavailable, match="reserved_streams_per_model"):
        admit(limits, "c")  # a, below its reserve again, has 2 kept for it
    admit(limits, "a", 2)
    assert limits.running == {"a": 2, "b": 2, "c": 2}
    capped = StreamLimits(_Config(max_streams=10, max_streams_per_model=3, reserved_streams_per_model=0,
                                  queue_timeout_s=0), lambda: ["x", "y"], lock)
    admit(capped, "x", 3)
    with pytest.raises(Unavailable, match="streams of model 'x' are running, the limit is "
                                          "generation.max_streams_per_model = 3"):
        admit(capped, "x")
    with pytest.raises(Unavailable, match="max_streams_per_model"):
        admit(capped, "y", 4)  # n choices are admitted together or not at all
    assert capped.running == {"x": 3}
