"""The model manager through the real server: hot swap under load, broken versions,
version policies, single-model base paths and warm-up requests.

Version directories are added as TF Serving's sources expect them: written elsewhere,
then renamed into the base path in one step.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from tests.support.modelgen import encode_predict_log, reference_predict, reference_predict_tflite, write_warmup_file

RTOL, ATOL = 1e-4, 1e-5
NO_DISCOVERY = "[discovery]\nenabled = false\n"  # not under test here; keeps start and stop quick


def mlp_version(models_dir: Path, dest: Path) -> Path:
    """keras_mlp/1 with both artifacts: the SavedModel and its model.tflite."""
    shutil.copytree(models_dir / "keras_mlp" / "1", dest)
    if not (dest / "model.tflite").exists():
        shutil.copy(models_dir / "keras_mlp_tflite" / "1" / "model.tflite", dest / "model.tflite")
    return dest


def add_version(src: Path, base: Path, version: int, tmp_path: Path) -> Path:
    """Copy ``src`` beside the base path, then rename it into place atomically."""
    stage = tmp_path / f".stage-{base.name}-{version}"
    shutil.copytree(src, stage)
    target = base / str(version)
    stage.rename(target)
    return target


def config_file(tmp_path: Path, text: str = "") -> str:
    path = tmp_path / "appliance.toml"
    path.write_text(text.split("[[models]]", 1)[0] + NO_DISCOVERY + ("[[models]]" + text.split("[[models]]", 1)[1]
                                                                     if "[[models]]" in text else ""))
    return str(path)


def versions(server: Any, model: str) -> list[tuple[str, str]]:
    resp = server.get(f"/v1/models/{model}")
    if resp.status_code != 200:
        return []
    return [(s["version"], s["state"]) for s in resp.json()["model_version_status"]]


def version_status(server: Any, model: str, version: int) -> dict[str, Any] | None:
    resp = server.get(f"/v1/models/{model}/versions/{version}")
    return resp.json()["model_version_status"][0] if resp.status_code == 200 else None


def settled(server: Any, model: str, version: int) -> dict[str, Any] | None:
    """The version's TF Serving status once it is AVAILABLE or END."""
    try:
        status = version_status(server, model, version)
    except requests.ConnectionError:
        return None
    return status if status and status["state"] in ("AVAILABLE", "END") else None


class Load(threading.Thread):
    """A client sending the same predict request continuously, counting every outcome."""

    def __init__(self, url: str, body: dict[str, Any]):
        super().__init__(daemon=True, name="load-client")
        self.url, self.body = url, body
        self.stop = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.answers: list[Any] = []
        self._lock = threading.Lock()
        self.start()

    def run(self) -> None:
        with requests.Session() as session:
            while not self.stop.is_set():
                try:
                    resp = session.post(self.url, json=self.body, timeout=30)
                    good = resp.status_code == 200
                    outcome = resp.json()["predictions"] if good else f"{resp.status_code} {resp.text[:200]}"
                except requests.RequestException as exc:
                    good, outcome = False, f"{type(exc).__name__}: {exc}"
                with self._lock:
                    if good:
                        self.ok += 1
                        if len(self.answers) < 5 or self.ok % 50 == 0:
                            self.answers.append(outcome)
                    else:
                        self.failures.append(outcome)

    def count(self) -> int:
        with self._lock:
            return self.ok

    def finish(self) -> None:
        self.stop.set()
        self.join(60)
        assert not self.is_alive()


def wait_more_requests(server: Any, load: Load, n: int) -> None:
    start = load.count()
    server.wait_for(lambda: load.count() >= start + n, what=f"{n} more successful requests")


