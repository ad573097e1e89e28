"""Choosing the next token from a step's logits, and what a stream reports of that choice.

``sample``: greedy at temperature 0; else temperature, then top-k, then top-p (nucleus),
then min-p (tokens below ``min_p`` x the best one's probability dropped, vLLM's rule).
``process``: the logit processors before it, as OpenAI and vLLM define them: ``logit_bias``
added to the named tokens; ``repetition_penalty`` (CTRL's, vLLM's and transformers') divides
a positive logit and multiplies a negative one of every token in the prompt or the output;
``presence_penalty`` subtracts once and ``frequency_penalty`` per occurrence, for tokens of
the output (OpenAI's formula). ``choose``: the whole choice of one stream's step: the
processors, the grammar's mask (a stream with a ``Constraint``,
appliance/core/constraints.py), the sample, and the log-probabilities.

**Log-probabilities** are the model's own: log-softmax of the raw logits in float32,
before temperature, top-k/top-p and the grammar's mask. That is vLLM's default
(``logprobs_mode = "raw_logprobs"``: "the raw log-probabilities from the model output,
before any logit processing"), so a client reads the same numbers from either server; the
sampled token of a constrained stream may then have a lower logprob than a token the
grammar refused. Pure functions: no locks, no threads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from appliance.core.streams import TokenLogprob

if TYPE_CHECKING:
    from appliance.core.streams import Params, Stream

MAX_TOP_LOGPROBS = 20  # OpenAI's limit


def sample(logits: np.ndarray, params: Params, rng: np.random.Generator) -> int:
    """Greedy at temperature 0; else temperature, then top-k, then top-p (nucleus)."""
    if params.temperature <= 0:
        return int(np.argmax(logits))
    x = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < x.size:
        x[x < np.partition(x, -params.top_k)[-params.top_k]] = -np.inf
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs)
        before = np.cumsum(probs[order]) - probs[order]  # mass of the more likely tokens
        probs[order[before >= params.top_p]] = 0.0
        probs /= probs.sum()
    if params.min_p > 0:
        probs[probs < params.min_p * probs.max()] = 0.0
        probs /= probs.sum()
    return int(rng.choice(probs.size, p=probs))


def process(logits: np.ndarray, params: Params, prompt: list[int], output: list[int]) -> np.ndarray:
    """The logit processors (module docstring), on a copy; ids past the logits are ignored."""
    x = logits.astype(np.float32).copy()
    size = x.size
    for token, bias in params.logit_bias:
        if token < size:
            x[token] += bias
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.array([t for t in prompt + output if t < size], np.int64))
        x[seen] = np.where(x[seen] > 0, x[seen] / params.repetition_penalty, x[seen] * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and output:
        ids, counts = np.unique(np.array([t for t in output if t < size], np.int64), return_counts=True)
        x[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return x


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float32)
    top = x.max()
    return x - (top + np.log(np.exp(x - top).sum(dtype=np.float32)))  # type: ignore[no-any-return]  # numpy's stubs widen the expression to Any


def logprob_of(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The token's logprob and the ``top`` best (module docstring: raw, before any mask)."""
    lp = log_softmax(logits)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        k = min(top, lp.size)
        ids = np.argpartition(-lp, k - 1)[:k]
        ids = ids[np.lexsort((ids, -lp[ids]))]  # best first; ties by id, so the order is stable
        best = tuple((int(i), float(lp[i])) for i in ids)
    return TokenLogprob(token, float(lp[token]), best)


def choose(logits: np.ndarray, stream: Stream) -> tuple[int | None, TokenLogprob | None]:
    """(token, its logprob when asked) for one stream's step; token None: the stream's
    grammar allows only the end of the text (it is complete)."""
    params = stream.params
    scored = process(logits, params, stream.prompt, stream.tokens) if params.processed else logits
    if stream.constraint is not None:
        allowed = stream.constraint.allowed()
        if allowed.size != logits.size:  # a tokenizer smaller or larger than the model's logits
            allowed = np.pad(allowed[:logits.size], (0, max(0, logits.size - allowed.size)))
        if not allowed.any():
            return None, None
        scored = np.where(allowed, scored, -np.inf)
    token = sample(scored, params, stream.rng)
    if params.logprobs is None:
        return token, None
    return token, logprob_of(logits, token, params.logprobs)


__all__ = ["MAX_TOP_LOGPROBS", "choose", "log_softmax", "logprob_of", "process", "sample"]
