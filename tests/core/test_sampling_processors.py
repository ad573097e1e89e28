"""The logit processors of appliance/core/sampling.py, against OpenAI's and vLLM's formulas:
logit_bias, repetition_penalty, presence_penalty, frequency_penalty, min_p; and the OpenAI
fields that set them (appliance/api/openai_fields.py), refused by name when out of range."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import orjson
import pytest

from appliance.api.openai_fields import CHAT, FieldError, params, processors_asked, read
from appliance.core.sampling import choose, process, sample
from appliance.core.streams import Params

CONFIG = SimpleNamespace(default_max_new_tokens=64, max_new_tokens_limit=1024)


def test_penalties_follow_the_published_formulas() -> None:
    logits = np.array([2.0, -2.0, 1.0, 0.5, 3.0], np.float32)
    p = Params(8, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((3, 10.0),))
    out = process(logits, p, prompt=[0], output=[1, 2, 2])
    # repetition (prompt and output): positive / 2, negative * 2; then presence once, frequency per count
    assert out[0] == pytest.approx(1.0)
    assert out[1] == pytest.approx(-4.0 - 0.5 - 0.25)
    assert out[2] == pytest.approx(0.5 - 0.5 - 0.5)
    assert out[3] == pytest.approx(10.5) and out[4] == pytest.approx(3.0)
    assert logits[0] == 2.0  # a copy: the raw logits (for logprobs) are untouched


def test_logit_bias_steers_a_greedy_choice() -> None:
    stream = SimpleNamespace(params=Params(4, logit_bias=((1, 100.0),)), prompt=[0], tokens=[], constraint=None,
                             rng=np.random.default_rng(0))
    token, _ = choose(np.array([5.0, 0.0, 1.0], np.float32), stream)
    assert token == 1


def test_min_p_drops_tokens_below_its_share_of_the_best() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(1)
    picked = {sample(logits, Params(1, temperature=1.0, min_p=0.5), rng) for _ in range(300)}
    assert picked == {0, 1}  # 0.15 and 0.05 are below 0.5 x 0.5


def test_the_fields_set_them_and_refuse_bad_values_by_name() -> None:
    body = {"presence_penalty": 1, "frequency_penalty": -0.5, "logit_bias": {"7": -100}, "top_k": 5, "min_p": 0.1,
            "repetition_penalty": 1.3}
    p = params(body, CONFIG, chat=True, room=100, vocab_size=32)
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias, p.top_k, p.min_p, p.repetition_penalty) == \
        (1.0, -0.5, ((7, -100.0),), 5, 0.1, 1.3)
    assert processors_asked(body) == "presence_penalty" and processors_asked({"top_k": 3, "min_p": 0}) is None
    with pytest.raises(FieldError) as outside:  # the model's vocabulary: known to params() only
        params({"logit_bias": {"99": 1}}, CONFIG, chat=True, room=100, vocab_size=32)
    assert outside.value.param == "logit_bias" and "0..31" in outside.value.message
    # the bounds are declared (appliance/api/schemas/openai.py): read() refuses them by name
    for bad in ({"logit_bias": {"1": 101}}, {"logit_bias": {"x": 1}}, {"presence_penalty": 3}, {"min_p": 2},
                {"repetition_penalty": 0}, {"frequency_penalty": "1"}, {"top_k": 1.5}):
        with pytest.raises(FieldError) as refused:
            read(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], **bad}), CHAT)
        assert refused.value.param == next(iter(bad)), bad
        assert refused.value.message.startswith(f"field '{next(iter(bad))}' must be "), refused.value.message


def test_max_tokens_defaults_to_and_is_capped_by_the_rest_of_the_context() -> None:
    assert params({}, CONFIG, chat=True, room=3000).max_new_tokens == 3000  # not 64
    assert params({"max_tokens": 5000}, CONFIG, chat=False, room=3000).max_new_tokens == 3000  # not a 400 at 1024
    assert params({"max_completion_tokens": 7}, CONFIG, chat=True, room=3000).max_new_tokens == 7
    assert params({}, CONFIG, chat=True, room=None).max_new_tokens == 64  # no context known: the config's
