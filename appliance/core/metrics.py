"""Prometheus metrics (TF Serving's names where they exist) and cheap per-model request stats.

The hot path does two things per request: one counter increment and one histogram
observation, both in memory. ``RequestWindow`` keeps the last minutes of latencies per
model in a bounded ring so ``/api/status`` and the page can show rate, p50/p99 and error
rate without a database write per request.

Two kinds of metric live here:

* **event-driven** ones, updated where things happen: requests (``observe_request``, called
  by the REST handlers and, through appliance/api/grpc_errors.py ``observed``, by the gRPC
  services; ``entrypoint`` is TF Serving's "REST" or "GRPC"), batches (``batch_observer``,
  handed to each ``Batcher``), warm-ups, sync runs (``observe_sync``, for the sync loop
  to call after each bucket poll) and state events (``on_event``, a ``StateDB`` subscriber);
* **scrape-time** ones, computed only when ``/monitoring/prometheus/metrics`` is read:
  model version states, backend in use, queue depth and load time (from the manager
  snapshot given to ``bind``), device gauges (psutil) and the process collector. Reading
  them at scrape time means no stale series for a version that is gone, and nothing on
  the hot path.

TF Serving's own series carry TF Serving's labels and label values, so its dashboards work
unchanged (tensorflow_serving/servables/tensorflow/util.cc):

* ``:tensorflow:serving:request_count{model_name, status}``: ``status`` the canonical error
  code's name (``OK``, ``INVALID_ARGUMENT``, ``NOT_FOUND``, ``UNAVAILABLE``...), as
  ``error::Code_Name`` writes it; every API's requests count there;
* ``:tensorflow:serving:request_latency{model_name, API, entrypoint}``: successful requests
  only, as TF Serving records it; ``API`` its method names (``Predict``, ``Classify``,
  ``Regress``) for TF Serving's methods, our API's name for the others;
* ``:tensorflow:serving:runtime_latency{model_name, API, runtime}``.

Our own, richer view of the same requests is ``edge_appliance_requests_total{model_name,
API, entrypoint, status}`` (every API under its own name, REST or gRPC, the same code names).

Thread-safety: every method may be called from any thread.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.core.cgroup import available_bytes
from appliance.core.inference_stats import InferenceStats
from appliance.core.json_types import JSONObject, JSONValue

LATENCY_BUCKETS_US = (100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000, 1e6, 2.5e6, 1e7)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SYNC_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
WINDOW_SECONDS = 300
WINDOW_MAX = 20000  # latencies kept per model: bounds memory under any load
TFS_COUNTERS = (b":tensorflow:serving:request_count",)  # exported without prometheus_client's "_total"
BUCKET_SECONDS = 5  # width of one point of the page's charts
# A request's outcome as TF Serving labels it: the canonical code's name. Callers that know
# the error's gRPC code pass it; an HTTP status is read back the way TF Serving's
# http_server.cc maps codes to statuses (where two codes share a status, the usual one).
HTTP_TO_CODE = {200: "OK", 400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
                404: "NOT_FOUND", 405: "UNIMPLEMENTED", 408: "DEADLINE_EXCEEDED", 409: "ABORTED",
                413: "RESOURCE_EXHAUSTED", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL",
                501: "UNIMPLEMENTED", 503: "UNAVAILABLE", 504: "DEADLINE_EXCEEDED"}
TFS_API_NAMES = {"predict": "Predict", "classify": "Classify", "regress": "Regress"}  # TF Serving's method names

Snapshot = Callable[[], Mapping[str, Any]]


# A request's outcome in the page's window: the client's mistake (a 4xx: a bad tensor, an unknown
# model) is counted apart from the server's failure (a 5xx), and only the latter is "Errors".
OK, CLIENT_ERROR, SERVER_ERROR = 0, 1, 2
# RESOURCE_EXHAUSTED is what the REST API answers 413/429 for (a body over the limit, a full batch
# queue: HTTP_TO_CODE), which the window counts as the client's by their 4xx class; a gRPC call
# refused the same way is counted the same.
CLIENT_CODES = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "UNAUTHENTICATED", "PERMISSION_DENIED", "FAILED_PRECONDITION",
                          "OUT_OF_RANGE", "ALREADY_EXISTS", "CANCELLED", "RESOURCE_EXHAUSTED"})


def outcome(status: int | str, code: str) -> int:
    """OK, CLIENT_ERROR or SERVER_ERROR: an HTTP status by its class, a gRPC code by its name."""
    if code == "OK":
        return OK
    if isinstance(status, int):
        return SERVER_ERROR if status >= 500 else CLIENT_ERROR
    return CLIENT_ERROR if code in CLIENT_CODES else SERVER_ERROR


class RequestWindow:
    """Recent (time, latency, outcome) per model, bounded; summarised per request of the page."""

    def __init__(self) -> None:
        self._data: dict[str, collections.deque[tuple[float, float, int]]] = {}
        self._lock = threading.Lock()

    def add(self, model: str, seconds: float, result: int) -> None:
        """``result``: OK, CLIENT_ERROR or SERVER_ERROR."""
        q = self._data.get(model)
        if q is None:
            with self._lock:
                q = self._data.setdefault(model, collections.deque(maxlen=WINDOW_MAX))
        q.append((time.time(), seconds, int(result)))

    def summary(self, model: str, window: float = 60.0) -> JSONObject:
        """Rate, p50/p99 (ms), server and client error rates over ``window`` seconds, plus
        per-5-s series.

        ``series`` is requests/s per bucket; ``p50_series``/``p99_series`` (ms, None for an
        empty bucket), ``error_series`` (server errors, fraction) and ``client_error_series``
        are per bucket too. All series are oldest first and ``window // 5`` long, so the page
        draws them without any state.
        """
        q = self._data.get(model)
        now = time.time()
        rows = np.array([r for r in list(q or ()) if now - r[0] <= window], dtype=float).reshape(-1, 3)
        if not len(rows):
            return {"requests_per_s": 0.0, "p50_ms": None, "p99_ms": None, "error_rate": 0.0, "client_error_rate": 0.0,
                    "series": [], "p50_series": [], "p99_series": [], "error_series": [], "client_error_series": []}
        lat, errors, mistakes = rows[:, 1] * 1000, rows[:, 2] == SERVER_ERROR, rows[:, 2] == CLIENT_ERROR
        buckets = int(window // BUCKET_SECONDS)
        return {
            "requests_per_s": round(len(rows) / window, 2),
            "p50_ms": round(float(np.percentile(lat, 50)), 3),
            "p99_ms": round(float(np.percentile(lat, 99)), 3),
            "error_rate": round(float(errors.mean()), 4),
            "client_error_rate": round(float(mistakes.mean()), 4),
            **_bucket_series(now - rows[:, 0], lat, errors, buckets),
            "client_error_series": _bucket_series(now - rows[:, 0], lat, mistakes, buckets)["error_series"],
        }


def _bucket_series(age: np.ndarray, lat: np.ndarray, errors: np.ndarray, n: int) -> dict[str, list[JSONValue]]:
    """Per-bucket rate, p50, p99 and error rate (None: an empty bucket), oldest bucket first."""
    index = np.minimum((age // BUCKET_SECONDS).astype(int), n - 1)
    rate: list[JSONValue] = []
    p50: list[JSONValue] = []
    p99: list[JSONValue] = []
    err: list[JSONValue] = []
    for i in range(n - 1, -1, -1):
        mask = index == i
        count = int(mask.sum())
        rate.append(count / BUCKET_SECONDS)
        p50.append(round(float(np.percentile(lat[mask], 50)), 3) if count else None)
        p99.append(round(float(np.percentile(lat[mask], 99)), 3) if count else None)
        err.append(round(float(errors[mask].mean()), 4) if count else 0.0)
    return {"series": rate, "p50_series": p50, "p99_series": p99, "error_series": err}


class Metrics:
    """The registry behind ``/monitoring/prometheus/metrics``.

    Construction does no I/O and starts no threads. ``bind`` (once the manager exists)
    adds the scrape-time gauges; without it only the event-driven metrics are exported.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_count = Counter(":tensorflow:serving:request_count", "The total number of requests.",
                                     ["model_name", "status"], registry=None)
        r.register(_TFServingCounters(self.request_count))
        self.requests = Counter("edge_appliance_requests", "Requests by model, API, entrypoint and status code",
                                ["API", "entrypoint", "model_name", "status"], registry=r)
        self.request_latency = Histogram(":tensorflow:serving:request_latency",
                                         "Latency of successful requests (us)", ["model_name", "API", "entrypoint"],
                                         buckets=LATENCY_BUCKETS_US, registry=r)
        self.runtime_latency = Histogram(":tensorflow:serving:runtime_latency", "Backend run latency per batch (us)",
                                         ["model_name", "API", "runtime"], buckets=LATENCY_BUCKETS_US, registry=r)
        self.queueing_latency = Histogram(":tensorflow:serving:batching_session:queuing_latency",
                                          "Time a request waited in the batch queue (us)", ["thread_pool_name"],
                                          buckets=LATENCY_BUCKETS_US, registry=r)
        self.batch_size = Histogram("edge_appliance_batch_size", "Rows per executed batch (before padding)",
                                    ["model_name"], buckets=BATCH_BUCKETS, registry=r)
        self.padded_rows = Counter("edge_appliance_batch_padding_rows", "Rows added by padding to allowed batch sizes",
                                   ["model_name"], registry=r)
        self.warmup_latency = Histogram(":tensorflow:serving:model_warmup_latency", "Warm-up time per version (us)",
                                        ["model_path"], buckets=LATENCY_BUCKETS_US, registry=r)
        self.events = Counter("edge_appliance_events", "State events by kind (loads, swaps, refusals, errors)",
                              ["kind"], registry=r)
        self.sync_runs = Counter("edge_appliance_sync_runs", "Sync polls by result", ["result"], registry=r)
        self.sync_duration = Histogram("edge_appliance_sync_duration_seconds", "Duration of one sync poll",
                                       ["result"], buckets=SYNC_BUCKETS_S, registry=r)
        self.window = RequestWindow()
        self.inference = InferenceStats()  # Triton's statistics extension (appliance/core/inference_stats.py)
        self._bound = False

    def bind(self, snapshot: Snapshot, state_dir: str | None = None) -> None:
        """Export scrape-time gauges from ``snapshot()`` (``Manager.snapshot``), device and process.

        ``state_dir`` is where disk free is measured. Idempotent: only the first call binds.
        """
        if self._bound:
            return
        self._bound = True
        self.registry.register(_SnapshotCollector(snapshot))
        self.registry.register(_DeviceCollector(state_dir))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, ..._resident_memory_bytes (reads /proc)

    # -- event-driven --------------------------------------------------------------------
    def observe_request(self, model: str, api: str, status: int | str, seconds: float,
                        entrypoint: str = "REST") -> None:
        """One request ended: ``status`` is its canonical code's name ("OK", "NOT_FOUND"...)
        or an HTTP status (read as ``code_name`` says). ``entrypoint``: "REST" or "GRPC",
        the values TF Serving gives that label."""
        code = code_name(status)
        self.request_count.labels(model, code).inc()
        self.requests.labels(api, entrypoint, model, code).inc()
        if code == "OK":
            self.request_latency.labels(model, TFS_API_NAMES.get(api, api), entrypoint).observe(seconds * 1e6)
        self.window.add(model, seconds, outcome(status, code))

    def batch_observer(self, model: str, backend: str,
                       version: int = 0) -> Callable[[str, int, int, float, float, int], None]:
        """The ``observe`` callback of one version's ``Batcher`` (called once per executed batch):
        the Prometheus series and the version's statistics (``inference``)."""
        runtime = self.runtime_latency.labels(model, "Predict", backend)  # TF Serving's API name
        sizes = self.batch_size.labels(model)
        queueing = self.queueing_latency.labels(model)
        padding = self.padded_rows.labels(model)
        stats = self.inference

        def observe(signature: str, rows: int, padded: int, queued: float, ran: float, requests: int = 1) -> None:
            stats.execution(model, version, rows, requests, queued, ran)
            runtime.observe(ran * 1e6)
            sizes.observe(rows)
            queueing.observe(queued * 1e6)
            if padded > rows:
                padding.inc(padded - rows)

        return observe

    def observe_warmup(self, path: str, seconds: float) -> None:
        self.warmup_latency.labels(path).observe(seconds * 1e6)

    def observe_sync(self, result: str, seconds: float) -> None:
        """One sync poll ended after ``seconds``: ``result`` is e.g. "unchanged", "updated",
        "refused", "error". Exported as ``edge_appliance_sync_runs_total{result}`` and
        ``edge_appliance_sync_duration_seconds{result}``."""
        self.sync_runs.labels(result).inc()
        self.sync_duration.labels(result).observe(seconds)

    def on_event(self, row: Mapping[str, object]) -> None:
        """``StateDB.subscribe`` callback: count every state event by kind; an unloaded version's
        Triton statistics are forgotten."""
        kind = str(row.get("kind", ""))
        self.events.labels(kind).inc()
        if kind == "unloaded" and isinstance(version := row.get("version"), int):
            self.inference.forget(str(row.get("model", "")), version)

    def render(self) -> bytes:
        """Prometheus text format 0.0.4, TF Serving's counter names kept exact (see below)."""
        text = generate_latest(self.registry)
        for name in TFS_COUNTERS:  # prometheus_client writes "<name>_total" in HELP/TYPE
            for line in (b"# HELP ", b"# TYPE "):
                text = text.replace(line + name + b"_total ", line + name + b" ")
        return text


