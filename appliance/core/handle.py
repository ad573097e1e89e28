"""The handle: what a request gets from the core, and the one verb that runs it.

``held = manager.handle(model, version, label, route_key)``, then ``await held.run(sig,
inputs, context)`` on the caller's event loop (API code gets handles through a ``HandleSource``,
appliance/core/seams.py: ``LocalHandles`` here; ``context``, the request's scheduling hints,
appliance/core/request_context.py, goes to the batch queue as it is). Protocol code sees the version's number,
path and signatures, and capabilities of the servable; never the batcher, the version
slot or the backend's name. Inside ``run``:

- **batching**: inputs that fit the signature's declared shapes join the version's batch
  queue; others run alone on the loop's executor (TensorFlow, like TF Serving, is the judge
  of a shape an Identity such as half_plus_two's ``x`` accepts), unless the servable has
  ``strict_shapes`` (LiteRT: its shapes are real), where a mismatch is refused with the
  reason;
- **rollouts**: when the manager routed the request (an unversioned request of a model
  with a candidate, appliance/core/rollout.py), the answer's outcome and latency are
  tallied for the judge; a canary candidate's failure is answered again by the serving
  version; a shadow request's decoded inputs and answer are queued for the candidate.

Release the handle promptly (``with``): a version unloads only after every handle on it is
released. One handle serves one request; it is not thread-safe.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import numpy as np

from runtimes import RuntimeFailure, Servable, SignatureInfo, TensorSpec

from appliance.core.batcher import Batcher
from appliance.core.errors import ApplianceError, InvalidArgument, from_runtime
from appliance.core.request_context import NO_CONTEXT, RequestContext

if TYPE_CHECKING:
    from appliance.core.inference_stats import InferenceStats
    from appliance.core.metrics import Metrics
    from appliance.core.rollout import Route, Rollouts


class VersionSlot(Protocol):
    """What a handle reads of the version it holds (appliance/core/manager.py ``VersionSlot``)."""

    model: str
    version: int
    path: str
    servable: Servable | None
    batcher: Batcher | None


class Holder(Protocol):
    """Who hands out handles and takes them back (appliance/core/manager.py ``Manager``)."""

    rollouts: "Rollouts | None"  # set before the first routed request
    metrics: "Metrics | None"  # where each run is counted (Triton's statistics: inference_stats.py)

    def handle(self, name: str, version: int | None = None, label: str | None = None,
               route_key: Callable[[str], str | None] | None = None, judged: bool = True) -> "Handle": ...

    # The manager's own slot class (appliance/core/slots.py), which the handle knows only as the
    # protocol above: a parameter cannot be narrower in the manager than here, hence Any.
    def release_slot(self, slot: Any) -> None: ...


def shape_error(arr: np.ndarray, spec: TensorSpec, where: str) -> str | None:
    """Why ``arr`` does not fit the signature's declared shape, or None when it fits."""
    if spec.shape is None:
        return None
    want = spec.shape
    if arr.ndim == len(want) and all(w in (-1, None) or w == g for w, g in zip(want, arr.shape)):
        return None
    pretty = "[" + ",".join(str(d) for d in want) + "]"
    return f"{where}: expected shape {pretty} ({spec.dtype.name}), got [{','.join(str(d) for d in arr.shape)}]"