def test_hot_swap_under_load_and_a_broken_version(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "models"
    v1 = mlp_version(models_dir, base / "keras_mlp" / "1")
    srv = start_server("--models", str(base), "--backend", "tflite", "--poll-interval", "0.2",
                       "--config", config_file(tmp_path))
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    want = reference_predict_tflite(v1 / "model.tflite", {"x": x})["probs"]
    load = Load(f"{srv.url}/v1/models/keras_mlp:predict", {"instances": x.tolist()})
    try:
        wait_more_requests(srv, load, 20)
        assert versions(srv, "keras_mlp") == [("1", "AVAILABLE")]

        add_version(v1, base / "keras_mlp", 2, tmp_path)
        srv.wait_for(lambda: versions(srv, "keras_mlp") == [("2", "AVAILABLE"), ("1", "END")],
                     what="version 2 to replace version 1")
        wait_more_requests(srv, load, 20)
        meta = srv.get("/v1/models/keras_mlp/metadata").json()
        assert meta["model_spec"]["version"] == "2"  # new requests go to the new version
        assert srv.get("/v1/models/keras_mlp/versions/1/metadata").status_code == 404  # unloaded

        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "model.tflite").write_bytes(b"this is not a flatbuffer" * 40)
        add_version(broken, base / "keras_mlp", 3, tmp_path)
        status = srv.wait_for(lambda: settled(srv, "keras_mlp", 3), what="version 3 to fail")
        assert status["state"] == "END"
        assert status["status"]["error_code"] != "OK" and status["status"]["error_message"]
        wait_more_requests(srv, load, 20)
        assert ("2", "AVAILABLE") in versions(srv, "keras_mlp")
        assert srv.get("/v1/models/keras_mlp/metadata").json()["model_spec"]["version"] == "2"
        assert srv.get("/readyz").status_code == 200
        snapshot = srv.status()["models"]["keras_mlp"]
        assert snapshot["serving_version"] == 2 and "3" in snapshot["quarantined"]
        shutil.rmtree(base / "keras_mlp" / "3")  # what sync's retention does to a failed version first
        add_version(v1, base / "keras_mlp", 4, tmp_path)  # a scan that sees 4 saw 3 gone
        srv.wait_for(lambda: ("4", "AVAILABLE") in versions(srv, "keras_mlp"), what="version 4 after 3 went")
        assert "3" in srv.status()["models"]["keras_mlp"]["quarantined"]  # its reason stays, not NOT_FOUND
        assert (version_status(srv, "keras_mlp", 3) or {}).get("status", {}).get("error_message")
    finally:
        load.finish()
    assert load.failures == [], load.failures[:5]
    assert load.ok >= 60
    for answer in load.answers:
        np.testing.assert_allclose(answer, want, rtol=RTOL, atol=ATOL)


