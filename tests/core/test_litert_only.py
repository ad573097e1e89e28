"""Whole means whole on every device (issue 49): a LiteRT-only device checks the SavedModel it
cannot run, refuses a version whose ``saved_model.pb`` or checkpoint index is broken with the
code a TensorFlow device gives (DATA_LOSS), and says what it cannot serve of a whole version
(``degraded``: the signatures only TensorFlow serves) in ``/api/status``, its problems, its
fleet report and the fleet view built from it.

The devices are the real service whose processes cannot find TensorFlow
(tests/support/litert_only: ``find_spec("tensorflow")`` is None, as where it is not installed),
on the real sample model and real LiteRT conversions, from a folder and from a file:// bucket.
The checks on their own (truncations, the checkpoint index's footer) are at the end.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from appliance.core.artifacts import FOOTER_BYTES, check, table_footer
from sync.fleet_view import device_row
from sync.listing import Entry
from sync.open_source import open_source
from sync.publisher import publish, set_channel
from tests.support.fleet_support import lite_device, lite_models, report_of
from tests.support.servers import ROOT
from tests.support.versions_support import (SAMPLE, add_version, failed, half_broken, model_status, tfs_status,
                                            version_record)

LITERT_ONLY = {"PYTHONPATH": f"{ROOT / 'tests' / 'support' / 'litert_only'}:{ROOT}"}
TF_ONLY_SIGNATURES = ["classify_x_to_y", "regress_x2_to_y3", "regress_x_to_y", "regress_x_to_y2"]
CONFIG = "poll_interval_s = 0.3\n[discovery]\nenabled = false\n"


def predict_only(dst: Path) -> Path:
    """The sample's SavedModel (five signatures) beside a LiteRT y = 0.5 x + 2 with one."""
    shutil.copytree(SAMPLE, dst, ignore=shutil.ignore_patterns("model.tflite"))
    shutil.copy(lite_models() / "1" / "model.tflite", dst / "model.tflite")
    return dst


def truncated_index(dst: Path) -> Path:
    predict_only(dst)
    index = dst / "variables" / "variables.index"
    index.write_bytes(index.read_bytes()[:-1])
    return dst


def refused(server: Any, model: str, version: int, *words: str) -> dict[str, Any]:
    record = server.wait_for(lambda: failed(server, model, version), 120, f"{model} version {version} to fail")
    assert record["error_code"] == "DATA_LOSS", record
    for word in words:
        assert word in record["error"], (word, record["error"])
    assert tfs_status(server, model, version)["status"]["error_code"] == "DATA_LOSS"
    return record


def test_a_litert_only_device_refuses_a_broken_savedmodel_and_says_what_it_lacks(start_server: Any,
                                                                                tmp_path: Path) -> None:
    base = tmp_path / "models"
    add_version(predict_only, base / "hpt", 1)
    config = tmp_path / "appliance.toml"
    config.write_text(CONFIG)
    srv = start_server("--models", str(base), "--config", str(config), env=LITERT_ONLY)
    status = srv.status()
    assert "tensorflow" not in status["service"]["imported"]
    one = version_record(srv, "hpt", 1)
    assert one is not None and one["state"] == "AVAILABLE" and one["backend"] == "tflite", one
    lacks = model_status(srv, "hpt")["degraded"]["1"]
    assert lacks == one["degraded"]
    assert f"lacks signatures {', '.join(TF_ONLY_SIGNATURES)} that saved_model.pb declares" in lacks, lacks
    assert "TensorFlow is not installed" in lacks, lacks
    assert [p["kind"] for p in status["problems"]] == ["version_degraded"], status["problems"]
    assert srv.post("/v1/models/hpt:predict", {"instances": [[2.0]]}).json() == {"predictions": [[3.0]]}

    add_version(half_broken, base / "hpt", 2)  # truncated saved_model.pb beside the sample's good model.tflite
    record = refused(srv, "hpt", 2, "not whole", "saved_model.pb failed its check", "does not parse as a SavedModel",
                     "while model.tflite did")
    assert record["decision"]["chosen"] == "tflite"  # the part this device runs loaded; the rest failed its check
    add_version(truncated_index, base / "hpt", 3)
    refused(srv, "hpt", 3, "variables/variables.index is not a whole checkpoint index", "table magic number")
    assert model_status(srv, "hpt")["serving_version"] == 1
    assert "tensorflow" not in srv.status()["service"]["imported"]


