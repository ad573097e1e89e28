"""Safe rollouts on one device: shadow or canary traffic for a candidate version, gates,
automatic promote or abort (docs/rollouts.md). Part of the core, so every API (TF Serving
REST and gRPC, KServe v2 REST and gRPC, ``:generate``) is routed and judged the same way.

The manager (``rollout.mode`` shadow|canary) keeps a newer version loaded next to the
serving one as the *candidate* and tells ``Rollouts.candidate_ready`` when it is
AVAILABLE: the rollout starts then (event, judge thread), not at the first request.
``Manager.handle`` asks ``route(model, route_key)`` for every request that names no
version or label, and the handle it returns carries the choice:

- **shadow**: the serving version answers; the decoded inputs and the answer go on a
  bounded queue that one background thread runs through the candidate's batcher and
  compares array by array. A full queue drops the copy (counted), so shadow work is shed
  first and never delays or fails an answer.
- **canary**: ``canary_percent`` of requests (sticky per route key: the client's
  ``sticky_header`` value over REST, metadata over gRPC) are answered by the candidate; a
  candidate failure is answered again by the serving version, so a bad candidate costs a
  client latency, never an error.

A judge thread evaluates the gates continuously; each decision promotes (one atomic swap
in the manager) or quarantines the candidate, and is an event in state.db with the
figures. ``status()`` is ``/api/status`` ``rollouts`` and the device report's.

Thread-safety: ``route``/``observe``/``shadow`` are called by request threads and event
loops and take no lock on the common path (a dict read); everything else may be called
from any thread.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from appliance.core.errors import ApplianceError

if TYPE_CHECKING:
    from appliance.core.config import RolloutConfig
    from appliance.core.state import StateDB

SAMPLES = 2000  # latencies kept per version for p99
JUDGE_INTERVAL_S = 0.25
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

class ShadowHandle(Protocol):
    """What a shadow copy uses of a handle on the candidate (``core.handle.Handle``)."""

    def __enter__(self) -> "ShadowHandle": ...

    def __exit__(self, *exc: object) -> None: ...

    async def run(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


class RolloutManager(Protocol):
    """What rollouts read and do of the manager (``core.manager.Manager``, which owns them): a
    protocol rather than an import, so the manager and its rollouts do not import each other."""

    def rollout_policy(self, name: str) -> RolloutConfig | None: ...

    def rollout_versions(self, name: str) -> tuple[int | None, int | None]: ...

    def handle(self, name: str, version: int | None = None, *, judged: bool = True) -> ShadowHandle: ...

    def promote(self, name: str, version: int) -> None: ...

    def quarantine(self, name: str, version: int, reason: str) -> None: ...


class NoCandidate(ApplianceError):
    """An operator's promote or abort of a model that has no candidate (HTTP 409)."""

    http_status = 409
    grpc_code = "FAILED_PRECONDITION"


@dataclass
class Tally:
    """Requests, failures and recent latencies of one version in one rollout."""

    requests: int = 0
    errors: int = 0
    latencies: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=SAMPLES))

    def p99(self) -> float | None:
        return float(np.percentile(np.fromiter(self.latencies, float), 99)) if self.latencies else None


@dataclass
class Rollout:
    model: str
    serving: int
    candidate: int
    mode: str
    started: float = field(default_factory=time.time)
    old: Tally = field(default_factory=Tally)
    new: Tally = field(default_factory=Tally)
    drift_sum: float = 0.0
    compared: int = 0
    shadow_dropped: int = 0
    decided: str = ""

    def figures(self) -> dict[str, Any]:
        old_p99, new_p99 = self.old.p99(), self.new.p99()
        return {
            "mode": self.mode, "serving_version": self.serving, "candidate_version": self.candidate,
            "elapsed_s": round(time.time() - self.started, 1),
            "serving_requests": self.old.requests, "candidate_requests": self.new.requests,
            "candidate_errors": self.new.errors,
            "error_rate": round(self.new.errors / self.new.requests, 4) if self.new.requests else None,
            "serving_p99_ms": round(old_p99 * 1000, 2) if old_p99 is not None else None,
            "candidate_p99_ms": round(new_p99 * 1000, 2) if new_p99 is not None else None,
            "p99_latency_ratio": round(new_p99 / old_p99, 3) if old_p99 and new_p99 is not None else None,
            "output_drift": round(self.drift_sum / self.compared, 5) if self.compared else None,
            "compared": self.compared, "shadow_dropped": self.shadow_dropped,
        }