def test_a_new_model_directory_is_picked_up(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "models"
    shutil.copytree(models_dir / "multisig_tflite", base / "multisig_tflite")
    srv = start_server("--models", str(base), "--poll-interval", "0.2", "--config", config_file(tmp_path))
    assert srv.get("/v1/models/nosig").status_code == 404
    stage = tmp_path / ".stage"
    shutil.copytree(models_dir / "multisig_tflite", stage)
    stage.rename(base / "second")
    srv.wait_for(lambda: versions(srv, "second") == [("1", "AVAILABLE")], what="the new model")
    got = srv.post("/v1/models/second:predict", {"signature_name": "mul", "inputs": {"a": [[2] * 4], "b": [[3] * 4]}})
    assert got.status_code == 200 and got.json() == {"outputs": [[6.0] * 4]}


def test_version_policies(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "models" / "mlp"
    v1 = mlp_version(models_dir, base / "1")
    shutil.copytree(v1, base / "2")
    text = "poll_interval_s = 0.5\n"
    for name, extra in (("all_mlp", 'version_policy = "all"'), ("specific_mlp", 'version_policy = "specific"\nversions = [1]'),
                        ("latest_mlp", 'version_policy = "latest"'), ("latest2_mlp", "latest = 2")):
        text += f'[[models]]\nname = "{name}"\nbase_path = "{base}"\nbackend = "tflite"\n{extra}\n'
    srv = start_server("--config", config_file(tmp_path, text))
    for model, want in (("all_mlp", [("2", "AVAILABLE"), ("1", "AVAILABLE")]),
                        ("latest2_mlp", [("2", "AVAILABLE"), ("1", "AVAILABLE")]),
                        ("specific_mlp", [("1", "AVAILABLE")]), ("latest_mlp", [("2", "AVAILABLE")])):
        # ready means one version of each model serves; the others may still be in their trial
        srv.wait_for(lambda: versions(srv, model) == want, what=f"{model} to serve {want}")
    x = np.ones((1, 64), np.float32)
    want = reference_predict_tflite(v1 / "model.tflite", {"x": x})["probs"]
    for model, version, code in (("all_mlp", 1, 200), ("all_mlp", 2, 200), ("specific_mlp", 1, 200),
                                 ("specific_mlp", 2, 404), ("latest_mlp", 1, 404), ("latest_mlp", 2, 200)):
        resp = srv.post(f"/v1/models/{model}/versions/{version}:predict", {"instances": x.tolist()})
        assert resp.status_code == code, (model, version, resp.text)
        if code == 200:
            np.testing.assert_allclose(resp.json()["predictions"], want, rtol=RTOL, atol=ATOL)
    meta = srv.get("/v1/models/specific_mlp/metadata").json()
    assert meta["model_spec"]["version"] == "1"  # the newest of the versions the policy names


def test_single_model_base_path(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    """tensorflow_model_server --model_base_path=DIR/keras_mlp --model_name=foo."""
    base = tmp_path / "keras_mlp"
    v1 = mlp_version(models_dir, base / "1")
    srv = start_server("--models", str(base), "--model-name", "foo", "--backend", "tflite",
                       "--config", config_file(tmp_path))
    x = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32)
    resp = srv.post("/v1/models/foo:predict", {"instances": x.tolist()})
    assert resp.status_code == 200, resp.text
    np.testing.assert_allclose(resp.json()["predictions"],
                               reference_predict_tflite(v1 / "model.tflite", {"x": x})["probs"], rtol=RTOL, atol=ATOL)
    assert versions(srv, "foo") == [("1", "AVAILABLE")]
    assert srv.get("/v1/models/keras_mlp").status_code == 404
    assert srv.get("/v1/models/1").status_code == 404  # the version directory is not a model


def test_single_model_base_path_default_name(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    base = tmp_path / "multisig"
    shutil.copytree(models_dir / "multisig_tflite" / "1", base / "7")
    srv = start_server("--models", str(base), "--config", config_file(tmp_path))
    assert versions(srv, "default") == [("7", "AVAILABLE")]
    resp = srv.post("/v1/models/default/versions/7:predict",
                    {"signature_name": "add", "inputs": {"a": [[1] * 4], "b": [[1] * 4]}})
    assert resp.status_code == 200 and resp.json() == {"outputs": [[2.0] * 4]}


# --- warm-up ------------------------------------------------------------------------------
def with_warmup(models_dir: Path, dest: Path, records: list[bytes] | None = None, raw: bytes | None = None) -> Path:
    """half_plus_two/1 with its warm-up file replaced by ``records`` or by ``raw`` bytes."""
    shutil.copytree(models_dir / "half_plus_two" / "1", dest)
    warm = dest / "assets.extra" / "tf_serving_warmup_requests"
    if records is not None:
        warm.unlink()
        write_warmup_file(dest, records)
    if raw is not None:
        warm.write_bytes(raw)
    return dest


WARMUP_CASES = ("ok", "ok_more", "bad_signature", "bad_input", "garbage", "bad_crc", "too_many")


@pytest.fixture(scope="module")
def warmup(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One tf-cpu server over half_plus_two copies, each with its own warm-up file; waits until each settled."""
    tmp = tmp_path_factory.mktemp("warmup")
    good = (models_dir / "half_plus_two" / "1" / "assets.extra" / "tf_serving_warmup_requests").read_bytes()
    x = {"x": np.array([1.0, 2.0], np.float32)}
    bad_crc = bytearray(good)
    bad_crc[-1] ^= 0xFF  # the data CRC of the last record
    base = tmp / "models"
    paths = {
        "ok": with_warmup(models_dir, base / "ok" / "1"),
        "ok_more": with_warmup(models_dir, base / "ok_more" / "1",
                               [encode_predict_log("ok_more", x), encode_predict_log("ok_more", {"x": np.float32(3)})]),
        "bad_signature": with_warmup(models_dir, base / "bad_signature" / "1",
                                     [encode_predict_log("m", x, signature_name="no_such_signature")]),
        "bad_input": with_warmup(models_dir, base / "bad_input" / "1", [encode_predict_log("m", {"zzz": x["x"]})]),
        "garbage": with_warmup(models_dir, base / "garbage" / "1", raw=b"\x17garbage, not a TFRecord file" * 8),
        "bad_crc": with_warmup(models_dir, base / "bad_crc" / "1", raw=bytes(bad_crc)),
        "too_many": with_warmup(models_dir, base / "too_many" / "1", [encode_predict_log("m", x)] * 1001),
    }
    assert set(paths) == set(WARMUP_CASES)
    srv = module_server("--models", str(base), "--backend", "tf-cpu", "--config", config_file(tmp), ready=False)
    outcome = {name: srv.wait_for(lambda n=name: settled(srv, n, 1), timeout=120, what=f"{name} to settle")
               for name in paths}
    return srv, paths, outcome


def failed_load(status: dict[str, Any]) -> bool:
    return status["state"] == "END" and status["status"]["error_code"] != "OK" and bool(status["status"]["error_message"])


def test_warmup_file_of_valid_requests_loads(warmup: Any) -> None:
    srv, paths, outcome = warmup
    for name in ("ok", "ok_more"):
        assert outcome[name]["state"] == "AVAILABLE", (name, outcome[name])
        resp = srv.post(f"/v1/models/{name}:predict", {"instances": [1.0, 2.0, 5.0]})
        assert resp.status_code == 200
        want = reference_predict(paths[name], {"x": [1.0, 2.0, 5.0]})["y"]
        np.testing.assert_allclose(resp.json()["predictions"], want, rtol=RTOL)
    version = srv.status()["models"]["ok"]["versions"][0]
    assert version["warmup_ms"] > 0


def test_warmup_requests_the_model_cannot_run_fail_the_load(warmup: Any) -> None:
    """Proof that the file is replayed: a synthetic warm-up would have passed."""
    srv, _, outcome = warmup
    assert failed_load(outcome["bad_signature"]), outcome["bad_signature"]
    assert "no_such_signature" in outcome["bad_signature"]["status"]["error_message"]
    assert failed_load(outcome["bad_input"]), outcome["bad_input"]
    resp = srv.post("/v1/models/bad_signature:predict", {"instances": [1.0]})
    assert resp.status_code in (404, 503) and "error" in resp.json()
    assert srv.get("/readyz").status_code == 503  # those models have no version to serve


def test_corrupt_warmup_file_fails_the_load(warmup: Any) -> None:
    _, _, outcome = warmup
    assert failed_load(outcome["garbage"]), outcome["garbage"]


def test_warmup_record_with_a_bad_crc_fails_the_load(warmup: Any) -> None:
    """TF Serving reads the file with a TFRecord reader: a CRC mismatch is DATA_LOSS and fails the load."""
    _, _, outcome = warmup
    assert failed_load(outcome["bad_crc"]), outcome["bad_crc"]


def test_more_than_1000_warmup_records_fail_the_load(warmup: Any) -> None:
    """TF Serving: 'Number of warmup records exceeds the maximum (1000)' fails the load."""
    _, _, outcome = warmup
    assert failed_load(outcome["too_many"]), outcome["too_many"]


def test_a_version_unloads_only_after_the_requests_holding_it_let_go(models_dir: Path, tmp_path: Path) -> None:
    """Manager.handle takes no lock once a request was answered before (the pick is cached):
    an unload that starts while requests hold the version still waits for every one of them,
    and requests after it never get the unloading version."""
    from appliance.core.appliance import Appliance
    from appliance.core.config_file import load as load_config
    from appliance.core.errors import ApplianceError
    from tests.support.servers import poll_until

    base = tmp_path / "models"
    shutil.copytree(models_dir / "keras_mlp_tflite", base / "keras_mlp_tflite")
    config = load_config(None, {"models_dir": str(base), "state_dir": str(tmp_path / "state"),
                                "discovery.enabled": False, "poll_interval_s": 60.0})
    appliance = Appliance(config).start()
    try:
        manager = appliance.manager
        assert manager is not None
        poll_until(manager.ready, timeout=120, what="the model loaded")
        with manager.handle("keras_mlp_tflite"):
            pass  # the pick is now cached: what follows takes the lock-free path
        held = [manager.handle("keras_mlp_tflite") for _ in range(3)]
        slot = held[0].slot
        assert all(h.slot is slot for h in held) and slot.refs == 3
        unloading = threading.Thread(target=manager._begin_unload, args=(slot, "test", False))
        unloading.start()
        poll_until(lambda: slot.state.value == "UNLOADING", timeout=10, what="the unload to begin")
        with pytest.raises(ApplianceError):  # the cached pick is gone with the state change
            manager.handle("keras_mlp_tflite")
        for h in held[:2]:
            h.__exit__(None, None, None)
        unloading.join(0.5)
        assert unloading.is_alive() and slot.servable is not None  # one request still holds it
        held[2].__exit__(None, None, None)
        unloading.join(30)
        assert not unloading.is_alive() and slot.servable is None and slot.refs == 0
    finally:
        appliance.close()