def test_the_fleet_view_blames_the_litert_only_device_that_serves_less(start_server: Any, tmp_path: Path) -> None:
    """The device's report carries what its version lacks; the view marks that device degraded
    and says why, and a half-broken version fails there as it does on TensorFlow devices."""
    folder = tmp_path / "bucket"
    source = open_source(f"file://{folder}")
    publish(source, "hpt", str(predict_only(tmp_path / "v1")), 1, channel="stable")
    device = lite_device(start_server, tmp_path, f"file://{folder}", env=LITERT_ONLY)
    device_id = device.status()["service"]["device_id"]

    def degraded_report() -> dict[str, Any] | None:
        report = report_of(source, device_id)
        versions = (((report or {}).get("models") or {}).get("hpt") or {}).get("versions") or []
        return report if any(v.get("degraded") for v in versions) else None

    report = device.wait_for(degraded_report, 60, "a report saying version 1 serves degraded")
    row = device_row(Entry(device_id, "", 0.0, 0, report), {})
    assert row["status"] == "degraded", row
    assert "classify_x_to_y" in row["models"]["hpt"]["degraded"], row["models"]
    assert any("serves only in part" in p for p in row["problems"]), row["problems"]

    publish(source, "hpt", str(half_broken(tmp_path / "v2")), 2)
    set_channel(source, "hpt", "stable", 2)
    report = device.wait_for(lambda: (r := report_of(source, device_id)) and any(
        v["version"] == 2 and v.get("error_code") == "DATA_LOSS" for v in r["models"]["hpt"]["versions"]) and r,
        120, "a report saying version 2 failed with DATA_LOSS")
    row = device_row(Entry(device_id, "", 0.0, 0, report), {})
    assert row["models"]["hpt"]["state"] == "failed" and "saved_model.pb failed its check" in \
        row["models"]["hpt"]["reason"], row["models"]
    assert report["models"]["hpt"]["serving_version"] == 1


def test_the_sample_serves_all_five_signatures_on_a_litert_only_device(start_server: Any, tmp_path: Path) -> None:
    """The embedded default's model.tflite carries every signature of its SavedModel; its
    classify and regress parse tf.Examples (runtimes/tflite_split.py), so nothing is degraded
    and the answers are TF Serving's for half_plus_two (y = 0.5 x + 2; y2 = 0.5 x + 3)."""
    base = tmp_path / "models"
    add_version(lambda dst: shutil.copytree(SAMPLE, dst), base / "hpt", 1)
    config = tmp_path / "appliance.toml"
    config.write_text(CONFIG)
    srv = start_server("--models", str(base), "--config", str(config), env=LITERT_ONLY)
    one = version_record(srv, "hpt", 1)
    assert one is not None and one["backend"] == "tflite" and not one.get("degraded"), one
    assert srv.status()["problems"] == [] and model_status(srv, "hpt")["degraded"] == {}
    meta = srv.get("/v1/models/hpt/metadata").json()["metadata"]["signature_def"]["signature_def"]
    assert sorted(meta) == sorted(["serving_default", *TF_ONLY_SIGNATURES]), meta
    assert meta["classify_x_to_y"]["method_name"] == "tensorflow/serving/classify"
    examples = [{"x": 2.0}, {"x": 10.0}]
    got = srv.post("/v1/models/hpt:classify", {"signature_name": "classify_x_to_y", "examples": examples})
    assert got.status_code == 200 and got.json() == {"results": [[["", 3.0]], [["", 7.0]]]}, got.text
    got = srv.post("/v1/models/hpt:regress", {"signature_name": "regress_x_to_y2", "examples": examples})
    assert got.status_code == 200 and got.json() == {"results": [4.0, 8.0]}, got.text
    got = srv.post("/v1/models/hpt:regress", {"signature_name": "regress_x_to_y", "examples": [{"y": 1.0}]})
    assert got.status_code == 400 and got.json() == {"error": "Failed to invoke TfLite interpreter"}, got.text  # TF
    # Serving's TFLite words for an Example without the required feature (the detail goes to the log)
    assert srv.post("/v1/models/hpt:predict", {"instances": [1.0, 2.0]}).json() == {"predictions": [2.5, 3.0]}
    assert "tensorflow" not in srv.status()["service"]["imported"]


