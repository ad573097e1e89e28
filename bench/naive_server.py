"""The naive baseline: Flask + TensorFlow, one request = one model call, on waitress.

What a team writes in an afternoon; the figure every server should beat.

    python bench/naive_server.py MODEL_BASE PORT     # serves MODEL_BASE/<model>/1 at /v1/models/<model>:predict
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):  # before the heavy imports
    print(__doc__)
    raise SystemExit(0)


import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import waitress  # noqa: E402
from flask import Flask, request  # noqa: E402


def build(base: str) -> Flask:
    app = Flask("naive")
    models = {}
    for name in os.listdir(base):
        if not os.path.isfile(os.path.join(base, name, "1", "saved_model.pb")):
            continue
        loaded = tf.saved_model.load(os.path.join(base, name, "1"))
        models[name] = loaded.signatures["serving_default"]

    @app.post("/v1/models/<name>:predict")
    def predict(name: str):  # type: ignore[no-untyped-def]
        fn = models[name]
        (arg,) = fn.structured_input_signature[1]
        x = np.asarray(json.loads(request.get_data())["instances"], dtype=np.float32)
        out = next(iter(fn(**{arg: tf.constant(x)}).values())).numpy()
        return json.dumps({"predictions": out.tolist()}), 200, {"Content-Type": "application/json"}

    return app


if __name__ == "__main__":
    waitress.serve(build(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), threads=8, _quiet=True)
