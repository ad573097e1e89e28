"""Build the bundled sample model: appliance/sample_models/half_plus_two/1.

TF Serving's half_plus_two (y = 0.5x + 2) as a TF1 SavedModel with every signature TF
Serving's test model has (predict, classify, regress), plus a LiteRT conversion of all of
them, so the embedded default serves all five on a LiteRT-only device too and, where both
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


SIGNATURES = ["serving_default", "classify_x_to_y", "regress_x_to_y", "regress_x_to_y2", "regress_x2_to_y3"]


def tflite_half_plus_two(saved_model: str, path: str) -> None:
    """Every signature of the SavedModel at ``saved_model`` as a LiteRT model at ``path``.

    ``allow_custom_ops`` keeps the classify/regress signatures' ParseExample as a custom op,
    as TF Serving's TFLite session runs it; LiteRT's Python interpreter has none, so
    runtimes/tflite_split.py parses the tf.Examples and runs the rest on LiteRT: a LiteRT-only
    device serves all five signatures of the sample."""
    import tensorflow as tf

    converter = tf.lite.TFLiteConverter.from_saved_model(saved_model, signature_keys=SIGNATURES, tags={"serve"})
    converter.allow_custom_ops = True
    with open(path, "wb") as f:
        f.write(converter.convert())


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Rebuild the bundled sample model (module docstring): "
                                                 "replaces the checkout's appliance/sample_models/half_plus_two/1 "
                                                 "unless --out names another folder.")
    parser.add_argument("--out", default=TARGET, help="the version folder to (re)build (default: %(default)s)")
    parser.add_argument("--tflite-only", action="store_true",
                        help="convert the folder's SavedModel again, keeping its other files as they are")
    args = parser.parse_args(argv)
    target = args.out
    if not args.tflite_only:
        shutil.rmtree(target, ignore_errors=True)
        modelgen.build_half_plus_two(target, warmup=True)
    tflite_half_plus_two(target, os.path.join(target, "model.tflite"))
    for root, _, files in os.walk(target):
        for name in files:
            print(os.path.join(root, name), os.path.getsize(os.path.join(root, name)))


if __name__ == "__main__":
    main()
