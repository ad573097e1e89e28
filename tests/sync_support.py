"""Helpers shared by the sync tests: versioned models, load generators, store checks.

``sync_models()`` builds TF Serving's half_plus_two three times with different ``b``
(version 1: y = x/2 + 2, version 2: + 3, version 3: + 4), cached across runs like the
``models_dir`` fixture, so a response tells which version answered it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parent.parent
OFFSETS = {1: 2.0, 2: 3.0, 3: 4.0}  # version -> b in y = 0.5 x + b


def sync_models() -> Path:
    """<cache>/hpt/<v>/ for v in OFFSETS (real SavedModels with warm-up requests)."""
    from tests import modelgen

    digest = hashlib.sha256((ROOT / "tests" / "modelgen.py").read_bytes() + json.dumps(OFFSETS).encode())
    cache = Path(os.environ.get("EDGE_TEST_MODEL_CACHE", "/tmp/edge-appliance-test-models")) / \
        f"sync-{digest.hexdigest()[:12]}"
    if not (cache / ".complete").exists():
        build = cache.with_name(cache.name + ".build")
        shutil.rmtree(build, ignore_errors=True)
        for version, b in OFFSETS.items():
            modelgen.build_half_plus_two(str(build / "hpt" / str(version)), b=b, warmup=True)
        shutil.rmtree(cache, ignore_errors=True)
        build.rename(cache)
        (cache / ".complete").write_text("ok")
    return cache


def predict(url: str, model: str = "hpt", timeout: float = 10) -> float:
    """y for x = 2.0 (1 + b), from the real REST API."""
    r = requests.post(f"{url}/v1/models/{model}:predict", json={"instances": [2.0]}, timeout=timeout)
    r.raise_for_status()
    return float(r.json()["predictions"][0])


def version_of(y: float) -> int:
    for version, b in OFFSETS.items():
        if abs(y - (1.0 + b)) < 1e-5:
            return version
    raise AssertionError(f"answer {y} matches no published version")


class Load:
    """Steady concurrent predict load; counts failures and which versions answered."""

    def __init__(self, url: str, threads: int = 4):
        self.url, self.threads = url, threads
        self.ok = 0
        self.failures: list[str] = []
        self.versions: set[int] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers = [threading.Thread(target=self._run, name=f"load-{i}") for i in range(threads)]

    def __enter__(self) -> "Load":
        for w in self._workers:
            w.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for w in self._workers:
            w.join(30)

    def _run(self) -> None:
        session = requests.Session()
        while not self._stop.is_set():
            try:
                r = session.post(f"{self.url}/v1/models/hpt:predict", json={"instances": [2.0]}, timeout=30)
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                version = version_of(float(r.json()["predictions"][0]))
                with self._lock:
                    self.ok += 1
                    self.versions.add(version)
            except Exception as exc:  # every failure is a finding
                with self._lock:
                    self.failures.append(str(exc))
        session.close()


def serving_version(status: dict[str, Any], model: str = "hpt") -> int | None:
    return status.get("models", {}).get(model, {}).get("serving_version")


def events(status: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in status.get("events", []) if e["kind"] == kind]


def store_is_complete(models_dir: Path) -> list[str]:
    """Problems in a device's model store: any version whose files disagree with its manifest."""
    problems = []
    for version_dir in sorted(models_dir.glob("*/*")):
        manifest = version_dir / "MANIFEST.json"
        if not manifest.exists():
            problems.append(f"{version_dir}: no manifest")
            continue
        for entry in json.loads(manifest.read_text())["files"]:
            path = version_dir / entry["path"]
            if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
                problems.append(f"{path}: missing or wrong content")
    return problems


def wait(predicate: Any, timeout: float = 60, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
