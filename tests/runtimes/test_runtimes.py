"""The runtime backends called directly, and the per-device backend selection.

Every answer is compared with the model run in-process by tests.support.modelgen's references.
TF-TRT is exercised through an injected converter (a test double that copies the
SavedModel) with a fake GPU device profile; the real TF-TRT path runs only in the
``gpu``-marked test, when an NVIDIA GPU with TensorRT is present.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import runtimes
from runtimes import LoadFailure, TFCPUBackend, TFGPUBackend, TFLiteBackend
from runtimes.base import InputFailure
from tests.support.modelgen import reference_predict, reference_predict_tflite

FAKE_GPU = {"nvidia_gpu": True, "tensorrt": True, "gpu_name": "FakeGPU", "tensorflow_build": "cuda",
            "tensorflow_version": "2.x", "cpu_count": 2, "memory_mb": 8192, "delegates": {}}
RTOL, ATOL = 1e-4, 1e-5


def vdir(models_dir: Path, name: str) -> str:
    return str(models_dir / name / "1")


def mlp_both(models_dir: Path, dest: Path) -> str:
    """A keras_mlp version directory holding the SavedModel AND its model.tflite."""
    shutil.copytree(models_dir / "keras_mlp" / "1", dest)
    if not (dest / "model.tflite").exists():
        shutil.copy(models_dir / "keras_mlp_tflite" / "1" / "model.tflite", dest / "model.tflite")
    return str(dest)


def mlp_tflite(models_dir: Path) -> str:
    for name in ("keras_mlp", "keras_mlp_tflite"):
        path = models_dir / name / "1" / "model.tflite"
        if path.exists():
            return str(path)
    raise AssertionError("no TFLite conversion of the Keras MLP among the test models")


def examples(**features: list[float]) -> np.ndarray:
    """Serialized tf.Example protos, one per value, with float features."""
    import tensorflow as tf

    n = len(next(iter(features.values())))
    out = []
    for i in range(n):
        feats = {k: tf.train.Feature(float_list=tf.train.FloatList(value=[v[i]])) for k, v in features.items()}
        out.append(tf.train.Example(features=tf.train.Features(feature=feats)).SerializeToString())
    return np.array(out, dtype=object)


def real_device() -> dict[str, Any]:
    from appliance.core import device

    return device.profile({})


@pytest.fixture(scope="module")
def half_plus_two(models_dir: Path):
    servable = TFCPUBackend().load(vdir(models_dir, "half_plus_two"), {"intra_op_threads": 1, "inter_op_threads": 1})
    yield servable
    servable.close()


# --- tf-cpu ------------------------------------------------------------------------------
def test_tf_cpu_probe_and_artifact(models_dir: Path) -> None:
    backend = TFCPUBackend()
    availability = backend.probe(real_device())
    assert availability.available and availability.reason
    assert backend.can_serve(vdir(models_dir, "half_plus_two")) is not None
    assert backend.can_serve(vdir(models_dir, "multisig_tflite")) is None


def test_tf1_signatures_are_all_served(half_plus_two: Any) -> None:
    sigs = half_plus_two.signatures
    assert set(sigs) == {"serving_default", "classify_x_to_y", "regress_x_to_y", "regress_x_to_y2",
                         "regress_x2_to_y3"}
    assert sigs["serving_default"].method_name == "tensorflow/serving/predict"
    assert sigs["classify_x_to_y"].method_name == "tensorflow/serving/classify"
    assert sigs["regress_x_to_y"].method_name == "tensorflow/serving/regress"
    x = sigs["serving_default"].inputs["x"]
    assert x.shape is None and x.dtype == np.float32 and x.tensor_name == "x:0"
    inputs = sigs["classify_x_to_y"].inputs["inputs"]
    assert inputs.is_string and inputs.shape == (-1,)
    assert list(sigs["classify_x_to_y"].outputs) == ["scores"]


def test_tf1_predict_matches_reference(half_plus_two: Any, models_dir: Path) -> None:
    for x in ([1.0, 2.0, 5.0], [[1.0], [2.0]], 4.0):
        arr = np.asarray(x, np.float32)
        got = half_plus_two.run("serving_default", {"x": arr})["y"]
        want = reference_predict(vdir(models_dir, "half_plus_two"), {"x": arr})["y"]
        np.testing.assert_allclose(got, want, rtol=RTOL)
    np.testing.assert_allclose(half_plus_two.run("serving_default", {"x": np.array([1, 2, 5], np.float32)})["y"],
                               [2.5, 3.0, 4.5])


@pytest.mark.parametrize("signature, features, output", [
    ("classify_x_to_y", {"x": [1.0, 2.0, 5.0]}, "scores"),
    ("regress_x_to_y", {"x": [2.0, 80.0]}, "outputs"),
    ("regress_x_to_y2", {"x": [4.0]}, "outputs"),
])
def test_tf1_classify_regress_via_session(half_plus_two: Any, models_dir: Path, signature: str,
                                          features: dict[str, list[float]], output: str) -> None:
    serialized = examples(**features)
    got = half_plus_two.run(signature, {"inputs": serialized})[output]
    want = reference_predict(vdir(models_dir, "half_plus_two"), {"inputs": serialized}, signature)[output]
    np.testing.assert_allclose(got, want, rtol=RTOL)
    assert got.shape[0] == len(serialized)


def test_tf1_bad_input_is_an_input_failure(half_plus_two: Any) -> None:
    with pytest.raises(InputFailure):
        half_plus_two.run("regress_x_to_y", {"inputs": examples(x2=[1.0])})  # required feature x missing
    with pytest.raises(InputFailure):
        half_plus_two.run("no_such_signature", {"x": np.ones(1, np.float32)})


def test_tf_cpu_keras_matches_reference(models_dir: Path) -> None:
    servable = TFCPUBackend().load(vdir(models_dir, "keras_mlp"), {})
    try:
        sig = servable.signatures["serving_default"]
        assert list(sig.inputs) == ["x"] and list(sig.outputs) == ["probs"]
        assert sig.inputs["x"].shape == (-1, 64)
        x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
        got = servable.run("serving_default", {"x": x})["probs"]
        np.testing.assert_allclose(got, reference_predict(vdir(models_dir, "keras_mlp"), {"x": x})["probs"],
                                   rtol=RTOL, atol=ATOL)
        with pytest.raises(InputFailure):
            servable.run("serving_default", {"x": x[:, :63]})
    finally:
        servable.close()


def test_tf_cpu_string_model(models_dir: Path) -> None:
    servable = TFCPUBackend().load(vdir(models_dir, "string_model"), {})
    try:
        text = np.array([b"hello", b"", b"\xff\x00binary"], dtype=object)
        got = servable.run("serving_default", {"text": text})
        want = reference_predict(vdir(models_dir, "string_model"), {"text": text})
        np.testing.assert_array_equal(got["len"], want["len"])
        assert list(got["echo_bytes"]) == list(want["echo_bytes"]) == list(text)
    finally:
        servable.close()


def test_tf_cpu_feeds_by_the_graph_tensors_dtype_not_the_signatures() -> None:
    """TF Serving's saved_model_half_plus_three: its regress SignatureDef declares ``tf_example:0``
    DT_FLOAT, the placeholder is a string. Serialized Examples are fed as strings, as TF
    Serving feeds them ({"results": [3.5, 4.0]} in its REST doc); the signature still says
    float (metadata shows the declaration); a float fed to the string placeholder gets
    TensorFlow's own refusal."""
    from tensorflow.core.example import example_pb2

    version = Path(__file__).resolve().parents[1] / "data" / "tfserving" / "saved_model_half_plus_three" / "00000123"
    servable = TFCPUBackend().load(str(version), {})
    try:
        regress = servable.signatures["tensorflow/serving/regress"]
        assert regress.inputs["inputs"].dtype == np.float32 and regress.inputs["inputs"].tensor_name == "tf_example:0"
        examples = []
        for x in (1.0, 2.0):
            example = example_pb2.Example()
            example.features.feature["x"].float_list.value.append(x)
            examples.append(example.SerializeToString())
        got = servable.run("tensorflow/serving/regress", {"inputs": np.array(examples, dtype=object)})
        np.testing.assert_array_equal(got["outputs"].reshape(-1), [3.5, 4.0])
        with pytest.raises(InputFailure, match="Type mismatch: actual float vs. expect string"):
            servable.run("tensorflow/serving/regress", {"inputs": np.zeros(2, np.float32)})
        np.testing.assert_array_equal(servable.run("serving_default", {"x": np.array([1.0, 5.0])})["y"], [3.5, 5.5])
    finally:
        servable.close()


