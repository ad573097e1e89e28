"""Streams of text-level servables (``runtimes.TextServable``: a LiteRT-LM ``.litertlm``
bundle), beside the step scheduler of appliance/core/generation.py.

Such a servable owns its tokenizer and KV cache and decodes by itself (LiteRT-LM runs one
session per request), so there is no step to share with other streams from here: each
stream is one thread iterating the servable's ``generate``, under the same limits
(``generation.max_streams``), handle, status and metrics as a token-level stream. Its
events are ("text", piece), one piece per decoded token; LiteRT-LM does not say the ids,
so ``Stream.tokens`` stays empty and the counts are pieces.

Thread-safety: ``TextStreams.start`` may be called from any thread; the counts are
guarded by the owner's lock; each stream's thread touches only its stream.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Protocol

from runtimes import RuntimeFailure, TextRequest, TextServable

from appliance.core.errors import from_runtime
from appliance.core.json_types import JSONObject
from appliance.core.streams import GenerationMetrics, Stream

log = logging.getLogger("appliance.generation")

# LiteRT-LM's sampler takes a top_k; "no cut" is one far above the vocabularies of the
# small models a device runs (the probability mass beyond it is nil in practice).
NO_TOP_K = 1 << 16
SEED_RANGE = 1 << 31  # LiteRT-LM's seed is a 32-bit signed int


class TextDriver:
    """What the API layer reads of a text-level servable (``generative.Driver``'s face)."""

    kind = "litertlm"
    batch_size = 1

    def __init__(self, servable: TextServable):
        self.servable = servable
        context = servable.context_length or 0
        # the positions a prompt may use: the engine puts its start token before it
        self.context_length = context - servable.prompt_overhead if context else None
        self.vocab_size = 1 << 31  # not said by LiteRT-LM: its own tokenizer checks ids

    def describe(self) -> JSONObject:
        return self.servable.describe()


class TextVocabulary:
    """A text-level servable's own tokenizer, with ``Vocabulary``'s face."""

    def __init__(self, servable: TextServable):
        self.servable = servable

    def encode(self, text: str, special: bool = True) -> list[int]:
        """``special``: the engine puts its own start token before a prompt, whatever is asked."""
        try:
            return self.servable.tokenize(text)
        except RuntimeFailure as exc:
            raise from_runtime(exc) from exc

    def decode(self, token: int) -> str:
        return self.decode_all([token])

    def decode_all(self, ids: list[int]) -> str:
        """A prompt of ids as the text the engine takes (``:generate``'s ``input_ids``)."""
        try:
            return self.servable.detokenize(ids)
        except RuntimeFailure as exc:
            raise from_runtime(exc) from exc


class Owner(Protocol):
    """What text streams need of their owner (appliance/core/generation.py ``Generation``)."""

    lock: threading.Lock
    metrics: GenerationMetrics

    def ended(self, stream: Stream, reason: str, error: str = "") -> None: ...


class TextStreams:
    """The running text streams of every version (module docstring)."""

    def __init__(self, owner: Owner):
        self.owner = owner
        self.running: dict[tuple[str, int], int] = {}  # (model, version) -> streams; owner.lock

    def count_in(self, stream: Stream) -> None:
        """(under owner.lock) A stream admitted: counted until it ends."""
        key = (stream.model, stream.version)
        self.running[key] = self.running.get(key, 0) + 1

    def start(self, stream: Stream, driver: TextDriver, text: str) -> None:
        threading.Thread(target=self._run, args=(stream, driver, text), daemon=True,
                         name=f"generate-text-{stream.model}-{stream.version}").start()

    def status(self) -> list[JSONObject]:
        """(under owner.lock) The status contribution."""
        return [{"model": m, "version": v, "streams": n} for (m, v), n in sorted(self.running.items())]

    def _run(self, stream: Stream, driver: TextDriver, text: str) -> None:
        """(its own thread) One stream, start to end; a backend failure ends it, never the service."""
        p = stream.params
        greedy = p.temperature <= 0
        request = TextRequest(text, p.max_new_tokens, top_k=1 if greedy else (p.top_k or NO_TOP_K),
                              top_p=1.0 if greedy else p.top_p, temperature=1.0 if greedy else p.temperature,
                              seed=self._seed(stream))
        reason, error = "", ""
        try:
            reason = self._pieces(stream, driver, request)
        except RuntimeFailure as exc:  # the engine refused or failed: this stream ends, the service goes on
            log.warning("text stream of %s version %s failed: %s", stream.model, stream.version, exc)
            reason, error = "error", str(from_runtime(exc))
        except Exception as exc:  # a bug: still end the stream (its reader waits, its version would never drain)
            log.exception("text stream of %s version %s failed", stream.model, stream.version)
            reason, error = "error", f"internal error: {type(exc).__name__}"
        if not reason:
            context = driver.context_length
            reason = ("length" if stream.generated >= p.max_new_tokens else
                      "context" if context is not None and len(stream.prompt) + stream.generated >= context else "stop")
        with self.owner.lock:
            key = (stream.model, stream.version)
            self.running[key] -= 1
            if not self.running[key]:
                del self.running[key]
        self.owner.ended(stream, reason, error)

    @staticmethod
    def _seed(stream: Stream) -> int:
        """The engine's seed: the request's, one apart per choice (``n``); without one, a fresh
        random seed (the engine's own default is fixed: the same text every time)."""
        base = stream.params.seed if stream.params.seed is not None else secrets.randbits(62)
        return (base + stream.index) % SEED_RANGE

    def _pieces(self, stream: Stream, driver: TextDriver, request: TextRequest) -> str:
        """Put the pieces on the stream's events; the cancel reason if it was cancelled."""
        metrics = self.owner.metrics
        ttft, tokens = metrics.ttft.labels(stream.model), metrics.tokens.labels(stream.model)
        pieces = driver.servable.generate(request)
        try:
            for piece in pieces:
                if stream.cancelled.is_set():
                    return stream.cancel_reason
                if stream.first_at is None:
                    stream.first_at = time.monotonic()
                    ttft.observe(stream.first_at - stream.started)
                stream.pieces.append(piece)
                stream.events.put(("text", piece))
                tokens.inc()
        finally:
            pieces.close()  # type: ignore[attr-defined]  # a generator: ends the engine's session early
        return ""


__all__ = ["TextDriver", "TextStreams", "TextVocabulary"]
