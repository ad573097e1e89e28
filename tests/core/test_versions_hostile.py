"""A bad version never passes for a good one and never takes the device down (issue 38), through
the real service with real models, from a folder source and from a file:// bucket:

- half-broken (truncated saved_model.pb beside a good model.tflite), broken, and a 1 KB .tflite
  declaring [1, 2^31-1] floats (its trial runs under ``load_memory_mb = 256``, so it cannot take
  this machine down) are each quarantined with their error code while the last good version
  serves, across a restart too;
- a folder named 9223372036854775808 (past int64) is ignored, as TF Serving ignores it;
- a version that drops a signature is refused with the difference named, unless the change is
  declared (config ``accept_api_change``, or ``appliance publish --api-change``);
- ``allow_partial_versions`` serves a half-broken version, shown as degraded;
- a version whose in-process load kills the service is quarantined at the next start but one;
- retention keeps the version that served and drops the failed ones; rollback has a target.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from sync.publisher import publish, set_channel
from sync.open_source import open_source
from sync.store import Store
from tests.support.fleet_support import lite_models
from tests.support.servers import ROOT, free_port
from tests.support.sync_support import predict, serving_version, sync_models, version_of
from tests.support.versions_support import (add_version, broken, classify, copy_of, failed, good, half_broken,
                                    huge_shape, model_status, tfs_status, version_record)

LIMITS = "[runtime]\nload_memory_mb = 256\n[discovery]\nenabled = false\n"


def config(tmp_path: Path, text: str = "") -> str:
    path = tmp_path / "appliance.toml"
    path.write_text("poll_interval_s = 0.3\n" + text.split("[[models]]", 1)[0] + LIMITS +
                    ("[[models]]" + text.split("[[models]]", 1)[1] if "[[models]]" in text else ""))
    return str(path)


def serves(server: Any, model: str, version: int) -> None:
    """``version`` answers unversioned requests of ``model`` (status and TF Serving's metadata)."""
    assert model_status(server, model)["serving_version"] == version
    meta = server.get(f"/v1/models/{model}/metadata").json()
    assert meta["model_spec"]["version"] == str(version), meta


def refused(server: Any, model: str, version: int, code: str, *words: str) -> dict[str, Any]:
    """Wait for ``version`` to fail; check its code in /api/status and TF Serving's status."""
    record = server.wait_for(lambda: failed(server, model, version), 120, f"{model} version {version} to fail")
    assert record["error_code"] == code, record
    for word in words:
        assert word in record["error"], (word, record["error"])
    status = tfs_status(server, model, version)
    assert status["state"] == "END" and status["status"]["error_code"] == code, status
    assert str(version) in model_status(server, model)["quarantine"]
    return record


def test_hostile_versions_in_a_folder_leave_the_last_good_one_serving(start_server: Any, models_dir: Path,
                                                                        tmp_path: Path) -> None:
    base = tmp_path / "models"
    add_version(good, base / "hpt", 1)
    nosig = models_dir / "nosig_tflite" / "1"
    shutil.copytree(nosig, base / "tiny" / "1")
    port = free_port()
    srv = start_server("--models", str(base), "--config", config(tmp_path), port=port)
    serves(srv, "hpt", 1)
    assert model_status(srv, "hpt")["versions"][0]["backend"] in ("tf-cpu", "tflite")  # both serve all five: measured
    assert classify(srv).status_code == 200

    add_version(half_broken, base / "hpt", 2)
    record = refused(srv, "hpt", 2, "DATA_LOSS", "not whole", "saved_model.pb did not load", "model.tflite")
    assert record["decision"]["considered"]  # the decision record stays with the failure
    add_version(broken, base / "hpt", 3)
    refused(srv, "hpt", 3, "DATA_LOSS")
    add_version(huge_shape, base / "tiny", 2, nosig / "model.tflite")
    refused(srv, "tiny", 2, "RESOURCE_EXHAUSTED", "2147483647", "load_memory_mb")
    add_version(good, base / "hpt", 9223372036854775808)  # 2^63: no int64, so not a version
    add_version(copy_of(nosig), base / "tiny", 3)  # a newer good version still loads after all that
    srv.wait_for(lambda: model_status(srv, "tiny")["serving_version"] == 3, 120, "tiny version 3")
    checks_after_the_hostile_ones(srv)

    srv.stop()
    again = start_server("--models", str(base), "--config", config(tmp_path), port=port)  # same state folder
    for version in (2, 3):
        again.wait_for(lambda: failed(again, "hpt", version), 120, f"version {version} tried and refused again")
    checks_after_the_hostile_ones(again)


def checks_after_the_hostile_ones(srv: Any) -> None:
    serves(srv, "hpt", 1)
    got = classify(srv)
    assert got.status_code == 200 and got.json() == {"results": [[["", 3.0]]]}, got.text  # 0.5 * 2 + 2
    assert srv.post("/v1/models/tiny:predict", {"instances": [[3.0]]}).json() == {"predictions": [[7.0]]}
    versions = [v["version"] for v in model_status(srv, "hpt")["versions"]]
    assert 9223372036854775808 not in versions and srv.get("/readyz").status_code == 200
    # The refused versions stand as quarantined (the operator must act on their folders); nothing
    # else is wrong: the event writes never overflowed the state database, every part is up.
    problems = srv.status()["problems"]
    assert {(p["kind"], p["model"]) for p in problems} <= {("version_quarantined", "hpt"),
                                                          ("version_quarantined", "tiny")}, problems


def test_a_version_that_drops_a_signature_is_refused_unless_declared(start_server: Any, models_dir: Path,
                                                                     tmp_path: Path) -> None:
    base = tmp_path / "models"
    shutil.copytree(models_dir / "multisig_tflite" / "1", base / "ms" / "1")
    text = f'[[models]]\nname = "ms"\nbase_path = "{base / "ms"}"\naccept_api_change = [3]\n'
    srv = start_server("--config", config(tmp_path, text))
    add_version(copy_of(models_dir / "nosig_tflite" / "1"), base / "ms", 2)
    refused(srv, "ms", 2, "FAILED_PRECONDITION", "serves less than version 1", "signature 'add' is gone",
            "signature 'mul' is gone", "--api-change", "accept_api_change")
    serves(srv, "ms", 1)
    add_version(copy_of(models_dir / "nosig_tflite" / "1"), base / "ms", 3)  # the configuration declares it
    srv.wait_for(lambda: model_status(srv, "ms")["serving_version"] == 3, 120, "the declared change to serve")
    assert "accept_api_change" in version_record(srv, "ms", 3)["api_change"]


def test_a_partial_version_fails_unless_allowed_then_serves_degraded(start_server: Any, models_dir: Path,
                                                                     tmp_path: Path) -> None:
    """keras_mlp ships a SavedModel and its .tflite with the same API: the truncated SavedModel
    is the only difference between whole and partial."""
    base = tmp_path / "models"

    def mlp(dst: Path, truncate: bool = False) -> Path:
        shutil.copytree(models_dir / "keras_mlp" / "1", dst)
        shutil.copy(models_dir / "keras_mlp_tflite" / "1" / "model.tflite", dst / "model.tflite")
        if truncate:
            (dst / "saved_model.pb").write_bytes((dst / "saved_model.pb").read_bytes()[:300])
        return dst

    for name in ("strict", "lenient"):
        mlp(base / name / "1")
    text = (f'[[models]]\nname = "strict"\nbase_path = "{base / "strict"}"\n'
            f'[[models]]\nname = "lenient"\nbase_path = "{base / "lenient"}"\nallow_partial_versions = true\n')
    srv = start_server("--config", config(tmp_path, text))
    for name in ("strict", "lenient"):
        add_version(lambda dst: mlp(dst, truncate=True), base / name, 2)
    refused(srv, "strict", 2, "DATA_LOSS", "allow_partial_versions")
    serves(srv, "strict", 1)
    srv.wait_for(lambda: model_status(srv, "lenient")["serving_version"] == 2, 120, "the partial version to serve")
    degraded = model_status(srv, "lenient")["degraded"]["2"]
    assert "saved_model.pb did not load" in degraded and "tflite" in degraded, degraded
    assert version_record(srv, "lenient", 2)["backend"] == "tflite"


def test_a_version_whose_load_kills_the_service_is_quarantined_at_the_next_start(start_server: Any,
                                                                                  tmp_path: Path) -> None:
    """EDGE_APPLIANCE_LOAD_FAULT kills the service (SIGKILL, as an OOM kill) inside version 2's
    load into the serving process, every time it gets there: the first restart tries it again
    (its trial in a child first), the next one quarantines it and serves version 1."""
    hpt = sync_models() / "hpt"  # version 1 answers 0.5 x + 2, version 2 0.5 x + 3
    base = tmp_path / "models"
    shutil.copytree(hpt / "1", base / "hpt" / "1")
    port = free_port()
    args = ("--models", str(base), "--config", config(tmp_path))
    start_server(*args, port=port).stop()
    add_version(copy_of(hpt / "2"), base / "hpt", 2)
    fault = {"EDGE_APPLIANCE_LOAD_FAULT": "hpt:2"}
    for attempt in (1, 2):
        dying = start_server(*args, port=port, env=fault, ready=False)
        assert dying.proc.wait(180) == -9, f"attempt {attempt} should die in the load\n{dying.log_text()[-2000:]}"
    srv = start_server(*args, port=port, env=fault)
    record = srv.wait_for(lambda: failed(srv, "hpt", 2), 60, "version 2 quarantined")
    assert record["error_code"] == "ABORTED" and "ended 2 times while loading" in record["error"]
    assert version_of(predict(srv.url)) == 1 and model_status(srv, "hpt")["serving_version"] == 1


def test_hostile_versions_through_a_bucket(start_server: Any, tmp_path: Path) -> None:
    """The same promises through fleet sync from a file:// bucket, with retention and rollback."""
    folder = tmp_path / "bucket"
    bucket = open_source(f"file://{folder}")
    port = free_port()
    state = tmp_path / f"state-{port}"
    cfg = tmp_path / "device.toml"
    cfg.write_text(f'models_dir = "{state}/models"\npoll_interval_s = 0.3\n[sync]\nbucket = "file://{folder}"\n'
                   'channel = "stable"\npoll_interval_s = 0.3\njitter = 0.1\nretain = 2\n' + LIMITS)
    work = tmp_path / "work"

    def release(version: int, build: Any, **kw: Any) -> None:
        publish(bucket, "hpt", str(build(work / str(version))), version, **kw)
        set_channel(bucket, "hpt", "stable", version)

    release(1, good)
    srv = start_server("--config", str(cfg), port=port)
    serves(srv, "hpt", 1)
    release(2, half_broken)
    refused(srv, "hpt", 2, "DATA_LOSS", "not whole")
    release(3, broken)
    refused(srv, "hpt", 3, "DATA_LOSS")
    store = Store(str(state))
    srv.wait_for(lambda: sorted(store.versions("hpt")) == [1, 3], 60, "retention to drop the failed version 2")
    assert store.previous_version("hpt") == 1 and classify(srv).status_code == 200

    srv.stop()
    srv = start_server("--config", str(cfg), port=port)
    srv.wait_for(lambda: failed(srv, "hpt", 3), 120, "version 3 refused again after the restart")
    serves(srv, "hpt", 1)

    def tflite_only(dst: Path) -> Path:
        """y = 0.5 x + 2 on LiteRT with its predict signature only (the sample's model.tflite
        carries all five now): classify and regress are gone."""
        dst.mkdir(parents=True)
        shutil.copy(lite_models() / "1" / "model.tflite", dst / "model.tflite")
        return dst

    release(4, tflite_only)
    refused(srv, "hpt", 4, "FAILED_PRECONDITION", "signature 'classify_x_to_y' is gone")
    serves(srv, "hpt", 1)
    srv.wait_for(lambda: sorted(store.versions("hpt")) == [1, 4], 60, "retention to drop the failed version 3")
    assert classify(srv).status_code == 200
    cli = [sys.executable, "-m", "appliance.cli", "publish", "--bucket", f"file://{folder}", "--model", "hpt",
           "--version", "5", "--channel", "stable", "--api-change", "classify and regress retired"]
    subprocess.run(cli + [str(tflite_only(work / "5"))], check=True, cwd=ROOT, capture_output=True)
    srv.wait_for(lambda: model_status(srv, "hpt")["serving_version"] == 5, 120, "the declared change to serve")
    assert "classify and regress retired" in version_record(srv, "hpt", 5)["api_change"]
    srv.wait_for(lambda: 4 not in store.versions("hpt"), 60, "retention to drop the refused version 4")
    assert store.previous_version("hpt") == 1 and 1 in store.versions("hpt")
    assert serving_version(srv.status()) == 5