def test_tf_cpu_refuses_a_broken_saved_model(tmp_path: Path) -> None:
    bad = tmp_path / "1"
    bad.mkdir()
    (bad / "saved_model.pb").write_bytes(b"not a protobuf at all" * 10)
    with pytest.raises(LoadFailure):
        TFCPUBackend().load(str(bad), {})
    with pytest.raises(LoadFailure):
        TFCPUBackend().load(str(tmp_path), {})  # no saved_model.pb at all


# --- tflite ------------------------------------------------------------------------------
def test_tflite_probe_and_artifact(models_dir: Path) -> None:
    backend = TFLiteBackend()
    availability = backend.probe(real_device())
    assert availability.available and availability.reason
    assert backend.can_serve(vdir(models_dir, "multisig_tflite")) is not None
    assert backend.can_serve(vdir(models_dir, "half_plus_two")) is None


def test_tflite_mlp_matches_reference(models_dir: Path) -> None:
    path = mlp_tflite(models_dir)
    servable = TFLiteBackend().load(os.path.dirname(path), {"num_threads": 1, "delegate": "none", "pool_size": 1})
    try:
        sig = servable.signatures["serving_default"]
        assert sig.inputs["x"].shape == (-1, 64) and sig.inputs["x"].dtype == np.float32
        for batch in (1, 7, 1, 3):  # re-allocation between sizes keeps the answers right
            x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
            got = servable.run("serving_default", {"x": x})["probs"]
            np.testing.assert_allclose(got, reference_predict_tflite(path, {"x": x})["probs"], rtol=RTOL, atol=ATOL)
        with pytest.raises(InputFailure):
            servable.run("nope", {"x": np.zeros((1, 64), np.float32)})
    finally:
        servable.close()


