"""A LiteRT-only device: `pip install edge-appliance[tflite]` in a fresh venv, no TensorFlow.

The venv is real (built with pip from the package registry, cached per pyproject hash);
the service in it serves a TFLite model, never imports TensorFlow, and says which extra a
SavedModel or :classify would need.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.load import scaled
from tests.support.servers import ROOT, launch

# the first test builds a venv: pip's 900 s (stretched by the load) must fit inside pytest's timeout
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="session")
def lite_python() -> Path:
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    venv = Path(os.environ.get("EDGE_LITE_VENV", f"/tmp/edge-appliance-lite-venv-{digest}"))
    python = venv / "bin" / "python"
    if not (venv / ".complete").exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", f"{ROOT}[tflite]"], check=True,
                       timeout=scaled(900))
        (venv / ".complete").write_text("ok")
    return python


def test_lite_venv_has_no_tensorflow(lite_python: Path) -> None:
    out = subprocess.run([str(lite_python), "-c", "import importlib.util as u; print(u.find_spec('tensorflow'))"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_lite_service_serves_tflite_without_importing_tensorflow(lite_python: Path, models_dir: Path,
                                                                  tmp_path: Path) -> None:
    base = tmp_path / "models"
    (base / "mlp" / "1").mkdir(parents=True)
    shutil.copy(models_dir / "keras_mlp_tflite" / "1" / "model.tflite", base / "mlp" / "1" / "model.tflite")
    shutil.copytree(models_dir / "half_plus_two", base / "half_plus_two")  # a SavedModel only: needs [tf]
    server = launch(["--models", str(base), "--poll-interval", "0.5"], tmp_path, ready=False,
                    python=str(lite_python))
    try:
        server.wait_for(lambda: _served(server), 90, "the TFLite model to be served")
        r = server.post("/v1/models/mlp:predict", {"instances": [[0.5] * 64]})
        assert r.status_code == 200, r.text
        assert len(r.json()["predictions"][0]) == 10
        status = server.status()
        hp2 = status["models"]["half_plus_two"]
        assert "edge-appliance[tf]" in str(hp2), hp2  # the load failure names the extra
        versions = status["models"]["mlp"]["versions"]
        assert versions[0]["backend"] == "tflite"
        reasons = {c["backend"]: c["reason"] for c in versions[0]["decision"]["considered"]}
        assert "not installed" in reasons["tf-cpu"]
        service = status["service"]
        assert service["ready"] is False  # half_plus_two cannot be served here; mlp is served all the same
        assert "ai_edge_litert" in service["imported"] and "tensorflow" not in service["imported"]
        r = server.post("/v1/models/half_plus_two:predict", {"instances": [1.0]})
        assert r.status_code == 404 and "edge-appliance[tf]" in r.json()["error"]
    finally:
        assert server.stop() == 0


def _served(server) -> bool:
    try:
        m = server.get("/api/status", timeout=2).json()["models"]
        return m["mlp"]["serving_version"] == 1 and m["half_plus_two"]["versions"][0]["state"] == "END"
    except Exception:
        return False


def test_lite_install_with_an_s3_bucket_names_the_missing_extra(lite_python: Path, tmp_path: Path) -> None:
    """No boto3 in a LiteRT-only install: the device keeps serving what it has and says, in one
    line, which extra an s3:// bucket needs; so does the CLI."""
    assert subprocess.run([str(lite_python), "-c", "import boto3"], capture_output=True).returncode != 0
    config = tmp_path / "device.toml"
    config.write_text('[sync]\nbucket = "s3://fleet/prod"\npoll_interval_s = 0.3\n')
    server = launch(["--config", str(config)], tmp_path, ready=False, python=str(lite_python))
    try:
        error = server.wait_for(lambda: server.get("/api/status", timeout=2).json()["sync"]["last_error"], 60,
                                "the sync error")
        assert error == "s3:// buckets need the s3 extra, which this install lacks: pip install 'edge-appliance[s3]' (boto3)"
        assert "ModuleNotFoundError" not in server.log_text() and "Traceback" not in server.log_text()
    finally:
        assert server.stop() == 0
    cli = subprocess.run([str(lite_python), "-m", "appliance.cli", "fleet", "--bucket", "s3://fleet/prod"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert cli.returncode == 1 and cli.stderr.strip().splitlines() == [
        "appliance fleet: error: s3:// buckets need the s3 extra, which this install lacks: "
        "pip install 'edge-appliance[s3]' (boto3)"], cli.stderr
