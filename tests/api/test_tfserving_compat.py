"""Models exactly as TF Serving's own tests build them, served over HTTP.

TF Serving's half_plus_two feeds ``x``, an Identity of the parsed examples with static
shape [?, 1]; TF Serving's C++ session accepts ``{"instances": [1.0, 2.0, 5.0]}`` (shape
[3]) for it. A Python ``Session.run`` would refuse that shape, so this pins down that the
service feeds tensors the way TF Serving does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def build_original_half_plus_two(version_dir: Path) -> None:
    import tensorflow as tf

    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        serialized = v1.placeholder(tf.string, name="tf_example", shape=[None])
        parsed = v1.io.parse_example(serialized, {"x": v1.io.FixedLenFeature([1], tf.float32)})
        x = tf.identity(parsed["x"], name="x")
        a, b = v1.Variable(0.5, name="a"), v1.Variable(2.0, name="b")
        y = tf.identity(a * x + b, name="y")
        with v1.Session() as session:
            session.run(v1.global_variables_initializer())
            builder = v1.saved_model.Builder(str(version_dir))
            builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map={
                "serving_default": v1.saved_model.predict_signature_def({"x": x}, {"y": y}),
                "regress_x_to_y": v1.saved_model.regression_signature_def(serialized, y),
            })
            builder.save()


@pytest.fixture(scope="module")
def server(module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    base = tmp_path_factory.mktemp("tfs") / "half_plus_two"
    build_original_half_plus_two(base / "123")
    return module_server("--models", str(base), "--model-name", "half_plus_two", "--backend", "tf-cpu")


def test_identity_input_takes_any_shape_as_in_tf_serving(server: Any) -> None:
    r = server.post("/v1/models/half_plus_two:predict", {"instances": [1.0, 2.0, 5.0]})
    assert r.status_code == 200, r.text
    assert r.json() == {"predictions": [2.5, 3.0, 4.5]}
    r = server.post("/v1/models/half_plus_two/versions/123:predict", {"instances": [[1.0], [2.0]]})
    assert r.json() == {"predictions": [[2.5], [3.0]]}


def test_metadata_shows_the_static_shape(server: Any) -> None:
    meta = server.get("/v1/models/half_plus_two/metadata").json()
    x = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]["inputs"]["x"]
    assert x == {"dtype": "DT_FLOAT", "name": "x:0", "tensor_shape": {
        "dim": [{"size": "-1", "name": ""}, {"size": "1", "name": ""}], "unknown_rank": False}}
    assert meta["model_spec"] == {"name": "half_plus_two", "signature_name": "", "version": "123"}


def test_regress_on_the_original_graph(server: Any) -> None:
    r = server.post("/v1/models/half_plus_two:regress", {"signature_name": "regress_x_to_y", "examples": [{"x": 80.0}]})
    assert r.json() == {"results": [42.0]}
