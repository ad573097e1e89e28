"""/monitoring/prometheus/metrics on the real server, parsed with prometheus_client's parser.

One server (LiteRT only: no TensorFlow import, starts in seconds) serves the whole module;
each test reads counters before and after its own requests, so order does not matter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.core.metrics import (CLIENT_ERROR, OK, SERVER_ERROR, SYNC_BUCKETS_S, Metrics, RequestWindow, code_name,
                                    outcome)
from tests.support.servers import Server, model_copy

MODEL = "multisig_tflite"
GOOD = {"signature_name": "add", "instances": [{"a": [1, 2, 3, 4], "b": [1, 1, 1, 1]}]}
BAD = {"signature_name": "no_such_signature", "instances": [{"a": [1, 2, 3, 4], "b": [1, 1, 1, 1]}]}


@pytest.fixture(scope="module")
def server(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Server:
    base = model_copy(models_dir, tmp_path_factory.mktemp("metrics-models"), MODEL)
    return module_server("--models", str(base), "--backend", "tflite")


def scrape(server: Server) -> dict[str, Any]:
    response = server.get("/monitoring/prometheus/metrics")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def total(families: dict[str, Any], name: str, sample: str | None = None, **labels: str) -> float:
    """Sum of the samples of one family whose labels include ``labels``."""
    family = families.get(name)
    if family is None:
        return 0.0
    return sum(s.value for s in family.samples
               if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items()))


def predict(server: Server, body: dict[str, Any], n: int, expect: int) -> None:
    for _ in range(n):
        response = server.post(f"/v1/models/{MODEL}:predict", body)
        assert response.status_code == expect, response.text


COUNT = ":tensorflow:serving:request_count"


def test_request_count_grows_by_exactly_n(server: Server) -> None:
    before = scrape(server)
    predict(server, GOOD, 7, 200)
    after = scrape(server)
    assert after[COUNT].type == "counter"
    assert total(after, COUNT, model_name=MODEL) - total(before, COUNT, model_name=MODEL) == 7
    assert total(after, COUNT, model_name=MODEL, status="OK") - total(before, COUNT, model_name=MODEL, status="OK") == 7


OURS = "edge_appliance_requests"


def test_rest_requests_are_counted_under_the_rest_entrypoint(server: Server) -> None:
    """Our own series keeps API and entrypoint (TF Serving's request_count has neither)."""
    before = scrape(server)
    predict(server, GOOD, 2, 200)
    after = scrape(server)
    rest = {"model_name": MODEL, "API": "predict", "entrypoint": "REST", "status": "OK"}
    assert total(after, OURS, **rest) - total(before, OURS, **rest) == 2
    assert total(after, OURS, model_name=MODEL, entrypoint="GRPC") == 0


def families_of(metrics: Metrics) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


# tensorflow_serving/servables/tensorflow/util.cc: the labels TF Serving gives each series.
TFS_LABELS = {":tensorflow:serving:request_count": {"model_name", "status"},
              ":tensorflow:serving:request_latency": {"model_name", "API", "entrypoint"},
              ":tensorflow:serving:runtime_latency": {"model_name", "API", "runtime"}}
# google.rpc.Code's names, as TF Serving's error::Code_Name writes the status label.
CANONICAL_CODES = {"OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
                   "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
                   "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"}


def test_tf_serving_series_carry_tf_servings_labels_only(server: Server) -> None:
    """What TF Serving's dashboards query: its series with its labels and nothing more, the
    status a canonical code name; a failed request leaves TF Serving's latency alone."""
    predict(server, GOOD, 1, 200)
    predict(server, BAD, 1, 400)
    families = scrape(server)
    for name, labels in TFS_LABELS.items():
        samples = [s for s in families[name].samples if not s.name.endswith(("_sum_created", "_created"))]
        assert samples, name
        assert all(set(s.labels) - {"le"} == labels for s in samples), (name, samples[:3])
    assert {s.labels["status"] for s in families[COUNT].samples} <= CANONICAL_CODES
    assert {s.labels["API"] for s in families[":tensorflow:serving:request_latency"].samples} == {"Predict"}


def test_entrypoint_label_is_tf_servings_rest_or_grpc() -> None:
    """TF Serving labels a call by how it came in: entrypoint "REST" or "GRPC" (the gRPC
    services count through appliance/api/grpc_errors.py ``observed``), and its status by
    the canonical code name (an HTTP status is read back to one)."""
    metrics = Metrics()
    metrics.observe_request("m", "predict", 200, 0.001)
    metrics.observe_request("m", "predict", 404, 0.001, entrypoint="GRPC")
    metrics.observe_request("m", "predict", "FAILED_PRECONDITION", 0.001, entrypoint="GRPC")
    metrics.observe_request("m", "predict", 413, 0.001)
    families = families_of(metrics)
    assert {s.labels["status"]: s.value for s in families[COUNT].samples} == \
        {"OK": 1.0, "NOT_FOUND": 1.0, "FAILED_PRECONDITION": 1.0, "RESOURCE_EXHAUSTED": 1.0}
    ours = {(s.labels["entrypoint"], s.labels["status"]): s.value for s in families[OURS].samples
            if s.name == OURS + "_total"}
    assert ours == {("REST", "OK"): 1.0, ("GRPC", "NOT_FOUND"): 1.0, ("GRPC", "FAILED_PRECONDITION"): 1.0,
                    ("REST", "RESOURCE_EXHAUSTED"): 1.0}
    latency = ":tensorflow:serving:request_latency"
    counts = {(s.labels["API"], s.labels["entrypoint"]): s.value for s in families[latency].samples
              if s.name == latency + "_count"}
    assert counts == {("Predict", "REST"): 1.0}  # TF Serving records the latency of successful requests only


def test_observe_sync_counts_runs_and_durations_by_result() -> None:
    metrics = Metrics()
    families = families_of(metrics)
    assert families["edge_appliance_sync_runs"].samples == []  # nothing before the first poll
    metrics.observe_sync("unchanged", 0.2)
    metrics.observe_sync("unchanged", 0.3)
    metrics.observe_sync("error", 4.0)
    families = families_of(metrics)
    runs = families["edge_appliance_sync_runs"]
    assert runs.type == "counter"
    assert {s.labels["result"]: s.value for s in runs.samples if s.name.endswith("_total")} == \
        {"unchanged": 2.0, "error": 1.0}
    name = "edge_appliance_sync_duration_seconds"
    duration = families[name]
    assert duration.type == "histogram"
    by = {(s.name, s.labels["result"], s.labels.get("le")): s.value for s in duration.samples}
    assert by[(name + "_count", "unchanged", None)] == 2 and by[(name + "_count", "error", None)] == 1
    assert by[(name + "_sum", "unchanged", None)] == pytest.approx(0.5)
    assert by[(name + "_sum", "error", None)] == pytest.approx(4.0)
    assert by[(name + "_bucket", "unchanged", "0.25")] == 1 and by[(name + "_bucket", "unchanged", "0.5")] == 2
    assert by[(name + "_bucket", "error", "2.5")] == 0 and by[(name + "_bucket", "error", "5.0")] == 1
    edges = {le for _, result, le in by if result == "error" and le}
    assert edges == {str(float(b)) for b in SYNC_BUCKETS_S} | {"+Inf"}


def test_counter_keeps_tf_serving_name(server: Server) -> None:
    """Exposed as TF Serving writes it: no ``_total`` suffix, HELP/TYPE under the same name."""
    predict(server, GOOD, 1, 200)
    text = server.get("/monitoring/prometheus/metrics").text
    assert f"# TYPE {COUNT} counter" in text
    assert any(line.startswith(COUNT + "{") and f'model_name="{MODEL}"' in line for line in text.splitlines())
    assert COUNT + "_total" not in text


def test_errors_are_counted_by_status(server: Server) -> None:
    """An unknown signature is INVALID_ARGUMENT (HTTP 400), as TF Serving counts it."""
    before = scrape(server)
    predict(server, BAD, 3, 400)
    after = scrape(server)
    bad = {"model_name": MODEL, "status": "INVALID_ARGUMENT"}
    assert total(after, COUNT, **bad) - total(before, COUNT, **bad) == 3
    assert total(after, COUNT, model_name=MODEL, status="OK") == total(before, COUNT, model_name=MODEL, status="OK")


def test_request_latency_histogram(server: Server) -> None:
    name = ":tensorflow:serving:request_latency"
    before = scrape(server)
    predict(server, GOOD, 5, 200)
    after = scrape(server)
    assert after[name].type == "histogram"
    count = total(after, name, name + "_count", model_name=MODEL) - total(before, name, name + "_count", model_name=MODEL)
    assert count == 5
    buckets = [s for s in after[name].samples if s.name == name + "_bucket" and s.labels["model_name"] == MODEL]
    assert buckets and buckets[-1].labels["le"] == "+Inf"
    assert total(after, name, name + "_sum", model_name=MODEL) > 0


def test_batch_histograms(server: Server) -> None:
    """Every executed batch is observed: backend run time, queueing time and batch size."""
    before = scrape(server)
    predict(server, GOOD, 4, 200)
    after = scrape(server)
    runtime, sizes = ":tensorflow:serving:runtime_latency", "edge_appliance_batch_size"
    queuing = ":tensorflow:serving:batching_session:queuing_latency"
    for name, labels in ((runtime, {"model_name": MODEL, "runtime": "tflite"}), (sizes, {"model_name": MODEL}),
                         (queuing, {"thread_pool_name": MODEL})):
        assert after[name].type == "histogram"
        grew = total(after, name, name + "_count", **labels) - total(before, name, name + "_count", **labels)
        assert grew == 4, f"{name} grew by {grew} after 4 requests"  # one at a time: one batch each


def test_model_and_backend_gauges(server: Server) -> None:
    families = scrape(server)
    assert total(families, "edge_appliance_model_version_state", model_name=MODEL, version="1", state="AVAILABLE") == 1
    assert total(families, "edge_appliance_backend_info", model_name=MODEL, version="1", backend="tflite") == 1
    assert total(families, "edge_appliance_serving_version", model_name=MODEL) == 1
    assert "edge_appliance_batch_queue_depth_rows" in families


def test_events_counted_by_kind(server: Server) -> None:
    families = scrape(server)
    assert total(families, "edge_appliance_events", kind="loaded") >= 1
    assert total(families, "edge_appliance_events", kind="service_start") == 1


def test_process_and_device_gauges(server: Server) -> None:
    families = scrape(server)
    assert total(families, "process_resident_memory_bytes") > 0
    assert total(families, "edge_appliance_device_memory_available_bytes") > 0
    assert total(families, "edge_appliance_device_disk_free_bytes") > 0
    assert "edge_appliance_device_temperature_celsius" in families  # empty where no sensor is reported


def test_request_window_series() -> None:
    """The page's charts: per-5-s rate, p50/p99 and error rate, oldest first, over 60 s."""
    window = RequestWindow()
    for i in range(10):  # one server error, two client errors, seven answers
        window.add("m", 0.002 * (i + 1), SERVER_ERROR if i == 0 else CLIENT_ERROR if i in (1, 2) else OK)
    summary = window.summary("m")
    assert summary["error_rate"] == 0.1 and summary["client_error_rate"] == 0.2  # a client's 400 is no "error"
    assert summary["requests_per_s"] == round(10 / 60, 2)
    for key in ("series", "p50_series", "p99_series", "error_series", "client_error_series"):
        assert len(summary[key]) == 12
    assert summary["series"][-1] == 10 / 5 and sum(summary["series"][:-1]) == 0
    assert summary["p50_series"][:-1] == [None] * 11 and summary["p50_series"][-1] == summary["p50_ms"]
    assert summary["error_series"][-1] == 0.1 and summary["client_error_series"][-1] == 0.2
    assert window.summary("unknown")["series"] == []


def test_a_request_is_the_clients_mistake_or_the_servers_failure() -> None:
    assert [outcome(s, code_name(s)) for s in (200, 400, 404, 413, 429, 500, 503)] == \
        [OK, CLIENT_ERROR, CLIENT_ERROR, CLIENT_ERROR, CLIENT_ERROR, SERVER_ERROR, SERVER_ERROR]
    assert [outcome(c, c) for c in ("INVALID_ARGUMENT", "NOT_FOUND", "INTERNAL", "UNAVAILABLE", "DATA_LOSS")] == \
        [CLIENT_ERROR, CLIENT_ERROR, SERVER_ERROR, SERVER_ERROR, SERVER_ERROR]
    # The same refusal counts the same over both APIs: REST's 413/429 are RESOURCE_EXHAUSTED over gRPC.
    assert outcome("RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED") == outcome(429, code_name(429)) == CLIENT_ERROR
