"""Checks that every model built by tests/support/modelgen.py really works.

SavedModels are loaded with the TF1 loader (tf.compat.v1.saved_model.loader
into a Session) and every signature is run; .tflite files are run with
ai_edge_litert.  Outputs are compared with the math / with each other.

The benchmark models (MobileNetV2 at 96x96, ~50 s on 2 cores) are only built
when MODELGEN_BENCH=1.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.support import modelgen as mg

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture(scope="session")
def tf():
    import tensorflow

    return tensorflow


@pytest.fixture(scope="session")
def models(request, tmp_path_factory, tf):
    """The session's model set: conftest's cached ``models_dir`` when there is one
    (built by ``mg.build_all`` and keyed by this module's hash), else built here."""
    try:
        return request.getfixturevalue("models_dir")
    except pytest.FixtureLookupError:
        pass
    base = tmp_path_factory.mktemp("models")
    t0 = time.perf_counter()
    times = mg.build_all(base)
    times["total"] = time.perf_counter() - t0
    print("\nmodelgen build times (s): " + ", ".join(f"{k}={v:.1f}" for k, v in times.items()))
    return base


def vdir(models, name):
    return os.path.join(models, name, "1")


class V1:
    """A SavedModel loaded with the TF1 loader into its own Session."""

    def __init__(self, tf, version_dir):
        self.graph = tf.Graph()
        self.sess = tf.compat.v1.Session(graph=self.graph)
        meta = tf.compat.v1.saved_model.loader.load(self.sess, ["serve"], str(version_dir))
        # __saved_model_init_op is TF2's init-op entry, not a servable signature
        self.sigs = {k: v for k, v in meta.signature_def.items() if not k.startswith("__")}

    def run(self, signature, feeds):
        """Run ``signature``; feeds and results keyed by signature input/output key."""
        sd = self.sigs[signature]
        feed = {sd.inputs[k].name: v for k, v in feeds.items()}
        names = sorted(sd.outputs)
        return dict(zip(names, self.sess.run([sd.outputs[k].name for k in names], feed_dict=feed)))

    def close(self):
        self.sess.close()


_V1_CACHE = {}


def v1(tf, version_dir):
    key = os.path.abspath(str(version_dir))
    if key not in _V1_CACHE:
        _V1_CACHE[key] = V1(tf, key)
    return _V1_CACHE[key]


def run_v1(tf, version_dir, signature, feeds):
    return v1(tf, version_dir).run(signature, feeds)


def v1_signatures(tf, version_dir):
    return v1(tf, version_dir).sigs


def examples(tf, **features):
    """Serialized tf.Examples, one per position of the given float lists."""
    n = len(next(iter(features.values())))
    out = []
    for i in range(n):
        feat = {
            k: tf.train.Feature(float_list=tf.train.FloatList(value=[float(v[i])]))
            for k, v in features.items()
        }
        out.append(tf.train.Example(features=tf.train.Features(feature=feat)).SerializeToString())
    return out


# ---------------------------------------------------------------- half_plus_two


def test_half_plus_two_layout(models):
    d = vdir(models, "half_plus_two")
    assert os.path.isfile(os.path.join(d, "saved_model.pb"))
    assert os.path.isfile(os.path.join(d, "variables", "variables.index"))
    with open(os.path.join(d, "assets", "foo.txt")) as f:
        assert f.read() == "asset-file-contents"
    assert os.path.isfile(os.path.join(d, "assets.extra", "tf_serving_warmup_requests"))
    # staging directories are gone
    assert os.listdir(os.path.dirname(d)) == ["1"]


def test_half_plus_two_signature_defs(models, tf):
    sigs = v1_signatures(tf, vdir(models, "half_plus_two"))
    assert set(sigs) == {
        "serving_default",
        "classify_x_to_y",
        "regress_x_to_y",
        "regress_x_to_y2",
        "regress_x2_to_y3",
    }
    p = sigs["serving_default"]
    assert p.method_name == "tensorflow/serving/predict"
    assert list(p.inputs) == ["x"] and list(p.outputs) == ["y"]
    assert p.inputs["x"].dtype == tf.float32.as_datatype_enum
    assert p.inputs["x"].tensor_shape.unknown_rank
    c = sigs["classify_x_to_y"]
    assert c.method_name == "tensorflow/serving/classify"
    assert list(c.inputs) == ["inputs"] and list(c.outputs) == ["scores"]
    assert c.inputs["inputs"].dtype == tf.string.as_datatype_enum
    assert [d.size for d in c.inputs["inputs"].tensor_shape.dim] == [-1]
    for k in ("regress_x_to_y", "regress_x_to_y2", "regress_x2_to_y3"):
        r = sigs[k]
        assert r.method_name == "tensorflow/serving/regress"
        assert list(r.inputs) == ["inputs"] and list(r.outputs) == ["outputs"]
    assert sigs["regress_x_to_y"].inputs["inputs"].dtype == tf.string.as_datatype_enum
    assert sigs["regress_x2_to_y3"].inputs["inputs"].dtype == tf.float32.as_datatype_enum


def test_half_plus_two_predict(models, tf):
    d = vdir(models, "half_plus_two")
    out = run_v1(tf, d, "serving_default", {"x": np.array([1.0, 2.0, 5.0], np.float32)})
    np.testing.assert_allclose(out["y"], [2.5, 3.0, 4.5])
    out = run_v1(tf, d, "serving_default", {"x": np.array([[1.0], [2.0]], np.float32)})
    np.testing.assert_allclose(out["y"], [[2.5], [3.0]])
    out = run_v1(tf, d, "serving_default", {"x": np.float32(4.0)})
    np.testing.assert_allclose(out["y"], 4.0)
    # the TF2 loader agrees
    np.testing.assert_allclose(mg.reference_predict(d, {"x": [1.0, 2.0, 5.0]})["y"], [2.5, 3.0, 4.5])


def test_half_plus_two_classify_regress(models, tf):
    d = vdir(models, "half_plus_two")
    ex = examples(tf, x=[1.0, 2.0, 5.0])
    out = run_v1(tf, d, "classify_x_to_y", {"inputs": ex})
    np.testing.assert_allclose(out["scores"], [[2.5], [3.0], [4.5]])
    out = run_v1(tf, d, "regress_x_to_y", {"inputs": ex})
    np.testing.assert_allclose(out["outputs"], [[2.5], [3.0], [4.5]])
    out = run_v1(tf, d, "regress_x_to_y2", {"inputs": ex})
    np.testing.assert_allclose(out["outputs"], [[3.5], [4.0], [5.5]])
    out = run_v1(tf, d, "regress_x2_to_y3", {"inputs": np.array([[1.0], [2.0]], np.float32)})
    np.testing.assert_allclose(out["outputs"], [[3.5], [4.0]])
    # TF2 loader, same answers
    got = mg.reference_predict(d, {"inputs": ex}, "classify_x_to_y")["scores"]
    np.testing.assert_allclose(got, [[2.5], [3.0], [4.5]])
    got = mg.reference_predict(d, {"inputs": examples(tf, x=[4.0])}, "regress_x_to_y2")["outputs"]
    np.testing.assert_allclose(got, [[5.0]])


def test_half_plus_two_missing_feature_fails(models, tf):
    d = vdir(models, "half_plus_two")
    with pytest.raises(tf.errors.InvalidArgumentError):
        run_v1(tf, d, "regress_x_to_y", {"inputs": examples(tf, x2=[1.0])})


def test_half_plus_two_parameters(tmp_path, tf):
    d = mg.build_half_plus_two(tmp_path / "m" / "7", a=2.0, b=-1.0, c=10.0)
    m = V1(tf, d)
    out = m.run("serving_default", {"x": np.array([0.0, 3.0], np.float32)})
    np.testing.assert_allclose(out["y"], [-1.0, 5.0])
    out = m.run("regress_x_to_y2", {"inputs": examples(tf, x=[1.0])})
    np.testing.assert_allclose(out["outputs"], [[12.0]])
    m.close()
    assert not os.path.exists(os.path.join(d, "assets.extra"))
    # rebuilding over an existing version replaces it
    d = mg.build_half_plus_two(tmp_path / "m" / "7", a=1.0, b=0.0)
    m = V1(tf, d)
    np.testing.assert_allclose(m.run("serving_default", {"x": np.array([3.0], np.float32)})["y"], [3.0])
    m.close()
    assert sorted(os.listdir(tmp_path / "m")) == ["7"]


# ---------------------------------------------------------------- warmup records


def _serving_message_classes():
    """PredictionLog & co. in a private descriptor pool (no tensorflow-serving-api).

    Field numbers as in tensorflow_serving/apis/{prediction_log,predict,model}.proto.
    """
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, wrappers_pb2
    from tensorflow.core.framework import tensor_pb2

    pool = descriptor_pool.DescriptorPool()
    added = set()

    def add(fd):
        if fd.name in added:
            return
        for dep in fd.dependencies:
            add(dep)
        p = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(p)
        pool.Add(p)
        added.add(fd.name)

    add(tensor_pb2.DESCRIPTOR)
    add(wrappers_pb2.DESCRIPTOR)
    F = descriptor_pb2.FieldDescriptorProto
    f = descriptor_pb2.FileDescriptorProto(
        name="modelgen_test/serving.proto",
        package="tensorflow.serving",
        syntax="proto3",
        dependency=["tensorflow/core/framework/tensor.proto", "google/protobuf/wrappers.proto"],
    )

    def msg(name, fields, nested=()):
        m = f.message_type.add(name=name)
        for n in nested:
            m.nested_type.add().CopyFrom(n)
        for fname, num, typ, label, tname in fields:
            fld = m.field.add(name=fname, number=num, type=typ, label=label)
            if tname:
                fld.type_name = tname
        return m

    opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    msg("ModelSpec", [
        ("name", 1, F.TYPE_STRING, opt, None),
        ("version", 2, F.TYPE_MESSAGE, opt, ".google.protobuf.Int64Value"),
        ("signature_name", 3, F.TYPE_STRING, opt, None),
    ])
    entry = descriptor_pb2.DescriptorProto(name="InputsEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=opt)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=opt, type_name=".tensorflow.TensorProto")
    msg("PredictRequest", [
        ("model_spec", 1, F.TYPE_MESSAGE, opt, ".tensorflow.serving.ModelSpec"),
        ("inputs", 2, F.TYPE_MESSAGE, rep, ".tensorflow.serving.PredictRequest.InputsEntry"),
        ("output_filter", 3, F.TYPE_STRING, rep, None),
    ], nested=[entry])
    msg("PredictLog", [("request", 1, F.TYPE_MESSAGE, opt, ".tensorflow.serving.PredictRequest")])
    msg("PredictionLog", [("predict_log", 6, F.TYPE_MESSAGE, opt, ".tensorflow.serving.PredictLog")])
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.serving.PredictionLog"))


@pytest.mark.parametrize(
    "value",
    [
        np.array([1.0, 2.0, 5.0], np.float32),
        np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5,
        np.array([[1, -2], [3, 2**40]], np.int64),
        np.array([-7, 0, 7], np.int32),
        np.array([0.25, -1e300], np.float64),
        np.array([True, False]),
        np.float32(3.5),
        np.array([b"a", b"\x00\xff", "h\u00e9".encode()], dtype=object),
        np.zeros((0, 4), np.float32),
    ],
)
def test_encode_tensor_proto_roundtrip(tf, value):
    from tensorflow.core.framework import tensor_pb2

    tp = tensor_pb2.TensorProto.FromString(mg.encode_tensor_proto(value))
    got = tf.make_ndarray(tp)
    assert got.shape == np.asarray(value).shape
    if np.asarray(value).dtype == object:
        assert got.tolist() == np.asarray(value).tolist()
    else:
        assert got.dtype == np.asarray(value).dtype
        np.testing.assert_array_equal(got, value)


def test_warmup_file(models, tf):
    from tensorflow.core.framework import tensor_pb2

    PredictionLog = _serving_message_classes()
    d = vdir(models, "half_plus_two")
    path = os.path.join(d, "assets.extra", "tf_serving_warmup_requests")
    recs = [r.numpy() for r in tf.data.TFRecordDataset(path)]
    assert len(recs) == 1
    log = PredictionLog.FromString(recs[0])
    assert log.HasField("predict_log")
    req = log.predict_log.request
    assert req.model_spec.name == "half_plus_two"
    assert req.model_spec.signature_name == "serving_default"
    assert list(req.inputs) == ["x"]
    tp = tensor_pb2.TensorProto.FromString(req.inputs["x"].SerializeToString())
    assert tp.dtype == tf.float32.as_datatype_enum
    x = tf.make_ndarray(tp)
    np.testing.assert_array_equal(x, np.array([1.0, 2.0, 5.0], np.float32))
    # the warmup request runs against the model
    out = run_v1(tf, d, req.model_spec.signature_name, {"x": x})
    np.testing.assert_allclose(out["y"], [2.5, 3.0, 4.5])


def test_encode_predict_log_many_inputs(tf):
    from tensorflow.core.framework import tensor_pb2

    PredictionLog = _serving_message_classes()
    raw = mg.encode_predict_log("m", {"b": np.ones((2, 2), np.float32), "a": np.array([b"q"], object)}, "sig")
    req = PredictionLog.FromString(raw).predict_log.request
    assert (req.model_spec.name, req.model_spec.signature_name) == ("m", "sig")
    assert sorted(req.inputs) == ["a", "b"]
    b = tf.make_ndarray(tensor_pb2.TensorProto.FromString(req.inputs["b"].SerializeToString()))
    np.testing.assert_array_equal(b, np.ones((2, 2), np.float32))


# ---------------------------------------------------------------- Keras models


def _check_keras_model(tf, tmp_path, d, shape, n_out, tflite_atol, tflite=True):
    sigs = v1_signatures(tf, d)
    assert set(sigs) == {"serving_default"}
    sd = sigs["serving_default"]
    assert sd.method_name == "tensorflow/serving/predict"
    assert list(sd.inputs) == ["x"] and list(sd.outputs) == ["probs"]
    assert [x.size for x in sd.inputs["x"].tensor_shape.dim] == [-1, *shape]
    assert [x.size for x in sd.outputs["probs"].tensor_shape.dim] == [-1, n_out]

    x = np.random.default_rng(3).standard_normal((4, *shape)).astype(np.float32)
    v1_out = run_v1(tf, d, "serving_default", {"x": x})["probs"]
    assert v1_out.shape == (4, n_out)
    np.testing.assert_allclose(v1_out.sum(axis=1), 1.0, rtol=1e-5)
    assert float(v1_out.std()) > 1e-4, "degenerate model: constant output"
    assert not np.allclose(v1_out[0], v1_out[1]), "output does not depend on the input"
    ref = mg.reference_predict(d, {"x": x})["probs"]
    np.testing.assert_allclose(v1_out, ref, rtol=1e-5, atol=1e-6)
    if not tflite:
        return

    tfl = mg.to_tflite(d, tmp_path / "model.tflite")
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=str(tfl))
    assert it.get_signature_list() == {"serving_default": {"inputs": ["x"], "outputs": ["probs"]}}
    got = it.get_signature_runner("serving_default")(x=x)["probs"]
    np.testing.assert_allclose(got, ref, atol=tflite_atol)
    # batch 1 as well (the runner resizes)
    got1 = mg.reference_predict_tflite(tfl, {"x": x[:1]})["probs"]
    np.testing.assert_allclose(got1, ref[:1], atol=tflite_atol)


def test_keras_mlp(models, tf, tmp_path):
    _check_keras_model(tf, tmp_path, vdir(models, "keras_mlp"), (64,), 10, 1e-5)


def test_keras_mlp_tflite(models):
    from ai_edge_litert.interpreter import Interpreter

    path = os.path.join(vdir(models, "keras_mlp_tflite"), "model.tflite")
    assert os.listdir(os.path.dirname(path)) == ["model.tflite"]
    it = Interpreter(model_path=path)
    assert it.get_signature_list() == {"serving_default": {"inputs": ["x"], "outputs": ["probs"]}}
    x = np.random.default_rng(9).standard_normal((3, 64)).astype(np.float32)
    ref = mg.reference_predict(vdir(models, "keras_mlp"), {"x": x})["probs"]
    got = it.get_signature_runner("serving_default")(x=x)["probs"]
    np.testing.assert_allclose(got, ref, atol=1e-5)


def test_keras_mlp_is_seeded(models, tf, tmp_path):
    x = np.random.default_rng(5).standard_normal((2, 64)).astype(np.float32)
    a = mg.reference_predict(vdir(models, "keras_mlp"), {"x": x})["probs"]
    d = mg.build_keras_mlp(tmp_path / "mlp" / "1", seed=0)
    np.testing.assert_array_equal(mg.reference_predict(d, {"x": x})["probs"], a)
    d = mg.build_keras_mlp(tmp_path / "mlp2" / "1", in_dim=8, hidden=16, out=3, seed=1)
    m = V1(tf, d)
    out = m.run("serving_default", {"x": x[:, :8]})["probs"]
    m.close()
    assert out.shape == (2, 3)
    assert not np.allclose(out, mg.reference_predict(d, {"x": x[::-1, :8]})["probs"])


def test_tiny_cnn(models, tf, tmp_path):
    _check_keras_model(tf, tmp_path, vdir(models, "tiny_cnn"), (32, 32, 3), 10, 1e-4)


def test_small_cnn(models, tf, tmp_path):
    # converting the full MobileNetV2 to TFLite takes ~30 s: only with MODELGEN_BENCH=1
    # (test_bench_models converts the same architecture at alpha 1.0)
    _check_keras_model(tf, tmp_path, vdir(models, "small_cnn"), (96, 96, 3), 10, 1e-4,
                       tflite=os.environ.get("MODELGEN_BENCH") == "1")


# ---------------------------------------------------------------- string model


def test_string_model(models, tf):
    d = vdir(models, "string_model")
    sd = v1_signatures(tf, d)["serving_default"]
    assert list(sd.inputs) == ["text"]
    assert sd.inputs["text"].dtype == tf.string.as_datatype_enum
    assert sorted(sd.outputs) == ["echo_bytes", "len"]
    assert sd.outputs["len"].dtype == tf.int64.as_datatype_enum
    assert sd.outputs["echo_bytes"].dtype == tf.string.as_datatype_enum
    text = [b"ab", b"\x00\xff\xfe", "h\u00e9llo".encode(), b""]
    out = run_v1(tf, d, "serving_default", {"text": text})
    assert out["len"].tolist() == [2, 3, 6, 0]
    assert out["len"].dtype == np.int64
    assert out["echo_bytes"].tolist() == text
    ref = mg.reference_predict(d, {"text": text})
    assert ref["len"].tolist() == [2, 3, 6, 0]
    assert ref["echo_bytes"].tolist() == text


# ---------------------------------------------------------------- TFLite


def test_multisig_tflite(models):
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=os.path.join(vdir(models, "multisig_tflite"), "model.tflite"))
    sigs = it.get_signature_list()
    assert sigs == {
        "add": {"inputs": ["a", "b"], "outputs": ["sum"]},
        "mul": {"inputs": ["a", "b"], "outputs": ["product"]},
    }
    rng = np.random.default_rng(0)
    for n in (1, 3):
        a = rng.standard_normal((n, 4)).astype(np.float32)
        b = rng.standard_normal((n, 4)).astype(np.float32)
        np.testing.assert_allclose(it.get_signature_runner("add")(a=a, b=b)["sum"], a + b, rtol=1e-6)
        np.testing.assert_allclose(it.get_signature_runner("mul")(a=a, b=b)["product"], a * b, rtol=1e-6)
    details = it.get_signature_runner("add").get_input_details()
    assert details["a"]["shape_signature"].tolist() == [-1, 4]


