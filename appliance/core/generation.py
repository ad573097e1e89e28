"""The step scheduler: token streams of generative models, batched per decode step.

One decode loop (a thread) per loaded model version, started by its first stream and
ended when it has none left. Each pass of the loop admits the streams that arrived since
the last one (their prompts are prefilled into free rows of the server-side KV cache),
drops the cancelled ones, then runs one decode step for every active stream, several
streams per call (continuous batching): a new stream joins at the next step, a finished
or cancelled one leaves at once and frees its row. Streams are packed into *lanes*: one
lane is one ``runtimes.generative.Slots`` of ``lane_size`` rows, i.e. one decode call per
step: the fixed decode batch of a LiteRT LLM, else ``max_streams_per_step`` (default the
model's ``batching.max_batch_size``); ``step_batching = false`` makes every lane one row
(one call per stream per step, the bench's baseline).

**Text-level servables** (``runtimes.TextServable``: a LiteRT-LM ``.litertlm`` bundle) own
their tokenizer and KV cache, so there is nothing to batch per step from here: each such
stream is one thread iterating the servable's ``generate`` (LiteRT-LM runs one session
per request), with the same limits (``generation.max_streams``), handle, status and
metrics. Their events are ("text", piece), one piece per decoded token; LiteRT-LM does
not say the ids, so ``tokens`` stays empty and the counts are pieces.

Chat prompts are rendered here too (``ChatTemplate``): the version's own Jinja template
(``assets/chat_template.jinja``, else ``chat_template`` of ``assets/tokenizer_config.json``,
Hugging Face's conventions), else ``DEFAULT_CHAT_TEMPLATE``. ``StopText`` cuts a text
stream at the first stop string, holding back what could still become one.

A stream holds a manager handle on the version it started on until it ends, so a
hot-swap never breaks it: new streams get the new version, the old one drains (and
unloads) when its last stream finishes. Thread-safety: ``Generation.start`` and
``Stream.cancel`` may be called from any thread; everything else runs in the loop thread
(a text stream's own thread for text-level servables).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from runtimes import RuntimeFailure, TextServable, generative
from runtimes.litertlm import Request as TextRequest

from appliance.core.config import GenerationConfig
from appliance.core.errors import InvalidArgument, Unavailable, from_runtime

log = logging.getLogger("appliance.generation")

VOCAB_FILE = os.path.join("assets", "vocab.json")
CHAT_TEMPLATE_FILE = os.path.join("assets", "chat_template.jinja")
TOKENIZER_CONFIG_FILE = os.path.join("assets", "tokenizer_config.json")
# The template of a version that ships none: role tags on lines of their own.
DEFAULT_CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message.role }}|>\n{{ message.content }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TEXT_TOP_K = 1 << 16  # LiteRT-LM's sampler wants a top_k; "no cut" is one larger than any vocabulary
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Params:
    """What a request asks for; validated by the API layer."""

    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no cut
    top_p: float = 1.0
    seed: int | None = None
    stop: frozenset[int] = frozenset()


class Vocabulary:
    """``assets/vocab.json`` of a version: a JSON list of token strings (index = id).
    Text is encoded by greedy longest match, which is exact for character vocabularies."""

    def __init__(self, tokens: Sequence[str]):
        self.tokens = list(tokens)
        self._ids = {t: i for i, t in reversed(list(enumerate(self.tokens)))}
        self._longest = max((len(t) for t in self.tokens), default=1)

    @classmethod
    def load(cls, version_dir: str) -> "Vocabulary | None":
        path = os.path.join(version_dir, VOCAB_FILE)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            tokens = json.load(f)
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise InvalidArgument(f"{VOCAB_FILE} of this version is not a JSON list of strings")
        return cls(tokens)

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for size in range(min(self._longest, len(text) - i), 0, -1):
                token = self._ids.get(text[i:i + size])
                if token is not None:
                    ids.append(token)
                    i += size
                    break
            else:
                raise InvalidArgument(f"field 'text': character {text[i]!r} at offset {i} is not in the "
                                      "model's vocabulary")
        return ids

    def decode(self, token: int) -> str:
        return self.tokens[token] if 0 <= token < len(self.tokens) else ""


class TextVocabulary:
    """A text-level servable's own tokenizer, with ``Vocabulary``'s face (ids of the prompt)."""

    def __init__(self, servable: TextServable):
        self.servable = servable

    def encode(self, text: str) -> list[int]:
        return self.servable.tokenize(text)

    def decode(self, token: int) -> str:
        return self.servable.detokenize([token])


class TextDriver:
    """What the API layer reads of a text-level servable (``generative.Driver``'s face):
    LiteRT-LM decodes itself, one stream per request (module docstring)."""

    kind = "litertlm"
    batch_size = 1

    def __init__(self, servable: TextServable):
        self.servable = servable
        context = servable.context_length or 0
        # the positions a prompt may use: LiteRT-LM puts a start token before it
        self.context_length = context - servable.prompt_overhead if context else None
        self.vocab_size = 1 << 31  # not said by LiteRT-LM: ids are checked by its tokenizer

    def describe(self) -> dict[str, Any]:
        return self.servable.describe()


class ChatTemplate:
    """A chat prompt template (module docstring): ``render(messages)`` -> prompt text.
    Rendered in Jinja's immutable sandbox, as Hugging Face renders ``chat_template``."""

    def __init__(self, source: str, origin: str, bos: str = "", eos: str = ""):
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # Flask's own dependency

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _template_error
        try:
            self.template = env.from_string(source)
        except Exception as exc:  # jinja2.TemplateError: the version's template is broken
            raise InvalidArgument(f"the chat template of this version ({origin}) does not parse: {exc}") from exc
        self.origin, self.bos, self.eos = origin, bos, eos

    @classmethod
    def load(cls, version_dir: str) -> "ChatTemplate":
        path = os.path.join(version_dir, CHAT_TEMPLATE_FILE)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return cls(f.read(), CHAT_TEMPLATE_FILE)
        config = _tokenizer_config(version_dir)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the "default" one
            template = next((t.get("template") for t in template if isinstance(t, dict)
                             and t.get("name") == "default"), None)
        if isinstance(template, str):
            return cls(template, TOKENIZER_CONFIG_FILE, _special(config.get("bos_token")),
                       _special(config.get("eos_token")))
        return cls(DEFAULT_CHAT_TEMPLATE, "the default template")

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        try:
            return str(self.template.render(messages=list(messages), add_generation_prompt=True,
                                            bos_token=self.bos, eos_token=self.eos))
        except InvalidArgument:
            raise
        except Exception as exc:  # the template refused these messages
            raise InvalidArgument(f"field 'messages': the chat template ({self.origin}) failed: {exc}") from exc


def _template_error(message: str) -> None:
    raise InvalidArgument(f"field 'messages': {message}")


def _special(token: Any) -> str:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _tokenizer_config(version_dir: str) -> dict[str, Any]:
    path = os.path.join(version_dir, TOKENIZER_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"{TOKENIZER_CONFIG_FILE} of this version is not readable JSON: {exc}") from exc
    return config if isinstance(config, dict) else {}


class StopText:
    """Stop strings over a text stream: ``feed(piece)`` -> (text that may be shown, stopped).
    Text that could still be the start of a stop string is held back until it cannot; the
    stop string itself and anything after it are never shown."""

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.keep = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, piece: str) -> tuple[str, bool]:
        text = self.held + piece
        if not self.stops:
            return text, False
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            return text[:cut], True
        safe = len(text)
        for size in range(min(self.keep, len(text)), 0, -1):  # the longest tail that begins a stop
            if any(s.startswith(text[-size:]) for s in self.stops):
                safe = len(text) - size
                break
        self.held = text[safe:]
        return text[:safe], False

    def flush(self) -> str:
        """What is held back when the stream ends without a stop string."""
        held, self.held = self.held, ""
        return held