# -- the checks on their own -----------------------------------------------------------------------
def test_the_sample_savedmodel_checks_whole_and_declares_its_signatures() -> None:
    result = check(str(SAMPLE), "saved_model.pb")
    assert result.ok and result.signatures == sorted(["serving_default", *TF_ONLY_SIGNATURES]), result
    assert check(str(SAMPLE), "model.tflite").ok


def test_every_truncation_of_saved_model_pb_fails_its_check(tmp_path: Path) -> None:
    """Cut anywhere (a byte, half, all but one byte, nothing left): never taken for whole."""
    version = tmp_path / "1"
    shutil.copytree(SAMPLE, version)
    data = (SAMPLE / "saved_model.pb").read_bytes()
    for size in (0, 1, 100, len(data) // 2, len(data) - 1):
        (version / "saved_model.pb").write_bytes(data[:size])
        result = check(str(version), "saved_model.pb")
        assert not result.ok and result.code == "DATA_LOSS", (size, result)


def test_a_checkpoint_index_is_whole_only_with_its_table_footer(tmp_path: Path) -> None:
    """TensorFlow's variables.index is a LevelDB table: its last 48 bytes are two block handles
    and the table magic; a cut one, or one whose handles point past it, is refused."""
    data = (SAMPLE / "variables" / "variables.index").read_bytes()
    assert table_footer(data) == ""
    assert "table magic" in table_footer(data[:-1])
    assert "shorter than" in table_footer(data[:FOOTER_BYTES - 1])
    past = bytearray(data)
    past[-FOOTER_BYTES] = 0x7F  # the metaindex block's offset (105, one varint byte) now 127: past the blocks
    assert "points past the data" in table_footer(bytes(past)), table_footer(bytes(past))
    version = tmp_path / "1"
    shutil.copytree(SAMPLE, version)
    shard = version / "variables" / "variables.data-00000-of-00001"
    shard.rename(version / "variables" / "variables.data-00000-of-00002")  # one of two shards: the other is gone
    result = check(str(version), "saved_model.pb")
    assert not result.ok and "lacks the data shard variables.data-00001-of-00002" in result.error, result
    (version / "variables" / "variables.data-00000-of-00002").unlink()  # no shard at all
    assert "no data shard" in check(str(version), "saved_model.pb").error


def test_a_tflite_that_is_no_flatbuffer_fails_its_check(tmp_path: Path) -> None:
    (tmp_path / "model.tflite").write_bytes(b"not a flatbuffer " * 8)
    assert check(str(tmp_path), "model.tflite").code == "DATA_LOSS"
    data = (SAMPLE / "model.tflite").read_bytes()
    (tmp_path / "model.tflite").write_bytes(data[:4] + b"TFL3")  # the identifier, the root past the end
    assert "past its 8 bytes" in check(str(tmp_path), "model.tflite").error


def test_what_a_version_lacks_names_why_in_either_case() -> None:
    """No backend here runs the artifact (a LiteRT-only device), or one does but the policy chose
    another (prefer_tflite_below_mb): the words say which; nothing lacking says nothing."""
    from appliance.core.loader import lacking

    missing = {"backend": "tflite", "lacks": {"saved_model.pb": {"signatures": ["classify_x_to_y"],
                                                                 "needs": {"tf-cpu": "TensorFlow is not installed"}}}}
    assert lacking(missing) == ("lacks signature classify_x_to_y that saved_model.pb declares, which no backend here "
                                "serves (tf-cpu: TensorFlow is not installed); served on tflite")
    policy = {"backend": "tflite", "decision": {"reason": "memory below 512 MB: LiteRT preferred"},
              "lacks": {"saved_model.pb": {"signatures": ["a", "b"], "needs": {}}}}
    assert "whose backend was not chosen (memory below 512 MB: LiteRT preferred)" in lacking(policy)
    assert lacking({"backend": "tflite", "lacks": {}}) == ""
