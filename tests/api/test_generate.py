"""Token generation over HTTP against the real server (``appliance serve``), with a tiny
character-level transformer trained by ``tests/support/genmodel.py`` and exported both ways."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import requests

from tests.support.cache import ahead_of_tests, built_once
from tests.support import genmodel
from tests.support.servers import model_copy

# The LiteRT LLM convention three ways (a decode batch of 4 with a position per row; ai-edge-torch's
# default export: batch 1, mask input, prefill_4 + prefill_8; a batch of 4 sharing one position)
# and the generate_step SavedModel.
EXPORTS = ("gen_tflite", "gen_tflite_aet", "gen_tflite_shared", "gen_savedmodel")
N = 24  # tokens per answer


@ahead_of_tests("gen_models")
def built_gen_models() -> Path:
    import hashlib

    digest = hashlib.sha256(Path(genmodel.__file__).read_bytes()).hexdigest()[:12]
    return built_once(f"gen-{digest}", genmodel.build)


@pytest.fixture(scope="session")
def gen_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """genmodel's models, built once and cached keyed by genmodel.py's hash (before the first test)."""
    return built_gen_models()


@pytest.fixture(scope="module")
def server(module_server: Any, gen_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = model_copy(gen_models, tmp_path_factory.mktemp("gen"), *EXPORTS)
    return module_server("--models", str(base))


@pytest.fixture(scope="module")
def references(gen_models: Path) -> dict[tuple[str, str], list[int]]:
    """Greedy answers of the in-process reference loops: (export, prompt) -> token ids."""
    loop = lambda name: genmodel.greedy_savedmodel if name == "gen_savedmodel" else genmodel.greedy_tflite
    return {(name, p): loop(name)(gen_models / name / "1", genmodel.encode(p), N)
            for name in EXPORTS for p in genmodel.PROMPTS}


def generate(server: Any, model: str, **body: Any) -> requests.Response:
    return server.post(f"/v1/models/{model}:generate", body)


def sse(response: requests.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event name, data) of a server-sent event stream."""
    event = "message"
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            yield event, json.loads(line[len("data: "):])
            event = "message"


@pytest.mark.parametrize("model", EXPORTS)
def test_greedy_equals_the_reference_loop(server: Any, references: dict, model: str) -> None:
    for prompt in genmodel.PROMPTS:
        answer = generate(server, model, input_ids=genmodel.encode(prompt), max_new_tokens=N).json()
        assert answer["tokens"] == references[(model, prompt)], prompt
        assert answer["finish_reason"] == "length" and answer["completion_tokens"] == N
        assert answer["prompt_tokens"] == len(prompt)
        assert answer["text"] == "".join(genmodel.vocab()[t] for t in answer["tokens"])
    # text in, the version's vocabulary: the same prompt gives the same answer
    by_text = generate(server, model, text=genmodel.PROMPTS[0], max_new_tokens=N).json()
    assert by_text["tokens"] == references[(model, genmodel.PROMPTS[0])]
    assert by_text["text"].startswith("answers token by token")  # the model learnt the corpus


@pytest.mark.parametrize("model", EXPORTS)
def test_stream_delivers_the_same_tokens_then_a_summary(server: Any, references: dict, model: str) -> None:
    prompt = genmodel.PROMPTS[1]
    with requests.post(f"{server.url}/v1/models/{model}:generate", stream=True, timeout=60,
                       data=json.dumps({"text": prompt, "max_new_tokens": N, "stream": True})) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        events = list(sse(r))
    tokens = [data["token"] for name, data in events if name == "message"]
    assert tokens == references[(model, prompt)]
    assert [data["text"] for name, data in events if name == "message"] == [genmodel.vocab()[t] for t in tokens]
    name, summary = events[-1]
    assert name == "done" and summary["finish_reason"] == "length" and summary["completion_tokens"] == N
    assert summary["model_version"] == "1" and summary["time_to_first_token_ms"] > 0


