"""The models Triton's client examples name, rebuilt as TensorFlow SavedModels.

Triton's examples (tests/peers/triton/examples/) hard-code their model names and tensors
(qa/L0_*'s "simple" family of the Triton repository): to run them unchanged, a repository
with the same names, tensors and arithmetic is served.

* ``simple``: INPUT0, INPUT1 INT32 [-1, 16] -> OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1;
* ``simple_int8``: the same on INT8;
* ``simple_string``: the same on BYTES holding decimal integers (answers as decimal strings);
* ``simple_identity``: INPUT0 BYTES [-1, -1] -> OUTPUT0 (the same bytes);
* ``image_cls``: a tiny classifier, INPUT FP32 [-1, 32, 32, 3] (NHWC) -> OUTPUT FP32 [-1, 10],
  with ``labels.txt`` (one label per line, Triton's label file) for the classification extension;
* ``densenet_onnx``: grpc_client.py's model under its name: data_0 FP32 [3, 224, 224] (no batch
  dimension) -> fc6_1 FP32 [1000, 1, 1].

``build(folder)`` writes ``<folder>/<name>/1`` for each; ``built_once`` caches them.
"""

from __future__ import annotations

import os
from pathlib import Path

LABELS = [f"label_{i}" for i in range(10)]
NAMES = ("simple", "simple_int8", "simple_string", "simple_identity", "image_cls", "densenet_onnx")


def _save(tf, module, fn, folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tf.saved_model.save(module, str(folder), signatures={"serving_default": fn.get_concrete_function()})


def _sum_diff(tf, dtype):
    class SumDiff(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 16], dtype, name="INPUT0"),
                                      tf.TensorSpec([None, 16], dtype, name="INPUT1")])
        def serve(self, INPUT0, INPUT1):  # noqa: N803 (Triton's tensor names)
            return {"OUTPUT0": INPUT0 + INPUT1, "OUTPUT1": INPUT0 - INPUT1}
    return SumDiff()


def _string_sum_diff(tf):
    class StringSumDiff(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.string, name="INPUT0"),
                                      tf.TensorSpec([None, 16], tf.string, name="INPUT1")])
        def serve(self, INPUT0, INPUT1):  # noqa: N803
            a = tf.strings.to_number(INPUT0, tf.int32)
            b = tf.strings.to_number(INPUT1, tf.int32)
            return {"OUTPUT0": tf.strings.as_string(a + b), "OUTPUT1": tf.strings.as_string(a - b)}
    return StringSumDiff()


def _identity(tf):
    class Identity(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.string, name="INPUT0")])
        def serve(self, INPUT0):  # noqa: N803
            return {"OUTPUT0": tf.identity(INPUT0)}
    return Identity()


def _classifier(tf):
    weights = tf.constant(
        [[(i * 7 + j * 3) % 11 / 10.0 - 0.5 for i in range(10)] for j in range(3)], tf.float32)

    class Classifier(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 32, 32, 3], tf.float32, name="INPUT")])
        def serve(self, INPUT):  # noqa: N803
            pooled = tf.reduce_mean(INPUT, axis=[1, 2])  # [N, 3]
            return {"OUTPUT": tf.nn.softmax(tf.matmul(pooled, weights) * 4.0)}
    return Classifier()


def _densenet_like(tf):
    class Dense(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([3, 224, 224], tf.float32, name="data_0")])
        def serve(self, data_0):
            pooled = tf.reduce_mean(data_0, axis=[1, 2])  # [3]
            scores = tf.tile(pooled, [334])[:1000]
            return {"fc6_1": tf.reshape(scores, [1000, 1, 1])}
    return Dense()


def build(folder: Path) -> None:
    import tensorflow as tf

    folder = Path(folder)
    for name, module in (("simple", _sum_diff(tf, tf.int32)), ("simple_int8", _sum_diff(tf, tf.int8)),
                         ("simple_string", _string_sum_diff(tf)), ("simple_identity", _identity(tf)),
                         ("image_cls", _classifier(tf)), ("densenet_onnx", _densenet_like(tf))):
        _save(tf, module, module.serve, folder / name / "1")
    (folder / "image_cls" / "1" / "labels.txt").write_text("".join(f"{label}\n" for label in LABELS))


def digest() -> str:
    import hashlib

    return "triton-" + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def triton_models() -> Path:
    """The repository, built once per content of this file (tests/support/cache.py)."""
    from tests.support.cache import built_once

    return built_once(digest(), build)


__all__ = ["LABELS", "NAMES", "build", "triton_models"]

if __name__ == "__main__":  # python -m tests.support.triton_models DIR
    import sys

    build(Path(sys.argv[1] if len(sys.argv) > 1 else os.getcwd()))