def test_tflite_wrong_shape_is_an_input_failure_and_leaves_the_pool_healthy(models_dir: Path) -> None:
    path = mlp_tflite(models_dir)
    servable = TFLiteBackend().load(os.path.dirname(path), {"num_threads": 1, "pool_size": 1})
    try:
        x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
        want = reference_predict_tflite(path, {"x": x})["probs"]
        np.testing.assert_allclose(servable.run("serving_default", {"x": x})["probs"], want, rtol=RTOL, atol=ATOL)
        with pytest.raises(InputFailure):
            servable.run("serving_default", {"x": np.zeros((1, 63), np.float32)})  # 63 features, not 64
        # the same (only) interpreter, the shape it had before the bad request: still right
        np.testing.assert_allclose(servable.run("serving_default", {"x": x})["probs"], want, rtol=RTOL, atol=ATOL)
    finally:
        servable.close()


def test_tflite_a_lone_batch_runs_on_an_interpreter_of_every_core(models_dir: Path) -> None:
    """``run_wide`` (a batch alone, core/batcher.py) runs on an interpreter of ``wide_threads``
    threads, made on its first call and kept beside the pool (XNNPACK's thread pool starts
    the threads: the process has more); its answers are ``run``'s; an input it refuses leaves
    nothing half-prepared behind; without ``wide_threads`` it is ``run``."""
    import psutil

    path = mlp_tflite(models_dir)
    x = np.random.default_rng(5).standard_normal((2, 64)).astype(np.float32)
    want = reference_predict_tflite(path, {"x": x})["probs"]
    me = psutil.Process()
    narrow = TFLiteBackend().load(os.path.dirname(path), {"num_threads": 1, "delegate": "none", "pool_size": 1})
    try:
        np.testing.assert_allclose(narrow.run_wide("serving_default", {"x": x})["probs"], want, rtol=RTOL, atol=ATOL)
        assert narrow._wide is None and narrow._created == 1
    finally:
        narrow.close()
    servable = TFLiteBackend().load(os.path.dirname(path), {"num_threads": 1, "wide_threads": 3, "delegate": "none",
                                                            "pool_size": 1})
    try:
        threads = me.num_threads()
        np.testing.assert_allclose(servable.run("serving_default", {"x": x})["probs"], want, rtol=RTOL, atol=ATOL)
        assert me.num_threads() == threads  # the pooled interpreter: one thread, the caller's
        np.testing.assert_allclose(servable.run_wide("serving_default", {"x": x})["probs"], want, rtol=RTOL, atol=ATOL)
        assert servable._wide is not None and servable._created == 1
        assert me.num_threads() >= threads + 2  # the wide one's pool: its own threads beside the caller's
        with pytest.raises(InputFailure):
            servable.run_wide("serving_default", {"x": np.zeros((1, 63), np.float32)})
        assert servable._wide is None  # refused: dropped, made again next time
        np.testing.assert_allclose(servable.run_wide("serving_default", {"x": x})["probs"], want, rtol=RTOL, atol=ATOL)
    finally:
        servable.close()


