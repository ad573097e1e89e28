"""Backend selection: which backend serves a model version on this device, and why.

``select`` returns a :class:`Decision` (chosen backend and, for every backend, whether
it was available, whether it could serve this version's artifacts, and the figures
measured) together with the loaded servable. When several backends can serve a version
it measures instead of guessing: each candidate is loaded and timed on a few batch-1 and
batch-N calls, and the fastest wins (on a CPU box LiteRT/XNNPACK beats TensorFlow by an
order of magnitude at batch 1, so no fixed order is right everywhere). The outcome is
cached by the caller's ``cache`` (keyed by device and version) so a restart loads the
winner directly. If the chosen backend fails to load, the next one is tried and the
failure is recorded in the decision.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, MutableMapping

import numpy as np

from . import generative
from .base import DEFAULT_SIGNATURE, Backend, LoadFailure, RuntimeFailure, Servable, SignatureInfo
from .json_types import JSONObject, ReadJSONObject, ReadJSONValue

TIMING_BATCH = 8
TIMING_ROUNDS = 5


@dataclass
class Considered:
    backend: str
    available: bool
    reason: str
    artifact: str | None = None
    batch1_ms: float | None = None
    batch_n_ms: float | None = None
    load_error: str | None = None


@dataclass
class Decision:
    chosen: str | None
    how: str  # pinned | only | measured | cached | policy | none
    reason: str
    considered: list[Considered] = field(default_factory=list)
    # What the loaded version generates with, when it has generation signatures (convention,
    # decode batch, context length, vocabulary size...: ``runtimes.generative``); else None.
    generation: JSONObject | None = None

    def to_dict(self) -> JSONObject:
        record: JSONObject = asdict(self)  # strings, numbers and the JSON above: a JSON object
        return record


def synthetic_inputs(signature: SignatureInfo, batch: int) -> dict[str, np.ndarray]:
    """Inputs of the right dtype and shape (unknown dimensions = 1, batch dimension = batch)."""
    feeds = {}
    for name, spec in signature.inputs.items():
        shape = list(spec.shape) if spec.shape is not None else [batch]
        shape = [batch if i == 0 and spec.batched else (d if d and d > 0 else 1) for i, d in enumerate(shape)]
        if spec.is_string:
            feeds[name] = np.full(shape, b"", dtype=object)
        else:
            feeds[name] = np.zeros(shape, dtype=spec.dtype)
    return feeds


def synthetic_bytes(signature: SignatureInfo, batch: int) -> int:
    """Bytes the synthetic inputs of ``signature`` at ``batch`` would hold, from the declared
    shapes alone (nothing allocated): a model declaring an input of [1, 2^31-1] floats asks for
    8 GiB, which no synthetic call may allocate."""
    total = 0
    for spec in signature.inputs.values():
        shape = list(spec.shape) if spec.shape is not None else [batch]
        dims = [batch if i == 0 and spec.batched else (d if d and d > 0 else 1) for i, d in enumerate(shape)]
        total += int(np.prod(dims, dtype=object)) * (spec.dtype.itemsize if not spec.is_string else 8)
    return total


def time_servable(servable: Servable, batch_n: int = TIMING_BATCH,
                  max_feed_bytes: int | None = None) -> tuple[float | None, float | None]:
    """Median milliseconds of a batch-1 and a batch-N call, on the default signature or, when
    a synthetic call of it fails, on the first signature whose call works (a signature TF
    Serving would serve need not take zeros: a regress SignatureDef declaring a float input
    for a string placeholder). (None, None) when no signature takes a synthetic call.
    Signatures whose synthetic batch-N inputs would pass ``max_feed_bytes`` are not timed."""
    for sig in _timing_order(servable):
        if max_feed_bytes is not None and synthetic_bytes(sig, batch_n) > max_feed_bytes:
            continue
        try:
            return _time_signature(servable, sig, batch_n)
        except (RuntimeFailure, MemoryError):
            continue
    return None, None


def _timing_order(servable: Servable) -> list[SignatureInfo]:
    default = servable.signatures.get(DEFAULT_SIGNATURE)
    rest = [s for s in servable.signatures.values() if s is not default and s.inputs
            and not any(spec.is_string for spec in s.inputs.values())]
    return ([default] if default is not None else []) + rest


def _time_signature(servable: Servable, sig: SignatureInfo, batch_n: int) -> tuple[float, float]:
    figures = []
    for batch in (1, batch_n if sig.batchable else 1):
        feeds = synthetic_inputs(sig, batch)
        servable.run(sig.name, feeds)  # first call allocates; not counted
        samples = []
        for _ in range(TIMING_ROUNDS):
            start = time.perf_counter()
            servable.run(sig.name, feeds)
            samples.append((time.perf_counter() - start) * 1000)
        figures.append(float(np.median(samples)))
    return figures[0], figures[1]


def consider(backends: Mapping[str, Backend], device: ReadJSONObject, version_dir: str) -> list[Considered]:
    """Every backend, with whether it can run here and which artifact of the version it serves."""
    out = []
    for name, backend in backends.items():
        availability = backend.probe(device)
        artifact = backend.can_serve(version_dir) if availability.available else None
        reason = availability.reason
        if availability.available and artifact is None:
            reason += "; but this version has no artifact it can serve"
        out.append(Considered(name, availability.available and artifact is not None, reason, artifact))
    return out


Loader = Callable[[str], Servable]


def select(
    backends: Mapping[str, Backend],
    device: ReadJSONObject,
    version_dir: str,
    load: Loader,
    policy: ReadJSONObject,
    cache: MutableMapping[str, ReadJSONObject] | None = None,
    cache_key: str = "",
) -> tuple[Decision, Servable | None]:
    """Pick and load a backend for one version directory (see module docstring).

    ``load(name)`` loads the version with the named backend (the caller supplies options);
    ``policy``: ``backend`` (auto or a name), ``prefer_tflite_below_mb`` (int),
    ``max_feed_bytes`` (int: no timing call feeds more than this, from the declared shapes).
    """
    decision, servable = _select(backends, device, version_dir, load, policy, cache, cache_key)
    if servable is None:
        return decision, None
    try:  # a generative version says what it is, or is refused here with the reason
        driver = generative.detect(servable)
    except LoadFailure as exc:
        servable.close()
        return Decision(None, decision.how, f"{decision.chosen} loaded the model, but {exc}", decision.considered), None
    decision.generation = driver.describe() if driver is not None else None
    return decision, servable


def _select(backends: Mapping[str, Backend], device: ReadJSONObject, version_dir: str, load: Loader,
            policy: ReadJSONObject, cache: MutableMapping[str, ReadJSONObject] | None,
            cache_key: str) -> tuple[Decision, Servable | None]:
    considered = consider(backends, device, version_dir)
    possible = [c for c in considered if c.available]
    pinned = policy.get("backend", "auto")
    if pinned != "auto":
        match = [c for c in possible if c.backend == pinned]
        if not match:
            why = next((c.reason for c in considered if c.backend == pinned), f"unknown backend {pinned!r}")
            return Decision(None, "pinned", f"backend pinned to {pinned}, which cannot serve: {why}", considered), None
        return _load_in_order(match, considered, load, "pinned", f"pinned to {pinned} by configuration")
    if not possible:
        why = "; ".join(f"{c.backend}: {c.reason}" for c in considered)
        return Decision(None, "none", f"no backend can serve this version ({why})", considered), None
    if len(possible) == 1:
        return _load_in_order(possible, considered, load, "only", "the only backend that can serve this version")
    small, memory = _number(policy.get("prefer_tflite_below_mb")), _number(device.get("memory_mb", 1 << 30))
    if small and memory is not None and memory < small and any(c.backend == "tflite" for c in possible):
        order = sorted(possible, key=lambda c: c.backend != "tflite")
        return _load_in_order(order, considered, load, "policy", f"memory below {small} MB: LiteRT preferred")
    cached = (cache or {}).get(cache_key) if cache_key else None
    if cached and cached.get("chosen") in {c.backend for c in possible}:
        _restore_figures(considered, cached)
        order = sorted(possible, key=lambda c: c.backend != cached["chosen"])
        return _load_in_order(order, considered, load, "cached", f"{cached.get('reason', '')} (measured earlier, cached)")
    feed_limit = _number(policy.get("max_feed_bytes"))
    decision, servable = _measure(possible, considered, load, None if feed_limit is None else int(feed_limit))
    if cache is not None and cache_key and servable is not None:
        cache[cache_key] = decision.to_dict()
    return decision, servable


def _number(value: ReadJSONValue) -> float | None:
    """A number of a policy or device report; None for anything else (absent, null)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _restore_figures(considered: list[Considered], cached: ReadJSONObject) -> None:
    listed = cached.get("considered", [])
    figures = {c["backend"]: c for c in (listed if isinstance(listed, (list, tuple)) else [])
               if isinstance(c, Mapping)}
    for c in considered:
        old = figures.get(c.backend, {})
        c.batch1_ms, c.batch_n_ms = _number(old.get("batch1_ms")), _number(old.get("batch_n_ms"))