def test_stop_tokens_end_the_answer(server: Any, references: dict) -> None:
    expected = references[("gen_tflite", genmodel.PROMPTS[2])]
    stop = expected[5]
    answer = generate(server, "gen_tflite", text=genmodel.PROMPTS[2], max_new_tokens=N, stop=[stop]).json()
    assert answer["finish_reason"] == "stop"
    assert answer["tokens"] == expected[:expected.index(stop)]


@pytest.mark.parametrize("model", EXPORTS)
def test_concurrent_streams_get_independent_answers(server: Any, references: dict, model: str) -> None:
    """More streams than the decode batch (4 rows for the LiteRT model): several lanes, rows
    reused as streams of different lengths finish and new ones join."""
    jobs = [(p, n) for p in genmodel.PROMPTS for n in (N, 7, 15)]
    results: dict[int, Any] = {}

    def run(i: int, prompt: str, n: int) -> None:
        results[i] = generate(server, model, text=prompt, max_new_tokens=n).json()

    threads = [threading.Thread(target=run, args=(i, p, n)) for i, (p, n) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (prompt, n) in enumerate(jobs):
        assert results[i]["tokens"] == references[(model, prompt)][:n], (prompt, n)
    steps = server.get("/monitoring/prometheus/metrics").text
    rows = [line for line in steps.splitlines()
            if line.startswith("edge_appliance_generation_step_rows_bucket") and f'model_name="{model}"' in line
            and 'le="1.0"' in line]
    count = [line for line in steps.splitlines()
             if line.startswith("edge_appliance_generation_step_rows_count") and f'model_name="{model}"' in line]
    single, total = float(rows[0].split()[-1]), float(count[0].split()[-1])
    if model == "gen_tflite_aet":  # a decode batch of 1: one call per stream per step
        assert single == total
    elif model != "gen_tflite_shared":  # (shared position: rows of a lane run in calls per position)
        assert single < total  # some steps ran several streams in one call


def _active(server: Any) -> int:
    return int(server.status()["generation"]["active_streams"])


def test_disconnect_cancels_a_running_stream(start_server: Any, gen_models: Path, tmp_path: Path) -> None:
    """The slow model spends ~80 ms a step: a client that leaves after one token of 60 frees
    its stream (and its version handle) long before 60 steps could have run."""
    base = model_copy(gen_models, tmp_path, "gen_slow")
    config = tmp_path / "gen.toml"
    config.write_text("[generation]\nmax_streams = 1\nqueue_timeout_s = 0\n")  # over the limit: refused, not queued
    srv = start_server("--models", str(base), "--config", str(config))
    r = requests.post(f"{srv.url}/v1/models/gen_slow:generate", stream=True, timeout=60,
                      data=json.dumps({"input_ids": [1, 2, 3], "max_new_tokens": 60, "stream": True}))
    events = sse(r)
    next(events)
    assert _active(srv) == 1
    full = generate(srv, "gen_slow", input_ids=[1], max_new_tokens=2)  # over generation.max_streams
    assert full.status_code == 503 and full.headers["Retry-After"] == "1"
    assert "generation.max_streams" in full.json()["error"]
    r.close()  # the client goes away
    srv.wait_for(lambda: _active(srv) == 0, 30, "the stream to be cancelled")
    status = srv.status()["generation"]
    assert status["streams_cancelled"] == 1 and status["tokens_generated"] < 60
    metrics = srv.get("/monitoring/prometheus/metrics").text
    assert 'edge_appliance_generation_active_streams{model_name="gen_slow"} 0.0' in metrics
    assert 'edge_appliance_generation_streams_total{finish_reason="cancelled",model_name="gen_slow"} 1.0' in metrics


class StreamChain:
    """Streams that overlap, one after another, until ``stop``: ``run(next_one)`` is one stream
    (what it returns goes to ``results``); it calls ``next_one()`` part of the way in, which
    starts the next. So from the first stream's start until ``stop``, some stream that started
    a fraction of a stream's time ago is running, however fast the model steps on this machine
    and however long a new version's trial takes. ``start`` also restarts a broken chain (a
    stream that ended before calling ``next_one``)."""

    def __init__(self, run: Callable[[Callable[[], None]], Any], most: int = 200):
        self._run, self._most = run, most
        self._lock = threading.Lock()
        self._stopped = False
        self.threads: list[threading.Thread] = []
        self.results: list[Any] = []

    def start(self) -> None:
        with self._lock:
            if self._stopped or len(self.threads) >= self._most:
                return
            thread = threading.Thread(target=lambda: self.results.append(self._run(self.start)), name="stream")
            self.threads.append(thread)
        thread.start()

    def running(self) -> bool:
        with self._lock:
            return any(t.is_alive() for t in self.threads)

    def stop(self, timeout: float) -> None:
        with self._lock:
            self._stopped = True
        for thread in self.threads:
            thread.join(timeout)


def test_hot_swap_mid_stream_finishes_on_the_old_version(start_server: Any, gen_models: Path,
                                                         tmp_path: Path) -> None:
    """A new version becomes AVAILABLE while streams hold version 1: each of them finishes on
    version 1, unbroken, and version 1 stays UNLOADING (draining) until they end, then
    unloads. How long a stream runs (60 steps of the slow model) against how long the new
    version's trial takes (TensorFlow imported in a child) depends on the machine, so streams
    are chained until the swap is seen, each starting the next a third of the way in: when
    version 2 becomes AVAILABLE, a stream on version 1 has two thirds of its steps or more to
    run, and holds version 1 in UNLOADING meanwhile."""
    base = model_copy(gen_models, tmp_path, "gen_slow")
    srv = start_server("--models", str(base), "--poll-interval", "0.2")
    old = generate(srv, "gen_slow", input_ids=[1, 2, 3], max_new_tokens=60).json()["tokens"]

    def stream(next_one: Callable[[], None]) -> list[tuple[str, dict[str, Any]]]:
        events = []
        with requests.post(f"{srv.url}/v1/models/gen_slow:generate", stream=True, timeout=120,
                           data=json.dumps({"input_ids": [1, 2, 3], "max_new_tokens": 60, "stream": True})) as r:
            for event in sse(r):
                events.append(event)
                if len(events) == 20:
                    next_one()
        return events

    def states() -> dict[int, str]:
        return {v["version"]: v["state"] for v in srv.status()["models"]["gen_slow"]["versions"]}

    def swapped() -> bool:
        if not chain.running():
            chain.start()
        now = states()
        return now.get(2) == "AVAILABLE" and now.get(1) == "UNLOADING"  # held by one of our streams

    chain = StreamChain(stream)
    try:
        chain.start()  # the first stream is under way before v2 appears
        shutil.copytree(gen_models / "gen_slow_v2" / "2", base / "gen_slow" / "2")  # a new version appears
        srv.wait_for(swapped, 120, "version 2 to serve while version 1 drains")
        new = generate(srv, "gen_slow", input_ids=[1, 2, 3], max_new_tokens=5).json()
    finally:
        chain.stop(120)
    results = chain.results
    assert len(results) == len(chain.threads)  # every stream answered
    assert all(events[-1][0] == "done" for events in results), [events[-1] for events in results]
    on_v1 = [events for events in results if events[-1][1]["model_version"] == "1"]
    assert on_v1
    for events in on_v1:
        assert [d["token"] for name, d in events if name == "message"] == old  # finished on version 1, unbroken
    assert new["model_version"] == "2" and new["tokens"] != old[:5]
    srv.wait_for(lambda: states().get(1) == "END", 30, "version 1 to unload once its streams ended")


@pytest.mark.parametrize(("body", "field"), [
    ({"max_new_tokens": 3}, "input_ids"),
    ({"input_ids": [], "max_new_tokens": 3}, "input_ids"),
    ({"input_ids": [1, 999]}, "input_ids"),
    ({"input_ids": "abc"}, "input_ids"),
    ({"input_ids": [1], "text": "a"}, "input_ids"),
    ({"text": "\u00e9"}, "text"),
    ({"input_ids": [1], "max_new_tokens": 0}, "max_new_tokens"),
    ({"input_ids": [1], "max_new_tokens": 100000}, "max_new_tokens"),
    ({"input_ids": [1], "temperature": -1}, "temperature"),
    ({"input_ids": [1], "top_p": 2}, "top_p"),
    ({"input_ids": [1], "top_k": 1.5}, "top_k"),
    ({"input_ids": [1], "stop": 3}, "stop"),
    ({"input_ids": [1], "stream": "yes"}, "stream"),
    ({"input_ids": [1], "max_tokens": 3}, "max_tokens"),
    ({"input_ids": [1] * 64}, "input_ids"),  # the LiteRT model's context is 64 positions
])
def test_bad_requests_are_400_naming_the_field(server: Any, body: dict, field: str) -> None:
    r = generate(server, "gen_tflite", **body)
    assert r.status_code == 400, r.text
    assert f"'{field}'" in r.json()["error"]


def test_unknown_model_version_and_bad_json(server: Any) -> None:
    r = generate(server, "nope", input_ids=[1])
    assert r.status_code == 404 and "Servable not found" in r.json()["error"]
    r = server.post("/v1/models/gen_tflite/versions/7:generate", {"input_ids": [1]})
    assert r.status_code == 404
    assert server.post("/v1/models/gen_tflite:generate", b"{not json").status_code == 400
    assert _active(server) == 0  # nothing left behind by refused requests


def test_sampling_is_reproducible_with_a_seed(server: Any) -> None:
    body = {"text": "the ", "max_new_tokens": 20, "temperature": 1.5, "top_k": 8, "top_p": 0.95, "seed": 7}
    a, b = (generate(server, "gen_savedmodel", **body).json()["tokens"] for _ in range(2))
    assert a == b
    c = generate(server, "gen_savedmodel", **{**body, "seed": 8}).json()["tokens"]
    assert c != a


def test_generation_config_is_validated_by_key() -> None:
    from appliance.core.config import GenerationConfig
    from appliance.core.errors import ConfigError

    GenerationConfig().validate("generation")
    for fields, key in (({"max_streams": 0}, "generation.max_streams"),
                        ({"max_streams_per_step": -1}, "generation.max_streams_per_step"),
                        ({"default_max_new_tokens": 2000}, "generation.default_max_new_tokens")):
        with pytest.raises(ConfigError) as err:
            GenerationConfig(**fields).validate("generation")
        assert err.value.key == key


def test_without_step_batching_streams_get_the_same_answers(start_server: Any, gen_models: Path, tmp_path: Path,
                                                             references: dict) -> None:
    """The bench's baseline (one decode call per stream per step) is a correct server too."""
    base = model_copy(gen_models, tmp_path, "gen_tflite", "gen_savedmodel")
    config = tmp_path / "gen.toml"
    config.write_text("[generation]\nstep_batching = false\n")
    srv = start_server("--models", str(base), "--config", str(config))
    results: dict[tuple[str, str], Any] = {}

    def run(model: str, prompt: str) -> None:
        results[(model, prompt)] = generate(srv, model, text=prompt, max_new_tokens=N).json()

    threads = [threading.Thread(target=run, args=(m, p)) for m in ("gen_tflite", "gen_savedmodel")
               for p in genmodel.PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for key, answer in results.items():
        assert answer["tokens"] == references[key], key
    assert len(results) == 2 * len(genmodel.PROMPTS)
    metrics = srv.get("/monitoring/prometheus/metrics").text
    for model in ("gen_tflite", "gen_savedmodel"):
        single = [line for line in metrics.splitlines() if line.startswith("edge_appliance_generation_step_rows")
                  and f'model_name="{model}"' in line and ('le="1.0"' in line or "_count" in line)]
        assert len({line.split()[-1] for line in single}) == 1  # every call ran one stream