def verdict(rollout: Rollout, policy: RolloutConfig) -> tuple[str, str]:
    """("promote" | "abort" | "", reason) from the figures and the policy's gates."""
    f = rollout.figures()
    n, errors = f["candidate_requests"], f["candidate_errors"]
    if errors > policy.max_error_rate * max(n, policy.min_requests):  # fails whatever comes next
        return "abort", f"error rate {errors}/{n} over max_error_rate {policy.max_error_rate}"
    if n >= policy.min_requests and f["serving_requests"] >= min(policy.min_requests, 20):
        ratio, drift = f["p99_latency_ratio"], f["output_drift"]
        if ratio is not None and ratio > policy.max_p99_latency_ratio:
            return "abort", (f"p99 latency {f['candidate_p99_ms']} ms is {ratio}x the serving version's "
                             f"{f['serving_p99_ms']} ms (max_p99_latency_ratio {policy.max_p99_latency_ratio})")
        if drift is not None and drift > policy.max_output_drift:
            return "abort", f"output drift {drift} over max_output_drift {policy.max_output_drift} ({f['compared']} compared)"
        if rollout.mode == "shadow" and f["compared"] < policy.min_requests:
            pass  # shadow judges outputs too: wait for enough comparisons
        else:
            return "promote", (f"all gates held after {n} requests: error rate {f['error_rate']}, "
                               f"p99 ratio {ratio}, drift {drift}")
    if f["elapsed_s"] > policy.max_duration_s:
        return "abort", f"undecided after max_duration_s {policy.max_duration_s:g} ({n} of {policy.min_requests} requests)"
    return "", ""


def output_drift(serving: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray]) -> float:
    """Mean absolute difference of numeric outputs, or top-1 disagreement rate when the
    outputs look like class scores (rows of probabilities); 1.0 when the outputs differ in
    names or shapes, and for strings, 0 or 1 by equality."""
    if set(serving) != set(candidate):
        return 1.0
    drifts = []
    for key in serving:
        x, y = np.asarray(serving[key]), np.asarray(candidate[key])
        if x.shape != y.shape:
            return 1.0
        if x.size == 0:
            continue
        if x.dtype.kind not in "biuf" or y.dtype.kind not in "biuf":
            drifts.append(float(np.mean(x != y)))
        elif x.ndim >= 2 and x.shape[-1] > 1 and _probabilities(x):
            drifts.append(float(np.mean(np.argmax(x, -1) != np.argmax(y, -1))))
        else:
            drifts.append(float(np.mean(np.abs(x.astype(float) - y.astype(float)))))
    return float(np.mean(drifts)) if drifts else 0.0


def _probabilities(x: np.ndarray) -> bool:
    return bool(np.all(x >= 0) and np.all(x <= 1) and np.allclose(x.sum(-1), 1.0, atol=1e-3))


def sticky_share(key: str | None) -> float:
    """Where a request falls in [0, 1): a stable hash of the client's key (the same answer on
    every request of that client), or a random draw without one."""
    if key:
        return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    return random.random()


@dataclass
class Route:
    """What ``Manager.handle`` does with one unversioned request of a model in rollout."""

    rollout: Rollout
    role: str  # "serving" or "candidate": which version answers
    shadow: bool  # a copy goes to the candidate after the serving version answered