class Handle:
    """A request's hold on one AVAILABLE version (module docstring)."""

    __slots__ = ("_manager", "slot", "_route")

    def __init__(self, manager: Holder, slot: VersionSlot, route: "Route | None" = None):
        self._manager, self.slot, self._route = manager, slot, route

    # -- what protocol code may read -------------------------------------------------------
    @property
    def model(self) -> str:
        return self.slot.model

    @property
    def version(self) -> int:
        return self.slot.version

    @property
    def path(self) -> str:
        return self.slot.path

    @property
    def signatures(self) -> Mapping[str, SignatureInfo]:
        servable = self.slot.servable
        return servable.signatures if servable is not None else {}

    @property
    def platform(self) -> str:
        """What the version is, as model metadata names it (KServe v2 ``platform``)."""
        servable = self.slot.servable
        return str(getattr(servable, "platform", "") or getattr(servable, "backend", ""))

    @property
    def reads_examples(self) -> bool:
        """Whether the servable parses serialized ``tf.Example``s (classify, regress)."""
        return bool(self.slot.servable is not None and self.slot.servable.reads_examples)

    def signature(self, name: str, missing: str) -> SignatureInfo:
        """The signature ``name``; InvalidArgument(``missing``) when the version lacks it."""
        sig = self.signatures.get(name)
        if sig is None:
            raise InvalidArgument(missing)
        return sig

    # -- running -----------------------------------------------------------------------------
    async def run(self, signature: str, inputs: Mapping[str, np.ndarray],
                  context: RequestContext = NO_CONTEXT) -> dict[str, np.ndarray]:
        """The outputs of ``signature`` on ``inputs`` (batched, routed, tallied). ``context``:
        the request's scheduling hints, handed to the batch queue (appliance/core/request_context.py);
        ``NO_CONTEXT``: no hints (never alone)."""
        route = self._route
        metrics = self._manager.metrics
        stats = metrics.inference if metrics is not None else None
        if route is None:
            return await _execute(self.slot, signature, inputs, stats, context)
        started = time.perf_counter()
        try:
            out = await _execute(self.slot, signature, inputs, stats, context)
        except ApplianceError as exc:
            if route.role != "candidate":
                self._observe(route.role, exc, started)
                raise
            return await self._fallback(signature, inputs, exc, started, context)
        return self._answered(signature, inputs, out, started)

    def _answered(self, signature: str, inputs: Mapping[str, np.ndarray], out: dict[str, np.ndarray],
                  started: float) -> dict[str, np.ndarray]:
        route = self._route
        assert route is not None
        self._observe(route.role, None, started)
        if route.shadow:
            self._rollouts().shadow(route.rollout, signature, inputs, out)
        return out

    async def _fallback(self, signature: str, inputs: Mapping[str, np.ndarray], failure: ApplianceError,
                        started: float, context: RequestContext) -> dict[str, np.ndarray]:
        """The canary candidate failed: the serving version answers. The candidate's failure
        counts only when the serving version does answer (a bad request fails on both)."""
        route = self._route
        assert route is not None
        rollouts, rollout = self._rollouts(), route.rollout
        again = time.perf_counter()
        try:
            with self._manager.handle(self.model, rollout.serving, judged=False) as serving:
                out = await serving.run(signature, inputs, context)
        except ApplianceError as exc:
            rollouts.observe(rollout, "serving", False, exc.http_status >= 500, time.perf_counter() - again)
            raise
        rollouts.observe(rollout, "candidate", False, failure.http_status >= 500, again - started)
        rollouts.observe(rollout, "serving", True, False, time.perf_counter() - again)
        return out

    def _observe(self, role: str, failure: ApplianceError | None, started: float) -> None:
        route = self._route
        assert route is not None
        self._rollouts().observe(route.rollout, role, failure is None,
                                 failure is not None and failure.http_status >= 500,
                                 time.perf_counter() - started)

    def _rollouts(self) -> "Rollouts":
        rollouts = self._manager.rollouts
        assert rollouts is not None, "a routed request's manager has its rollouts (they routed it)"
        return rollouts

    def report(self, failure: ApplianceError | None, seconds: float) -> None:
        """The outcome of a request that did not go through ``run``: a token stream, which
        the core's step scheduler drives (appliance/core/generation.py). Tallied for the
        rollout judge when the manager routed this handle, like ``run``'s answers."""
        route = self._route
        if route is not None:
            self._observe(route.role, failure, time.perf_counter() - seconds)

    # -- holding -------------------------------------------------------------------------------
    def release(self) -> None:
        self._manager.release_slot(self.slot)

    def __enter__(self) -> "Handle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _batchable(slot: VersionSlot, signature: str, inputs: Mapping[str, np.ndarray]) -> bool:
    servable = slot.servable
    assert servable is not None
    sig = servable.signatures.get(signature)
    if sig is None:
        return True  # the servable names the missing signature itself
    problems = [p for k, arr in inputs.items() if k in sig.inputs
                and (p := shape_error(arr, sig.inputs[k], f"input {k!r}"))]
    if problems and servable.strict_shapes:
        raise InvalidArgument(problems[0])
    return not problems


async def _execute(slot: VersionSlot, signature: str, inputs: Mapping[str, np.ndarray],
                   stats: "InferenceStats | None" = None, context: RequestContext = NO_CONTEXT) -> dict[str, np.ndarray]:
    """Through the batcher when batching is on and the inputs fit, else straight to the
    servable on the loop's executor (never on the loop). Counted in ``stats`` as a request of
    the slot's version, answered or failed (the batcher counts its batches itself)."""
    started = time.perf_counter()
    try:
        if _batchable(slot, signature, inputs) and slot.batcher is not None:
            out = await slot.batcher.submit(signature, inputs, context)
        else:
            out = await asyncio.get_running_loop().run_in_executor(None, _run_alone, slot, signature, inputs,
                                                                   stats, started)
    except BaseException:  # a cancelled request (its client went away) is a failed one too
        if stats is not None:
            stats.request(slot.model, slot.version, False, time.perf_counter() - started)
        raise
    if stats is not None:
        stats.request(slot.model, slot.version, True, time.perf_counter() - started)
    return out


def _run_alone(slot: VersionSlot, signature: str, inputs: Mapping[str, np.ndarray],
               stats: "InferenceStats | None" = None, queued_at: float = 0.0) -> dict[str, np.ndarray]:
    """One execution of its own (counted so: it joined no batch)."""
    assert slot.servable is not None
    started = time.perf_counter()
    try:
        return slot.servable.run(signature, inputs)
    except RuntimeFailure as exc:
        raise from_runtime(exc) from exc
    finally:
        if stats is not None:
            first = next(iter(inputs.values()), None)
            rows = int(first.shape[0]) if first is not None and first.ndim else 1
            stats.execution(slot.model, slot.version, rows, 1, started - (queued_at or started),
                            time.perf_counter() - started)