def test_nosig_tflite(models):
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=os.path.join(vdir(models, "nosig_tflite"), "model.tflite"))
    assert it.get_signature_list() == {}
    (inp,) = it.get_input_details()
    (out,) = it.get_output_details()
    assert inp["name"] == "x" and inp["shape"].tolist() == [1, 1] and inp["dtype"] == np.float32
    assert out["name"] == "y"
    it.allocate_tensors()
    for v in (3.0, -0.5):
        it.set_tensor(inp["index"], np.array([[v]], np.float32))
        it.invoke()
        np.testing.assert_allclose(it.get_tensor(out["index"]), [[2 * v + 1]])
    got = mg.reference_predict_tflite(os.path.join(vdir(models, "nosig_tflite"), "model.tflite"), {"x": [[3.0]]})
    np.testing.assert_allclose(got["y"], [[7.0]])


# ---------------------------------------------------------------- CLI


@pytest.mark.timeout(600)  # two builds of up to 240 s each
def test_cli(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run(
        [sys.executable, "-m", "tests.support.modelgen", "nosig_tflite,multisig_tflite", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["multisig_tflite", "nosig_tflite"]
    for n in ("multisig_tflite", "nosig_tflite"):
        assert os.listdir(tmp_path / n) == ["1"]
        assert os.path.isfile(tmp_path / n / "1" / "model.tflite")
    r = subprocess.run(
        [sys.executable, "-m", "tests.support.modelgen", "nope", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert r.returncode == 2 and "unknown model" in r.stderr


# ---------------------------------------------------------------- benchmark models


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MODELGEN_BENCH") != "1", reason="slow (~50 s); set MODELGEN_BENCH=1")
def test_bench_models(tmp_path, tf):
    from ai_edge_litert.interpreter import Interpreter

    info = mg.build_bench_models(tmp_path)
    assert sorted(info["models"]) == ["cnn", "mlp"]
    assert info["models"]["mlp"]["params"] == 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10
    for name, shape in mg.BENCH_SPECS.items():
        d = str(tmp_path / name / "1")
        for f in ("saved_model.pb", "variables/variables.index", "model.tflite"):
            assert os.path.isfile(os.path.join(d, f)), f
        m = V1(tf, d)
        sd = m.sigs["serving_default"]
        assert list(sd.inputs) == ["input"] and list(sd.outputs) == ["output"]
        assert [x.size for x in sd.inputs["input"].tensor_shape.dim] == [-1, *shape]
        x = np.random.default_rng(1).standard_normal((4, *shape)).astype(np.float32)
        ref = m.run("serving_default", {"input": x})["output"]
        m.close()
        assert ref.shape == (4, 10) and float(ref.std()) > 1e-4
        np.testing.assert_allclose(ref, mg.reference_predict(d, {"input": x})["output"], rtol=1e-5, atol=1e-6)
        it = Interpreter(model_path=os.path.join(d, "model.tflite"))
        assert it.get_signature_list() == {"serving_default": {"inputs": ["input"], "outputs": ["output"]}}
        got = it.get_signature_runner("serving_default")(input=x)["output"]
        np.testing.assert_allclose(got, ref, atol=1e-4)
