"""Memory budgets from where the service lives (appliance/core/cgroup.py): in a memory cgroup
smaller than the host (a container's ``--memory``, a unit's ``MemoryMax``), a trial's budget is
the cgroup's, and the kernel's OOM killer takes a trial or a worker before the serving process.

Real cgroups, created by these tests under this process's own memory cgroup (v1's
``memory.limit_in_bytes`` or v2's ``memory.max``, whichever this machine has), with a process put
in before it runs (``echo $$ > cgroup.procs; exec ...``), and removed afterwards. Skipped, with
the reason, where not root or no memory cgroup can be made here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from appliance.core import cgroup
from tests.support.servers import ROOT, free_port, poll_until, spawn
from tests.support.versions_support import SAMPLE, add_version, failed, model_status

GIB = 1 << 30
LIMIT = 1 * GIB  # what the shipped Kubernetes manifest gives the service
DECLARED = 3 * GIB  # the hostile version's input: [805306368] float32


class Group:
    """A memory cgroup made for one test (v1 or v2), removed by ``remove``."""

    def __init__(self, path: Path, v2: bool):
        self.path, self.v2 = path, v2

    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer ended in this group (0 where not counted)."""
        text = (self.path / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
        found = re.search(r"^oom_kill (\d+)$", text, re.M)
        return int(found.group(1)) if found else 0

    def members(self) -> list[int]:
        return [int(p) for p in self.procs().read_text().split()]

    def remove(self) -> None:
        """Once empty (the test ended its processes by PID): rmdir, which the kernel allows then."""
        poll_until(lambda: not self.members(), 60, f"the processes in {self.path} to be gone")
        self.path.rmdir()


def make_group(name: str, limit: int) -> Group:
    """A child of this process's own memory cgroup with ``limit``, or pytest.skip with why not."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    v2_path, v1_path = cgroup._own_paths()
    if v1_path is not None and (Path(cgroup.ROOT) / "memory").is_dir():
        base, limit_file, v2 = Path(cgroup.ROOT) / "memory" / v1_path.lstrip("/"), "memory.limit_in_bytes", False
    elif v2_path is not None and (Path(cgroup.ROOT) / "cgroup.controllers").exists():
        base, limit_file, v2 = Path(cgroup.ROOT) / v2_path.lstrip("/"), "memory.max", True
    else:
        pytest.skip("no memory cgroup hierarchy under /sys/fs/cgroup")
    path = base / f"{name}-{os.getpid()}"
    try:
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a memory cgroup under {base}: {exc}")
    try:
        (path / limit_file).write_text(str(limit))
    except OSError as exc:  # v2 without the memory controller delegated here
        path.rmdir()
        pytest.skip(f"cannot set {limit_file} in {path}: {exc}")
    return Group(path, v2)


@pytest.fixture
def group() -> Iterator[Group]:
    made = make_group("edge-appliance-test", LIMIT)
    try:
        yield made
    finally:
        made.remove()


def in_group(group: Group, argv: list[str]) -> list[str]:
    """``argv`` run inside ``group`` from its first instruction (no fork before it joins)."""
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group.procs()), *argv]


def test_the_budget_and_the_available_memory_are_the_cgroups(group: Group) -> None:
    """A process in a 1 GiB group sees a 1 GiB limit and at most 1 GiB available, on a host
    with more; the trial's budget is 80 % of that at most."""
    code = ("from appliance.core import cgroup, loader_trial; import psutil; "
            "vm = psutil.virtual_memory(); "
            "print(cgroup.limit_bytes(), cgroup.available_bytes(vm.available), loader_trial.memory_budget(0), "
            "cgroup.total_bytes(vm.total))")
    out = subprocess.run(in_group(group, [sys.executable, "-c", code]), capture_output=True, text=True, cwd=ROOT,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    limit, available, budget, total = (int(n) for n in out.stdout.split())
    assert limit == LIMIT and total == LIMIT
    assert 0 < available <= LIMIT and budget <= int(LIMIT * 0.8)


def huge_input(dst: Path) -> Path:
    """half_plus_two's ~1 KB ``model.tflite`` whose input declares [805306368] floats (3 GiB)."""
    from ai_edge_litert import schema_py_generated as schema

    data = bytearray((SAMPLE / "model.tflite").read_bytes())
    graph = schema.Model.GetRootAsModel(data, 0).Subgraphs(0)
    shape = graph.Tensors(graph.Inputs(0)).ShapeAsNumpy()  # a view on ``data``: writable
    shape[0] = DECLARED // 4
    dst.mkdir(parents=True)
    (dst / "model.tflite").write_bytes(bytes(data))
    return dst


def tflite_only(dst: Path) -> Path:
    dst.mkdir(parents=True)
    (dst / "model.tflite").write_bytes((SAMPLE / "model.tflite").read_bytes())
    return dst


def predict(server: Any) -> Any:
    return server.post("/v1/models/hpt:predict", {"instances": [2.0]}).json()


def test_a_3_gib_tflite_in_a_1_gib_cgroup_costs_only_its_trial(group: Group, tmp_path: Path) -> None:
    """The service, its zygote and workers all in a 1 GiB group; a ~1 KB version declaring a 3 GiB
    input is refused by its trial against the cgroup's budget before anything is allocated, the
    kernel's OOM killer never acts, version 1 keeps serving, and the workers (not the serving
    process) are the OOM killer's first choice."""
    base = tmp_path / "models"
    add_version(tflite_only, base / "hpt", 1)
    port = free_port()
    argv = [sys.executable, "-m", "appliance.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--state", str(tmp_path / "state"), "--models", str(base), "--workers", "2", "--no-discovery",
            "--grpc-port", "0"]
    server = spawn(in_group(group, argv), port, tmp_path / "state", tmp_path / "server.log", timeout=180)
    try:
        assert server.proc.pid in group.members()
        assert predict(server) == {"predictions": [3.0]}  # 0.5 * 2 + 2
        version = add_version(huge_input, base / "hpt", 2)
        assert 900 < (version / "model.tflite").stat().st_size < 8192  # the sample's five signatures: a few KiB declaring 3 GiB
        record = server.wait_for(lambda: failed(server, "hpt", 2), 120, "version 2's trial to fail")
        assert record["error_code"] == "RESOURCE_EXHAUSTED", record
        assert str(DECLARED) in record["error"] and "load_memory_mb" in record["error"], record["error"]
        budget = int(re.search(r"more than the (\d+) bytes a load may take", record["error"]).group(1))
        assert budget <= int(LIMIT * 0.8), budget  # the cgroup's figure, not the host's
        assert "2" in model_status(server, "hpt")["quarantine"]
        assert group.oom_kills() == 0
        assert model_status(server, "hpt")["serving_version"] == 1 and predict(server) == {"predictions": [3.0]}
        assert _oom_score(server.proc.pid) == _oom_score(os.getpid())  # the serving process as it was started
        workers = [w["pid"] for w in server.status()["workers"]]
        assert len(workers) == 2 and all(_oom_score(pid) == cgroup.WORKER_OOM_SCORE for pid in workers)
    finally:
        server.stop()


def _oom_score(pid: int) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())
