"""A LiteRT-only device: `pip install edge-appliance[tflite]` in a fresh venv, no TensorFlow.

The venv is real (built with pip from the package registry, cached per pyproject hash);
the service in it serves a TFLite model, never imports TensorFlow, and says which extra a
SavedModel or :classify would need; the README's first command (scripts/run.sh, VENV= this
venv) says each step, serves the sample whole on LiteRT and stops on Ctrl-C.
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


def test_run_sh_installs_litert_only_says_each_step_and_serves_the_sample_whole(lite_python: Path,
                                                                                 tmp_path: Path) -> None:
    """The README's first command on a LiteRT-only venv (VENV=, as the README says): a line for
    each step before it starts, the try: line answered as printed, all five signatures of the
    sample on LiteRT without TensorFlow, and Ctrl-C (SIGINT) stops it cleanly."""
    import re
    import signal

    import requests

    from tests.support.servers import free_port, poll_until

    port = free_port()
    log = tmp_path / "run.log"
    env = {**os.environ, "VENV": str(lite_python.parent.parent)}
    args = ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0", "--no-discovery",
            "--state", str(tmp_path / "state")]
    with open(log, "w") as out:
        proc = subprocess.Popen([str(ROOT / "scripts" / "run.sh"), *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    try:
        try_line = re.compile(r"^try:\s+curl -d '(.*)' (\S+)\n", re.M)  # the whole line, written
        text = poll_until(lambda: try_line.search(log.read_text()) and log.read_text(), 900, "run.sh's try: line",
                          context=lambda: log.read_text()[-3000:],
                          alive=lambda: proc.poll() is not None and f"run.sh exited {proc.returncode}")
        steps = re.findall(r"^run\.sh \[[\d:]+\] (.*)$", text, re.M)
        assert steps[-1].startswith("starting the service (Ctrl-C stops it)"), steps
        if len(steps) > 1:  # pip had something to do: it said so first, then named each package
            assert steps[0].startswith("installing edge-appliance[tflite]"), steps
        body, url = try_line.search(text).groups()  # type: ignore[union-attr]
        assert requests.post(url, data=body, timeout=10).json() == {"predictions": [2.5, 3.0, 4.5]}
        base = f"http://127.0.0.1:{port}"
        got = requests.post(f"{base}/v1/models/half_plus_two:classify",
                            json={"signature_name": "classify_x_to_y", "examples": [{"x": 2.0}]}, timeout=10)
        assert got.status_code == 200 and got.json() == {"results": [[["", 3.0]]]}, got.text
        status = requests.get(f"{base}/api/status", timeout=10).json()
        assert status["models"]["half_plus_two"]["versions"][0]["backend"] == "tflite"
        assert status["problems"] == [] and "tensorflow" not in status["service"]["imported"]
        proc.send_signal(signal.SIGINT)  # as Ctrl-C: run.sh exec'd the service, which drains and exits
        assert proc.wait(120) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
