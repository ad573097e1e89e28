"""Artifacts are data, never code: no pickle, no op libraries, no links or special files.

The bucket side: a symbolic link, FIFO or device planted in a folder bucket is refused by
the source (never followed, never opened in a way that blocks). The store side: a stage
holding anything but folders and regular files is refused at commit. The serving side: a
``--models DIR`` version directory with a link in it is quarantined, and a SavedModel whose
graph needs an op this server does not have (a custom-op model) fails to load with a clear
reason while the previous version keeps serving: nothing ever calls ``tf.load_op_library``.
"""

from __future__ import annotations

import ast
import hashlib
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest

from sync.errors import Refused
from sync.follower import Follower, LocalModel, Options
from sync.publisher import publish
from sync.open_source import open_source
from sync.store import Store, check_version_tree, unsafe_entries
from tests.support.servers import ROOT
from tests.support.sync_support import make_version, predict, sync_models, version_of

CUSTOM_OP = "EdgeApplianceCustomOp"


def follow(tmp: Path, bucket: Path) -> tuple[Store, Any]:
    store = Store(str(tmp / "device")).open()
    events: list[str] = []
    follower = Follower(open_source(f"file://{bucket}"), store, Options(models=["m"]),
                        lambda kind, msg, **kw: events.append(msg), lambda: {"m": LocalModel()})
    return store, follower


# -- the bucket side ----------------------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", ["symlink_to_zero", "symlink_to_secret", "fifo", "device"])
def test_links_fifos_and_devices_in_a_folder_bucket_are_refused(tmp_path: Path, planted: str) -> None:
    bucket = tmp_path / "bucket"
    publish(open_source(f"file://{bucket}"), "m", str(make_version(tmp_path, "v", {"model.tflite": b"m" * 1000})), 1)
    target = bucket / "m/1/model.tflite"
    target.unlink()
    if planted == "symlink_to_zero":
        os.symlink("/dev/zero", target)  # endless data behind a link
    elif planted == "symlink_to_secret":
        os.symlink("/etc/hostname", target)  # a file outside the bucket
    elif planted == "fifo":
        os.mkfifo(target)  # open() for reading would block forever
    else:
        if os.getuid() != 0:
            pytest.skip("mknod of a character device needs root")
        os.mknod(target, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    store, follower = follow(tmp_path, bucket)
    result = follower.sync_once()
    assert result.refused and ("symbolic link" in result.refused[0] or "not a regular file" in result.refused[0])
    assert store.versions("m") == {}
    assert not [p for p in Path(store.staging_dir).rglob("*") if p.is_file()]


def test_a_stage_holding_a_link_or_fifo_is_never_committed(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "device")).open()
    stage = Path(store.stage_dir("m", 1))
    stage.mkdir(parents=True)
    (stage / "saved_model.pb").write_bytes(b"graph")
    (stage / "variables").mkdir()
    os.symlink("/etc", stage / "variables" / "escape")
    os.mkfifo(stage / "pipe")
    with pytest.raises(Refused, match="pipe \\(FIFO\\), variables/escape \\(symbolic link\\)"):
        store.commit(str(stage), "m", 1)
    assert store.versions("m") == {}
    assert unsafe_entries(str(stage)) == ["pipe (FIFO)", "variables/escape (symbolic link)"]
    (stage / "pipe").unlink()
    (stage / "variables" / "escape").unlink()
    check_version_tree(str(stage))  # folders and regular files only: fine
    link = tmp_path / "linked-version"
    os.symlink(stage, link)
    with pytest.raises(Refused, match="is a symbolic link"):
        check_version_tree(str(link))


# -- no code in artifacts -----------------------------------------------------------------------
FORBIDDEN_CALLS = {"load_op_library", "load_library", "load_pluggable_device_library"}
FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "joblib", "marshal", "shelve", "cloudpickle"}


def test_no_code_path_unpickles_or_loads_op_libraries() -> None:
    """Every module of the service (not the tests or benches): no pickle-family import, no
    ``allow_pickle=True``, no op/plugin library loading, no ``exec``/``eval``, no Keras
    ``safe_mode=False``."""
    findings = []
    for package in ("appliance", "runtimes", "sync", "ui"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.Import):
                    findings += [f"{where} imports {a.name}" for a in node.names if a.name.split(".")[0] in FORBIDDEN_MODULES]
                elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                    findings.append(f"{where} imports from {node.module}")
                elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_CALLS:
                    findings.append(f"{where} uses {node.attr}")
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("exec", "eval"):
                    findings.append(f"{where} calls {node.func.id}")
                elif isinstance(node, ast.keyword) and (node.arg, getattr(node.value, "value", None)) in (
                        ("allow_pickle", True), ("safe_mode", False)):
                    findings.append(f"{where} passes {node.arg}={node.value.value}")  # type: ignore[attr-defined]
    assert findings == []


