"""``appliance probe``: the device profile and the backend decision, run as a real command."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = {"tf-gpu", "tf-cpu", "tflite", "litertlm"}  # litertlm: .litertlm bundles (issue 25)


def appliance(tmp_path: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "xdg"), "STATE_DIRECTORY": str(tmp_path / "state"),
           "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "appliance.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def probe_json(tmp_path: Path, *args: str) -> dict[str, Any]:
    done = appliance(tmp_path, "probe", "--json", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_probe_json(tmp_path: Path) -> None:
    result = probe_json(tmp_path)
    device = result["device"]
    assert device["cpu_count"] == os.cpu_count()
    assert device["memory_mb"] > 0
    assert isinstance(device["nvidia_gpu"], bool) and isinstance(device["tensorrt"], bool)
    assert "delegates" in device and set(device["delegates"]) >= {"gpu", "edgetpu"}
    backends = result["backends"]
    assert set(backends) == BACKENDS
    for name, b in backends.items():
        assert isinstance(b["available"], bool), name
        assert isinstance(b["reason"], str) and b["reason"], name
    assert backends["tf-cpu"]["available"] and backends["tflite"]["available"]  # both installed here
    assert "LiteRT-LM" in backends["litertlm"]["reason"]  # installed or not, probe says which
    if not device["nvidia_gpu"]:
        assert not backends["tf-gpu"]["available"] and "GPU" in backends["tf-gpu"]["reason"]
    assert "decisions" not in result  # nothing loaded without --models


def test_probe_text(tmp_path: Path) -> None:
    """One line per backend: its name, the word "available" or "unavailable" as --json says,
    then the same reason."""
    done = appliance(tmp_path, "probe")
    assert done.returncode == 0, done.stderr[-3000:]
    backends = probe_json(tmp_path)["backends"]
    for name in BACKENDS:
        line = next((l for l in done.stdout.splitlines() if l.strip().startswith(name + " ")), None)
        assert line is not None, done.stdout
        shown, word, reason = line.split(None, 2)
        assert shown == name
        assert word == ("available" if backends[name]["available"] else "unavailable"), line
        assert reason == backends[name]["reason"], line
    assert backends["tflite"]["available"]  # so the "available" branch is seen here, not only "unavailable"


# Modules that serve requests: building the parser for ``appliance --help`` imports none of them.
SERVER_MODULES = ("flask", "werkzeug", "prometheus_client", "numpy", "appliance.core.manager",
                  "appliance.service", "grpc", "zeroconf", "boto3", "runtimes")


# Prints the modules a process has imported once ``appliance ARGV`` is done (--help exits).
IMPORTED = """
import json, sys
from appliance.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["rollout", "--help"]], ids=" ".join)
def test_help_imports_none_of_the_server(argv: list[str]) -> None:
    """``appliance --help`` stays cheap: every subcommand's parser is built (that is --help's
    output), but what a verb needs is imported only when it runs. Read from ``sys.modules``
    (``-X importtime`` misses modules loaded by ``importlib.import_module``)."""
    done = subprocess.run([sys.executable, "-c", IMPORTED, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    usage, _, listing = done.stdout.rpartition("\n[")
    assert "usage: appliance" in usage
    imported = set(json.loads("[" + listing))
    assert {f"appliance.commands.{m}" for m in ("serve", "probe", "discover", "fleet", "tfs", "rollout")} <= imported
    heavy = sorted(m for m in imported if m in SERVER_MODULES or m.startswith(tuple(p + "." for p in SERVER_MODULES)))
    assert heavy == []


def test_serve_backend_choices_come_from_the_config() -> None:
    """``--backend`` checks its value against appliance.core.config.BACKEND_CHOICES, read only
    when the value is checked."""
    from appliance.cli import build_parser
    from appliance.core.config import BACKEND_CHOICES

    parser = build_parser()
    for name in BACKEND_CHOICES:
        assert parser.parse_args(["serve", "--backend", name]).backend == name
    done = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", "--backend", "cuda"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "invalid choice: 'cuda'" in done.stderr and "'tflite'" in done.stderr, done.stderr


def test_probe_names_the_litert_version(tmp_path: Path) -> None:
    """Platforms get different LiteRT releases (aarch64: 1.4.0, x86-64: 2.x): probe says which."""
    import importlib.metadata

    installed = importlib.metadata.version("ai-edge-litert")
    done = appliance(tmp_path, "probe")
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(l for l in done.stdout.splitlines() if l.strip().startswith("tflite "))
    assert f"ai_edge_litert {installed} importable" in line, line
    assert done.stdout.splitlines()[0].split()[2].rstrip(",") == os.uname().machine, done.stdout


@pytest.fixture(scope="module")
def probed(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("probe")
    base = tmp / "models"
    shutil.copytree(models_dir / "keras_mlp" / "1", base / "keras_mlp" / "1")
    if not (base / "keras_mlp" / "1" / "model.tflite").exists():
        shutil.copy(models_dir / "keras_mlp_tflite" / "1" / "model.tflite", base / "keras_mlp" / "1" / "model.tflite")
    shutil.copytree(models_dir / "multisig_tflite", base / "multisig_tflite")
    (base / "broken" / "3").mkdir(parents=True)
    (base / "broken" / "3" / "model.tflite").write_bytes(b"garbage" * 50)
    return probe_json(tmp, "--models", str(base))


def test_probe_models_measures_when_several_backends_can_serve(probed: dict[str, Any]) -> None:
    decision = probed["decisions"]["keras_mlp"]
    assert decision["how"] == "measured" and decision["chosen"] in ("tf-cpu", "tflite")
    considered = {c["backend"]: c for c in decision["considered"]}
    assert set(considered) == BACKENDS
    assert all(c["reason"] for c in considered.values())
    for name in ("tf-cpu", "tflite"):
        assert considered[name]["available"]
        assert considered[name]["batch1_ms"] > 0 and considered[name]["batch_n_ms"] > 0
        assert name in decision["reason"]
    assert not considered["litertlm"]["available"]  # no .litertlm bundle in this version


def test_probe_models_single_candidate(probed: dict[str, Any]) -> None:
    decision = probed["decisions"]["multisig_tflite"]
    assert (decision["chosen"], decision["how"]) == ("tflite", "only")
    tf_cpu = next(c for c in decision["considered"] if c["backend"] == "tf-cpu")
    assert not tf_cpu["available"] and tf_cpu["reason"]


def test_probe_models_reports_a_version_nothing_can_load(probed: dict[str, Any]) -> None:
    decision = probed["decisions"]["broken"]
    assert decision["chosen"] is None and decision["reason"]
    tflite = next(c for c in decision["considered"] if c["backend"] == "tflite")
    assert tflite["load_error"], decision


def test_probe_models_single_model_base_path(models_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "one"
    shutil.copytree(models_dir / "multisig_tflite" / "1", base / "4")
    result = probe_json(tmp_path, "--models", str(base))
    assert list(result["decisions"]) == ["default"]
    assert result["decisions"]["default"]["chosen"] == "tflite"


def test_probe_refuses_a_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[runtime]\nbackend = \"cuda\"\n")
    done = appliance(tmp_path, "probe", "--config", str(bad))
    assert done.returncode != 0
    assert "runtime.backend" in done.stderr and "Traceback" not in done.stderr