class Stream:
    """One generation request. The HTTP side reads ``events``: ("token", id), then one
    ("done", summary) or ("error", message)."""

    def __init__(self, prompt: list[int], params: Params, handle: Any, model: str):
        self.prompt, self.params, self.model = prompt, params, model
        self._handle = handle
        self.slot = handle.slot
        self.version = self.slot.version
        self.events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.cancel_reason = "cancelled"
        self.tokens: list[int] = []
        self.pieces: list[str] = []  # a text-level servable's output (its ids are not known)
        self.text_level = False
        self.rng = np.random.default_rng(params.seed)
        self.started = time.monotonic()
        self.first_at: float | None = None
        self.position = len(prompt) - 1  # where the next decode input (prompt[-1] first) goes
        self.next_input = prompt[-1]

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the loop to drop this stream at its next step: a client went away
        ("cancelled"), or the API layer found a stop string ("stop")."""
        self.cancel_reason = reason
        self.cancelled.set()

    @property
    def generated(self) -> int:
        """Tokens generated so far (pieces, for a text-level servable)."""
        return len(self.tokens) + len(self.pieces)

    def release(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.__exit__(None, None, None)

    def summary(self, reason: str) -> dict[str, Any]:
        elapsed = time.monotonic() - self.started
        ttft = (self.first_at - self.started) if self.first_at else None
        decode_s = time.monotonic() - self.first_at if self.first_at else 0.0
        return {"finish_reason": reason, "model_name": self.model, "model_version": str(self.version),
                "prompt_tokens": len(self.prompt), "completion_tokens": self.generated,
                "time_to_first_token_ms": round(ttft * 1000, 3) if ttft is not None else None,
                "tokens_per_s": round((self.generated - 1) / decode_s, 2) if self.generated > 1 and decode_s > 0
                else None, "elapsed_ms": round(elapsed * 1000, 3)}


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
    return int(rng.choice(probs.size, p=probs))


class GenerationMetrics:
    """Time to first token, tokens/s per stream and in total, active streams, rows per step."""

    def __init__(self, registry: Any):
        self.ttft = Histogram("edge_appliance_generation_time_to_first_token_seconds",
                              "From request to first generated token", ["model_name"], buckets=TTFT_BUCKETS_S,
                              registry=registry)
        self.tokens = Counter("edge_appliance_generation_tokens", "Generated tokens (rate() = total tokens/s)",
                              ["model_name"], registry=registry)
        self.stream_rate = Histogram("edge_appliance_generation_stream_tokens_per_second",
                                     "Decode speed of each finished stream", ["model_name"], buckets=RATE_BUCKETS,
                                     registry=registry)
        self.active = Gauge("edge_appliance_generation_active_streams", "Streams admitted and not finished",
                            ["model_name"], registry=registry)
        self.streams = Counter("edge_appliance_generation_streams", "Finished streams by finish reason",
                               ["model_name", "finish_reason"], registry=registry)
        self.step_rows = Histogram("edge_appliance_generation_step_rows", "Streams per decode call",
                                   ["model_name"], buckets=ROW_BUCKETS, registry=registry)


@dataclass
class Lane:
    """One decode call per step: ``slots`` (the cache rows) and the stream in each row."""

    slots: generative.Slots
    rows: list[Stream | None] = field(default_factory=list)

    def active(self) -> list[int]:
        return [i for i, s in enumerate(self.rows) if s is not None]


class DecodeLoop:
    """The loop of one model version (module docstring)."""

    def __init__(self, owner: "Generation", slot: Any, driver: generative.Driver, lane_size: int):
        self.owner, self.slot, self.driver = owner, slot, driver
        # Streams per lane: a fixed decode batch holds that many, unless step batching is off
        # (lane_size 1): then each stream has a lane, and the call's other rows stay empty.
        self.lane_size = min(driver.batch_size, lane_size) if driver.batch_size else lane_size
        self.packed = driver.batch_size is None  # a dynamic batch runs rows 0..n-1: keep them packed
        self.model = slot.model
        metrics = owner.metrics  # this model's series, looked up once: the step loop runs per token
        self._step_rows, self._ttft = metrics.step_rows.labels(self.model), metrics.ttft.labels(self.model)
        self._tokens = metrics.tokens.labels(self.model)
        self.pending: list[Stream] = []  # guarded by owner.lock
        self.lanes: list[Lane] = []
        self.thread = threading.Thread(target=self._run, name=f"generate-{slot.model}-{slot.version}", daemon=True)

    @property
    def count(self) -> int:
        return sum(len(lane.active()) for lane in self.lanes)

    def _run(self) -> None:
        try:
            while self._admit():
                self._step()
        except Exception as exc:  # a backend failure ends this version's streams, never the service
            log.exception("decode loop of %s version %s failed", self.model, self.slot.version)
            message = str(from_runtime(exc)) if isinstance(exc, RuntimeFailure) else f"{type(exc).__name__}: {exc}"
            with self.owner.lock:
                self.owner.loops.pop(id(self.slot), None)
                orphans, self.pending = self.pending, []
            for lane in self.lanes:
                for row in reversed(lane.active()):
                    self._finish(lane, row, "error", message)
            for stream in orphans:
                self.owner.ended(stream, "error", message)
        self.owner.publish()

    def _admit(self) -> bool:
        """Take new streams into free rows; False (loop ends) when nothing is left to do."""
        with self.owner.lock:
            arrived, self.pending = self.pending, []
            if not arrived and not self.count:
                self.owner.loops.pop(id(self.slot), None)  # under the lock: no stream can slip in
                return False
        placed = []
        for stream in arrived:
            if stream.cancelled.is_set():
                self.owner.ended(stream, stream.cancel_reason)
                continue
            lane, row = self._free_row()
            lane.rows[row] = stream
            placed.append((lane, row, stream))
        for lane, row, stream in placed:  # all placed first: a failing prefill ends every one of them
            self.driver.prefill(lane.slots, row, stream.prompt)
        self._drop_cancelled()
        return True

    def _free_row(self) -> tuple[Lane, int]:
        for lane in self.lanes:
            for row, stream in enumerate(lane.rows):
                if stream is None:
                    return lane, row
        lane = Lane(self.driver.new_slots(self.lane_size), [None] * self.lane_size)
        self.lanes.append(lane)
        return lane, 0

    def _drop_cancelled(self) -> None:
        for lane in self.lanes:
            for row in reversed(lane.active()):
                stream = lane.rows[row]
                if stream is not None and stream.cancelled.is_set():
                    self._finish(lane, row, stream.cancel_reason)

    def _step(self) -> None:
        for lane in self.lanes:
            rows = lane.active()
            if not rows:
                continue
            streams = [lane.rows[r] for r in rows]
            logits = self.driver.decode(lane.slots, rows, [s.next_input for s in streams],  # type: ignore[union-attr]
                                        [s.position for s in streams])  # type: ignore[union-attr]
            self._step_rows.observe(len(rows))
            for i in reversed(range(len(rows))):  # backwards: finishing may move a later row into this one
                self._advance(lane, rows[i], streams[i], logits[i])  # type: ignore[arg-type]
        self.lanes = [lane for lane in self.lanes if lane.active()]  # an idle lane frees its cache

    def _advance(self, lane: Lane, row: int, stream: Stream, logits: np.ndarray) -> None:
        token = sample(logits, stream.params, stream.rng)
        if token in stream.params.stop:
            self._finish(lane, row, "stop")
            return
        if stream.first_at is None:
            stream.first_at = time.monotonic()
            self._ttft.observe(stream.first_at - stream.started)
        stream.tokens.append(token)
        stream.events.put(("token", token))
        self._tokens.inc()
        stream.next_input, stream.position = token, stream.position + 1
        context = self.driver.context_length
        if len(stream.tokens) >= stream.params.max_new_tokens:
            self._finish(lane, row, "length")
        elif context is not None and stream.position >= context:
            self._finish(lane, row, "context")

    def _finish(self, lane: Lane, row: int, reason: str, error: str = "") -> None:
        stream = lane.rows[row]
        assert stream is not None
        lane.rows[row] = None
        if self.packed:
            last = max(lane.active(), default=-1)
            if last > row:
                self.driver.move(lane.slots, last, row)
                lane.rows[row], lane.rows[last] = lane.rows[last], None
        self.owner.ended(stream, reason, error)


class Generation:
    """Every decode loop of the service; the API layer's entry point (module docstring).
    One per core (``Generation.of``): ``:generate`` and the OpenAI API share its limits."""

    _instances: "weakref.WeakKeyDictionary[Any, Generation]" = weakref.WeakKeyDictionary()
    _instances_lock = threading.Lock()

    def __init__(self, core: Any):
        self.core = core
        self.lock = threading.Lock()
        self.loops: dict[int, DecodeLoop] = {}  # id(VersionSlot) -> its loop
        self._drivers: dict[int, tuple[Any, Any, Any]] = {}  # id(slot) -> (slot, driver, vocabulary)
        self._templates: dict[int, tuple[Any, ChatTemplate]] = {}
        self.text_streams: dict[tuple[str, int], int] = {}  # (model, version) -> running text streams
        self.metrics = GenerationMetrics(core.metrics.registry)
        self.counts = {"streams_started": 0, "streams_cancelled": 0, "tokens_generated": 0}
        self.admitted = 0  # streams queued or running, all versions
        self.status: dict[str, Any] = {}
        self.publish()
        core.add_status("generation", lambda: self.status)

    @classmethod
    def of(cls, core: Any) -> "Generation":
        """The core's one ``Generation``, built on first use: its metrics exist only where
        generation is used, and every API that generates shares its stream limit."""
        with cls._instances_lock:
            generation = cls._instances.get(core)
            if generation is None:
                generation = cls._instances[core] = cls(core)
            return generation

    @property
    def config(self) -> GenerationConfig:
        return self.core.config.generation  # type: ignore[no-any-return]

    def prepare(self, handle: Any) -> tuple[Any, Any]:
        """The driver and vocabulary of the handle's version (cached while it is loaded):
        a ``generative.Driver`` and ``Vocabulary`` (or None), or for a text-level servable a
        ``TextDriver`` and ``TextVocabulary``."""
        slot = handle.slot
        with self.lock:
            for key in [k for k, (s, _, _) in self._drivers.items() if s.servable is None]:
                del self._drivers[key]  # unloaded versions
            cached = self._drivers.get(id(slot))
        if cached is None or cached[0] is not slot:
            cached = (slot, *self._detect(slot))
            with self.lock:
                self._drivers[id(slot)] = cached
        if cached[1] is None:
            raise InvalidArgument(f"{slot.model} version {slot.version} cannot generate: it has neither "
                                  "'prefill'+'decode' signatures (LiteRT LLM) nor a 'generate_step' signature, "
                                  "and is no LiteRT-LM bundle")
        return cached[1], cached[2]

    @staticmethod
    def _detect(slot: Any) -> tuple[Any, Any]:
        servable = slot.servable
        if isinstance(servable, TextServable):
            return TextDriver(servable), TextVocabulary(servable)
        try:
            driver = generative.detect(servable)
        except RuntimeFailure as exc:
            raise InvalidArgument(f"{slot.model} version {slot.version}: {exc}") from exc
        return driver, (Vocabulary.load(slot.path) if driver is not None else None)

    def can_generate(self, handle: Any) -> bool:
        try:
            self.prepare(handle)
        except InvalidArgument:
            return False
        return True

    def chat_template(self, handle: Any) -> ChatTemplate:
        """The chat template of the handle's version (module docstring), cached while loaded."""
        slot = handle.slot
        with self.lock:
            for key in [k for k, (s, _) in self._templates.items() if s.servable is None]:
                del self._templates[key]
            cached = self._templates.get(id(slot))
        if cached is None or cached[0] is not slot:
            cached = (slot, ChatTemplate.load(slot.path))
            with self.lock:
                self._templates[id(slot)] = cached
        return cached[1]

    def start(self, prompt: list[int], params: Params, handle: Any, model: str, text: str | None = None) -> Stream:
        """Queue a stream on the handle's version; the loop owns (and releases) the handle.
        ``text``: the prompt as text, for a text-level servable (else its ids are detokenized)."""
        slot = handle.slot
        driver, _ = self.prepare(handle)
        if isinstance(driver, TextDriver) and params.stop:
            raise InvalidArgument("field 'stop': stop token ids need a token-level model; this version is a "
                                  "LiteRT-LM bundle, which stops at its own stop tokens")
        stream = Stream(prompt, params, handle, model)
        stream.text_level = isinstance(driver, TextDriver)
        try:
            prompt_text = "" if not stream.text_level else text if text is not None else \
                driver.servable.detokenize(prompt)
        except RuntimeFailure as exc:
            raise from_runtime(exc) from exc
        with self.lock:
            if self.admitted >= self.config.max_streams:
                raise Unavailable(f"{self.admitted} streams are running, the limit is generation.max_streams = "
                                  f"{self.config.max_streams}; retry later")
            self.admitted += 1
            self.counts["streams_started"] += 1
            if stream.text_level:
                key = (slot.model, slot.version)
                self.text_streams[key] = self.text_streams.get(key, 0) + 1
                loop, fresh = None, False
            else:
                loop = self.loops.get(id(slot))
                fresh = loop is None
                if loop is None:
                    loop = self.loops[id(slot)] = DecodeLoop(self, slot, driver, self._lane_size(slot, driver))
                loop.pending.append(stream)
        self.metrics.active.labels(model).inc()
        if stream.text_level:
            threading.Thread(target=self._run_text, args=(stream, driver, prompt_text),
                             name=f"generate-text-{slot.model}-{slot.version}", daemon=True).start()
        elif fresh:
            assert loop is not None
            loop.thread.start()
        self.publish()
        return stream

    def _run_text(self, stream: Stream, driver: TextDriver, text: str) -> None:
        """(its own thread) One stream of a text-level servable, start to end."""
        p = stream.params
        greedy = p.temperature <= 0
        request = TextRequest(text, p.max_new_tokens, top_k=1 if greedy else (p.top_k or TEXT_TOP_K),
                              top_p=1.0 if greedy else p.top_p, temperature=1.0 if greedy else p.temperature,
                              seed=None if p.seed is None else p.seed % (1 << 31))
        ttft, tokens = self.metrics.ttft.labels(stream.model), self.metrics.tokens.labels(stream.model)
        reason, error = "", ""
        try:
            pieces = driver.servable.generate(request)
            try:
                for piece in pieces:
                    if stream.cancelled.is_set():
                        reason = stream.cancel_reason
                        break
                    if stream.first_at is None:
                        stream.first_at = time.monotonic()
                        ttft.observe(stream.first_at - stream.started)
                    stream.pieces.append(piece)
                    stream.events.put(("text", piece))
                    tokens.inc()
            finally:
                pieces.close()  # type: ignore[attr-defined]
        except Exception as exc:  # a backend failure ends this stream, never the service
            log.warning("text stream of %s version %s failed: %s", stream.model, stream.version, exc)
            reason = "error"
            error = str(from_runtime(exc)) if isinstance(exc, RuntimeFailure) else f"{type(exc).__name__}: {exc}"
        if not reason:
            context = driver.context_length
            reason = ("length" if stream.generated >= p.max_new_tokens else
                      "context" if context is not None and len(stream.prompt) + stream.generated >= context else "stop")
        with self.lock:
            key = (stream.model, stream.version)
            self.text_streams[key] -= 1
            if not self.text_streams[key]:
                del self.text_streams[key]
        self.ended(stream, reason, error)

    def _lane_size(self, slot: Any, driver: generative.Driver) -> int:
        if not self.config.step_batching:
            return 1
        if driver.batch_size:
            return driver.batch_size
        entry = self.core.manager.entry(slot.model)
        return self.config.max_streams_per_step or self.core.config.batching_for(entry.config).max_batch_size

    def ended(self, stream: Stream, reason: str, error: str = "") -> None:
        """(loop thread) A stream left its loop: tell its reader, release its version."""
        summary = stream.summary(reason)
        stream.events.put(("error", error) if reason == "error" else ("done", summary))
        stream.release()
        m = self.metrics
        m.active.labels(stream.model).dec()
        m.streams.labels(stream.model, reason).inc()
        if summary["tokens_per_s"]:
            m.stream_rate.labels(stream.model).observe(summary["tokens_per_s"])
        with self.lock:
            self.admitted -= 1
            self.counts["tokens_generated"] += stream.generated
            self.counts["streams_cancelled"] += reason == "cancelled"
        self.publish()

    def publish(self) -> None:
        """The status contribution (``/api/status`` -> ``generation``); a fresh dict each time."""
        with self.lock:
            loops = list(self.loops.values())
            status = {**self.counts, "active_streams": self.admitted, "step_batching": self.config.step_batching,
                      "loops": [{"model": lp.model, "version": lp.slot.version, "lane_size": lp.lane_size,
                                 **lp.driver.describe()} for lp in loops],
                      "text_streams": [{"model": m, "version": v, "streams": n}
                                       for (m, v), n in sorted(self.text_streams.items())]}
        self.status = status
