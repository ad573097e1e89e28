"""KServe's own Python clients (kserve's ``InferenceRESTClient`` and ``InferenceGRPCClient``)
against ``appliance serve``, over REST (the v2 protocol and v1's predict) and gRPC.

The kserve package pins pydantic, starlette and psutil away from the project's venv, so it lives
in a venv of its own that scripts/peer_venv_kserve.sh makes (scripts/test.sh runs it; nothing is
installed at test time). The checks run in that venv as a child process
(tests/peers/kserve/kserve_clients.py: one ``PASS``/``FAIL`` line each), against the real
service on loopback, serving keras_mlp; every answer is compared with the model run in-process
here. Each check is one test below; the KServe client calls that do not apply are listed in
``NOT_RUN`` (and tests/peers/SKIPS.md) with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.support.servers import free_port

MODEL = "keras_mlp"
SCRIPT = Path(__file__).parent / "kserve" / "kserve_clients.py"
VENV = Path(os.environ.get("EDGE_KSERVE_VENV", Path.home() / ".cache" / "edge-appliance" / "peer-venvs" / "kserve"))
PYTHON = VENV / "bin" / "python"
CLIENTS_TIMEOUT_S = 600  # the child's whole run: importing kserve (pandas, grpcio) is slow on a loaded machine
# Above the module's fixture: the server's start and the model's load (300 s each) and the clients' run.
pytestmark = pytest.mark.timeout(1800)

CHECKS = ("rest v2 is_server_live", "rest v2 is_server_ready", "rest v2 is_model_ready",
          "rest v2 is_model_ready (unknown model)", "rest v2 infer (dict)", "rest v2 infer (InferRequest, JSON)",
          "rest v2 infer (binary input)", "rest v2 infer (binary output)", "rest v2 infer (unknown model)",
          "rest v1 infer (predict)", "grpc is_server_live", "grpc is_server_ready", "grpc is_model_ready",
          "grpc infer", "grpc infer (unknown model)", "grpc server metadata (KServe's stub)",
          "grpc model metadata (KServe's stub)")
NOT_RUN = {
    "rest v1 is_server_live": "KServe's v1 liveness is GET / answering {\"status\": \"alive\"}; here / is the "
                              "status page (HTML), as the v1 paths are TF Serving's API",
    "rest v1 is_model_ready": "KServe's v1 model ready reads {\"ready\": ...} from GET /v1/models/{m}, the path "
                              "where TF Serving's API (served here unchanged) answers model_version_status",
    "rest v1 is_server_ready": "kserve's client raises UnsupportedProtocol itself for v1 (no request is sent)",
    "explain": "KServe's v1 :explain needs an explainer (Alibi, ART): none is served here",
}


@pytest.fixture(scope="module")
def runs(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The client script's verdict per check, from one run against one server."""
    if not (VENV / ".complete").exists():
        pytest.skip(f"no complete KServe venv at {VENV}: run scripts/peer_venv_kserve.sh (scripts/test.sh does)")
    from tests.support.modelgen import reference_predict

    base = tmp_path_factory.mktemp("kserve-clients")
    shutil.copytree(models_dir / MODEL, base / "models" / MODEL)
    grpc_port = free_port()
    srv = module_server("--models", str(base / "models"), "--grpc-port", str(grpc_port), timeout=300)
    srv.wait_for(lambda: srv.get(f"/v2/models/{MODEL}/ready").status_code == 200, 300, f"{MODEL} ready")
    x = np.random.default_rng(7).standard_normal((3, 64)).astype(np.float32)
    probs = np.asarray(reference_predict(models_dir / MODEL / "1", {"x": x})["probs"])
    expected = base / "expected.json"
    expected.write_text(json.dumps({"x": x.tolist(), "probs": probs.tolist()}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the child sees kserve's venv only
    done = subprocess.run([str(PYTHON), str(SCRIPT), srv.url, f"127.0.0.1:{grpc_port}", MODEL, str(expected)],
                          capture_output=True, text=True, timeout=CLIENTS_TIMEOUT_S, env=env, cwd=base)
    verdicts = {}
    for line in done.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASS", "FAIL"):
            name, _, detail = rest.partition(": ")
            verdicts[name] = f"{word}: {detail}"
    assert set(verdicts) == set(CHECKS), (f"checks run {sorted(verdicts)}, expected {sorted(CHECKS)}; "
                                          f"exit {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return verdicts


@pytest.mark.parametrize("name", CHECKS)
def test_kserve_client(runs: dict[str, str], name: str) -> None:
    assert runs[name].startswith("PASS"), f"{name}: {runs[name]}"


def test_every_client_call_is_run_or_listed() -> None:
    """The clients' public calls, each run here or listed in NOT_RUN with its reason."""
    text = SCRIPT.read_text()
    for call in ("is_server_live(", "is_server_ready(", "is_model_ready(", "client.infer(", "ServerMetadata(",
                 "ModelMetadata("):
        assert call in text, call
    skips = (Path(__file__).parent / "SKIPS.md").read_text()
    for name in NOT_RUN:
        assert f"`{name}`" in skips, f"{name} is not listed in tests/peers/SKIPS.md"
