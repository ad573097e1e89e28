"""Prometheus metrics (TF Serving's names where they exist) and cheap per-model request stats.

The hot path does two things per request: one counter increment and one histogram
observation, both in memory. ``RequestWindow`` keeps the last minutes of latencies per
model in a bounded ring so ``/api/status`` and the page can show rate, p50/p99 and error
rate without a database write per request.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS_US = (100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000, 1e6, 2.5e6, 1e7)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
WINDOW_SECONDS = 300
WINDOW_MAX = 20000  # latencies kept per model: bounds memory under any load


class RequestWindow:
    """Recent (time, latency, ok) per model, bounded; summarised per request of the page."""

    def __init__(self) -> None:
        self._data: dict[str, collections.deque[tuple[float, float, bool]]] = {}
        self._lock = threading.Lock()

    def add(self, model: str, seconds: float, ok: bool) -> None:
        q = self._data.get(model)
        if q is None:
            with self._lock:
                q = self._data.setdefault(model, collections.deque(maxlen=WINDOW_MAX))
        q.append((time.time(), seconds, ok))

    def summary(self, model: str, window: float = 60.0) -> dict[str, Any]:
        q = self._data.get(model)
        now = time.time()
        rows = [r for r in list(q or ()) if now - r[0] <= window]
        if not rows:
            return {"requests_per_s": 0.0, "p50_ms": None, "p99_ms": None, "error_rate": 0.0, "series": []}
        lat = np.array([r[1] for r in rows]) * 1000
        errors = sum(1 for r in rows if not r[2])
        series = collections.Counter(int((now - r[0]) // 5) for r in rows)  # 5-s buckets, newest first
        return {
            "requests_per_s": round(len(rows) / window, 2),
            "p50_ms": round(float(np.percentile(lat, 50)), 3),
            "p99_ms": round(float(np.percentile(lat, 99)), 3),
            "error_rate": round(errors / len(rows), 4),
            "series": [series.get(i, 0) / 5 for i in range(int(window // 5))][::-1],
        }


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.request_count = Counter(":tensorflow:serving:request_count", "Requests by model and status",
                                     ["model_name", "API", "entrypoint", "status"], registry=r)
        self.request_latency = Histogram(":tensorflow:serving:request_latency", "End-to-end request latency (us)",
                                         ["model_name", "API", "entrypoint"], buckets=LATENCY_BUCKETS_US, registry=r)
        self.runtime_latency = Histogram(":tensorflow:serving:runtime_latency", "Backend run latency per batch (us)",
                                         ["model_name", "API", "runtime"], buckets=LATENCY_BUCKETS_US, registry=r)
        self.queueing_latency = Histogram(":tensorflow:serving:batching_session:queuing_latency",
                                          "Time a request waited in the batch queue (us)", ["thread_pool_name"],
                                          buckets=LATENCY_BUCKETS_US, registry=r)
        self.batch_size = Histogram("edge_appliance_batch_size", "Rows per executed batch (before padding)",
                                    ["model_name"], buckets=BATCH_BUCKETS, registry=r)
        self.queue_full = Counter("edge_appliance_queue_full_total", "Requests refused because the batch queue was full",
                                  ["model_name"], registry=r)
        self.warmup_latency = Histogram(":tensorflow:serving:model_warmup_latency", "Warm-up time per version (us)",
                                        ["model_path"], buckets=LATENCY_BUCKETS_US, registry=r)
        self.version_state = Gauge("edge_appliance_model_version_state", "1 for the current state of each version",
                                   ["model_name", "version", "state"], registry=r)
        self.backend = Gauge("edge_appliance_backend_info", "1 for the backend serving each model version",
                             ["model_name", "version", "backend"], registry=r)
        self.window = RequestWindow()

    def observe_request(self, model: str, api: str, status: int, seconds: float) -> None:
        self.request_count.labels(model, api, "REST", "OK" if status < 400 else str(status)).inc()
        self.request_latency.labels(model, api, "REST").observe(seconds * 1e6)
        self.window.add(model, seconds, status < 400)

    def batch_observer(self, model: str, backend: str) -> Any:
        runtime = self.runtime_latency.labels(model, "predict", backend)
        sizes = self.batch_size.labels(model)
        queueing = self.queueing_latency.labels(model)

        def observe(signature: str, rows: int, padded: int, queued: float, ran: float) -> None:
            runtime.observe(ran * 1e6)
            sizes.observe(rows)
            queueing.observe(queued * 1e6)

        return observe

    def render(self) -> bytes:
        return generate_latest(self.registry)
