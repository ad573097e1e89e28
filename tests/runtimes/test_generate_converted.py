"""Token generation of models litert-torch really converted (``tests/support/litert_llm.py``),
served by the real ``appliance serve``, compared token by token with a reference greedy
decoder that drives the model's LiteRT signature runners directly.

Covered shapes: the default export (prefill 8/32, cache 128, f32 and dynamic int8), a
decode batch of 4 (one shared ``input_pos``), the mask as an input, the transposed KV
cache with and without a mask, and caches of 120 and 124 positions (no multiple of the
prefill windows: the last windows must not run past the cache end). Prompts run from one
token to the last position the cache holds.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support import litert_llm
from tests.support.servers import model_copy
from tests.api.test_generate import generate, sse

N = 12  # new tokens per answer
MODELS = litert_llm.SERVABLE
HEADS, DIM = litert_llm.HEADS, litert_llm.HEAD_DIM
LENGTHS = (1, 2, 9, 33, 70)  # one token; inside one window; past the 8 and the 32 windows; several chunks


@pytest.fixture(scope="session")
def lt_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("litert_torch", reason="litert-torch converts the models (the test extra)")
    return litert_llm.models()


@pytest.fixture(scope="module")
def server(module_server: Any, lt_models: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = model_copy(lt_models, tmp_path_factory.mktemp("lt"), *MODELS)
    return module_server("--models", str(base))


class References:
    """Reference answers, computed once per (model, prompt, n)."""

    def __init__(self, models: Path):
        self.models, self.decoders, self.answers = models, {}, {}
        self.lock = threading.Lock()

    def __call__(self, model: str, prompt: list[int], n: int = N) -> list[int]:
        key = (model, tuple(prompt), n)
        with self.lock:
            if key not in self.answers:
                if model not in self.decoders:
                    self.decoders[model] = litert_llm.Reference(self.models / model / "1" / "model.tflite",
                                                                litert_llm.SPECS[model])
                self.answers[key] = self.decoders[model].greedy(prompt, n)
            return self.answers[key]


@pytest.fixture(scope="module")
def reference(lt_models: Path) -> References:
    return References(lt_models)


def answer(server: Any, model: str, prompt: list[int], n: int = N) -> dict[str, Any]:
    r = generate(server, model, input_ids=prompt, max_new_tokens=n)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("model", MODELS)
def test_answers_equal_the_reference(server: Any, reference: References, model: str) -> None:
    for length in LENGTHS:
        prompt = litert_llm.prompt(length)
        got = answer(server, model, prompt)
        assert got["tokens"] == reference(model, prompt), f"prompt of {length} tokens"
        assert got["finish_reason"] == "length" and got["prompt_tokens"] == length


@pytest.mark.parametrize("model", MODELS)
def test_a_stream_delivers_the_reference_tokens(server: Any, reference: References, model: str) -> None:
    prompt = litert_llm.prompt(41)
    with requests.post(f"{server.url}/v1/models/{model}:generate", stream=True, timeout=120,
                       data=json.dumps({"input_ids": prompt, "max_new_tokens": N, "stream": True})) as r:
        assert r.status_code == 200
        events = list(sse(r))
    assert [d["token"] for name, d in events if name == "message"] == reference(model, prompt)
    assert events[-1][0] == "done" and events[-1][1]["completion_tokens"] == N


@pytest.mark.parametrize("model", MODELS)
def test_four_concurrent_streams_each_get_the_reference(server: Any, reference: References, model: str) -> None:
    """Equal lengths (so a shared-position decode batch of 4 runs them in one call) and
    different ones, streamed and not, all at once."""
    jobs = [(litert_llm.prompt(12, seed), seed % 2 == 0) for seed in range(2)] + \
           [(litert_llm.prompt(length), True) for length in (5, 40)]
    results: dict[int, list[int]] = {}

    def run(i: int, prompt: list[int], streamed: bool) -> None:
        if not streamed:
            results[i] = answer(server, model, prompt)["tokens"]
            return
        with requests.post(f"{server.url}/v1/models/{model}:generate", stream=True, timeout=120,
                           data=json.dumps({"input_ids": prompt, "max_new_tokens": N, "stream": True})) as r:
            results[i] = [d["token"] for name, d in sse(r) if name == "message"]

    threads = [threading.Thread(target=run, args=(i, p, s)) for i, (p, s) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i, (prompt, _) in enumerate(jobs):
        assert results.get(i) == reference(model, prompt), f"stream {i} ({len(prompt)} tokens)"


@pytest.mark.parametrize("model", MODELS)
def test_prompts_near_and_past_the_cache_end(server: Any, reference: References, model: str) -> None:
    context = litert_llm.SPECS[model].cache
    for length in (context - 20, context - 14, context - 10, context - 3, context - 1):
        prompt = litert_llm.prompt(length)
        got = answer(server, model, prompt, N)
        room = context - (length - 1)  # decode positions left: prompt[-1] goes at length - 1
        assert got["tokens"] == reference(model, prompt, N), f"prompt of {length} tokens"
        assert got["completion_tokens"] == min(N, room)
        assert got["finish_reason"] == ("length" if N < room else "context"), length
    r = generate(server, model, input_ids=litert_llm.prompt(context), max_new_tokens=2)
    assert r.status_code == 400 and f"holds {context}" in r.json()["error"]


@pytest.mark.parametrize(("model", "lengths"), [("lt_c120", (97, 106, 110, 113, 119)),
                                                 ("lt_c124", (106, 110, 117, 121, 123))])
def test_windows_never_run_past_the_cache_end(server: Any, reference: References, model: str,
                                              lengths: tuple[int, ...]) -> None:
    """Issue 25 bug a: a 32-window at 96 would write 96..127 into a 120-cache; LiteRT clamps
    the slice back to 88..119 and overwrites context the answer depends on."""
    for length in lengths:
        prompt = litert_llm.prompt(length)
        assert answer(server, model, prompt, 4)["tokens"] == reference(model, prompt, 4), f"prompt of {length}"


def _version(server: Any, model: str) -> dict[str, Any]:
    try:
        versions = server.status().get("models", {}).get(model, {}).get("versions", [])
    except requests.RequestException:  # still starting
        return {}
    return versions[0] if versions else {}


@pytest.mark.parametrize("model", MODELS)
def test_the_version_status_says_what_it_generates_with(server: Any, model: str) -> None:
    spec = litert_llm.SPECS[model]
    generation = _version(server, model)["decision"]["generation"]
    assert generation["convention"] == "litert-llm"
    assert generation["decode_batch"] == spec.decode_batch
    assert generation["context_length"] == spec.cache  # bug b: the transposed cache's L, not its heads
    assert generation["vocab_size"] == litert_llm.VOCAB
    assert generation["prefill_windows"] == list(spec.prefill)
    assert generation["kv_layout"] == ("BNTH/BNHT" if spec.transposed else "BTNH/BTNH")
    assert generation["mask_input"] == spec.mask


def _shapes(metadata: dict[str, Any], signature: str) -> dict[str, list[int]]:
    inputs = metadata["metadata"]["signature_def"]["signature_def"][signature]["inputs"]
    return {name: [int(d["size"]) for d in t["tensor_shape"]["dim"]] for name, t in inputs.items()}


def test_metadata_shapes_are_the_models_own(server: Any) -> None:
    plain = server.get("/v1/models/lt_plain/metadata").json()
    assert _shapes(plain, "decode")["input_pos"] == [1]
    assert _shapes(plain, "prefill_32")["input_pos"] == [32]
    assert _shapes(plain, "prefill_8")["kv_cache_k_0"] == [1, 128, HEADS, DIM]
    b4 = _shapes(server.get("/v1/models/lt_b4/metadata").json(), "decode")
    assert b4["tokens"] == [4, 1] and b4["kv_cache_v_1"] == [4, 128, HEADS, DIM]
    transposed = _shapes(server.get("/v1/models/lt_t/metadata").json(), "decode")
    assert transposed["kv_cache_k_0"] == [1, HEADS, 128, DIM] and transposed["kv_cache_v_0"] == [1, HEADS, DIM, 128]


@pytest.mark.parametrize(("model", "reason"), [
    ("lt_ambiguous", "the KV cache layout cannot be decided"),
    # LiteRT's own words, from the warm-up step: which of its two depends on where it is caught
    # (in the process, XNNPack's reshape; in the trial's child, the allocation that follows it)
    ("g3_b4", "XNNPack delegate failed to reshape|Failed to allocate tensors"),
])
def test_a_version_that_cannot_generate_is_refused_at_load(start_server: Any, lt_models: Path, tmp_path: Path,
                                                           model: str, reason: str) -> None:
    base = model_copy(lt_models, tmp_path, model)
    srv = start_server("--models", str(base), ready=False)
    error = srv.wait_for(lambda: _version(srv, model).get("error"), 120, f"{model} version 1 to be refused")
    assert re.search(reason, error), error
    assert _version(srv, model)["state"] == "END"
    events = [e for e in srv.status()["events"] if e["kind"] == "load_failed" and e["model"] == model]
    assert events and re.search(reason, events[0]["message"])
    assert generate(srv, model, input_ids=[1, 2], max_new_tokens=2).status_code in (404, 503)


def test_streams_of_different_lengths_share_calls_when_the_mask_is_an_input(server: Any,
                                                                            reference: References) -> None:
    """lt_b4m: a shared input_pos with the mask as an input. Streams of 5, 12, 23 and 40 tokens
    are aligned onto one position (the shorter ones at an offset) and decode in one call per
    step; before, each ran a full batch-4 call of its own at every step. step_rows counts
    the rows of each real model call."""
    def rows(text: str) -> tuple[float, float]:
        lines = [line for line in text.splitlines() if 'model_name="lt_b4m"' in line]
        single = next((float(x.split()[-1]) for x in lines
                       if x.startswith("edge_appliance_generation_step_rows_bucket") and 'le="1.0"' in x), 0.0)
        total = next((float(x.split()[-1]) for x in lines
                      if x.startswith("edge_appliance_generation_step_rows_count")), 0.0)
        return single, total

    before = rows(server.get("/monitoring/prometheus/metrics").text)
    prompts = [litert_llm.prompt(length) for length in (40, 5, 12, 23)]
    results: dict[int, list[int]] = {}
    # the longest first, and running (its first token out): the others then join its lane, shorter
    # prompts at an offset (a longer prompt than a lane's position would open a lane of its own)
    with requests.post(f"{server.url}/v1/models/lt_b4m:generate", stream=True, timeout=120,
                       data=json.dumps({"input_ids": prompts[0], "max_new_tokens": 40, "stream": True})) as r:
        events = sse(r)
        first = [next(events)[1]["token"]]
        threads = [threading.Thread(target=lambda i, p: results.__setitem__(
            i, answer(server, "lt_b4m", p, 40)["tokens"]), args=(i, p)) for i, p in enumerate(prompts) if i]
        for t in threads:
            t.start()
        results[0] = first + [d["token"] for name, d in events if name == "message"]
    for t in threads:
        t.join(180)
    for i, prompt in enumerate(prompts):
        assert results.get(i) == reference("lt_b4m", prompt, 40), f"{len(prompt)} tokens"
    single, total = rows(server.get("/monitoring/prometheus/metrics").text)
    calls, alone = total - before[1], single - before[0]
    assert calls <= 4 * 40 and alone <= calls  # step_rows counts real calls (how many share: timing's)


def test_a_stream_joins_a_lane_at_an_offset_where_the_mask_allows() -> None:
    """lanes.place, deterministic: on an aligned driver a shorter prompt joins a running lane
    at an offset, a longer one (or one that would not fit its max_new_tokens) opens a lane;
    without the mask input only a stream at the lane's own position joins it."""
    from types import SimpleNamespace

    from appliance.core.lanes import Lane, place
    from runtimes.generative import Slots

    def stream(position: int, new: int = 20) -> Any:
        return SimpleNamespace(position=position, offset=0, leader=None, params=SimpleNamespace(max_new_tokens=new),
                               physical=position)

    driver = SimpleNamespace(aligned=True, shared_position=True, context_length=128,
                             new_slots=lambda n: Slots(n))
    running = stream(39)
    lanes = [Lane(Slots(4), [running, None, None, None])]
    lane, row, offset = place(lanes, driver, stream(4), 4)  # type: ignore[arg-type]
    assert (lane, row, offset) == (lanes[0], 1, 35)
    assert place(lanes, driver, stream(50), 4)[0] is not lanes[0]  # longer than the lane's position
    assert place(lanes, driver, stream(4, new=100), 4)[0] is not lanes[0]  # 35 + 4 + 100 > 128
    plain = SimpleNamespace(aligned=False, shared_position=True, context_length=128, new_slots=lambda n: Slots(n))
    lanes = [Lane(Slots(4), [running, None, None, None]), Lane(Slots(4), [stream(4), None, None, None])]
    assert place(lanes, plain, stream(4), 4)[:2] == (lanes[1], 1)  # the lane at its own position