def code_name(status: int | str) -> str:
    """The canonical code's name of a request's outcome: a code name is kept; an HTTP status
    maps by ``HTTP_TO_CODE`` (any 2xx is OK; another 4xx INVALID_ARGUMENT, 5xx INTERNAL)."""
    if isinstance(status, str):
        return status
    if 200 <= status < 300:
        return "OK"
    return HTTP_TO_CODE.get(status, "INVALID_ARGUMENT" if status < 500 else "INTERNAL")


class _TFServingCounters(Collector):
    """Counters under TF Serving's exact sample names: no ``_total`` suffix, no ``_created``.

    Dashboards written for TF Serving query ``:tensorflow:serving:request_count{...}``;
    prometheus_client would expose ``..._total``. The hot path still increments a plain
    ``Counter``; only the exposition is renamed, at scrape time.
    """

    def __init__(self, *counters: Counter):
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        for counter in self._counters:
            for family in counter.collect():
                out = Metric(family.name, family.documentation, "counter")
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        out.add_sample(family.name, sample.labels, sample.value)
                yield out

    def describe(self) -> list[Metric]:
        return []


class _SnapshotCollector(Collector):
    """Version states, backend, queue depth and load time, read from the manager at scrape."""

    def __init__(self, snapshot: Snapshot):
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily("edge_appliance_model_version_state", "1 for the current state of each version",
                                  labels=["model_name", "version", "state"])
        backend = GaugeMetricFamily("edge_appliance_backend_info", "1 for the backend serving each available version",
                                    labels=["model_name", "version", "backend"])
        serving = GaugeMetricFamily("edge_appliance_serving_version", "Version that unversioned requests get",
                                    labels=["model_name"])
        depth = GaugeMetricFamily("edge_appliance_batch_queue_depth_rows", "Rows waiting in the batch queue",
                                  labels=["model_name", "version"])
        load = GaugeMetricFamily("edge_appliance_model_load_ms", "Load time of each version (ms)",
                                 labels=["model_name", "version"])
        refused = CounterMetricFamily("edge_appliance_batch_queue_full", "Requests refused: batch queue full",
                                      labels=["model_name", "version"])
        for name, model in self._snapshot().items():
            if model.get("serving_version") is not None:
                serving.add_metric([name], model["serving_version"])
            for v in model.get("versions", []):
                labels = [name, str(v["version"])]
                state.add_metric([*labels, str(v["state"])], 1)
                load.add_metric(labels, v.get("load_ms") or 0.0)
                if v.get("state") == "AVAILABLE" and v.get("backend"):
                    backend.add_metric([*labels, v["backend"]], 1)
                if v.get("batching"):
                    depth.add_metric(labels, v["batching"].get("queue_depth_rows", 0))
                    refused.add_metric(labels, v["batching"].get("rejected_full", 0))
        yield from (state, backend, serving, depth, load, refused)

    def describe(self) -> list[Metric]:
        return []  # families are dynamic; do not call collect() at registration