def test_tflite_multi_signature(models_dir: Path) -> None:
    path = os.path.join(vdir(models_dir, "multisig_tflite"), "model.tflite")
    servable = TFLiteBackend().load(vdir(models_dir, "multisig_tflite"), {"num_threads": 1})
    try:
        assert set(servable.signatures) == {"add", "mul"}
        assert set(servable.signatures["add"].inputs) == {"a", "b"}
        assert list(servable.signatures["mul"].outputs) == ["product"]
        rng = np.random.default_rng(3)
        feeds = {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal((3, 4)).astype(np.float32)}
        for sig, out in (("add", "sum"), ("mul", "product"), ("add", "sum")):
            got = servable.run(sig, feeds)[out]
            np.testing.assert_allclose(got, reference_predict_tflite(path, feeds, sig)[out], rtol=RTOL)
        np.testing.assert_allclose(servable.run("mul", feeds)["product"], feeds["a"] * feeds["b"], rtol=RTOL)
    finally:
        servable.close()


def test_tflite_without_signature_defs(models_dir: Path) -> None:
    path = os.path.join(vdir(models_dir, "nosig_tflite"), "model.tflite")
    servable = TFLiteBackend().load(vdir(models_dir, "nosig_tflite"), {"num_threads": 1})
    try:
        (name,) = servable.signatures
        sig = servable.signatures[name]
        assert name == "serving_default"
        assert list(sig.inputs) == ["x"] and list(sig.outputs) == ["y"]
        one = np.array([[3.0]], np.float32)
        np.testing.assert_allclose(servable.run(name, {"x": one})["y"], reference_predict_tflite(path, {"x": one})["y"])
        many = np.array([[1.0], [2.0], [-4.0]], np.float32)  # the batch dimension is resized
        got = servable.run(name, {"x": many})["y"]
        np.testing.assert_allclose(got, reference_predict_tflite(path, {"x": many})["y"])
        np.testing.assert_allclose(got, 2 * many + 1)
    finally:
        servable.close()


