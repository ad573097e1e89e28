"""The models Triton's qa tests name, rebuilt as TensorFlow SavedModels.

Triton's qa files (tests/peers/triton/qa/) hard-code the models of Triton's qa repositories
(``qa/common/gen_qa_identity_models.py``: the "zero" identity models; ``simple_identity`` of
qa/L0_http). To run the files unchanged, a repository with the same names and tensors is
served; every model is an identity, as Triton's are:

* ``onnx_zero_1_float32``: INPUT0 FP32 [-1, -1] (batch, then Triton's dims [-1]) -> OUTPUT0;
* ``onnx_zero_1_float16``: INPUT0 FP16 [-1, -1, -1] (Triton's dims [-1, -1]) -> OUTPUT0;
* ``onnx_zero_3_float32``: INPUT0..2 FP32 [-1, -1] -> OUTPUT0..2;
* ``onnx_zero_1_object``: INPUT0 BYTES [-1, -1] -> OUTPUT0;
* ``onnx_zero_1_object_1_element``: INPUT0 BYTES [-1, 1] -> OUTPUT0 (Triton's dims [1]);
* ``simple_identity``: INPUT0 BYTES [-1, -1]; ``simple_identity_int64``: the same on INT64;
* ``string_identity``: INPUT0 BYTES [-1] -> OUTPUT0 (no batch dimension);
* ``simple``: INPUT0, INPUT1 INT32 [-1, 16] -> OUTPUT0 = sum, OUTPUT1 = difference.

``qa_models()`` builds them once per content of this file (tests/support/cache.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def _identity(tf, dtype, shape: list[int | None], count: int = 1):
    specs = [tf.TensorSpec(shape, dtype, name=f"INPUT{i}") for i in range(count)]

    class Identity(tf.Module):
        @tf.function(input_signature=specs)
        def serve(self, *inputs):
            return {f"OUTPUT{i}": tf.identity(x) for i, x in enumerate(inputs)}
    return Identity()


def _sum_diff(tf):
    class SumDiff(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.int32, name="INPUT0"),
                                      tf.TensorSpec([None, 16], tf.int32, name="INPUT1")])
        def serve(self, INPUT0, INPUT1):  # noqa: N803 (Triton's tensor names)
            return {"OUTPUT0": INPUT0 + INPUT1, "OUTPUT1": INPUT0 - INPUT1}
    return SumDiff()


def build(folder: Path) -> None:
    import tensorflow as tf

    folder = Path(folder)
    models = {
        "onnx_zero_1_float32": _identity(tf, tf.float32, [None, None]),
        "onnx_zero_1_float16": _identity(tf, tf.float16, [None, None, None]),
        "onnx_zero_3_float32": _identity(tf, tf.float32, [None, None], 3),
        "onnx_zero_1_object": _identity(tf, tf.string, [None, None]),
        "onnx_zero_1_object_1_element": _identity(tf, tf.string, [None, 1]),
        "simple_identity": _identity(tf, tf.string, [None, None]),
        "simple_identity_int64": _identity(tf, tf.int64, [None, None]),
        "string_identity": _identity(tf, tf.string, [None]),
        "simple": _sum_diff(tf),
    }
    for name, module in models.items():
        target = folder / name / "1"
        target.parent.mkdir(parents=True, exist_ok=True)
        tf.saved_model.save(module, str(target), signatures={"serving_default": module.serve.get_concrete_function()})


def digest() -> str:
    import hashlib

    return "triton-qa-" + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def qa_models() -> Path:
    from tests.support.cache import built_once

    return built_once(digest(), build)


__all__ = ["build", "qa_models"]

if __name__ == "__main__":  # python -m tests.support.triton_qa_models DIR
    import sys

    build(Path(sys.argv[1] if len(sys.argv) > 1 else os.getcwd()))
