"""Import only what serves (issue 34): with TensorFlow installed, a version that LiteRT wins by
measurement leaves no process of the service mapping TensorFlow; the measurement itself ran in
the trial's child process (appliance/core/loader_child.py), which exited. A version that does
run on TensorFlow maps it in the serving process only (the front workers never import it)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.versions_support import model_status


def tensorflow_mapped(pid: int) -> bool:
    """The process maps TensorFlow's own shared objects (LiteRT's live in ai_edge_litert/)."""
    with open(f"/proc/{pid}/maps") as f:
        return any("/site-packages/tensorflow/" in line or "libtensorflow" in line for line in f)


def service_tree(server: Any) -> list[int]:
    parent = psutil.Process(server.proc.pid)
    return [parent.pid, *(p.pid for p in parent.children(recursive=True))]


def trial_running(server: Any) -> bool:
    """A version's trial child (appliance/core/loader_child.py) is still in the tree."""
    for pid in service_tree(server):
        try:
            if "appliance.core.loader_child" in psutil.Process(pid).cmdline():
                return True
        except psutil.NoSuchProcess:
            pass
    return False


@pytest.mark.parametrize("workers", ["1", "2"])
def test_litert_won_so_no_process_maps_tensorflow(start_server: Any, models_dir: Path, tmp_path: Path,
                                                  workers: str) -> None:
    base = tmp_path / "models"
    shutil.copytree(models_dir / "keras_mlp" / "1", base / "mlp" / "1")
    shutil.copy(models_dir / "keras_mlp_tflite" / "1" / "model.tflite", base / "mlp" / "1")
    srv = start_server("--models", str(base), "--workers", workers)
    record = model_status(srv, "mlp")["versions"][0]
    decision = record["decision"]
    assert record["backend"] == "tflite" and decision["how"] == "measured", decision
    timed = {c["backend"]: c["batch1_ms"] for c in decision["considered"] if c["available"]}
    assert timed["tf-cpu"] and timed["tflite"], timed  # TensorFlow was measured, in the trial's child
    srv.wait_for(lambda: not trial_running(srv), 30, "the trial's child to exit")
    # the serving process, and with workers their zygote and the workers it forked
    assert len(service_tree(srv)) == (1 if workers == "1" else 2 + int(workers)), service_tree(srv)
    for pid in service_tree(srv):
        assert not tensorflow_mapped(pid), f"process {pid} maps TensorFlow"
    assert "tensorflow" not in srv.status()["service"]["imported"]


def test_a_version_on_tensorflow_maps_it_in_the_serving_process_only(start_server: Any, models_dir: Path,
                                                                     tmp_path: Path) -> None:
    base = tmp_path / "models"
    shutil.copytree(models_dir / "half_plus_two" / "1", base / "hpt" / "1")
    srv = start_server("--models", str(base), "--workers", "2")
    assert model_status(srv, "hpt")["versions"][0]["backend"] == "tf-cpu"
    srv.wait_for(lambda: not trial_running(srv), 30, "the trial's child to exit")
    serving, *others = service_tree(srv)
    assert len(others) == 3, others  # the zygote and the two workers it forked
    assert tensorflow_mapped(serving) and "tensorflow" in srv.status()["service"]["imported"]
    assert not any(tensorflow_mapped(pid) for pid in others)