# -- the serving side ---------------------------------------------------------------------------
def custom_op_model(hpt_dir: Path) -> Path:
    """half_plus_two whose AddV2 became ``EdgeApplianceCustomOp`` (declared in the graph's op
    list, as a model exported with a custom-op library is): loading it would need that
    library. Built once and cached like the other test models."""
    source = hpt_dir / "saved_model.pb"
    digest = hashlib.sha256(source.read_bytes() + CUSTOM_OP.encode()).hexdigest()[:12]
    cache = Path(os.environ.get("EDGE_TEST_MODEL_CACHE", "/tmp/edge-appliance-test-models")) / f"customop-{digest}"
    if (cache / ".complete").exists():
        return cache / "model"
    from tensorflow.core.protobuf import saved_model_pb2

    build = cache.with_name(cache.name + f".build-{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    shutil.copytree(hpt_dir, build / "model")
    sm = saved_model_pb2.SavedModel()
    sm.ParseFromString(source.read_bytes())
    graph = sm.meta_graphs[0]
    changed = [n for n in graph.graph_def.node if n.op == "AddV2"]
    assert changed, "half_plus_two has no AddV2 node to turn into a custom op"
    for node in changed:
        node.op = CUSTOM_OP
    op_list = graph.meta_info_def.stripped_op_list.op
    declared = next(o for o in op_list if o.name == "AddV2")
    custom = op_list.add()
    custom.CopyFrom(declared)
    custom.name = CUSTOM_OP
    (build / "model" / "saved_model.pb").write_bytes(sm.SerializeToString())
    (build / ".complete").write_text("ok")
    shutil.rmtree(cache, ignore_errors=True)
    build.rename(cache)
    return cache / "model"


@pytest.fixture(scope="module")
def artifact_server(module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One server over a plain model base directory: hpt 1 (good) and 2 (needs a custom op),
    and ``linked``: a good version 1 with a symbolic link planted in it."""
    hpt = sync_models() / "hpt"
    base = tmp_path_factory.mktemp("artifacts") / "models"
    shutil.copytree(hpt / "1", base / "hpt" / "1")
    shutil.copytree(custom_op_model(hpt / "1"), base / "hpt" / "2")
    shutil.copytree(hpt / "1", base / "linked" / "1")
    os.symlink("/etc/hostname", base / "linked" / "1" / "assets" / "hostname")
    return module_server("--models", str(base), "--backend", "tf-cpu", ready=False)


def version_detail(server: Any, model: str, version: int) -> dict[str, Any]:
    import requests

    try:
        status = server.status()
    except requests.RequestException:  # still starting
        return {}
    for v in status.get("models", {}).get(model, {}).get("versions", []):
        if int(v["version"]) == version:
            return v
    return {}


def test_a_model_needing_a_custom_op_is_quarantined_with_a_clear_reason(artifact_server: Any) -> None:
    server = artifact_server
    server.wait_for(lambda: version_detail(server, "hpt", 2).get("error"), 120, "version 2 to fail")
    error = version_detail(server, "hpt", 2)["error"]
    assert CUSTOM_OP in error and "not registered" in error, error
    server.wait_for(lambda: version_detail(server, "hpt", 1).get("state") == "AVAILABLE", 120, "version 1 serving")
    assert version_of(predict(server.url)) == 1
    failures = [e for e in server.status()["events"] if e["kind"] == "load_failed" and e["version"] == 2]
    assert failures and CUSTOM_OP in failures[0]["message"]


def test_a_link_in_a_served_version_directory_is_quarantined(artifact_server: Any) -> None:
    server = artifact_server
    server.wait_for(lambda: version_detail(server, "linked", 1).get("error"), 60, "linked version 1 to be refused")
    error = version_detail(server, "linked", 1)["error"]
    assert "assets/hostname (symbolic link)" in error, error
    r = server.post("/v1/models/linked:predict", {"instances": [2.0]})
    assert r.status_code in (404, 503) and "error" in r.json()
