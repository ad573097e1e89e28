"""LiteRT-LM backend: ``.litertlm`` bundles (model + tokenizer + metadata) run by Google's
LiteRT-LM engine (``pip install litert-lm-api``), imported only when such a version loads.

A bundle is text in, text out: LiteRT-LM owns the tokenizer, the KV cache, prefill and
decode, so this servable has no tensor signatures; it offers ``generate`` (a stream of
text pieces, one per decoded token) instead of ``run`` (the ``TextServable`` protocol
below, which appliance/core/generation.py drives). One LiteRT-LM session per request (a
session holds one conversation's cache).

**One call per engine at a time.** LiteRT-LM 0.18.1's ``Engine`` is not thread-safe: a
``tokenize`` while another thread's session decodes aborts the whole process ("double free
or corruption (fasttop)", reproduced in tests/runtimes/test_litertlm.py), and sessions of one engine
run side by side abort the same way under load. So a loaded version holds a pool of
``engines`` engines (option, default 1) and every engine call (a whole session from prefill
to close, a tokenize, a detokenize) takes one engine for itself. Measured on the 2-core
box (bench/RESULTS.md, "LiteRT-LM"): four streams on one engine in turn give 5,269 tok/s,
on four engines 6,244 (+18 %) for ~2 MB more each on the tiny test bundle; an engine of a
real model holds its own compiled weights, so one engine is the default on a small device.

What LiteRT-LM expects of the model inside (found by running it, issue 25): litert-torch's
*transposed* KV cache (K [B, heads, L, dim], V [B, heads, dim, L]); a bundle of a model
converted with the default layout loads, then refuses every prompt ("Input token ids are
too long ... 4 >= 2"): it reads the context from the dimension that holds the head count.
``load`` checks the layout first and refuses such a bundle with the reason.

Registered as ``litertlm`` in ``runtimes.BACKENDS``. Importing this module imports numpy
only, and ``probe`` only looks for the package (``importlib.util.find_spec``): a device
without LiteRT-LM, or a version that is no bundle, never loads the native engine.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from .base import Availability, InputFailure, LoadFailure, MissingDependency, RuntimeFailure, SignatureInfo
from .json_types import JSONObject, ReadJSONObject

NAME = "litertlm"
SUFFIX = ".litertlm"


def _module() -> ModuleType:
    try:
        import litert_lm  # heavy (a native engine): only when a bundle loads
    except ImportError as exc:
        raise MissingDependency(f"LiteRT-LM is not installed (pip install litert-lm-api): {exc}") from exc
    return litert_lm


@dataclass(frozen=True)
class Request:
    """What one generation asks for; top_k 1 is greedy."""

    text: str
    max_new_tokens: int
    top_k: int = 1
    top_p: float = 1.0
    temperature: float = 1.0
    seed: int | None = None


@runtime_checkable
class TextServable(Protocol):
    """A servable that generates text itself (it owns tokenizer and cache): what the core's
    text path needs. ``generate`` may be called from several threads at once, one request
    each; closing its iterator early ends that request's decoding."""

    context_length: int  # positions of the model's cache (0: not known)
    prompt_overhead: int  # positions the engine adds to a prompt (a start token)

    def describe(self) -> JSONObject: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...

    def generate(self, request: Request) -> Iterator[str]: ...


class _Response(Protocol):
    texts: Sequence[str]


class _Session(Protocol):
    """A LiteRT-LM conversation session (``Engine.create_session``): what ``_decode`` calls."""

    def run_prefill(self, texts: list[str]) -> None: ...
    def run_decode_async(self) -> Iterable[_Response]: ...
    def cancel_process(self) -> None: ...
    def close(self) -> None: ...


class Engine(Protocol):
    """A LiteRT-LM ``Engine`` (one loaded bundle; litert_lm ships no types): what is used of it."""

    bos_token_id: int | None

    def tokenize(self, text: str) -> Sequence[int]: ...
    def detokenize(self, ids: list[int]) -> str: ...
    def create_session(self, *, apply_prompt_template: bool, sampler_config: object,
                       max_output_tokens: int) -> _Session: ...
    def close(self) -> None: ...