def test_tflite_pool_concurrent_same_shape(models_dir: Path) -> None:
    """Threads share a pool of interpreters; repeated shapes keep their allocation."""
    path = mlp_tflite(models_dir)
    servable = TFLiteBackend().load(os.path.dirname(path), {"num_threads": 1, "pool_size": 3})
    rng = np.random.default_rng(11)
    inputs = [rng.standard_normal((4, 64)).astype(np.float32) for _ in range(8)]
    wants = [reference_predict_tflite(path, {"x": x})["probs"] for x in inputs]
    errors: list[BaseException] = []

    def client(k: int) -> None:
        try:
            for round_ in range(10):
                i = (k + round_) % len(inputs)
                got = servable.run("serving_default", {"x": inputs[i]})["probs"]
                np.testing.assert_allclose(got, wants[i], rtol=RTOL, atol=ATOL)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[0]
        assert servable._created <= 3  # never more interpreters than the pool holds
        programs = []
        while not servable._pool.empty():
            programs.append(servable._pool.get_nowait())
        # every pooled interpreter is still allocated for the repeated shape: nothing re-allocated it
        assert programs and all(p["serving_default"].shapes == {"x": (4, 64)} for p in programs)
    finally:
        servable.close()


def test_tflite_refuses_a_corrupt_model(tmp_path: Path) -> None:
    (tmp_path / "model.tflite").write_bytes(b"\x00garbage" * 64)
    with pytest.raises(LoadFailure):
        TFLiteBackend().load(str(tmp_path), {})


# A delegate library that dlopen refuses must not reach LiteRT's Delegate: its half-built
# object's __del__ raises ("Exception ignored in Delegate.__del__") on every such start.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_tflite_missing_delegate_falls_back_with_reason(models_dir: Path) -> None:
    servable = TFLiteBackend().load(vdir(models_dir, "multisig_tflite"), {
        "delegate": "edgetpu", "edgetpu_delegate_path": "/nonexistent/libedgetpu.so.1", "num_threads": 1})
    try:
        assert "edgetpu" in servable.delegate_reason and "XNNPACK" in servable.delegate_reason
        feeds = {"a": np.ones((1, 4), np.float32), "b": np.full((1, 4), 2.0, np.float32)}
        np.testing.assert_allclose(servable.run("add", feeds)["sum"], np.full((1, 4), 3.0))
    finally:
        servable.close()


# --- tf-gpu through a test double --------------------------------------------------------
class FakeConverter:
    """Stands in for TF-TRT: copies the SavedModel (or fails), counting calls."""

    def __init__(self, fail: bool = False):
        self.calls: list[tuple[str, str, str]] = []
        self.fail = fail

    def __call__(self, src: str, dst: str, precision: str) -> None:
        self.calls.append((src, dst, precision))
        if self.fail:
            raise RuntimeError("TensorRT engine build failed (test double)")
        shutil.copytree(src, dst)


