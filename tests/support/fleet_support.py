"""Helpers of the fleet tests: small LiteRT versions that tell which version answered, a
device configured for a bucket, and reading a device's report from the bucket.

``lite_models()`` converts y = 0.5 x + b to TFLite three times (version v: b = OFFSETS[v], as
tests/support/sync_support.py's SavedModels), cached across runs, so devices start on LiteRT in a
second and never import TensorFlow.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tests.support.cache import built_once
from tests.support.load import scaled
from tests.support.servers import free_port
from tests.support.sync_support import OFFSETS

ROOT = Path(__file__).resolve().parents[2]


def lite_models() -> Path:
    """<cache>/hpt/<v>/model.tflite for v in OFFSETS."""
    digest = hashlib.sha256(Path(__file__).read_bytes() + json.dumps(OFFSETS).encode()).hexdigest()[:12]

    def build(folder: Path) -> None:
        for version, b in OFFSETS.items():
            write_half_plus(folder / "hpt" / str(version) / "model.tflite", b)

    return built_once(f"fleet-{digest}", build) / "hpt"


def write_half_plus(path: Path, b: float, padding_bytes: int = 0) -> None:
    """A TFLite model of y = 0.5 x + b (input ``x`` [1, 1] float32), optionally carrying an
    unused constant of ``padding_bytes`` so a version can be made as large as a real one."""
    import numpy as np
    import tensorflow as tf

    pad = tf.constant(np.random.default_rng(int(b * 1000)).random(max(1, padding_bytes // 4), dtype=np.float32))

    @tf.function(input_signature=[tf.TensorSpec([1, 1], tf.float32, name="x")])
    def half_plus(x: Any) -> Any:
        y = x * 0.5 + b
        if padding_bytes:
            y = y + 0.0 * tf.reduce_sum(pad[:1])
        return {"y": y}

    converter = tf.lite.TFLiteConverter.from_concrete_functions([half_plus.get_concrete_function()], half_plus)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(converter.convert())


def lite_device(start_server: Any, tmp: Path, bucket: str, env: dict[str, str] | None = None, ready: bool = True,
                port: int | None = None, **sync: Any) -> Any:
    """A real service on LiteRT, in one process (``--workers 1``), following ``bucket``'s channel
    ``stable`` (keys of ``sync`` override)."""
    port = port or free_port()
    state = tmp / f"state-{port}"
    settings = {"bucket": bucket, "channel": "stable", "poll_interval_s": 0.5, "jitter": 0.1,
                "max_backoff_s": 2.0, "report_interval_s": 3600.0, **sync}
    # limits.max_queue_wait_s stretched by the load, as in sync_scenario.device_config: the swap
    # tests' steady load threads must not be shed as an overload on a busy machine.
    lines = [f'models_dir = "{state}/models"', "poll_interval_s = 1.0",
             "[limits]", f"max_queue_wait_s = {scaled(2.0):.1f}", "[sync]"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    config = tmp / f"device-{port}.toml"
    config.write_text("\n".join(lines) + "\n")
    return start_server("--config", str(config), "--backend", "tflite", "--workers", "1", port=port, env=env,
                        ready=ready)


def report_of(source: Any, device_id: str) -> dict[str, Any] | None:
    fetched = source.read(f"_devices/{device_id}.json")
    return json.loads(fetched.data) if fetched.data else None


def predict_lite(url: str) -> float:
    import requests

    r = requests.post(f"{url}/v1/models/hpt:predict", json={"instances": [[2.0]]}, timeout=10)
    r.raise_for_status()
    return float(r.json()["predictions"][0]["y"][0] if isinstance(r.json()["predictions"][0], dict)
                 else r.json()["predictions"][0][0])


def device_ids(n: int, seed: int = 0) -> list[str]:
    """Ids as appliance/core/device.py makes them (12 hex digits), from a fixed seed."""
    import random

    rng = random.Random(seed)
    return [f"{rng.getrandbits(48):012x}" for _ in range(n)]


def fleet_report(device_id: str, serving: int, target: int | None = None, state: str = "ok", model: str = "hpt",
                 channel: str = "stable", written_at: float | None = None, key: Any = None,
                 report_interval_s: float = 300.0) -> dict[str, Any]:
    """A report as a device writes it (schema 2), for a fleet larger than the machine runs:
    ``state`` ok | refused | failed | unhealthy | waiting. Signed with ``key`` when given."""
    import time

    from sync.report import sign_report

    target = serving if target is None else target
    versions = [{"version": serving, "state": "AVAILABLE", "reason": "", "backend": "tflite"}]
    refused = None
    if state == "refused":
        refused = {"version": target, "reason": f"{model} version {target}: model.tflite does not match its sha256 "
                                                "(corrupt object)", "since": time.time()}
        versions.append({"version": target, "state": "REFUSED", "reason": refused["reason"], "backend": None})
    elif state == "failed":
        versions.append({"version": target, "state": "END", "reason": "Could not open 'model.tflite'", "backend": None})
    wave = {"version": target, "wave": 2, "admitted": False, "opens_at": time.time() + 600,
            "reason": "in wave 2 (25%), which opens in 10.0 min"} if state == "waiting" else None
    now = time.time() if written_at is None else written_at
    doc = {"schema": 2, "device_id": device_id, "hostname": f"edge-{device_id[:6]}", "software_version": "0.1.0",
           "written_at": now, "updated": now, "sequence": 1, "trigger": "start", "started_at": now - 60,
           "report_interval_s": report_interval_s, "poll_interval_s": 30.0, "healthy": state != "unhealthy",
           "channel": channel, "sync": {"last_poll": now, "failures": 0, "last_error": ""}, "last_sync": now,
           "last_error": "", "problems": [], "rollouts": {}, "backend_decisions": {},
           "models": {model: {"serving_version": serving if state != "unhealthy" else None, "target_version": target,
                              "candidate_version": None, "pinned": None, "versions": versions, "quarantined": {},
                              "refused": refused, "wave": wave}}}
    return sign_report(doc, key) if key is not None else doc


def write_reports(source: Any, reports: list[dict[str, Any]], workers: int = 16) -> None:
    """Put each report at ``_devices/<id>.json`` (in parallel for S3)."""
    from concurrent.futures import ThreadPoolExecutor

    def put(doc: dict[str, Any]) -> None:
        source.put(f"_devices/{doc['device_id']}.json", json.dumps(doc).encode())

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(put, reports))