class _Waiter:
    """A caller waiting in ``EnginePool.lend``: set once an engine is handed to it."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.engine: Engine | None = None


class EnginePool:
    """Engines of one bundle, each lent to one caller at a time (module docstring), first
    come first served: an engine given back goes to the longest waiter, so a stream of
    tokenize calls cannot starve a waiting session. ``lend`` blocks until one is free.
    Thread-safe."""

    def __init__(self, engines: Sequence[Engine]):
        self.engines = list(engines)
        self._lock = threading.Lock()
        self._free = list(self.engines)
        self._waiting: deque[_Waiter] = deque()

    @contextmanager
    def lend(self) -> Iterator[Engine]:
        with self._lock:
            waiter = None if self._free and not self._waiting else _Waiter()
            if waiter is None:
                engine: Engine | None = self._free.pop()
            else:
                self._waiting.append(waiter)
        if waiter is not None:
            waiter.event.wait()
            engine = waiter.engine
        assert engine is not None, "an engine is handed over before the waiter is woken"
        try:
            yield engine
        finally:
            self._give_back(engine)

    def _give_back(self, engine: Engine) -> None:
        with self._lock:
            if not self._waiting:
                self._free.append(engine)
                return
            waiter = self._waiting.popleft()
        waiter.engine = engine
        waiter.event.set()

    def close(self) -> None:
        engines, self.engines = self.engines, []
        for engine in engines:
            engine.close()


class LiteRTLMServable:
    """One loaded bundle (module docstring). Not a tensor servable: ``run`` refuses."""

    backend = NAME
    platform = NAME
    strict_shapes = True
    reads_examples = False
    signatures: Mapping[str, SignatureInfo] = {}

    def __init__(self, path: str, engines: Sequence[Engine], module: ModuleType, context_length: int):
        self.path, self._lm, self.context_length = path, module, context_length
        self._pool: EnginePool | None = EnginePool(engines)
        self.prompt_overhead = 1 if engines[0].bos_token_id is not None else 0  # LiteRT-LM puts it first

    def describe(self) -> JSONObject:
        return {"convention": NAME, "decode_batch": 1, "context_length": self.context_length,
                "vocab_size": None,  # the tokenizer is LiteRT-LM's own; it does not say its size
                "engines": len(self._pool.engines) if self._pool else 0}

    @property
    def pool(self) -> EnginePool:
        if self._pool is None:
            raise RuntimeFailure("this LiteRT-LM bundle is closed")
        return self._pool

    def tokenize(self, text: str) -> list[int]:
        with self.pool.lend() as engine:
            return list(engine.tokenize(text))

    def detokenize(self, ids: list[int]) -> str:
        try:
            with self.pool.lend() as engine:
                return str(engine.detokenize(list(ids)))
        except RuntimeError as exc:  # an id the tokenizer does not have
            raise InputFailure(f"LiteRT-LM cannot detokenize these ids: {exc}") from exc

    def generate(self, request: Request) -> Iterator[str]:
        """Text pieces as LiteRT-LM decodes them; the prompt is used as is (no template:
        the caller renders one). Holds one engine from the first piece to the end (the
        generator waits for a free one). Closing the iterator early cancels the session."""
        sampler = self._lm.SamplerConfig(top_k=request.top_k, top_p=request.top_p,
                                         temperature=request.temperature, seed=request.seed)
        with self.pool.lend() as engine:
            session = engine.create_session(apply_prompt_template=False, sampler_config=sampler,
                                            max_output_tokens=request.max_new_tokens)
            yield from _decode(session, request.text)

    def run(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise InputFailure("a LiteRT-LM bundle takes text (generate), not tensors")

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


def _decode(session: _Session, text: str) -> Iterator[str]:
    """One session, prefill to close; cancelled when the caller stops early."""
    finished = False
    try:
        try:
            session.run_prefill([text])
        except RuntimeError as exc:  # LiteRT-LM logs the reason; its exception only says "failed"
            raise InputFailure(f"LiteRT-LM refused the prompt ({exc})") from exc
        try:
            for response in session.run_decode_async():
                yield from response.texts
        except RuntimeError as exc:
            raise RuntimeFailure(f"LiteRT-LM failed while decoding ({exc})") from exc
        finished = True
    finally:
        if not finished:
            session.cancel_process()
        session.close()


class LiteRTLMBackend:
    name = NAME

    def probe(self, device: ReadJSONObject) -> Availability:
        if importlib.util.find_spec("litert_lm") is None:  # not imported here: probe runs for every version
            return Availability(False, "LiteRT-LM is not installed (pip install litert-lm-api)")
        return Availability(True, "LiteRT-LM engine on CPU")

    def can_serve(self, version_dir: str) -> str | None:
        bundles = sorted(f for f in os.listdir(version_dir) if f.endswith(SUFFIX)) if os.path.isdir(version_dir) else []
        return bundles[0] if bundles else None

    def load(self, version_dir: str, options: ReadJSONObject) -> LiteRTLMServable:
        bundle = self.can_serve(version_dir)
        if bundle is None:
            raise LoadFailure(f"no {SUFFIX} bundle in {version_dir}")
        path = os.path.join(version_dir, bundle)
        context = _check_layout(path)
        lm = _module()
        configured = options.get("cache_dir")
        cache_dir = None if configured is None else str(configured)
        if cache_dir:  # LiteRT-LM refuses a cache directory that does not exist yet
            os.makedirs(cache_dir, exist_ok=True)
        engines: list[Engine] = []
        count = options.get("engines")
        try:
            for _ in range(max(1, int(count) if isinstance(count, (int, float, str)) and count else 1)):
                engines.append(lm.Engine(path, backend=lm.Backend.CPU(), max_num_tokens=options.get("max_num_tokens"),
                                         cache_dir=cache_dir))
        except Exception as exc:  # the engine's own words (a bad bundle, an unsupported model)
            for engine in engines:
                engine.close()
            raise LoadFailure(f"LiteRT-LM refused {bundle}: {exc}") from exc
        return LiteRTLMServable(path, engines, lm, context)


def _check_layout(path: str) -> int:
    """The context length of the bundle's prefill/decode model, which must use the transposed
    KV cache layout (module docstring). The bundle's header is read with LiteRT-LM's own
    builder package (litert-lm-builder) when it is installed; without it the bundle is
    trusted and LiteRT-LM's engine has the last word."""
    try:
        from litert_lm_builder import litertlm_peek
        from litert_lm_builder import litertlm_header_schema_py_generated as schema
    except ImportError:
        return 0
    import io

    from . import generative
    from .tflite import interpreter_module

    sections = litertlm_peek.read_litertlm_header(path, io.StringIO()).SectionMetadata()
    for i in range(sections.ObjectsLength() if sections else 0):
        section = sections.Objects(i)
        if section.DataType() != schema.AnySectionDataType.TFLiteModel:
            continue
        with open(path, "rb") as f:
            f.seek(section.BeginOffset())
            model = f.read(section.EndOffset() - section.BeginOffset())
        signatures = interpreter_module().Interpreter(model_content=model).get_signature_list()
        if "decode" not in signatures:
            continue
        decode = interpreter_module().Interpreter(model_content=model).get_signature_runner("decode")
        shapes = {n: tuple(int(x) for x in d["shape_signature"]) for n, d in decode.get_input_details().items()}
        kv = sorted(n for n in shapes if n.startswith(generative.KV_PREFIX))
        layout, context = generative.cache_layout(shapes, kv, shapes["mask"][-1] if "mask" in shapes else None)
        if layout != generative.TRANSPOSED_LAYOUT:
            raise LoadFailure(f"the bundle's model uses the {layout} KV cache layout; LiteRT-LM reads the context "
                              f"from the transposed one ({generative.TRANSPOSED_LAYOUT}) and would refuse every "
                              "prompt: convert with ExportConfig.kvcache_layout = KV_LAYOUT_TRANSPOSED")
        return context
    return 0


__all__ = ["EnginePool", "LiteRTLMBackend", "LiteRTLMServable", "Request", "TextServable"]
