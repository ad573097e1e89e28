"""Safe rollouts against the real server: four candidates built here, judged on live traffic.

One server serves four models, each at version 1 = y = 2x + 1. A version 2 lands next to
each: an equal one (promoted), a slow one (aborted on p99 latency), one with other outputs
(aborted on drift) and one that fails on large inputs (aborted on errors, in canary mode so
that clients hit it and must still get answers). Every client request must succeed.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.support.cache import built_once

ADMIN = "rollout-test-admin-token-0123456789"
MODELS = {  # model -> (version 2 variant, rollout mode)
    "same": ("same", "shadow"),
    "slow": ("slow", "shadow"),
    "drift": ("drift", "shadow"),
    "flaky": ("flaky", "canary"),
}


def build(path: Path, variant: str) -> None:
    """A SavedModel x [None, 4] float32 -> y = 2x + 1, changed as ``variant`` says."""
    import tensorflow as tf

    class M(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
        def serve(self, x: Any) -> Any:
            y = x * (3.0 if variant == "drift" else 2.0) + 1.0
            if variant == "slow":  # same answer, much more work: a loop of matmuls fed by the input
                m = tf.fill([256, 256], tf.tanh(x[0, 0]) * 0.01)
                m = tf.while_loop(lambda i, m: i < 80, lambda i, m: (i + 1, tf.tanh(m @ m)), (0, m))[1]
                y = y + 0.0 * tf.reduce_mean(m)
            if variant == "flaky":  # fails on inputs of 100 and above
                with tf.control_dependencies([tf.debugging.assert_less(tf.reduce_max(x), 100.0)]):
                    y = tf.identity(y)
            return {"y": y}

    m = M()
    tf.saved_model.save(m, str(path), signatures={"serving_default": m.serve.get_concrete_function()})


VARIANTS = ("base", "same", "slow", "drift", "flaky")


def built_variants() -> Path:
    """``<cache>/rollout-<hash>/<variant>`` for every variant, built once (tests/support/cache.py)
    for this file and tests/api/test_rollout_apis.py, keyed by ``build``'s source: the tests only
    copy from it."""
    digest = hashlib.sha256((inspect.getsource(build) + repr(VARIANTS)).encode()).hexdigest()[:12]

    def build_all(folder: Path) -> None:
        for variant in VARIANTS:
            build(folder / variant, variant)
    return built_once(f"rollout-{digest}", build_all)


@pytest.fixture(scope="module")
def variants() -> Path:
    return built_variants()


def write_config(tmp_path: Path, base: Path, models: dict[str, tuple[str, str]] = MODELS,
                 min_requests: int = 40, p99_ratio: float = 5.0) -> Path:
    """A config serving ``models`` ({name: (variant, rollout mode)}) from ``base`` with the gates used here."""
    lines = ["poll_interval_s = 0.5", "[security]", f'admin_token = "{ADMIN}"']
    for name, (_, mode) in models.items():
        lines += ["[[models]]", f'name = "{name}"', f'base_path = "{base / name}"', "[models.rollout]",
                  f'mode = "{mode}"', "canary_percent = 50.0", f"min_requests = {min_requests}",
                  "max_duration_s = 240.0", "max_error_rate = 0.05", f"max_p99_latency_ratio = {p99_ratio}",
                  "max_output_drift = 0.01", "shadow_busy_share = 1.0"]
    path = tmp_path / "appliance.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def decisions(server: Any) -> dict[str, dict[str, Any]]:
    rollouts = server.status().get("rollouts", {})
    return {m: r["decisions"][-1] for m, r in rollouts.items() if r.get("decisions")}


def test_candidates_promoted_or_aborted_with_zero_failed_requests(start_server: Any, variants: Path,
                                                                  tmp_path: Path) -> None:
    base = tmp_path / "models"
    for name in MODELS:
        shutil.copytree(variants / "base", base / name / "1")
    server = start_server("--config", str(write_config(tmp_path, base)))
    # No candidate yet: the admin endpoint says so, and only with the admin token.
    assert server.post("/api/models/same/rollout/promote").status_code in (401, 403)
    answer = server.post("/api/models/same/rollout/promote", headers={"Authorization": f"Bearer {ADMIN}"})
    assert answer.status_code == 409 and "no rollout candidate" in answer.json()["error"]

    for name, (variant, _) in MODELS.items():  # version 2 appears by one rename, as sync commits it
        shutil.copytree(variants / variant, tmp_path / f"stage-{name}")
        os.rename(tmp_path / f"stage-{name}", base / name / "2")
    server.wait_for(lambda: all(m.get("candidate_version") == 2 and len([v for v in m["versions"]
                                if v["state"] == "AVAILABLE"]) == 2 for m in server.status()["models"].values()),
                    120, "every candidate loaded next to version 1")

    failures: list[str] = []
    answered = [0]
    stop = threading.Event()

    def client(worker: int) -> None:
        session = requests.Session()
        i = 0
        while not stop.is_set():
            i += 1
            for name in MODELS:
                value = 150.0 if (name == "flaky" and i % 3 == 0) else float(i % 7)
                r = session.post(f"{server.url}/v1/models/{name}:predict", json={"instances": [[value] * 4]},
                                 headers={"X-Client-Key": f"client-{worker}-{i}"}, timeout=30)
                if r.status_code != 200 or r.json()["predictions"] != [[value * 2 + 1] * 4]:
                    failures.append(f"{name}: {r.status_code} {r.text[:200]}")
                answered[0] += 1

    threads = [threading.Thread(target=client, args=(w,), name=f"rollout-client-{w}") for w in range(3)]
    for t in threads:
        t.start()
    try:
        server.wait_for(lambda: len(decisions(server)) == len(MODELS), 240, "a decision for every model")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failures == [] and answered[0] > 0

    done = decisions(server)
    assert done["same"]["action"] == "promote", done["same"]
    assert done["slow"]["action"] == "abort" and "p99 latency" in done["slow"]["reason"], done["slow"]
    assert done["drift"]["action"] == "abort" and "output drift" in done["drift"]["reason"], done["drift"]
    assert done["flaky"]["action"] == "abort" and "error rate" in done["flaky"]["reason"], done["flaky"]
    assert done["drift"]["output_drift"] > 0.5 and done["same"]["output_drift"] == 0

    status = server.status()
    models = status["models"]
    server.wait_for(lambda: server.status()["models"]["same"]["serving_version"] == 2, 30, "the promotion")
    for name in ("slow", "drift", "flaky"):
        assert models[name]["serving_version"] == 1
        assert "rollout aborted" in models[name]["quarantined"]["2"]
    kinds = {(e["kind"], e["model"]) for e in status["events"]}
    assert ("rollout_promoted", "same") in kinds and ("rollout_aborted", "slow") in kinds
    # TF Serving's model status shape is unchanged; the rollout figures are metrics too.
    version_status = server.get("/v1/models/drift").json()["model_version_status"]
    assert {"version", "state", "status"} <= set(version_status[0])
    metrics = server.get("/monitoring/prometheus/metrics").text
    assert 'edge_appliance_rollout_requests_total{model_name="slow",outcome="ok",role="candidate",version="2"}' in metrics
