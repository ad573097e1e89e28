"""A version with a batch-1 decode beside its batched one runs each step on whichever its load
measured cheaper (runtimes/decode_plan.py, runtimes/generative.py), and both give the same
greedy answers.

The model is litert-torch's real conversion with both decode signatures
(tests/support/litert_dual.py: ``decode`` batch 1, ``decode_4`` batch 4, the mask as an input),
loaded by the LiteRT backend. Which signature runs is read from the calls the servable gets;
where a test needs one side slower than the other, the servable's own calls are slowed by a
fixed amount on that signature, so the measurement, not a setting, must find it.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import pytest
import requests

from runtimes.decode_plan import DecodePlan

DELAY_S = 0.1  # far above a tiny decode call (~0.1-2 ms even on a loaded box)


def test_the_plan_runs_batched_from_the_first_group_it_pays_for() -> None:
    plan = DecodePlan(batch=4)
    assert not plan.measured and plan.use_batched(1)  # unmeasured: as before (every group batched)
    plan.decide(single_ms=1.0, batched_ms=2.5)
    assert [plan.use_batched(m) for m in (1, 2, 3, 4)] == [False, False, True, True]
    plan.decide(single_ms=1.0, batched_ms=4.5)  # a full batch costs more than its rows one by one
    assert not any(plan.use_batched(m) for m in (1, 2, 3, 4))
    assert plan.describe()["batched_from"] == "never"
    plan.decide(single_ms=1.0, batched_ms=0.5)
    assert plan.use_batched(1)


@pytest.fixture(scope="module")
def dual(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("litert_torch", reason="litert-torch converts the model (the test extra)")
    pytest.importorskip("ai_edge_litert", reason="LiteRT runs the model")
    from tests.support import litert_dual

    return litert_dual.models() / "dual_tiny" / "1"


class Counted:
    """The LiteRT servable, counting calls per signature and slowing one of them."""

    def __init__(self, servable: Any, slow: str | None = None):
        self.servable, self.slow = servable, slow
        self.calls: dict[str, int] = {}

    @property
    def signatures(self) -> Any:
        return self.servable.signatures

    def run(self, signature: str, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls[signature] = self.calls.get(signature, 0) + 1
        if signature == self.slow:
            time.sleep(DELAY_S)
        return self.servable.run(signature, feeds)  # type: ignore[no-any-return]  # the servable's own dict

    def close(self) -> None:
        self.servable.close()


@pytest.fixture
def load(dual: Path) -> Iterator[Any]:
    from runtimes.tflite import TFLiteBackend

    opened: list[Any] = []

    def make(slow: str | None = None) -> Counted:
        servable = Counted(TFLiteBackend().load(str(dual), {"num_threads": 1, "delegate": "none", "pool_size": 1}),
                           slow)
        opened.append(servable)
        return servable

    yield make
    for servable in opened:
        servable.close()


def _step_one_row(driver: Any, servable: Counted) -> str:
    """Which signature one decode step of one stream ran."""
    slots = driver.new_slots(4)
    driver.prefill(slots, 0, [5, 6, 7])
    servable.calls.clear()
    driver.decode(slots, [0], [7], [2], [0])
    assert slots.calls == [1]
    (name,) = servable.calls
    return name


def test_a_lone_stream_runs_batch_1_where_the_batched_call_measured_slower(load: Any) -> None:
    from runtimes import generative

    servable = load(slow="decode_4")
    driver = generative.detect(servable)
    assert isinstance(driver, generative.LiteRTLLM)
    assert (driver.decode_sig, driver.single_sig, driver.batch_size) == ("decode_4", "decode", 4)
    driver.warm_up()  # what the loader does: one prompt and step, then the measurement
    plan = driver.plan
    assert plan.measured and plan.batched_ms is not None and plan.batched_ms >= DELAY_S * 1000
    assert not plan.use_batched(1)
    assert _step_one_row(driver, servable) == "decode"
    assert generative.detect(servable) is driver  # the decode loop gets the measured driver
    assert driver.describe()["batched_from"] == plan.describe()["batched_from"]


def test_a_lone_stream_runs_batched_where_batch_1_measured_slower(load: Any) -> None:
    from runtimes import generative

    servable = load(slow="decode")
    driver = generative.detect(servable)
    driver.warm_up()
    assert driver.plan.measured and driver.plan.batched_from == 1
    assert _step_one_row(driver, servable) == "decode_4"


def _greedy(driver: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Every prompt in one lane at one shared position (equal lengths), ``n`` greedy steps."""
    slots = driver.new_slots(4)
    rows = list(range(len(prompts)))
    for row, prompt in enumerate(prompts):
        driver.prefill(slots, row, prompt)
    tokens = [p[-1] for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(n):
        position = len(prompts[0]) - 1 + step
        logits = driver.decode(slots, rows, tokens, [position] * len(rows), [0] * len(rows))
        tokens = [int(np.argmax(row)) for row in logits]
        for got, token in zip(out, tokens):
            got.append(token)
    return out


def test_both_paths_give_the_same_greedy_answers(load: Any) -> None:
    from runtimes import generative
    from tests.support import litert_llm

    driver = generative.detect(load())
    prompts = [litert_llm.prompt(12, seed) for seed in range(4)]
    answers = {}
    for single_ms, batched_ms, name in ((1000.0, 1.0, "batched"), (1.0, 1000.0, "batch-1")):
        driver.plan.decide(single_ms, batched_ms)
        answers[name] = _greedy(driver, prompts, 16)
        assert driver.plan.use_batched(4) == (name == "batched")
    assert answers["batched"] == answers["batch-1"]
    assert len({tuple(a) for a in answers["batched"]}) > 1  # four prompts, not one answer four times


def test_the_service_measures_at_load_and_streams_the_same_answers(start_server: Any, dual: Path,
                                                                    tmp_path: Path) -> None:
    """``appliance serve``: the status shows the measured costs, and four concurrent streams of
    one length (batched when it pays) answer as each alone (batch 1 when that pays)."""
    import shutil

    from tests.support import litert_llm

    shutil.copytree(dual, tmp_path / "models" / "dual" / "1")
    server = start_server("--models", str(tmp_path / "models"))
    generation = server.status()["models"]["dual"]["versions"][0]["decision"]["generation"]
    assert generation["decode_signature"] == "decode_4" and generation["batch1_signature"] == "decode"
    prompts = [litert_llm.prompt(12, seed) for seed in range(4)]

    def answer(prompt: list[int]) -> list[int]:
        r = requests.post(f"{server.url}/v1/models/dual:generate", timeout=120,
                          data=json.dumps({"input_ids": prompt, "max_new_tokens": 12}))
        assert r.status_code == 200, r.text
        return r.json()["tokens"]  # type: ignore[no-any-return]  # the JSON answer's list

    alone = [answer(p) for p in prompts]
    together: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i, p: together.__setitem__(i, answer(p)), args=(i, p))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert [together.get(i) for i in range(4)] == alone
    (version,) = [v for v in server.status()["generation"]["versions"] if v["model"] == "dual"]
    assert set(version["decode_ms"]) == {"1", "4"} and min(version["decode_ms"].values()) > 0
    assert version["batched_from"] in (1, 2, 3, 4, "never")