class _DeviceCollector(Collector):
    """Load, memory, disk free on the state directory and temperatures (psutil, at scrape)."""

    def __init__(self, state_dir: str | None):
        self._state_dir = state_dir

    def collect(self) -> Iterator[GaugeMetricFamily]:
        import psutil

        load1 = os.getloadavg()[0]
        yield _gauge("edge_appliance_device_load1", "1-minute load average", load1)
        yield _gauge("edge_appliance_device_memory_available_bytes",
                     "Memory available (the host's, or the service's cgroup's when it has less left)",
                     available_bytes(psutil.virtual_memory().available))
        if self._state_dir:
            try:
                yield _gauge("edge_appliance_device_disk_free_bytes", "Free space on the state directory's disk",
                             psutil.disk_usage(self._state_dir).free)
            except OSError:
                pass
        temps = GaugeMetricFamily("edge_appliance_device_temperature_celsius", "Temperature sensors",
                                  labels=["sensor"])
        for sensor, value in _temperatures().items():
            temps.add_metric([sensor], value)
        yield temps

    def describe(self) -> list[Metric]:
        return []


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _temperatures() -> dict[str, float]:
    import psutil

    out: dict[str, float] = {}
    try:
        for chip, sensors in (psutil.sensors_temperatures() or {}).items():
            for i, s in enumerate(sensors):
                out[f"{chip}/{s.label or i}"] = s.current
    except (AttributeError, OSError):  # not every platform reports temperatures
        pass
    return out