def _load_in_order(order: list[Considered], considered: list[Considered], load: Loader, how: str, reason: str):
    failures = []
    for c in order:
        try:
            servable = load(c.backend)
        except (RuntimeFailure, LoadFailure) as exc:
            c.load_error = str(exc)
            failures.append(f"{c.backend} failed to load: {exc}")
            continue
        text = reason if not failures else f"{reason}; " + "; ".join(failures) + f"; fell back to {c.backend}"
        return Decision(c.backend, how, text, considered), servable
    return Decision(None, how, "; ".join(failures) or reason, considered), None


def _measure(possible: list[Considered], considered: list[Considered], load: Loader, max_feed_bytes: int | None):
    loaded: list[tuple[float, Considered, Servable]] = []
    for c in possible:
        try:
            servable = load(c.backend)
        except RuntimeFailure as exc:
            c.load_error = str(exc)
            continue
        c.batch1_ms, c.batch_n_ms = time_servable(servable, max_feed_bytes=max_feed_bytes)
        if c.batch1_ms is None or c.batch_n_ms is None:  # loaded, but nothing to time: ranked last
            c.reason += "; no signature takes a synthetic call, so not timed"
            loaded.append((float("inf"), c, servable))
        else:
            loaded.append((c.batch1_ms + c.batch_n_ms / TIMING_BATCH, c, servable))
    if not loaded:
        return Decision(None, "measured", "every candidate failed to load", considered), None
    # Never trade a signature for speed: only backends exposing every signature compete.
    every = set().union(*(set(s.signatures) for _, _, s in loaded))
    partial = [t for t in loaded if set(t[2].signatures) < every]
    for _, c, s in partial:
        missing = sorted(every - set(s.signatures))
        c.reason += f"; lacks signatures {', '.join(missing)}, so not chosen"
        s.close()
    loaded = [t for t in loaded if t not in partial]
    loaded.sort(key=lambda t: t[0])
    _, best, servable = loaded[0]
    for _, _, other in loaded[1:]:
        other.close()
    figures = ", ".join(_figures(c) for _, c, _ in loaded)
    scope = "of the backends serving every signature" if partial else "on this device"
    return Decision(best.backend, "measured", f"fastest {scope} ({figures})", considered), servable


def _figures(c: Considered) -> str:
    if c.batch1_ms is None or c.batch_n_ms is None:
        return f"{c.backend} not timed"
    return f"{c.backend} {c.batch1_ms:.3f} ms@1 / {c.batch_n_ms:.3f} ms@{TIMING_BATCH}"
