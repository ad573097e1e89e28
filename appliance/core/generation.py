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
(one call per stream per step, the bench's baseline). Which row a stream takes, and at
which offset (a shared-position conversion aligns streams of any length): appliance/core/lanes.py.
A version with a batch-1 decode beside its batched one runs a lane's step as one batched call
or one batch-1 call per stream, whichever its load measured cheaper for that many streams
(runtimes/decode_plan.py): batching never costs a lone stream; ``/api/status`` ->
``generation.versions`` shows the measured costs.

Each step of a stream chooses its token in appliance/core/sampling.py: a constrained stream
(``Stream.constraint``: OpenAI's ``response_format``, forced tool calls;
appliance/core/constraints.py) has its own mask over its row's logits, so constrained and
free streams share lanes and calls. ``n`` choices of one prompt (``start_choices``) are
prefilled once: the other rows get a copy of that row's cache, and the choices run in the
same calls.

**Limits**: a stream holds one row of its version's KV cache (``stream_bytes``: the bytes
the version's cache tensors declare for one sequence, read once per version), and streams run
while their rows fit in ``generation.cache_memory_mb`` (all models; ``cache_budget``);
``generation.max_streams`` is a ceiling on the count, ``max_streams_per_model`` (0: none) a
model's own. A request that finds no room waits in its model's queue, admitted as streams
end, fewest-running model first (appliance/core/stream_limits.py); ``/api/status`` ->
``generation.requests_waiting``, ``cache_bytes_used``/``cache_bytes_total`` and the metrics
``..._requests_waiting``, ``..._cache_bytes``, ``..._cache_limit_bytes`` show them.

Text-level servables (a LiteRT-LM ``.litertlm`` bundle) decode by themselves: their
streams run in appliance/core/text_streams.py under the same limits, handle, status and
metrics. Prompts as text: the version's tokenizer (appliance/core/tokenizer.py); chat templates and
stop strings: appliance/core/text.py; the
stream object, its parameters and metrics: appliance/core/streams.py.

A stream holds a manager handle on the version it started on until it ends, so a
hot-swap never breaks it: new streams get the new version, the old one drains (and
unloads) when its last stream finishes. Thread-safety: ``Generation.start``, ``prepare``
and ``Stream.cancel`` may be called from any thread; everything else runs in the loop
thread (a text stream's own thread for text-level servables).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, TypeVar, cast

import numpy as np
from prometheus_client import Gauge

from runtimes import RuntimeFailure, TextServable, generative

from appliance.core.cgroup import total_bytes
from appliance.core.config import GenerationConfig
from appliance.core.constraints import Constraint, Grammar, TokenTable
from appliance.core.errors import ApplianceError, InvalidArgument, from_runtime
from appliance.core.lanes import Lane, place
from appliance.core.sampling import choose
from appliance.core.stream_limits import SharedHandle, StreamLimits
from appliance.core.streams import EventSink, GenerationMetrics, Params, Stream, Tagged
from appliance.core.text import ChatTemplate
from appliance.core.tokenizer import load as load_tokenizer
from appliance.core.text_streams import TextDriver, TextStreams, TextVocabulary

if TYPE_CHECKING:
    from appliance.core.handle import Handle, VersionSlot

log = logging.getLogger("appliance.generation")
T = TypeVar("T")

# Test hook (EDGE_APPLIANCE_TEST_HOOKS=1, SIGUSR1: appliance/service): while cleared, every decode
# loop waits before its next step, as a wedged backend would, so a test can hold a stream running
# for as long as it needs instead of racing its length. Always set on a device.
STEPPING = threading.Event()
STEPPING.set()


AUTO_CACHE_SHARE = 4  # generation.cache_memory_mb = 0: streams' caches may hold 1/4 of the memory
# What a stream of a text-level servable (a LiteRT-LM bundle, whose engine keeps its session's
# cache out of sight) is counted as holding: a 1B model's KV cache at a 4k context, in fp16.
TEXT_STREAM_BYTES = 64 << 20


def cache_budget(config: GenerationConfig, memory: int | None = None) -> int:
    """The bytes all streams' KV caches may hold: ``generation.cache_memory_mb``, else a
    ``1/AUTO_CACHE_SHARE`` of ``memory`` (default: the host's, the cgroup's limit when smaller)."""
    if config.cache_memory_mb:
        return max(1, int(config.cache_memory_mb * (1 << 20)))
    if memory is None:
        memory = total_bytes(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return memory // AUTO_CACHE_SHARE


def stream_bytes(driver: "generative.Driver | TextDriver") -> int:
    """The cache bytes one stream of a version holds: one row of the cache its driver allocates
    from the cache tensors' declared shapes and types (``np.zeros``: the pages are not touched,
    so sizing it costs no memory); 0 for a generate_step without a cache (its history is a few
    bytes a token); ``TEXT_STREAM_BYTES`` for a text-level servable."""
    if isinstance(driver, TextDriver):
        return TEXT_STREAM_BYTES
    slots = driver.new_slots(1)
    return sum(int(a.nbytes) for a in slots.arrays.values()) // max(1, slots.capacity)


def freeze_steps(frozen: bool) -> None:
    """Hold (``frozen``) or release every decode loop before its next step (the test hook)."""
    if frozen:
        STEPPING.clear()
    else:
        STEPPING.set()

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
                STEPPING.wait()
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
        rows: dict[int, tuple[Lane, int]] = {}
        if self.driver.aligned:  # the longest prompt first: the shorter ones then align to it
            arrived.sort(key=lambda s: -s.position)
        for stream in arrived:
            lane, row, stream.offset = place(self.lanes, self.driver, stream, self.lane_size)
            lane.rows[row] = stream
            placed.append((lane, row, stream))
            rows[id(stream)] = (lane, row)
        for lane, row, stream in placed:  # all placed first: a failing prefill ends every one of them
            if stream.leader is None:
                self.driver.prefill(lane.slots, row, stream.prompt, stream.offset)
            else:  # another choice of a prompt prefilled above: a copy of its row
                src, src_row = rows[id(stream.leader)]
                self.driver.copy_row(src.slots, src_row, lane.slots, row)
        self._drop_cancelled()
        return True

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
            logits = self.driver.decode(lane.slots, rows, [s.next_input for s in streams],
                                        [s.physical for s in streams],
                                        [s.offset for s in streams] if self.driver.aligned else None)
            for call in lane.slots.calls:
                self._step_rows.observe(call)
            for i in reversed(range(len(rows))):  # backwards: finishing may move a later row into this one
                self._advance(lane, rows[i], streams[i], logits[i])
        self.lanes = [lane for lane in self.lanes if lane.active()]  # an idle lane frees its cache

    def _advance(self, lane: Lane, row: int, stream: Stream, logits: np.ndarray) -> None:
        if stream.vocab_limit is not None and logits.shape[-1] > stream.vocab_limit:
            logits = logits[:stream.vocab_limit]  # a padded lm_head: ids past the tokenizer are no tokens
        token, logprob = choose(logits, stream)
        if token is None or token in stream.params.stop:  # the grammar is complete, or a stop token
            self._finish(lane, row, "stop")
            return
        if stream.constraint is not None:
            stream.constraint.advance(token)
        if stream.first_at is None:
            stream.first_at = time.monotonic()
            self._ttft.observe(stream.first_at - stream.started)
        if logprob is not None:
            stream.logprobs.append(logprob)  # before the event: its reader finds it there
        stream.tokens.append(token)
        stream.events.put(("token", token))
        self._tokens.inc()
        stream.next_input, stream.position = token, stream.position + 1
        context = self.driver.context_length
        if stream.constraint is not None and stream.constraint.finished:
            self._finish(lane, row, "stop")
        elif len(stream.tokens) >= stream.params.max_new_tokens:
            self._finish(lane, row, "length")
        elif context is not None and stream.physical >= context:
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
    """Every decode loop and text stream of the service; the API layer's entry point (module
    docstring). One per core (``Generation.of``): ``:generate`` and the OpenAI API share it."""

    _instances: "weakref.WeakKeyDictionary[Any, Generation]" = weakref.WeakKeyDictionary()
    _instances_lock = threading.Lock()

    def __init__(self, core: Any):
        self.core = core
        self.lock = threading.Lock()
        self.loops: dict[int, DecodeLoop] = {}  # id(VersionSlot) -> its loop
        self.text = TextStreams(self)
        self._versions: dict[int, tuple[Any, dict[str, Any]]] = {}  # id(slot) -> (slot, what was read of it)
        self.metrics: GenerationMetrics = GenerationMetrics(core.metrics.registry)
        self.counts = {"streams_started": 0, "streams_cancelled": 0, "tokens_generated": 0}
        self.admitted = 0  # streams queued or running, all versions
        self._budget: tuple[float, int] = (-1.0, 0)  # (generation.cache_memory_mb, the bytes it means)
        self.limits = StreamLimits(lambda: self.config, self._generative_models, self.lock, self.metrics,
                                   self.cache_total)
        self.holding: dict[int, int] = {}  # id(stream) -> the cache bytes it was counted in with
        registry = core.metrics.registry
        self._cache_gauge = Gauge("edge_appliance_generation_cache_bytes", "KV cache bytes held by running streams",
                                  ["model_name"], registry=registry)
        self._cache_limit = Gauge("edge_appliance_generation_cache_limit_bytes",
                                  "KV cache bytes all streams may hold (generation.cache_memory_mb)", registry=registry)
        self._cache_models: set[str] = set()
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
        return self.core.config.generation  # type: ignore[no-any-return]  # self.core is typed Any here (the core object, not its Protocol)

    def cache_total(self) -> int:
        """``cache_budget`` of the current configuration (the host's memory read once)."""
        mb = self.config.cache_memory_mb
        if self._budget[0] != mb:
            self._budget = (mb, cache_budget(self.config))
        return self._budget[1]

    def stream_bytes(self, handle: "Handle") -> int:
        """The cache bytes one stream of the handle's version holds (``stream_bytes``, read once)."""
        driver, _ = self.prepare(handle)
        return self._read(handle.slot, "stream_bytes", lambda slot: stream_bytes(driver))

    def _read(self, slot: "VersionSlot", key: str, build: "Callable[[VersionSlot], T]") -> T:
        """``build(slot)``, read once per loaded version (unloaded versions are forgotten)."""
        with self.lock:
            for gone in [k for k, (s, _) in self._versions.items() if s.servable is None]:
                del self._versions[gone]
            cached = self._versions.get(id(slot))
            if cached is None or cached[0] is not slot:
                cached = self._versions[id(slot)] = (slot, {})
            if key in cached[1]:
                return cast(T, cached[1][key])
        value = build(slot)  # outside the lock: it may read files
        with self.lock:
            cached[1][key] = value
        return value

    def prepare(self, handle: "Handle") -> tuple[Any, Any]:
        """The driver and vocabulary of the handle's version: a ``generative.Driver`` and a
        ``Vocabulary`` (None when the version ships none), or for a text-level servable a
        ``TextDriver`` and ``TextVocabulary``. InvalidArgument when it cannot generate."""
        slot = handle.slot
        driver, vocab = self._read(slot, "driver", self._detect)
        if driver is None:
            raise InvalidArgument(f"{slot.model} version {slot.version} cannot generate: it has neither "
                                  "'prefill'+'decode' signatures (LiteRT LLM) nor a 'generate_step' signature, "
                                  "and is no LiteRT-LM bundle")
        return driver, vocab

    @staticmethod
    def _detect(slot: Any) -> tuple[Any, Any]:
        servable = slot.servable
        if isinstance(servable, TextServable):
            return TextDriver(servable), TextVocabulary(servable)
        try:
            driver = generative.detect(servable)
        except RuntimeFailure as exc:
            raise InvalidArgument(f"{slot.model} version {slot.version}: {exc}") from exc
        return driver, (load_tokenizer(slot.path) if driver is not None else None)

    def can_generate(self, handle: "Handle") -> bool:
        try:
            self.prepare(handle)
        except InvalidArgument:
            return False
        return True

    def chat_template(self, handle: "Handle") -> ChatTemplate:
        """The chat template of the handle's version (appliance/core/text.py)."""
        return self._read(handle.slot, "chat_template", lambda slot: ChatTemplate.load(slot.path))

    def token_table(self, handle: "Handle") -> TokenTable:
        """The version's vocabulary as the grammar engine reads it (built once per version)."""
        _, vocab = self.prepare(handle)
        if vocab is None or isinstance(vocab, TextVocabulary):
            raise InvalidArgument("constrained decoding needs a token-level model with its tokenizer "
                                  "(tokenizer.json, tokenizer.model or assets/vocab.json); a LiteRT-LM bundle "
                                  "decodes by itself")
        return self._read(handle.slot, "token_table", lambda slot: TokenTable.of(vocab))

    def start(self, prompt: list[int], params: Params, handle: Any, model: str, text: str | None = None) -> Stream:
        """Queue a stream on the handle's version; the loop owns (and releases) the handle.
        ``text``: the prompt as text, for a text-level servable (else its ids are detokenized)."""
        return self.start_choices(prompt, params, handle, model, text, tagged=False)[0]

    def start_choices(self, prompt: list[int], params: Params, handle: Any, model: str, text: str | None = None,
                      n: int = 1, grammar: Grammar | None = None, tagged: bool = True,
                      events: EventSink | None = None) -> list[Stream]:
        """``n`` streams of one prompt (OpenAI's choices), sharing its prefill and the handle
        (released with the last of them); each constrained by ``grammar`` when given.
        Admitted together or refused together (``Unavailable`` over the limits). ``tagged``:
        every stream's events go to one queue, ``streams[0].choice_events``, as (index, kind,
        value), or to ``events`` when given."""
        driver, vocab = self.prepare(handle)
        text_level = isinstance(driver, TextDriver)
        if text_level and params.stop:
            raise InvalidArgument("field 'stop': stop token ids need a token-level model; this version is a "
                                  "LiteRT-LM bundle, which stops at its own stop tokens")
        table = self.token_table(handle) if grammar is not None else None
        prompt_text = (text if text is not None else vocab.decode_all(prompt)) if text_level else ""
        shared = SharedHandle(handle, n) if n > 1 else handle
        streams = [Stream(prompt, params, shared, model) for _ in range(n)]
        merged: EventSink = events if events is not None else queue.SimpleQueue()  # a LoopQueue: read on a loop
        for i, stream in enumerate(streams):
            stream.text_level, stream.index = text_level, i
            if i and params.seed is not None:  # each choice samples its own, reproducibly
                stream.rng = np.random.default_rng((params.seed, i))
            if tagged:
                stream.events, stream.choice_events = Tagged(merged, i), merged  # type: ignore[assignment]  # Tagged is the queue's interface over a shared queue
            stream.leader = streams[0] if i and not text_level else None
            stream.constraint = Constraint(grammar, table) if grammar is not None and table is not None else None
            stream.vocab_limit = None if text_level or vocab is None else vocab.size
        self.limits.refresh()
        loop = self._admit(streams, handle.slot, driver, model, text_level, self.stream_bytes(handle))
        self.metrics.active.labels(model).inc(n)
        # the queue's series exist (at 0) for a model whose requests never had to wait
        self.metrics.waiting.labels(model)
        self.metrics.queue_wait.labels(model)
        if text_level:
            for stream in streams:
                self.text.start(stream, driver, prompt_text)
        elif loop is not None:
            loop.thread.start()
        self.publish()
        return streams

    def _admit(self, streams: list[Stream], slot: Any, driver: Any, model: str, text_level: bool,
               each: int) -> "DecodeLoop | None":
        """Count the streams in (``each`` cache bytes apiece; or refuse them all) and queue them;
        the loop to start, if new."""
        with self.lock:
            self.limits.admit(model, len(streams), each)
            for stream in streams:
                self.holding[id(stream)] = each
            self.admitted += len(streams)
            self.counts["streams_started"] += len(streams)
            if text_level:
                for stream in streams:
                    self.text.count_in(stream)
                return None
            loop = self.loops.get(id(slot))
            fresh = loop is None
            if loop is None:
                loop = self.loops[id(slot)] = DecodeLoop(self, slot, driver, self._lane_size(slot, driver))
            loop.pending.extend(streams)
            return loop if fresh else None

    def _generative_models(self) -> list[str]:
        """The models whose serving version can generate (what the stream limits keep room for)."""
        manager = self.core.manager
        if manager is None:
            return []
        out = []
        for name in manager.snapshot():
            try:
                with manager.handle(name, judged=False) as held:
                    if self.can_generate(held):
                        out.append(name)
            except ApplianceError:  # no version serves now
                continue
        return out

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
        stream.release(ApplianceError(error) if reason == "error" else None)
        m = self.metrics
        m.active.labels(stream.model).dec()
        m.streams.labels(stream.model, reason).inc()
        if summary["tokens_per_s"]:
            m.stream_rate.labels(stream.model).observe(summary["tokens_per_s"])
        with self.lock:
            self.admitted -= 1
            self.limits.leave(stream.model, self.holding.pop(id(stream), 0))
            self.counts["tokens_generated"] += stream.generated
            self.counts["streams_cancelled"] += reason == "cancelled"
        self.publish()

    def publish(self) -> None:
        """The status contribution (``/api/status`` -> ``generation``); a fresh dict each time."""
        with self.lock:
            loops = list(self.loops.values())
            status = {**self.counts, "active_streams": self.admitted, "step_batching": self.config.step_batching,
                      "streams_per_model": dict(self.limits.running),
                      "requests_waiting": len(self.limits.waiting), "waiting_per_model": self.limits.queued(),
                      "cache_bytes_used": self.limits.cache_bytes, "cache_bytes_total": self.cache_total(),
                      "cache_bytes_per_model": dict(self.limits.cache_used),
                      "longest_wait_s": round(time.monotonic() - min(w.since for w in self.limits.waiting), 3)
                      if self.limits.waiting else 0.0,
                      "loops": [{"model": lp.model, "version": lp.slot.version, "lane_size": lp.lane_size,
                                 **lp.driver.describe()} for lp in loops],
                      # what each version generates with, as its load measured it (decode costs)
                      "versions": [{"model": slot.model, "version": slot.version, **read["driver"][0].describe(),
                                    **({"cache_bytes_per_stream": read["stream_bytes"]}
                                       if "stream_bytes" in read else {})}
                                   for slot, read in self._versions.values()
                                   if isinstance(read.get("driver", (None,))[0], generative.Driver)],
                      "text_streams": self.text.status()}
            held = dict(self.limits.cache_used)
            self._cache_models.update(held)
            for model in self._cache_models:
                self._cache_gauge.labels(model).set(held.get(model, 0))
            self._cache_limit.set(self.cache_total())
        self.status = status
