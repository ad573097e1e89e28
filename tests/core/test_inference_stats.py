"""Triton's statistics per version (appliance/core/inference_stats.py): figures kept apart per
version, safe from many threads at once, and forgotten when the version is unloaded."""

from __future__ import annotations

import threading

from appliance.core.inference_stats import InferenceStats
from appliance.core.metrics import Metrics


def test_versions_count_apart_and_concurrently() -> None:
    stats = InferenceStats()
    threads = [threading.Thread(target=lambda v=v: [stats.request("m", v, True, 0.001) for _ in range(500)])
               for v in (1, 2) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats.execution("m", 2, rows=3, requests=2, queued=0.5, ran=0.25)
    one, two = stats.of("m", 1), stats.of("m", 2)
    assert one["inference_stats"]["success"]["count"] == 2000
    assert two["inference_stats"]["success"]["count"] == 2000
    assert (one["execution_count"], two["execution_count"]) == (0, 1)
    assert two["batch_stats"][0]["batch_size"] == 3


def test_unloaded_version_is_forgotten() -> None:
    metrics = Metrics()
    metrics.inference.request("m", 1, False, 0.01)
    metrics.inference.request("m", 2, True, 0.01)
    metrics.on_event({"kind": "unloaded", "model": "m", "version": 1})
    assert metrics.inference.of("m", 1)["inference_stats"]["fail"]["count"] == 0
    assert metrics.inference.of("m", 2)["inference_stats"]["success"]["count"] == 1
    metrics.on_event({"kind": "load_start", "model": "m", "version": 2})  # other events forget nothing
    assert metrics.inference.of("m", 2)["inference_stats"]["success"]["count"] == 1
