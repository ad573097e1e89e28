"""Build the bundled sample model: appliance/sample_models/half_plus_two/1.

TF Serving's half_plus_two (y = 0.5x + 2) as a TF1 SavedModel with every signature TF
Serving's test model has (predict, classify, regress), plus a LiteRT conversion of its
predict path, so the embedded default serves on a LiteRT-only device too and, where both
backends are installed, shows the measured backend choice. Run from the repo root:

    .venv/bin/python scripts/make_sample_model.py
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.support.modelgen

from tests.support import modelgen  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "appliance", "sample_models", "half_plus_two", "1")  # this checkout's, wherever it runs


def tflite_half_plus_two(path: str) -> None:
    import tensorflow as tf

    class HalfPlusTwo(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def serve(self, x):
            return {"y": 0.5 * x + 2.0}

    module = HalfPlusTwo()
    fn = module.serve.get_concrete_function()
    converter = tf.lite.TFLiteConverter.from_concrete_functions([fn], module)
    with open(path, "wb") as f:
        f.write(converter.convert())


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Rebuild the bundled sample model (module docstring): "
                                                 "replaces the checkout's appliance/sample_models/half_plus_two/1 "
                                                 "unless --out names another folder.")
    parser.add_argument("--out", default=TARGET, help="the version folder to (re)build (default: %(default)s)")
    target = parser.parse_args(argv).out
    shutil.rmtree(target, ignore_errors=True)
    modelgen.build_half_plus_two(target, warmup=True)
    tflite_half_plus_two(os.path.join(target, "model.tflite"))
    for root, _, files in os.walk(target):
        for name in files:
            print(os.path.join(root, name), os.path.getsize(os.path.join(root, name)))


if __name__ == "__main__":
    main()