class Rollouts:
    """Every rollout of the device: routing, tallies, shadow copies, the judge."""

    def __init__(self, manager: RolloutManager, db: StateDB, registry: CollectorRegistry):
        self.manager, self.db = manager, db
        self._lock = threading.Lock()
        self._active: dict[str, Rollout] = {}
        self._history: dict[str, list[dict[str, Any]]] = {}
        self._shadow: "queue.Queue[tuple[Rollout, str, dict[str, np.ndarray], dict[str, np.ndarray]] | None]" = queue.Queue()
        self._waiting: collections.Counter[str] = collections.Counter()  # shadow copies queued per model
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self.view: dict[str, dict[str, Any]] = {}
        self.m_requests = Counter("edge_appliance_rollout_requests", "Rollout requests by version and role",
                                  ["model_name", "version", "role", "outcome"], registry=registry)
        self.m_latency = Histogram("edge_appliance_rollout_latency_seconds", "Rollout request latency by version",
                                   ["model_name", "version", "role"], buckets=LATENCY_BUCKETS_S, registry=registry)
        self.m_drift = Gauge("edge_appliance_rollout_output_drift", "Mean output drift of the candidate",
                             ["model_name", "version"], registry=registry)
        self.m_dropped = Counter("edge_appliance_rollout_shadow_dropped", "Shadow copies shed under load",
                                 ["model_name"], registry=registry)

    # -- requests ----------------------------------------------------------------------------
    def route(self, model: str, route_key: Callable[[str], str | None] | None) -> Route | None:
        """The route of an unversioned request of ``model``, or None when it has no rollout.
        ``route_key(header)``: the request's value of a header (REST) or metadata key
        (gRPC), for the sticky canary choice. A dict read: no lock on the request path (the
        judge notices candidates that go)."""
        rollout = self._active.get(model)
        if rollout is None or rollout.decided:
            return None
        policy = self.manager.rollout_policy(model)
        if policy is None or policy.mode == "off":
            return None
        if rollout.mode == "canary":
            key = route_key(policy.sticky_header) if route_key is not None else None
            candidate = sticky_share(key) * 100 < policy.canary_percent
            return Route(rollout, "candidate" if candidate else "serving", False)
        return Route(rollout, "serving", random.random() * 100 < policy.shadow_percent)

    def observe(self, rollout: Rollout, role: str, ok: bool, server_error: bool, seconds: float) -> None:
        """One answer of ``role``'s version: counted in the tallies the gates read."""
        tally = rollout.new if role == "candidate" else rollout.old
        version = rollout.candidate if role == "candidate" else rollout.serving
        with self._lock:
            tally.requests += 1
            tally.errors += server_error or (role == "candidate" and not ok)
            tally.latencies.append(seconds)
        self.m_requests.labels(rollout.model, str(version), role, "ok" if ok else "error").inc()
        self.m_latency.labels(rollout.model, str(version), role).observe(seconds)

    def shadow(self, rollout: Rollout, signature: str, inputs: Mapping[str, np.ndarray],
               served: Mapping[str, np.ndarray]) -> None:
        """Queue a copy of an answered request for the candidate, or drop it when full."""
        policy = self.manager.rollout_policy(rollout.model)
        limit = policy.shadow_queue if policy is not None else 64
        full = self._waiting[rollout.model] >= limit  # a lock-free look first: under load most copies drop
        if not full:
            with self._lock:
                full = self._waiting[rollout.model] >= limit
                if not full:
                    self._waiting[rollout.model] += 1
        if full:
            rollout.shadow_dropped += 1  # a figure for status; a rare lost increment does not matter
            self.m_dropped.labels(rollout.model).inc()
            return
        self._shadow.put((rollout, signature, dict(inputs), dict(served)))

    def _shadow_loop(self) -> None:
        """(the shadow thread) Each copy through the candidate's batch queue, awaited on this
        thread's own event loop."""
        loop = asyncio.new_event_loop()
        try:
            while True:
                item = self._shadow.get()
                if item is None:
                    return
                rollout = item[0]
                with self._lock:
                    self._waiting[rollout.model] -= 1
                if rollout.decided:
                    continue
                seconds = loop.run_until_complete(self._shadow_one(*item))
                # Pacing: busy at most shadow_busy_share of the time, so on a small box the
                # copies take a bounded share of the CPU; while it rests, new copies are shed.
                policy = self.manager.rollout_policy(rollout.model)
                share = policy.shadow_busy_share if policy is not None else 1.0
                if share < 1.0:
                    self._stop.wait(seconds * (1 - share) / share)
        finally:
            loop.close()

    async def _shadow_one(self, rollout: Rollout, signature: str, inputs: Mapping[str, np.ndarray],
                          served: Mapping[str, np.ndarray]) -> float:
        """Run one copy on the candidate, tally and compare it; the seconds it took."""
        started = time.perf_counter()
        out: dict[str, np.ndarray] | None = None
        server_error = False
        try:
            with self.manager.handle(rollout.model, rollout.candidate, judged=False) as handle:
                out = await handle.run(signature, inputs)
        except ApplianceError as exc:  # the candidate failed where the serving version answered
            server_error = exc.http_status >= 500
        except Exception:  # a shadow copy never takes the rollout down
            server_error = True
        seconds = time.perf_counter() - started
        self.observe(rollout, "candidate", out is not None, server_error, seconds)
        if out is not None:
            self._compare(rollout, served, out)
        return seconds

    def _compare(self, rollout: Rollout, served: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray]) -> None:
        drift = output_drift(served, out)
        with self._lock:
            rollout.drift_sum += drift
            rollout.compared += 1
        self.m_drift.labels(rollout.model, str(rollout.candidate)).set(rollout.drift_sum / rollout.compared)

    # -- lifecycle -----------------------------------------------------------------------------
    def candidate_ready(self, model: str) -> None:
        """(manager) A version of ``model`` became AVAILABLE: start its rollout when that made
        a candidate ready beside the serving version."""
        self._refresh(model)

    def _refresh(self, model: str) -> Rollout | None:
        policy = self.manager.rollout_policy(model)
        serving, candidate = self.manager.rollout_versions(model)
        with self._lock:
            current = self._active.get(model)
            if current is not None and current.candidate == candidate and current.serving == serving \
                    and policy is not None and policy.mode == current.mode:
                return current
            if candidate is None or serving is None or policy is None or policy.mode == "off":
                self._active.pop(model, None)
                return None
            rollout = self._active[model] = Rollout(model, serving, candidate, policy.mode)
        self._start_threads()
        self.db.event("rollout_started", f"{model}: version {candidate} is a {policy.mode} candidate next to "
                      f"version {serving}", model=model, version=candidate, serving_version=serving, mode=policy.mode)
        self._publish()
        return rollout

    def _start_threads(self) -> None:
        with self._lock:
            if self._threads or self._stop.is_set():
                return
            self._threads = [threading.Thread(target=self._shadow_loop, name="rollout-shadow", daemon=True),
                             threading.Thread(target=self._judge_loop, name="rollout-judge", daemon=True)]
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        """Stop the judge and the shadow thread (idempotent)."""
        self._stop.set()
        self._shadow.put(None)
        for thread in self._threads:
            thread.join(timeout=10)

    def _judge_loop(self) -> None:
        while not self._stop.wait(JUDGE_INTERVAL_S):
            for model in list(self._active):
                self._refresh(model)  # notices a candidate that went away (abort elsewhere, reload)
            with self._lock:
                rollouts = list(self._active.values())
            for rollout in rollouts:
                try:
                    policy = self.manager.rollout_policy(rollout.model)
                    action, reason = verdict(rollout, policy) if policy is not None else ("", "")
                    if action:
                        self.decide(rollout, action, reason)
                except Exception as exc:  # a judging failure must never stop serving
                    self.db.event("rollout_error", f"{rollout.model}: judging failed: {exc}", model=rollout.model)
            self._publish()

    # -- decisions -----------------------------------------------------------------------------
    def operator(self, model: str, action: str) -> dict[str, Any]:
        """``POST /api/models/{m}/rollout/promote|abort``: decide now. InvalidArgument (409)
        when the model has no candidate."""
        rollout = self._active.get(model) or self._refresh(model)
        if rollout is None or rollout.decided:
            raise NoCandidate(f"{model} has no rollout candidate to {action}")
        return {"model": model, **self.decide(rollout, action, f"{action} by an operator")}

    def decide(self, rollout: Rollout, action: str, reason: str) -> dict[str, Any]:
        """Promote or abort ``rollout``: one manager step and one event with the figures."""
        with self._lock:
            if rollout.decided:
                return {}
            rollout.decided = action
            self._active.pop(rollout.model, None)
        figures = rollout.figures()
        if action == "promote":
            self.manager.promote(rollout.model, rollout.candidate)
            message = f"{rollout.model}: version {rollout.candidate} promoted over {rollout.serving}: {reason}"
        else:
            self.manager.quarantine(rollout.model, rollout.candidate, f"rollout aborted: {reason}")
            message = f"{rollout.model}: version {rollout.candidate} aborted, version {rollout.serving} keeps serving: {reason}"
        record = {"action": action, "reason": reason, "ts": time.time(), **figures}
        self.db.event(f"rollout_{'promoted' if action == 'promote' else 'aborted'}", message,
                      model=rollout.model, version=rollout.candidate, reason=reason, **figures)
        with self._lock:
            self._history.setdefault(rollout.model, []).append(record)
            del self._history[rollout.model][:-10]
        self._publish()
        return record

    def _publish(self) -> None:
        """Fresh status for /api/status and the device report (a new dict: readers never see
        one being changed)."""
        with self._lock:  # copies only: numpy work under the lock releases the GIL and convoys the workers
            active = list(self._active.items())
            histories = {model: list(history) for model, history in self._history.items()}
        view: dict[str, dict[str, Any]] = {m: {"active": r.figures()} for m, r in active}
        for model, history in histories.items():
            view.setdefault(model, {})["decisions"] = history
        self.view = view

    def status(self) -> dict[str, dict[str, Any]]:
        return self.view