def test_a_lone_stream_zeroes_only_its_own_row_and_garbage_in_the_others_changes_nothing(load: Any) -> None:
    """A lane's rows are allocated unwritten (``Slots.blank``): a lone stream on the batch-1 decode
    zeroes its own row only (zeroing the whole batch-4 lane cost its time to first token), and
    whatever the other rows hold (NaN here, which the additive mask does not hide) reaches no
    answer: a row is zeroed when a stream first takes it, and every row before a batched call."""
    from runtimes import generative
    from tests.support import litert_llm

    driver = generative.detect(load())
    prompts = [litert_llm.prompt(12, seed) for seed in range(2)]
    clean = {}
    for name, (single_ms, batched_ms) in {"batch-1": (1.0, 1000.0), "batched": (1000.0, 1.0)}.items():
        driver.plan.decide(single_ms, batched_ms)
        clean[name] = _greedy(driver, prompts[:1], 8)
    assert clean["batch-1"] == clean["batched"]

    for name, (single_ms, batched_ms) in {"batch-1": (1.0, 1000.0), "batched": (1000.0, 1.0)}.items():
        driver.plan.decide(single_ms, batched_ms)
        slots = driver.new_slots(4)
        assert slots.blank == {0, 1, 2, 3}
        for array in slots.arrays.values():
            array[...] = np.nan  # what an unwritten row may hold
        driver.prefill(slots, 0, prompts[0])
        assert slots.blank == {1, 2, 3}  # its own row zeroed before the prefill fed it, no other
        token, got = prompts[0][-1], []
        for step in range(8):
            logits = driver.decode(slots, [0], [token], [len(prompts[0]) - 1 + step], [0])
            token = int(np.argmax(logits[0]))
            got.append(token)
        assert got == clean[name][0], name
        assert slots.blank == (set() if name == "batched" else {1, 2, 3})
