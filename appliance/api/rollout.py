"""Safe rollouts on one device: shadow or canary traffic for a candidate version, gates,
automatic promote or abort (docs/rollouts.md).

The manager (``rollout.mode`` shadow|canary) keeps a newer version loaded next to the
serving one as the *candidate*. This WSGI layer, inside authentication, routes the
unversioned inference requests of such a model:

- **shadow**: the serving version answers; a copy of the request goes on a bounded queue
  that one background thread runs on the candidate and compares. A full queue drops the
  copy (counted), so shadow work is shed first and never delays or fails an answer.
- **canary**: ``canary_percent`` of requests (sticky per ``sticky_header`` value) are
  answered by the candidate; a candidate failure is answered again by the serving version,
  so a bad candidate costs a client latency, never an error.

A judge thread evaluates the gates continuously; each decision promotes (one atomic swap
in the manager) or quarantines the candidate, and is an event in state.db with the
figures. ``/api/status`` ``rollouts`` carries the live state to /api/status and the
device report. Admin: ``POST /api/models/{m}/rollout/promote|abort`` (auth.py guards
every POST under /api/).
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import queue
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from appliance.api.body import read_raw
from appliance.core.config import RolloutConfig
from appliance.core.errors import ApplianceError

PREDICT_RE = re.compile(r"/v1/models/([^/:]+):(predict|classify|regress)")
ADMIN_RE = re.compile(r"/api/models/([^/]+)/rollout/(promote|abort)")
SAMPLES = 2000  # latencies kept per version for p99
JUDGE_INTERVAL_S = 0.25
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class Tally:
    """Requests, failures and recent latencies of one version in one rollout."""

    requests: int = 0
    errors: int = 0
    latencies: collections.deque = field(default_factory=lambda: collections.deque(maxlen=SAMPLES))

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


def verdict(rollout: Rollout, policy: Any) -> tuple[str, str]:
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


def output_drift(serving: Any, candidate: Any) -> float:
    """Mean absolute difference of numeric outputs, or top-1 disagreement rate when the
    outputs look like class scores (rows of probabilities) or are :classify results."""
    a, b = _outputs(serving), _outputs(candidate)
    if set(a) != set(b):
        return 1.0
    drifts = []
    for key in a:
        x, y = a[key], b[key]
        if x.shape != y.shape:
            return 1.0
        if x.size == 0:
            continue
        if x.ndim >= 2 and x.shape[-1] > 1 and _probabilities(x):
            drifts.append(float(np.mean(np.argmax(x, -1) != np.argmax(y, -1))))
        else:
            drifts.append(float(np.mean(np.abs(x - y))))
    return float(np.mean(drifts)) if drifts else 0.0


def _outputs(doc: Any) -> dict[str, np.ndarray]:
    body = doc.get("predictions", doc.get("outputs", doc.get("results"))) if isinstance(doc, dict) else None
    if isinstance(body, dict):
        return {k: _numeric(v) for k, v in body.items()}
    if isinstance(body, list) and body and isinstance(body[0], dict):  # row format, named outputs
        return {k: _numeric([row.get(k) for row in body]) for k in body[0]}
    if isinstance(body, list) and body and isinstance(body[0], list) and body[0] and isinstance(body[0][0], list) \
            and len(body[0][0]) == 2 and isinstance(body[0][0][0], str):  # :classify [[label, score], ...]
        return {"top1": np.array([[1.0 if i == int(np.argmax([s for _, s in r])) else 0.0 for i in range(len(r))]
                                 for r in body], float)}
    return {"": _numeric(body)}


def _numeric(value: Any) -> np.ndarray:
    try:
        return np.asarray(value, dtype=float)
    except (TypeError, ValueError):
        return np.asarray([hash(json.dumps(value, sort_keys=True))], dtype=float)  # strings: equal or not


def _probabilities(x: np.ndarray) -> bool:
    return bool(np.all(x >= 0) and np.all(x <= 1) and np.allclose(x.sum(-1), 1.0, atol=1e-3))


class _Captured:
    """start_response that remembers the status and headers of an inner call."""

    def __init__(self) -> None:
        self.status = "500 Internal Server Error"
        self.headers: list[tuple[str, str]] = []

    def __call__(self, status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
        self.status, self.headers = status, headers
        return lambda data: None

    @property
    def code(self) -> int:
        return int(self.status.split(" ", 1)[0])


class RolloutLayer:
    def __init__(self, inner: Callable[..., Any], core: Any):
        self.inner, self.core = inner, core
        self._lock = threading.Lock()
        self._active: dict[str, Rollout] = {}
        self._history: dict[str, list[dict[str, Any]]] = {}
        self._shadow: "queue.Queue[tuple[Rollout, dict[str, Any], bytes, Any]]" = queue.Queue()
        self._shadow_sizes: dict[str, int] = {}
        self._shadow_shares: dict[str, float] = {}
        self._waiting: collections.Counter[str] = collections.Counter()  # shadow copies queued per model
        self._threads: list[threading.Thread] = []
        r = core.metrics.registry
        self.m_requests = Counter("edge_appliance_rollout_requests", "Rollout requests by version and role",
                                  ["model_name", "version", "role", "outcome"], registry=r)
        self.m_latency = Histogram("edge_appliance_rollout_latency_seconds", "Rollout request latency by version",
                                   ["model_name", "version", "role"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.m_drift = Gauge("edge_appliance_rollout_output_drift", "Mean output drift of the candidate",
                             ["model_name", "version"], registry=r)
        self.m_dropped = Counter("edge_appliance_rollout_shadow_dropped", "Shadow copies shed under load",
                                 ["model_name"], registry=r)

    # -- WSGI ------------------------------------------------------------------------------
    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD", "GET")
        if method == "POST":
            admin = ADMIN_RE.fullmatch(path)
            if admin:
                return self._admin(admin.group(1), admin.group(2), start_response)
            match = PREDICT_RE.fullmatch(path)
            if match and not environ.get("QUERY_STRING"):
                rollout = self._rollout(match.group(1))
                if rollout is not None:
                    return self._route(rollout, match.group(2), environ, start_response)
        return self.inner(environ, start_response)

    def _rollout(self, model: str) -> Rollout | None:
        """The active rollout of ``model``, started (and the judge running) on first sight.

        The request path takes no lock while a rollout is active or the model has none
        configured: with dozens of worker threads, three lock round trips per request
        formed a convoy under the GIL (the shadow bench at 64 clients fell from ~1,100 to
        ~70-165 requests/s). The judge calls ``_refresh`` every JUDGE_INTERVAL_S and so
        notices a candidate that went away or changed."""
        current = self._active.get(model)  # a dict read is atomic under the GIL
        if current is not None and not current.decided:
            return current
        policy = self.core.manager.rollout_policy(model) if self.core.manager is not None else None
        if policy is None or policy.mode == "off":
            return None
        return self._refresh(model)

    def _refresh(self, model: str) -> Rollout | None:
        manager = self.core.manager
        if manager is None:
            return None
        try:
            policy = manager.entry(model).config.rollout
        except ApplianceError:
            return None
        if policy.mode == "off":
            return None
        serving, candidate = manager.rollout_versions(model)
        with self._lock:
            current = self._active.get(model)
            if current is not None and current.candidate == candidate and current.serving == serving:
                return current
            if candidate is None or serving is None:
                self._active.pop(model, None)
                return None
            rollout = self._active[model] = Rollout(model, serving, candidate, policy.mode)
            self._shadow_sizes[model] = policy.shadow_queue
            self._shadow_shares[model] = policy.shadow_busy_share
        self._start_threads()
        self.core.db.event("rollout_started", f"{model}: version {candidate} is a {policy.mode} candidate next to "
                           f"version {serving}", model=model, version=candidate, serving_version=serving,
                           mode=policy.mode)
        return rollout

    def _route(self, rollout: Rollout, verb: str, environ: dict[str, Any],
               start_response: Callable[..., Any]) -> Iterable[bytes]:
        try:
            body = read_raw(environ, self.core.config.server.max_body_bytes)
        except ApplianceError as exc:
            from appliance.api.tfserving.rest import error_response

            return error_response(exc)(environ, start_response)
        policy = self.core.manager.rollout_policy(rollout.model) or RolloutConfig()
        use_candidate = rollout.mode == "canary" and self._canary_pick(environ, policy)
        if use_candidate:
            code, headers, out, seconds = self._call(environ, body, rollout.model, rollout.candidate, verb)
            if code == 200:
                self._observe(rollout, "candidate", code, seconds)
                start_response(_status_line(code), headers)
                return [out]
            failed = (code, seconds)  # answered again by the serving version below
        code, headers, out, seconds = self._call(environ, body, rollout.model, rollout.serving, verb)
        if code == 404:  # the serving version was swapped away under us: the model's current one
            code, headers, out, seconds = self._call(environ, body, rollout.model, None, verb)
        self._observe(rollout, "serving", code, seconds)
        if use_candidate and code == 200:  # the candidate failed where the serving version did not
            self._observe(rollout, "candidate", *failed)
        if rollout.mode == "shadow" and code == 200 and random.random() * 100 < policy.shadow_percent:
            self._enqueue_shadow(rollout, environ, body, out, verb)
        start_response(_status_line(code), headers)
        return [out]

    @staticmethod
    def _canary_pick(environ: dict[str, Any], policy: Any) -> bool:
        key = environ.get("HTTP_" + policy.sticky_header.upper().replace("-", "_"))
        if key:  # sticky: a stable hash of the client's key, the same answer on every request
            share = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
        else:
            share = random.random()
        return share * 100 < policy.canary_percent

    def _call(self, environ: dict[str, Any], body: bytes, model: str, version: int | None,
              verb: str) -> tuple[int, list[tuple[str, str]], bytes, float]:
        path = f"/v1/models/{model}" + (f"/versions/{version}" if version is not None else "") + f":{verb}"
        env = {**environ, "PATH_INFO": path, "RAW_URI": path, "REQUEST_URI": path,
               "wsgi.input": io.BytesIO(body), "CONTENT_LENGTH": str(len(body))}
        captured = _Captured()
        started = time.perf_counter()
        result = self.inner(env, captured)
        try:
            out = b"".join(result)
        finally:
            getattr(result, "close", lambda: None)()
        return captured.code, captured.headers, out, time.perf_counter() - started

    def _observe(self, rollout: Rollout, role: str, code: int, seconds: float) -> None:
        tally = rollout.new if role == "candidate" else rollout.old
        version = rollout.candidate if role == "candidate" else rollout.serving
        with self._lock:
            tally.requests += 1
            tally.errors += code >= 500 or (role == "candidate" and code != 200)
            tally.latencies.append(seconds)
        self.m_requests.labels(rollout.model, str(version), role, "ok" if code == 200 else str(code)).inc()
        self.m_latency.labels(rollout.model, str(version), role).observe(seconds)

    # -- shadow ----------------------------------------------------------------------------
    def _enqueue_shadow(self, rollout: Rollout, environ: dict[str, Any], body: bytes, served: bytes, verb: str) -> None:
        limit = self._shadow_sizes.get(rollout.model, 64)
        full = self._waiting[rollout.model] >= limit  # a lock-free look first: under load most copies drop
        if not full:
            with self._lock:
                full = self._waiting[rollout.model] >= limit
                if not full:
                    self._waiting[rollout.model] += 1
        if full:
            rollout.shadow_dropped += 1  # a figure for status; a rare lost increment does not matter
        if full:
            self.m_dropped.labels(rollout.model).inc()
            return
        env = {k: v for k, v in environ.items() if isinstance(v, str)}  # no streams: the request is over
        self._shadow.put((rollout, env, body, (served, verb)))

    def _shadow_loop(self) -> None:
        while True:
            rollout, env, body, (served, verb) = self._shadow.get()
            with self._lock:
                self._waiting[rollout.model] -= 1
            if rollout.decided:
                continue
            started = time.perf_counter()
            try:
                code, _, out, seconds = self._call(env, body, rollout.model, rollout.candidate, verb)
            except Exception:  # a shadow copy never takes the layer down
                code, out, seconds = 500, b"", 0.0
            self._observe(rollout, "candidate", code, seconds)
            self._compare(rollout, code, served, out)
            # Pacing: busy at most shadow_busy_share of the time, so on a small box the
            # copies take a bounded share of the CPU; while it rests, new copies are shed.
            share = self._shadow_shares.get(rollout.model, 1.0)
            if share < 1.0:
                time.sleep((time.perf_counter() - started) * (1 - share) / share)

    def _compare(self, rollout: Rollout, code: int, served: bytes, out: bytes) -> None:
        if code == 200:
            try:
                drift = output_drift(json.loads(served), json.loads(out))
            except ValueError:
                drift = 1.0
            with self._lock:
                rollout.drift_sum += drift
                rollout.compared += 1
            self.m_drift.labels(rollout.model, str(rollout.candidate)).set(rollout.drift_sum / rollout.compared)

    # -- judging -----------------------------------------------------------------------------
    def _start_threads(self) -> None:
        with self._lock:
            if self._threads:
                return
            self._threads = [threading.Thread(target=self._shadow_loop, name="rollout-shadow", daemon=True),
                             threading.Thread(target=self._judge_loop, name="rollout-judge", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _judge_loop(self) -> None:
        while True:
            time.sleep(JUDGE_INTERVAL_S)
            for model in list(self._active):
                self._refresh(model)  # notices a candidate that went away (abort elsewhere, reload)
            with self._lock:
                rollouts = list(self._active.values())
            for rollout in rollouts:
                try:
                    policy = self.core.manager.entry(rollout.model).config.rollout
                    action, reason = verdict(rollout, policy)
                    if action:
                        self.decide(rollout, action, reason)
                except Exception as exc:  # a judging failure must never stop serving
                    self.core.db.event("rollout_error", f"{rollout.model}: judging failed: {exc}", model=rollout.model)
            self._publish()

    def decide(self, rollout: Rollout, action: str, reason: str) -> dict[str, Any]:
        """Promote or abort ``rollout``: one manager step and one event with the figures."""
        with self._lock:
            if rollout.decided:
                return {}
            rollout.decided = action
            self._active.pop(rollout.model, None)
        figures = rollout.figures()
        manager = self.core.manager
        if action == "promote":
            manager.promote(rollout.model, rollout.candidate)
            message = f"{rollout.model}: version {rollout.candidate} promoted over {rollout.serving}: {reason}"
        else:
            manager.quarantine(rollout.model, rollout.candidate, f"rollout aborted: {reason}")
            message = f"{rollout.model}: version {rollout.candidate} aborted, version {rollout.serving} keeps serving: {reason}"
        record = {"action": action, "reason": reason, "ts": time.time(), **figures}
        self.core.db.event(f"rollout_{'promoted' if action == 'promote' else 'aborted'}", message,
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

    # -- admin -------------------------------------------------------------------------------
    def _admin(self, model: str, action: str, start_response: Callable[..., Any]) -> Iterable[bytes]:
        rollout = self._rollout(model)
        if rollout is None:
            return _json(start_response, 409, {"error": f"{model} has no rollout candidate to {action}"})
        reason = f"{action} by an operator"
        record = self.decide(rollout, action, reason)
        return _json(start_response, 200, {"model": model, **record})


def _status_line(code: int) -> str:
    from http import HTTPStatus

    return f"{code} {HTTPStatus(code).phrase}"


def _json(start_response: Callable[..., Any], code: int, doc: dict[str, Any]) -> list[bytes]:
    body = json.dumps(doc).encode()
    start_response(_status_line(code), [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]
