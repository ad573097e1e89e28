"""Build small, REAL TensorFlow / TFLite models for tests and benchmarks.

Every ``build_*`` function takes a *version directory* (for example
``base/half_plus_two/1``) and writes a complete servable there.  The directory
is assembled in a hidden sibling (``base/half_plus_two/.modelgen-tmp-*``) and
renamed into place at the end, so a server that polls ``base/half_plus_two``
never sees a half-written version (non-numeric directory names are not
versions).  An existing version directory is replaced.

TensorFlow is imported lazily, inside the functions, so importing this module
is cheap (pytest collection, ``--help`` of the CLI).

Models (signature keys, inputs -> outputs):

=====================  =====================================================
build_half_plus_two    TF1 graph SavedModel mirroring TF Serving's testdata
                       ``saved_model_half_plus_two.py``.
                       serving_default (predict): x float ? -> y = a*x+b
                       classify_x_to_y (classify): inputs string[None]
                           (serialized tf.Example, float feature "x") -> scores
                       regress_x_to_y  (regress): inputs -> outputs = a*x+b
                       regress_x_to_y2 (regress): inputs -> outputs = a*x+c
                       regress_x2_to_y3 (regress): inputs float ? (x2)
                           -> outputs = a*x2+c
                       variables a, b, c, a2, c2; assets/foo.txt;
                       optional assets.extra/tf_serving_warmup_requests.
build_keras_mlp        serving_default: x f32[None,in_dim] -> probs f32[None,out]
build_keras_mlp_tflite model.tflite of the same MLP (same weights), signature
                       serving_default: x -> probs
build_small_cnn        serving_default: x f32[None,size,size,3] -> probs
build_tiny_cnn         MobileNetV2-style mini CNN (3 inverted-residual blocks) at
                       32x32x3, same naming (x -> probs); arch="mobilenetv2"
                       gives build_small_cnn at 32 instead
build_string_model     serving_default: text string[None] -> len int64[None],
                       echo_bytes string[None]
build_multisig_tflite  model.tflite; signatures "add": a,b f32[None,4] -> sum,
                       "mul": a,b f32[None,4] -> product
build_nosig_tflite     model.tflite without SignatureDefs: tensor x f32[1,1]
                       -> tensor y = 2x+1
build_bench_models     OUT/mlp/1 and OUT/cnn/1 (SavedModel + model.tflite),
                       serving_default: input -> output, the architectures of
                       peer-bench's make_models.py.
=====================  =====================================================

CLI::

    python -m tests.support.modelgen all OUTDIR             # every test model -> OUTDIR/<name>/1
    python -m tests.support.modelgen all OUTDIR --bench     # ... plus OUTDIR/mlp/1, OUTDIR/cnn/1
    python -m tests.support.modelgen bench OUTDIR           # only the benchmark models
    python -m tests.support.modelgen NAME OUTDIR [NAME ...] # chosen models (see --help)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__all__ = [
    "build_half_plus_two",
    "build_keras_mlp",
    "build_keras_mlp_tflite",
    "build_small_cnn",
    "build_tiny_cnn",
    "build_string_model",
    "build_multisig_tflite",
    "build_nosig_tflite",
    "build_bench_models",
    "to_tflite",
    "saved_model_signature_keys",
    "reference_predict",
    "reference_predict_tflite",
    "encode_tensor_proto",
    "encode_predict_log",
    "write_warmup_file",
    "build_all",
    "BUILDERS",
]


def _tf():
    import tensorflow as tf

    return tf


# --------------------------------------------------------------------------
# directory handling
# --------------------------------------------------------------------------


def _abs(path):
    return os.path.abspath(os.fspath(path))


@contextlib.contextmanager
def _staged(version_dir):
    """Yield a temporary directory path that becomes ``version_dir`` on success.

    The yielded path does not exist yet (SavedModelBuilder insists on that);
    its parent does and lies next to ``version_dir`` so the final rename is
    atomic on one filesystem.
    """
    version_dir = _abs(version_dir)
    parent = os.path.dirname(version_dir)
    os.makedirs(parent, exist_ok=True)
    holder = tempfile.mkdtemp(prefix=".modelgen-tmp-", dir=parent)
    stage = os.path.join(holder, "v")
    try:
        yield stage
        if not os.path.isdir(stage):
            raise RuntimeError(f"model builder wrote nothing for {version_dir}")
        if os.path.lexists(version_dir):
            if os.path.isdir(version_dir) and not os.path.islink(version_dir):
                shutil.rmtree(version_dir)
            else:
                os.remove(version_dir)
        os.rename(stage, version_dir)
    finally:
        shutil.rmtree(holder, ignore_errors=True)


def _write_bytes(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


# --------------------------------------------------------------------------
# tiny protobuf wire encoder (TF Serving warmup records, no tensorflow-serving-api)
#
# Field numbers, checked against the .proto sources:
#   tensorflow_serving/apis/prediction_log.proto
#       PredictionLog { LogMetadata log_metadata = 1; oneof log_type {
#           ClassifyLog classify_log = 2; RegressLog regress_log = 3;
#           PredictLog predict_log = 6; ... } }
#       PredictLog { PredictRequest request = 1; PredictResponse response = 2; }
#   tensorflow_serving/apis/predict.proto
#       PredictRequest { ModelSpec model_spec = 1;
#                        map<string, TensorProto> inputs = 2;
#                        repeated string output_filter = 3; }
#   tensorflow_serving/apis/model.proto
#       ModelSpec { string name = 1; google.protobuf.Int64Value version = 2;
#                   string signature_name = 3; string version_label = 4; }
#   tensorflow/core/framework/tensor.proto
#       TensorProto { DataType dtype = 1; TensorShapeProto tensor_shape = 2;
#                     bytes tensor_content = 4; repeated float float_val = 5;
#                     repeated bytes string_val = 8; ... }
#   tensorflow/core/framework/tensor_shape.proto
#       TensorShapeProto { repeated Dim dim = 2; bool unknown_rank = 3; }
#       Dim { int64 size = 1; string name = 2; }
#   map<K,V> entries are messages { K key = 1; V value = 2; }
# --------------------------------------------------------------------------

_WT_VARINT = 0
_WT_LEN = 2

# tensorflow/core/framework/types.proto
_DT_BY_NUMPY = {
    "float32": 1,  # DT_FLOAT
    "float64": 2,  # DT_DOUBLE
    "int32": 3,  # DT_INT32
    "uint8": 4,  # DT_UINT8
    "int16": 5,  # DT_INT16
    "int8": 6,  # DT_INT8
    "int64": 9,  # DT_INT64
    "bool": 10,  # DT_BOOL
    "uint16": 17,  # DT_UINT16
    "float16": 19,  # DT_HALF
    "uint32": 22,  # DT_UINT32
    "uint64": 23,  # DT_UINT64
}
_DT_STRING = 7


def _varint(n: int) -> bytes:
    if n < 0:  # proto int32/int64 negatives are 10-byte two's complement
        n += 1 << 64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _f_varint(field: int, value: int) -> bytes:
    return _key(field, _WT_VARINT) + _varint(int(value))


def _f_bytes(field: int, data) -> bytes:
    if isinstance(data, str):
        data = data.encode("utf-8")
    data = bytes(data)
    return _key(field, _WT_LEN) + _varint(len(data)) + data


def encode_tensor_proto(value) -> bytes:
    """Serialize a numpy array (or array-like) as a ``tensorflow.TensorProto``.

    Numeric dtypes go to ``tensor_content`` (little-endian raw bytes), strings /
    bytes to ``string_val``.
    """
    import numpy as np

    arr = np.asarray(value)
    shape = b"".join(_f_bytes(2, _f_varint(1, d)) for d in arr.shape)  # dim{size}
    if arr.dtype.kind in ("U", "S", "O"):
        out = _f_varint(1, _DT_STRING) + _f_bytes(2, shape)
        for item in arr.reshape(-1).tolist():
            out += _f_bytes(8, item if isinstance(item, (bytes, str)) else str(item))
        return out
    name = arr.dtype.name
    if name not in _DT_BY_NUMPY:
        raise TypeError(f"unsupported dtype for TensorProto: {arr.dtype}")
    content = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
    return _f_varint(1, _DT_BY_NUMPY[name]) + _f_bytes(2, shape) + _f_bytes(4, content)


def encode_predict_log(model_name: str, inputs: dict, signature_name: str = "serving_default") -> bytes:
    """Serialize a ``tensorflow.serving.PredictionLog`` holding one PredictRequest."""
    spec = _f_bytes(1, model_name)
    if signature_name:
        spec += _f_bytes(3, signature_name)
    req = _f_bytes(1, spec)  # PredictRequest.model_spec
    for k in sorted(inputs):
        entry = _f_bytes(1, k) + _f_bytes(2, encode_tensor_proto(inputs[k]))
        req += _f_bytes(2, entry)  # PredictRequest.inputs map entry
    predict_log = _f_bytes(1, req)  # PredictLog.request
    return _f_bytes(6, predict_log)  # PredictionLog.predict_log


def write_warmup_file(version_dir, records) -> str:
    """Write ``assets.extra/tf_serving_warmup_requests`` (TFRecord of PredictionLog).

    ``records`` is an iterable of serialized PredictionLog bytes (see
    :func:`encode_predict_log`).  Returns the file path.
    """
    tf = _tf()
    d = os.path.join(os.fspath(version_dir), "assets.extra")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "tf_serving_warmup_requests")
    with tf.io.TFRecordWriter(path) as w:
        for r in records:
            w.write(r)
    return path


# --------------------------------------------------------------------------
# 1. half_plus_two (TF1 graph SavedModel, as TF Serving's testdata)
# --------------------------------------------------------------------------


def build_half_plus_two(
    version_dir,
    a=0.5,
    b=2.0,
    c=3.0,
    warmup=False,
    model_name="half_plus_two",
    warmup_inputs=((1.0, 2.0, 5.0),),
    as_text=False,
):
    """Write TF Serving's half_plus_two SavedModel to ``version_dir``.

    Mirrors tensorflow_serving/servables/tensorflow/testdata/
    saved_model_half_plus_two.py (cpu variant): y = a*x + b, y2 = a*x + c,
    y3 = a2*x2 + c2 (a2 = a, c2 = c), variables for all parameters, an asset
    file ``assets/foo.txt`` assigned to a variable by the main op, and the
    signatures serving_default, classify_x_to_y, regress_x_to_y,
    regress_x_to_y2 and regress_x2_to_y3.

    One deliberate difference: in the original, ``x`` and ``x2`` are
    ``tf.identity`` of the parsed features (static shape [?, 1]); the C++
    session of TF Serving lets them be fed with any shape.  Here they are
    ``placeholder_with_default(parsed, shape=None)`` so that the predict
    signature declares an unknown shape and Python sessions accept
    ``x = [1., 2., 5.]`` (shape [3]) as TF Serving does.  When only the
    serialized examples are fed (classify / regress), the defaults are used.

    With ``warmup=True`` writes ``assets.extra/tf_serving_warmup_requests``:
    one PredictionLog per entry of ``warmup_inputs`` (signature
    serving_default, input x float32).
    Returns ``version_dir``.
    """
    tf = _tf()
    v1 = tf.compat.v1
    with _staged(version_dir) as stage:
        asset_src = tempfile.mkdtemp(prefix="modelgen-assets-")
        try:
            asset_path = os.path.join(asset_src, "foo.txt")
            with open(asset_path, "w") as f:
                f.write("asset-file-contents")

            g = tf.Graph()
            with g.as_default(), v1.Session(graph=g) as sess:
                va = v1.Variable(float(a), name="a")
                vb = v1.Variable(float(b), name="b")
                vc = v1.Variable(float(c), name="c")

                serialized_tf_example = v1.placeholder(tf.string, name="tf_example", shape=[None])
                feature_configs = {
                    "x": v1.FixedLenFeature([1], dtype=tf.float32),
                    "x2": v1.FixedLenFeature([1], dtype=tf.float32, default_value=[0.0]),
                }
                tf_example = v1.parse_example(serialized_tf_example, feature_configs)

                x = v1.placeholder_with_default(tf_example["x"], shape=None, name="x")
                y = tf.identity(tf.add(tf.multiply(va, x), vb), name="y")
                y2 = tf.identity(tf.add(tf.multiply(va, x), vc), name="y2")
                x2 = v1.placeholder_with_default(tf_example["x2"], shape=None, name="x2")
                a2 = v1.Variable(float(a), name="a2")
                c2 = v1.Variable(float(c), name="c2")
                y3 = tf.identity(tf.add(tf.multiply(a2, x2), c2), name="y3")

                # asset file, as in the original: its path goes to the
                # ASSET_FILEPATHS collection (the builder copies it into
                # assets/), and the main op assigns the file name to a variable.
                assets_filepath = tf.constant(asset_path)
                v1.add_to_collection(v1.GraphKeys.ASSET_FILEPATHS, assets_filepath)
                filename_tensor = v1.Variable(
                    "foo.txt", name="filename_tensor", trainable=False, collections=[]
                )
                assign_filename_op = filename_tensor.assign("foo.txt")

                sc = v1.saved_model.signature_constants
                info = v1.saved_model.utils.build_tensor_info

                def regression(inp, out):
                    return v1.saved_model.signature_def_utils.build_signature_def(
                        {sc.REGRESS_INPUTS: info(inp)},
                        {sc.REGRESS_OUTPUTS: info(out)},
                        sc.REGRESS_METHOD_NAME,
                    )

                def classification(inp, scores):
                    return v1.saved_model.signature_def_utils.build_signature_def(
                        {sc.CLASSIFY_INPUTS: info(inp)},
                        {sc.CLASSIFY_OUTPUT_SCORES: info(scores)},
                        sc.CLASSIFY_METHOD_NAME,
                    )

                predict = v1.saved_model.signature_def_utils.build_signature_def(
                    {"x": info(x)}, {"y": info(y)}, sc.PREDICT_METHOD_NAME
                )
                signature_def_map = {
                    "regress_x_to_y": regression(serialized_tf_example, y),
                    "regress_x_to_y2": regression(serialized_tf_example, y2),
                    "regress_x2_to_y3": regression(x2, y3),
                    "classify_x_to_y": classification(serialized_tf_example, y),
                    sc.DEFAULT_SERVING_SIGNATURE_DEF_KEY: predict,
                }
                sess.run(v1.global_variables_initializer())
                builder = v1.saved_model.Builder(stage)
                builder.add_meta_graph_and_variables(
                    sess,
                    [v1.saved_model.tag_constants.SERVING],
                    signature_def_map=signature_def_map,
                    assets_collection=v1.get_collection(v1.GraphKeys.ASSET_FILEPATHS),
                    main_op=tf.group(assign_filename_op),
                )
                builder.save(as_text)
        finally:
            shutil.rmtree(asset_src, ignore_errors=True)

        if warmup:
            import numpy as np

            recs = [
                encode_predict_log(model_name, {"x": np.asarray(v, dtype=np.float32)})
                for v in warmup_inputs
            ]
            write_warmup_file(stage, recs)
    return _abs(version_dir)


# --------------------------------------------------------------------------
# Keras models (SavedModel via keras.export.ExportArchive)
# --------------------------------------------------------------------------


def _export_keras(model, stage, input_shape, in_name="x", out_name="probs"):
    """Export ``model`` with one endpoint serving_default: in_name -> out_name.

    keras.export.ExportArchive tracks Keras-3 variables so that the TFLite
    converter sees real weights (a hand-made tf.Module leaves VAR_HANDLE ops
    without initial values in the .tflite).
    """
    tf = _tf()
    import keras

    _check_ident(in_name)
    archive = keras.export.ExportArchive()
    archive.track(model)

    # The Python argument name of the endpoint becomes the signature input key.
    ns = {}
    exec(  # noqa: S102 - builds `def serve(<in_name>)` with a fixed, validated name
        f"def serve({in_name}):\n    return {{{out_name!r}: model({in_name}, training=False)}}\n",
        {"model": model},
        ns,
    )
    archive.add_endpoint(
        name="serving_default",
        fn=ns["serve"],
        input_signature=[tf.TensorSpec([None, *input_shape], tf.float32, name=in_name)],
    )
    archive.write_out(stage, verbose=False)


def _check_ident(name):
    import keyword

    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"tensor name must be a Python identifier: {name!r}")


def _keras_mlp(in_dim, hidden, out, in_name="x", out_layer_name=None):
    import keras

    inp = keras.Input(shape=(in_dim,), dtype="float32", name=in_name)
    h = keras.layers.Dense(hidden, activation="relu")(inp)
    h = keras.layers.Dense(hidden, activation="relu")(h)
    o = keras.layers.Dense(out, activation="softmax", name=out_layer_name)(h)
    return keras.Model(inp, o, name="mlp")


def build_keras_mlp(version_dir, in_dim=64, hidden=512, out=10, seed=0, in_name="x", out_name="probs"):
    """Keras MLP in_dim -> hidden -> hidden -> out (relu, relu, softmax).

    SavedModel signature serving_default: ``x`` float32 [None, in_dim] ->
    ``probs`` float32 [None, out].  Weights are random, seeded with ``seed``.
    Returns ``version_dir``.
    """
    import keras

    _check_ident(in_name)
    _check_ident(out_name)
    _tf()
    keras.utils.set_random_seed(seed)
    model = _keras_mlp(in_dim, hidden, out)
    with _staged(version_dir) as stage:
        _export_keras(model, stage, (in_dim,), in_name, out_name)
    return _abs(version_dir)


def build_keras_mlp_tflite(version_dir, in_dim=64, hidden=512, out=10, seed=0, in_name="x", out_name="probs"):
    """TFLite-only servable: ``model.tflite`` converted from :func:`build_keras_mlp`.

    Same weights as ``build_keras_mlp`` with the same arguments; SignatureDef
    serving_default: ``x`` float32 [None, in_dim] -> ``probs`` float32 [None, out].
    Returns ``version_dir``.
    """
    tmp = tempfile.mkdtemp(prefix="modelgen-mlp-")
    try:
        sm = build_keras_mlp(os.path.join(tmp, "1"), in_dim, hidden, out, seed, in_name, out_name)
        with _staged(version_dir) as stage:
            to_tflite(sm, os.path.join(stage, "model.tflite"), ["serving_default"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _abs(version_dir)


def _calibrate_bn(model, sample):
    """Give every BatchNormalization layer moving statistics from ``sample``.

    A randomly initialised network with fresh BN statistics (mean 0, var 1)
    collapses to a constant output.  One forward pass in training mode with
    momentum 0 stores, layer by layer, exactly the batch statistics that
    inference will then use.
    """
    import keras

    bns = [l for l in model.layers if isinstance(l, keras.layers.BatchNormalization)]
    saved = [l.momentum for l in bns]
    try:
        for l in bns:
            l.momentum = 0.0
        model(sample, training=True)
    finally:
        for l, m in zip(bns, saved):
            l.momentum = m


def build_small_cnn(version_dir, size=96, classes=10, seed=0, alpha=0.35, in_name="x", out_name="probs"):
    """MobileNetV2 (random weights, width ``alpha``) at size x size x 3.

    SavedModel signature serving_default: ``x`` float32 [None, size, size, 3]
    -> ``probs`` float32 [None, classes].  BatchNorm statistics are calibrated
    on seeded random data so the output depends on the input.
    Returns ``version_dir``.
    """
    import keras
    import numpy as np

    _check_ident(in_name)
    _check_ident(out_name)
    _tf()
    keras.utils.set_random_seed(seed)
    model = keras.applications.MobileNetV2(
        weights=None, input_shape=(size, size, 3), classes=classes, alpha=alpha, include_top=True
    )
    sample = np.random.default_rng(seed + 123).standard_normal((8, size, size, 3)).astype(np.float32)
    _calibrate_bn(model, sample)
    with _staged(version_dir) as stage:
        _export_keras(model, stage, (size, size, 3), in_name, out_name)
    return _abs(version_dir)


def _mini_mobilenet(size, classes, in_name):
    """A MobileNetV2-style CNN with 3 inverted-residual blocks (~20 layers).

    Same kinds of ops as MobileNetV2 (Conv2D, DepthwiseConv2D, BatchNorm,
    ReLU6, residual Add, global average pooling, Dense softmax) at a fraction
    of the graph size, so export and TFLite conversion take seconds.
    """
    import keras
    from keras import layers as L

    def bn_relu6(h):
        return L.ReLU(6.0)(L.BatchNormalization()(h))

    def block(h, expand, out, stride):
        c = h.shape[-1]
        y = bn_relu6(L.Conv2D(c * expand, 1, use_bias=False)(h))
        y = bn_relu6(L.DepthwiseConv2D(3, strides=stride, padding="same", use_bias=False)(y))
        y = L.BatchNormalization()(L.Conv2D(out, 1, use_bias=False)(y))
        return L.Add()([h, y]) if stride == 1 and c == out else y

    inp = keras.Input(shape=(size, size, 3), dtype="float32", name=in_name)
    h = bn_relu6(L.Conv2D(16, 3, strides=2, padding="same", use_bias=False)(inp))
    h = block(h, 1, 16, 1)
    h = block(h, 4, 24, 2)
    h = block(h, 4, 24, 1)
    h = bn_relu6(L.Conv2D(64, 1, use_bias=False)(h))
    h = L.GlobalAveragePooling2D()(h)
    out = L.Dense(classes, activation="softmax")(h)
    return keras.Model(inp, out, name="mini_mobilenet")


def build_tiny_cnn(version_dir, size=32, classes=10, seed=0, arch="mini", in_name="x", out_name="probs"):
    """A small, fast CNN at size x size x 3 (default 32).

    ``arch="mini"`` (default): a MobileNetV2-style net of 3 inverted-residual
    blocks (builds and exports in a few seconds; the full MobileNetV2 graph
    costs ~15 s to export whatever the input size).
    ``arch="mobilenetv2"``: :func:`build_small_cnn` (MobileNetV2, alpha 0.35)
    at this size.
    SavedModel signature serving_default: ``x`` float32 [None, size, size, 3]
    -> ``probs`` float32 [None, classes].  Returns ``version_dir``.
    """
    if arch == "mobilenetv2":
        return build_small_cnn(version_dir, size=size, classes=classes, seed=seed, alpha=0.35,
                               in_name=in_name, out_name=out_name)
    if arch != "mini":
        raise ValueError(f"unknown arch {arch!r}: 'mini' or 'mobilenetv2'")
    import keras
    import numpy as np

    _check_ident(in_name)
    _check_ident(out_name)
    _tf()
    keras.utils.set_random_seed(seed)
    model = _mini_mobilenet(size, classes, in_name)
    sample = np.random.default_rng(seed + 123).standard_normal((8, size, size, 3)).astype(np.float32)
    _calibrate_bn(model, sample)
    with _staged(version_dir) as stage:
        _export_keras(model, stage, (size, size, 3), in_name, out_name)
    return _abs(version_dir)


# --------------------------------------------------------------------------
# string model
# --------------------------------------------------------------------------


def build_string_model(version_dir):
    """SavedModel with a DT_STRING input (base64 / ``*_bytes`` tests).

    serving_default: ``text`` string [None] -> ``len`` int64 [None] (length in
    bytes), ``echo_bytes`` string [None] (the input unchanged).
    Returns ``version_dir``.
    """
    tf = _tf()

    class StringModel(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
        def serve(self, text):
            return {
                "len": tf.cast(tf.strings.length(text, unit="BYTE"), tf.int64),
                "echo_bytes": tf.identity(text),
            }

    m = StringModel()
    with _staged(version_dir) as stage:
        tf.saved_model.save(m, stage, signatures={"serving_default": m.serve.get_concrete_function()})
    return _abs(version_dir)


# --------------------------------------------------------------------------
# TFLite
# --------------------------------------------------------------------------


def _tflite_float32_converter(conv):
    tf = _tf()
    conv.optimizations = []
    conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    return conv


def saved_model_signature_keys(saved_model_dir, tag="serve"):
    """Signature keys of the MetaGraph tagged ``tag`` (read from saved_model.pb,
    without loading the model); internal keys such as __saved_model_init_op
    are left out."""
    _tf()
    from tensorflow.core.protobuf import saved_model_pb2

    sm = saved_model_pb2.SavedModel()
    with open(os.path.join(os.fspath(saved_model_dir), "saved_model.pb"), "rb") as f:
        sm.ParseFromString(f.read())
    for mg in sm.meta_graphs:
        if tag in mg.meta_info_def.tags:
            return sorted(k for k in mg.signature_def if not k.startswith("__"))
    raise ValueError(f"no MetaGraph tagged {tag!r} in {saved_model_dir}")


def to_tflite(saved_model_dir, tflite_path, signature_keys=None):
    """Convert a SavedModel to a float32 ``.tflite`` file, keeping its SignatureDefs.

    ``signature_keys``: which signatures to convert (default: serving_default
    if present, else all).  Returns ``tflite_path``.
    """
    tf = _tf()
    saved_model_dir = os.fspath(saved_model_dir)
    if signature_keys is None:
        keys = saved_model_signature_keys(saved_model_dir)
        signature_keys = ["serving_default"] if "serving_default" in keys else keys
    conv = tf.lite.TFLiteConverter.from_saved_model(saved_model_dir, signature_keys=list(signature_keys))
    data = _tflite_float32_converter(conv).convert()
    tmp = os.fspath(tflite_path) + ".tmp"
    _write_bytes(tmp, data)
    os.replace(tmp, tflite_path)
    return _abs(tflite_path)


def build_multisig_tflite(version_dir):
    """``model.tflite`` with two SignatureDefs.

    ``add``: a, b float32 [None, 4] -> ``sum`` = a + b
    ``mul``: a, b float32 [None, 4] -> ``product`` = a * b
    Returns ``version_dir``.
    """
    tf = _tf()
    class TwoSigs(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="a"),
                                      tf.TensorSpec([None, 4], tf.float32, name="b")])
        def add(self, a, b):
            return {"sum": tf.add(a, b)}

        @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="a"),
                                      tf.TensorSpec([None, 4], tf.float32, name="b")])
        def mul(self, a, b):
            return {"product": tf.multiply(a, b)}

    m = TwoSigs()
    conv = tf.lite.TFLiteConverter.from_concrete_functions(
        [m.add.get_concrete_function(), m.mul.get_concrete_function()], m
    )
    data = _tflite_float32_converter(conv).convert()
    _require_signatures(data, {"add", "mul"})
    with _staged(version_dir) as stage:
        _write_bytes(os.path.join(stage, "model.tflite"), data)
    return _abs(version_dir)


def _tflite_signature_list(data):
    from ai_edge_litert.interpreter import Interpreter

    return Interpreter(model_content=bytes(data)).get_signature_list()


def _require_signatures(data, keys):
    got = set(_tflite_signature_list(data))
    if got != set(keys):
        raise RuntimeError(f"TFLite converter produced signatures {sorted(got)}, wanted {sorted(keys)}")


def _strip_tflite_signatures(data):
    """Remove every SignatureDef from a .tflite flatbuffer."""
    from tensorflow.lite.tools import flatbuffer_utils

    model = flatbuffer_utils.convert_bytearray_to_object(bytearray(data))
    if not model.signatureDefs:
        return bytes(data)
    model.signatureDefs = []
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model))


def build_nosig_tflite(version_dir):
    """``model.tflite`` without SignatureDefs: tensor ``x`` float32 [1, 1] -> ``y`` = 2x + 1.

    Built like TF Serving's ``saved_model_half_plus_two_tflite`` testdata (TF1
    graph, ``TFLiteConverter.from_session``); any SignatureDef is stripped from
    the flatbuffer so ``get_signature_list()`` is empty.  Returns ``version_dir``.
    """
    tf = _tf()
    v1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default(), v1.Session(graph=g) as sess:
        x = v1.placeholder(tf.float32, [1, 1], name="x")
        y = tf.identity(tf.add(tf.multiply(x, 2.0), 1.0), name="y")
        conv = v1.lite.TFLiteConverter.from_session(sess, [x], [y])
        data = conv.convert()
    data = _strip_tflite_signatures(data)
    if _tflite_signature_list(data):
        raise RuntimeError("could not strip SignatureDefs from the TFLite model")
    with _staged(version_dir) as stage:
        _write_bytes(os.path.join(stage, "model.tflite"), data)
    return _abs(version_dir)


# --------------------------------------------------------------------------
# benchmark models (peer-bench make_models.py)
# --------------------------------------------------------------------------

BENCH_SPECS = {"mlp": (64,), "cnn": (96, 96, 3)}


def _bench_mlp():
    # make_models.py build_mlp(): input "input" (64) -> 512 relu -> 512 relu -> 10 softmax "output"
    return _keras_mlp(64, 512, 10, in_name="input", out_layer_name="output")


def _bench_cnn():
    # make_models.py build_cnn(): MobileNetV2 alpha=1.0 at 96x96x3, 10 classes,
    # BN moving stats calibrated layer by layer on rng(123) data (16 images).
    import keras
    import numpy as np

    m = keras.applications.MobileNetV2(weights=None, input_shape=(96, 96, 3), classes=10, include_top=True)
    x = np.random.default_rng(123).standard_normal((16, 96, 96, 3)).astype(np.float32)
    for layer in m.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            pre = keras.Model(m.input, layer.input)(x, training=False).numpy()
            axes = tuple(range(pre.ndim - 1))
            layer.moving_mean.assign(pre.mean(axis=axes))
            layer.moving_variance.assign(pre.var(axis=axes) + 1e-3)
    return m


def build_bench_models(out_dir, seed=0, names=("mlp", "cnn")):
    """Benchmark models of /work/shared/peer-bench/make_models.py.

    Writes ``out_dir/mlp/1`` and ``out_dir/cnn/1``, each holding the SavedModel
    (saved_model.pb + variables/) AND ``model.tflite`` (float32, converted
    from that SavedModel).  Signature serving_default: ``input`` float32
    [None, 64] / [None, 96, 96, 3] -> ``output`` float32 [None, 10].
    Same seeding as make_models.py (``keras.utils.set_random_seed(seed)``
    once, then mlp, then cnn), so the weights match its output.
    Also writes ``out_dir/models.json``.  Returns that dict.
    """
    import keras

    tf = _tf()
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    keras.utils.set_random_seed(seed)
    info = {"tensorflow": tf.__version__, "keras": keras.__version__, "seed": seed, "models": {}}
    builders = {"mlp": _bench_mlp, "cnn": _bench_cnn}
    for name in ("mlp", "cnn"):  # fixed order: the RNG stream is shared
        if name not in names and name == "cnn":
            break
        model = builders[name]()
        if name not in names:
            continue
        shape = BENCH_SPECS[name]
        vdir = os.path.join(out_dir, name, "1")
        with _staged(vdir) as stage:
            _export_keras(model, stage, shape, "input", "output")
            to_tflite(stage, os.path.join(stage, "model.tflite"), ["serving_default"])
        info["models"][name] = {
            "version_dir": f"{name}/1",
            "input": {"name": "input", "shape": [None, *shape], "dtype": "float32"},
            "output": {"name": "output", "shape": [None, 10], "dtype": "float32"},
            "params": int(model.count_params()),
        }
    with open(os.path.join(out_dir, "models.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


# --------------------------------------------------------------------------
# in-process references
# --------------------------------------------------------------------------

_LOADED = {}


def _load_saved_model(version_dir):
    tf = _tf()
    path = os.path.abspath(os.fspath(version_dir))
    pb = os.path.join(path, "saved_model.pb")
    if not os.path.exists(pb):
        pb = os.path.join(path, "saved_model.pbtxt")
    key = (path, os.stat(pb).st_mtime_ns)
    if key not in _LOADED:
        _LOADED[key] = tf.saved_model.load(path)
    return _LOADED[key]


def reference_predict(version_dir, inputs_dict, signature="serving_default"):
    """Run ``signature`` of the SavedModel in ``version_dir`` in-process.

    Loads with ``tf.saved_model.load`` (cached per path and saved_model.pb
    mtime), casts each input to the signature's dtype and returns
    ``{output_name: numpy array}``.
    """
    tf = _tf()
    loaded = _load_saved_model(version_dir)
    fn = loaded.signatures[signature]
    specs = fn.structured_input_signature[1]
    feeds = {}
    for k, v in inputs_dict.items():
        if k not in specs:
            raise KeyError(f"signature {signature!r} has no input {k!r}; inputs: {sorted(specs)}")
        feeds[k] = tf.constant(v, dtype=specs[k].dtype)
    out = fn(**feeds)
    return {k: v.numpy() for k, v in out.items()}


def reference_predict_tflite(tflite_path, inputs_dict, signature=None):
    """Run a ``.tflite`` model in-process with ai_edge_litert.

    With SignatureDefs: ``signature`` (default: the only one, or
    serving_default) via the signature runner.  Without: inputs are matched
    by tensor name, outputs are returned by tensor name.
    """
    import numpy as np
    from ai_edge_litert.interpreter import Interpreter

    it = Interpreter(model_path=os.fspath(tflite_path))
    sigs = it.get_signature_list()
    if sigs:
        if signature is None:
            signature = "serving_default" if "serving_default" in sigs or len(sigs) != 1 else next(iter(sigs))
        runner = it.get_signature_runner(signature)
        dts = {k: d["dtype"] for k, d in runner.get_input_details().items()}
        out = runner(**{k: np.asarray(v, dtype=dts[k]) for k, v in inputs_dict.items()})
        return {k: np.array(v) for k, v in out.items()}
    ins = {d["name"]: d for d in it.get_input_details()}
    for k, v in inputs_dict.items():
        arr = np.asarray(v)
        if tuple(arr.shape) != tuple(ins[k]["shape"]):
            it.resize_tensor_input(ins[k]["index"], list(arr.shape))
    it.allocate_tensors()
    for k, v in inputs_dict.items():
        it.set_tensor(ins[k]["index"], np.asarray(v, dtype=ins[k]["dtype"]))
    it.invoke()
    return {d["name"]: np.array(it.get_tensor(d["index"])) for d in it.get_output_details()}


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------

BUILDERS = {
    "half_plus_two": lambda d: build_half_plus_two(d, warmup=True),
    "keras_mlp": build_keras_mlp,
    "keras_mlp_tflite": build_keras_mlp_tflite,
    "small_cnn": build_small_cnn,
    "tiny_cnn": build_tiny_cnn,
    "string_model": build_string_model,
    "multisig_tflite": build_multisig_tflite,
    "nosig_tflite": build_nosig_tflite,
}


def build_all(out_dir, names=None, bench=False, log=None):
    """Build ``names`` (default: all of BUILDERS) into ``out_dir/<name>/1``.

    With ``bench=True`` also the benchmark models (``out_dir/mlp/1``,
    ``out_dir/cnn/1``).  Returns {name: wall seconds}; ``log`` (a callable)
    also gets the process CPU seconds of each step.
    """
    out_dir = os.fspath(out_dir)
    steps = [(n, lambda n=n: BUILDERS[n](os.path.join(out_dir, n, "1"))) for n in (names or list(BUILDERS))]
    if bench:
        steps.append(("bench", lambda: build_bench_models(out_dir)))
    times = {}
    for name, fn in steps:
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        times[name] = time.perf_counter() - t0
        if log:
            log(f"{name}: {times[name]:.1f}s wall, {time.process_time() - c0:.1f}s cpu")
    return times


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m tests.support.modelgen",
        description="Build test/benchmark models into OUTDIR/<name>/1. "
        f"Names: {', '.join(BUILDERS)}; 'all' = every one of them; 'bench' = OUTDIR/mlp/1 + OUTDIR/cnn/1.",
    )
    ap.add_argument("what", help="'all', 'bench' or a comma-separated list of names")
    ap.add_argument("out_dir")
    ap.add_argument("--bench", action="store_true", help="with 'all': also build the benchmark models")
    ap.add_argument("--seed", type=int, default=0, help="seed of the benchmark models")
    a = ap.parse_args(argv)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    t0, c0 = time.perf_counter(), time.process_time()
    if a.what == "bench":
        build_bench_models(a.out_dir, seed=a.seed)
    else:
        names = None if a.what == "all" else [n.strip() for n in a.what.split(",") if n.strip()]
        unknown = [n for n in names or [] if n not in BUILDERS]
        if unknown:
            ap.error(f"unknown model(s) {unknown}; choose from {list(BUILDERS)}")
        build_all(a.out_dir, names, bench=a.bench and a.what == "all", log=log)
    log(f"total: {time.perf_counter() - t0:.1f}s wall, {time.process_time() - c0:.1f}s cpu"
        f" (TensorFlow import included) -> {os.path.abspath(a.out_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