def gpu_options(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    return {"device": FAKE_GPU, "cache_dir": str(tmp_path / "cache"), "model_name": "hpt", "version": 1,
            "precision": "FP16", "tftrt": True, **kw}


def test_tf_gpu_probe() -> None:
    backend = TFGPUBackend(converter=FakeConverter())
    yes = backend.probe(FAKE_GPU)
    assert yes.available and "FakeGPU" in yes.reason
    no = backend.probe({**FAKE_GPU, "nvidia_gpu": False})
    assert not no.available and "GPU" in no.reason
    cpu_build = backend.probe({**FAKE_GPU, "tensorflow_build": "cpu"})
    assert not cpu_build.available and "CPU" in cpu_build.reason


def test_tf_gpu_converts_once_then_loads_from_cache(models_dir: Path, tmp_path: Path) -> None:
    converter = FakeConverter()
    backend = TFGPUBackend(converter=converter)
    path = vdir(models_dir, "half_plus_two")
    first = backend.load(path, gpu_options(tmp_path))
    try:
        assert len(converter.calls) == 1 and converter.calls[0][2] == "FP16"
        assert "converted" in first.conversion and first.backend == "tf-gpu"
        np.testing.assert_allclose(first.run("serving_default", {"x": np.array([1, 2, 5], np.float32)})["y"],
                                   [2.5, 3.0, 4.5])
    finally:
        first.close()
    second = TFGPUBackend(converter=converter).load(path, gpu_options(tmp_path))  # "the next start"
    try:
        assert len(converter.calls) == 1, "the cached conversion must be loaded, not converted again"
        assert "cache" in second.conversion
        got = second.run("regress_x_to_y", {"inputs": examples(x=[2.0])})["outputs"]
        np.testing.assert_allclose(got, reference_predict(path, {"inputs": examples(x=[2.0])}, "regress_x_to_y")["outputs"])
    finally:
        second.close()
    third = backend.load(path, gpu_options(tmp_path, precision="FP32"))  # another precision: its own entry
    third.close()
    assert len(converter.calls) == 2 and converter.calls[1][2] == "FP32"


def test_tf_gpu_failed_conversion_serves_plain_and_is_not_retried(models_dir: Path, tmp_path: Path) -> None:
    converter = FakeConverter(fail=True)
    path = vdir(models_dir, "half_plus_two")
    servable = TFGPUBackend(converter=converter).load(path, gpu_options(tmp_path))
    try:
        assert "failed" in servable.conversion and "TensorRT engine build failed" in servable.conversion
        np.testing.assert_allclose(servable.run("serving_default", {"x": np.array([4.0], np.float32)})["y"], [4.0])
    finally:
        servable.close()
    notes = list((tmp_path / "cache").rglob("*.failed"))
    assert len(notes) == 1 and "TensorRT engine build failed" in notes[0].read_text()
    again = TFGPUBackend(converter=converter).load(path, gpu_options(tmp_path))
    again.close()
    assert len(converter.calls) == 1, "a failed conversion is recorded, not retried on every start"
    assert "failed earlier" in again.conversion


def test_tf_gpu_without_tensorrt_serves_plain(models_dir: Path, tmp_path: Path) -> None:
    converter = FakeConverter()
    opts = gpu_options(tmp_path, device={**FAKE_GPU, "tensorrt": False})
    servable = TFGPUBackend(converter=converter).load(vdir(models_dir, "half_plus_two"), opts)
    servable.close()
    assert converter.calls == [] and "plain SavedModel" in servable.conversion


@pytest.mark.gpu
def test_tf_gpu_real_tftrt(models_dir: Path, tmp_path: Path) -> None:
    """The real TF-TRT conversion, on hardware that has it."""
    device = real_device()
    if not (device.get("nvidia_gpu") and device.get("tensorrt") and device.get("tensorflow_build") == "cuda"):
        pytest.skip("needs an NVIDIA GPU, TensorRT and a CUDA build of TensorFlow")
    path = mlp_both(models_dir, tmp_path / "mlp" / "1")
    backend = TFGPUBackend()
    assert backend.probe(device).available
    opts = {"device": device, "cache_dir": str(tmp_path / "cache"), "model_name": "mlp", "version": 1,
            "precision": "FP32", "tftrt": True}
    servable = backend.load(path, opts)
    try:
        assert "converted" in servable.conversion, servable.conversion
        x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
        np.testing.assert_allclose(servable.run("serving_default", {"x": x})["probs"],
                                   reference_predict(path, {"x": x})["probs"], rtol=1e-3, atol=1e-4)
    finally:
        servable.close()
    again = backend.load(path, opts)
    again.close()
    assert "cache" in again.conversion


# --- selection ---------------------------------------------------------------------------
class CountingLoader:
    def __init__(self, backends: dict[str, Any], path: str, options: dict[str, dict[str, Any]] | None = None):
        self.backends, self.path, self.options = backends, path, options or {}
        self.calls: list[str] = []
        self.loaded: list[Any] = []

    def __call__(self, name: str) -> Any:
        self.calls.append(name)
        servable = self.backends[name].load(self.path, self.options.get(name, {"num_threads": 1}))
        self.loaded.append(servable)
        return servable

    def close(self) -> None:
        for s in self.loaded:
            s.close()


def cpu_backends() -> dict[str, Any]:
    return runtimes.default_backends()


def test_selection_measures_every_candidate(models_dir: Path, tmp_path: Path) -> None:
    path = mlp_both(models_dir, tmp_path / "1")
    backends = cpu_backends()
    device = real_device()
    load = CountingLoader(backends, path)
    cache: dict[str, Any] = {}
    try:
        decision, servable = runtimes.select(backends, device, path, load, {"backend": "auto"}, cache, "k1")
        assert servable is not None and decision.chosen in ("tf-cpu", "tflite")
        assert decision.how == "measured"
        assert sorted(load.calls) == ["tf-cpu", "tflite"]
        by_name = {c.backend: c for c in decision.considered}
        assert set(by_name) == {"tf-gpu", "tf-cpu", "tflite", "litertlm"}  # every backend, with a reason
        assert not by_name["litertlm"].available  # LiteRT-LM serves .litertlm bundles only
        assert all(c.reason for c in decision.considered)
        if not device.get("nvidia_gpu"):
            assert not by_name["tf-gpu"].available and "GPU" in by_name["tf-gpu"].reason
        for name in ("tf-cpu", "tflite"):
            assert by_name[name].available
            assert by_name[name].batch1_ms is not None and by_name[name].batch1_ms > 0
            assert by_name[name].batch_n_ms is not None and by_name[name].batch_n_ms > 0
            assert name in decision.reason
        assert servable.backend == decision.chosen
        x = np.ones((2, 64), np.float32)
        np.testing.assert_allclose(servable.run("serving_default", {"x": x})["probs"],
                                   reference_predict(path, {"x": x})["probs"], rtol=RTOL, atol=ATOL)
        assert "k1" in cache and cache["k1"]["chosen"] == decision.chosen
    finally:
        load.close()

    # the next start: the cached figures decide, nothing is measured again
    again = CountingLoader(backends, path)
    try:
        decision2, servable2 = runtimes.select(backends, device, path, again, {"backend": "auto"}, cache, "k1")
        assert decision2.how == "cached" and decision2.chosen == decision.chosen
        assert again.calls == [decision.chosen]
        restored = {c.backend: c.batch1_ms for c in decision2.considered}
        assert restored["tf-cpu"] == by_name["tf-cpu"].batch1_ms and restored["tflite"] == by_name["tflite"].batch1_ms
        assert decision2.to_dict()["considered"]  # JSON-able record
    finally:
        again.close()


def test_selection_only_one_candidate(models_dir: Path) -> None:
    backends = cpu_backends()
    load = CountingLoader(backends, vdir(models_dir, "multisig_tflite"))
    try:
        decision, servable = runtimes.select(backends, real_device(), vdir(models_dir, "multisig_tflite"), load,
                                             {"backend": "auto"})
        assert decision.chosen == "tflite" and decision.how == "only" and servable is not None
        assert load.calls == ["tflite"]
        tfcpu = next(c for c in decision.considered if c.backend == "tf-cpu")
        assert not tfcpu.available and "artifact" in tfcpu.reason
    finally:
        load.close()


def test_selection_pinned(models_dir: Path, tmp_path: Path) -> None:
    path = mlp_both(models_dir, tmp_path / "1")
    backends = cpu_backends()
    load = CountingLoader(backends, path)
    try:
        decision, servable = runtimes.select(backends, real_device(), path, load, {"backend": "tf-cpu"}, {}, "k")
        assert (decision.chosen, decision.how) == ("tf-cpu", "pinned") and load.calls == ["tf-cpu"]
        assert servable is not None and servable.backend == "tf-cpu"
    finally:
        load.close()
    load = CountingLoader(backends, vdir(models_dir, "half_plus_two"))
    decision, servable = runtimes.select(backends, real_device(), vdir(models_dir, "half_plus_two"), load,
                                         {"backend": "tflite"})
    assert servable is None and decision.chosen is None and load.calls == []
    assert "tflite" in decision.reason


def test_selection_policy_prefers_tflite_on_small_memory(models_dir: Path, tmp_path: Path) -> None:
    path = mlp_both(models_dir, tmp_path / "1")
    backends = cpu_backends()
    load = CountingLoader(backends, path)
    try:
        device = {**real_device(), "memory_mb": 256}
        decision, _ = runtimes.select(backends, device, path, load, {"backend": "auto", "prefer_tflite_below_mb": 1024})
        assert (decision.chosen, decision.how) == ("tflite", "policy") and load.calls == ["tflite"]
    finally:
        load.close()


def test_selection_falls_back_when_the_measured_winner_cannot_load(models_dir: Path, tmp_path: Path) -> None:
    path = mlp_both(models_dir, tmp_path / "1")
    (Path(path) / "model.tflite").write_bytes(b"corrupt" * 100)
    backends = cpu_backends()
    load = CountingLoader(backends, path)
    try:
        decision, servable = runtimes.select(backends, real_device(), path, load, {"backend": "auto"}, {}, "k")
        assert decision.chosen == "tf-cpu" and servable is not None
        tflite = next(c for c in decision.considered if c.backend == "tflite")
        assert tflite.load_error, "the failed load is recorded in the decision"
    finally:
        load.close()


def test_selection_falls_back_when_the_cached_choice_cannot_load(models_dir: Path, tmp_path: Path) -> None:
    path = mlp_both(models_dir, tmp_path / "1")
    (Path(path) / "model.tflite").write_bytes(b"corrupt" * 100)
    cache = {"k": {"chosen": "tflite", "how": "measured", "reason": "fastest earlier", "considered": []}}
    backends = cpu_backends()
    load = CountingLoader(backends, path)
    try:
        decision, servable = runtimes.select(backends, real_device(), path, load, {"backend": "auto"}, cache, "k")
        assert decision.chosen == "tf-cpu" and servable is not None and servable.backend == "tf-cpu"
        assert load.calls == ["tflite", "tf-cpu"]
        assert "tflite failed to load" in decision.reason and "fell back to tf-cpu" in decision.reason
        assert next(c for c in decision.considered if c.backend == "tflite").load_error
    finally:
        load.close()


def test_selection_nothing_can_serve(tmp_path: Path) -> None:
    backends = cpu_backends()
    load = CountingLoader(backends, str(tmp_path))
    decision, servable = runtimes.select(backends, real_device(), str(tmp_path), load, {"backend": "auto"})
    assert servable is None and decision.chosen is None and decision.how == "none" and load.calls == []
    assert all(c.reason for c in decision.considered)


def test_selection_on_a_gpu_device_through_the_double(models_dir: Path, tmp_path: Path) -> None:
    """With a (fake) GPU every backend is a candidate: tf-gpu is measured like the others."""
    path = mlp_both(models_dir, tmp_path / "1")
    converter = FakeConverter()
    backends = {"tf-gpu": TFGPUBackend(converter=converter), "tf-cpu": TFCPUBackend(), "tflite": TFLiteBackend()}
    options = {"tf-gpu": gpu_options(tmp_path, model_name="mlp"), "tf-cpu": {}, "tflite": {"num_threads": 1}}
    load = CountingLoader(backends, path, options)
    try:
        decision, servable = runtimes.select(backends, FAKE_GPU, path, load, {"backend": "auto"}, {}, "g")
        assert decision.how == "measured" and sorted(load.calls) == ["tf-cpu", "tf-gpu", "tflite"]
        assert all(c.available and c.batch1_ms for c in decision.considered)
        assert len(converter.calls) == 1
        assert servable is not None
    finally:
        load.close()


def test_synthetic_inputs_follow_the_signature(models_dir: Path) -> None:
    servable = TFLiteBackend().load(vdir(models_dir, "multisig_tflite"), {"num_threads": 1})
    try:
        feeds = runtimes.synthetic_inputs(servable.signatures["add"], 5)
        assert {k: v.shape for k, v in feeds.items()} == {"a": (5, 4), "b": (5, 4)}
        assert servable.run("add", feeds)["sum"].shape == (5, 4)
    finally:
        servable.close()
