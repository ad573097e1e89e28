"""TF Serving's REST API document (g3doc/api_rest.md, vendored under tests/peers/tfserving/),
run against ``appliance tfs`` as a TF Serving user would run it, and its gRPC APIs on the same
models with tensorflow-serving-api's stubs.

The server starts as the document's Docker line starts ``tensorflow_model_server``
(``MODEL_NAME=saved_model_half_plus_three``, TF Serving's own test model from
tests/data/tfserving/), through a models.config that adds the models the test builds for the
document's other request bodies. The document's requests:

1. ``curl .../v1/models/saved_model_half_plus_three`` (status; the document's answer)
2. ``curl -d '{"instances": [1.0,2.0,5.0]}' ...:predict`` (the document's answer)
3. ``curl -d '{"signature_name": "tensorflow/serving/regress", ...}' ...:regress`` (the
   document's answer, {"results": [3.5, 4.0]}: the SignatureDef declares ``tf_example:0`` as
   DT_FLOAT, the graph's placeholder is a string; TF Serving feeds by the tensor)
4. ``curl -i ... /v1/models/half:predict`` (404 and the document's error body)
5. ``{"instances": [ "foo", "bar", "baz" ]}`` (row format, 3 scalar strings)
6. ``{"instances": [ [[1, 2]], [[3, 4]] ]}`` (row format, 2 tensors of [1, 2])
7. the row format with tag/signal/sensor: as printed it is not JSON (``[3, 4, 1, 2, 5]],``),
   so 400 as on TF Serving; with that bracket taken out, the three tensors of two instances
8. the columnar format with tag/signal/sensor
9. the classify request with binary ``image`` and ``caption`` features
10. the JSON conformance example: as printed (``Nan``, key ``example``) refused as TF Serving's
    parser refuses it; with ``NaN`` and ``examples``, non-finite values in and out

Also: the status, metadata and predict URL forms with ``/versions/${VERSION}``. The document
gives no answers for 5-10: the test asserts what the models compute.
"""

from __future__ import annotations

import base64
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

grpc = pytest.importorskip("grpc")
pytest.importorskip("tensorflow_serving.apis.prediction_service_pb2_grpc")
from tensorflow_serving.apis import (  # noqa: E402
    classification_pb2, get_model_metadata_pb2, get_model_status_pb2, inference_pb2, model_service_pb2_grpc,
    predict_pb2, prediction_service_pb2_grpc, regression_pb2)

from tests.support.servers import ROOT, Server, free_port, spawn  # noqa: E402

DOC = ROOT / "tests" / "peers" / "tfserving" / "api_rest.md"
DATA = ROOT / "tests" / "data" / "tfserving"
HALF_PLUS_THREE = "saved_model_half_plus_three"
RPC_TIMEOUT = 30.0
# Five TensorFlow models, each tried in a child before it serves (tens of seconds apiece on a
# loaded 2-core box), and the ports open only once all are AVAILABLE: the module's first test
# carries that start-up, so its timeout is above the start-up's own wait.
START_S = 840
pytestmark = pytest.mark.timeout(900)  # START_S + 60, written out: tests/test_timeouts.py reads literals

# The document's bodies without a TF Serving test model, served by models built here: one model
# per default signature the bodies need (they name no signature, but for classify_objects).
DOC_MODELS = r'''
import sys
import tensorflow as tf
v1 = tf.compat.v1
root = sys.argv[1]
sd = v1.saved_model.signature_def_utils
info = v1.saved_model.utils.build_tensor_info

def save(name, build):
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        signatures = build()
        builder = v1.saved_model.Builder(f"{root}/{name}/1")
        builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map=signatures)
        builder.save()

def predict(**tensors):
    ins = {k: info(v) for k, v in tensors.items()}
    outs = {k: info(tf.identity(v, name=k + "_out")) for k, v in tensors.items()}
    return sd.build_signature_def(ins, outs, "tensorflow/serving/predict")

def strings():
    return {"serving_default": predict(s=v1.placeholder(tf.string, [None], name="s"))}

def pairs():
    return {"serving_default": predict(p=v1.placeholder(tf.float32, [None, 1, 2], name="p"))}

def tag_signal_sensor():
    serialized = v1.placeholder(tf.string, [None], name="tf_example")
    parsed = v1.io.parse_example(serialized, {"image": v1.io.FixedLenFeature([], tf.string),
                                              "caption": v1.io.FixedLenFeature([], tf.string)})
    classes = tf.reshape(parsed["caption"], [-1, 1])
    scores = tf.reshape(tf.cast(tf.strings.length(parsed["image"]), tf.float32), [-1, 1])
    return {"serving_default": predict(tag=v1.placeholder(tf.string, [None], name="tag"),
                                       signal=v1.placeholder(tf.int32, [None, 5], name="signal"),
                                       sensor=v1.placeholder(tf.float32, [None, 2, 2], name="sensor")),
            "classify_objects": sd.classification_signature_def(serialized, classes, scores)}

def readings():
    serialized = v1.placeholder(tf.string, [None], name="tf_example")
    parsed = v1.io.parse_example(serialized, {"sensor_readings": v1.io.FixedLenFeature([4], tf.float32)})
    return {"serving_default": sd.regression_signature_def(serialized, parsed["sensor_readings"][:, 3:4])}

for name, build in (("doc_strings", strings), ("doc_pairs", pairs), ("doc_tag_signal_sensor", tag_signal_sensor),
                    ("doc_sensor_readings", readings)):
    save(name, build)
'''


def doc_text() -> str:
    return DOC.read_text()


def code_blocks(*langs: str) -> list[str]:
    """The fenced blocks whose info string is one of ``langs`` ("" for none), in order."""
    blocks, lang, lines = [], None, []
    for line in doc_text().splitlines():
        if not line.startswith("```"):
            lines.append(line)
        elif lang is None:
            lang, lines = line[3:].strip(), []
        else:
            if lang in langs:
                blocks.append("\n".join(lines) + "\n")
            lang = None
    return blocks


def curl_examples() -> list[tuple[list[str], str]]:
    """The document's curl calls: (argv after ``$ ``, what it prints), continuation lines joined."""
    found = []
    for block in code_blocks("shell", ""):
        block = block.replace("\\\n", " ")
        for command, answer in re.findall(r"^\$ (curl [^\n]*)\n(.*?)(?=^\$|\Z)", block, re.S | re.M):
            found.append((shlex.split(command), answer.strip()))
    return found


def concrete_bodies() -> list[str]:
    """The document's request bodies that are not templates (no ``<placeholder>``), one per
    JSON object, comment lines taken out, in the document's order."""
    bodies = []
    for block in code_blocks("javascript"):
        if "<" in block:
            continue
        text = "\n".join(line for line in block.splitlines() if not line.strip().startswith("//"))
        bodies += [part.strip() for part in re.split(r"\n\s*\n(?=\{)", text) if part.strip()]
    return bodies


def body(marker: str) -> str:
    [found] = [b for b in concrete_bodies() if marker in b]
    return found


class Served:
    def __init__(self, server: Server, grpc_port: int):
        self.server, self.grpc_address = server, f"127.0.0.1:{grpc_port}"
        self.rest = f"http://127.0.0.1:{server.port}"

    def post(self, path: str, data: str) -> requests.Response:
        return requests.post(self.rest + path, data=data, timeout=60)


@pytest.fixture(scope="module")
def served(module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """``appliance tfs`` with half_plus_three (as the document's Docker line names it) and the
    document models (``module_server`` is requested so the leak check counts this child as the
    module's; it starts nothing itself)."""
    tmp = tmp_path_factory.mktemp("tfsdoc")
    built = subprocess.run([sys.executable, "-c", DOC_MODELS, str(tmp / "models")], capture_output=True,
                           text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    names = {HALF_PLUS_THREE: DATA / HALF_PLUS_THREE,
             **{p.name: p for p in sorted((tmp / "models").iterdir())}}
    config = tmp / "models.config"
    config.write_text("model_config_list {\n" + "".join(
        f'  config {{ name: "{n}" base_path: "{p}" model_platform: "tensorflow" }}\n' for n, p in names.items())
        + "}\n")
    grpc_port, rest_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "appliance.cli", "tfs", f"--port={grpc_port}", f"--rest_api_port={rest_port}",
           f"--model_config_file={config}", "--host", "127.0.0.1", "--state", str(tmp / "state"), "--no-discovery"]
    server = spawn(cmd, rest_port, tmp / "state", tmp / "server.log", timeout=START_S)
    try:
        yield Served(server, grpc_port)
    finally:
        server.stop()


def _curl(served: Served, argv: list[str]) -> requests.Response:
    url = argv[-1].replace("http://localhost:8501", served.rest)
    data = argv[argv.index("-d") + 1] if "-d" in argv else None
    if data is None:
        return requests.get(url, timeout=60)
    return requests.post(url, data=data, timeout=60)


def test_the_document_has_the_examples_this_module_runs() -> None:
    """A newer copy of the document with other examples must be looked at, not half-run."""
    assert [argv[-1].rsplit("/", 1)[-1] for argv, _ in curl_examples()] == [
        HALF_PLUS_THREE, f"{HALF_PLUS_THREE}:predict", f"{HALF_PLUS_THREE}:regress", "half:predict"]
    assert len(concrete_bodies()) == 6, concrete_bodies()


@pytest.mark.parametrize("index", range(3))
def test_a_curl_example_answers_what_the_document_prints(served: Served, index: int) -> None:
    """Examples 1-3: status, predict, regress on half_plus_three, compared with the document."""
    argv, printed = curl_examples()[index]
    r = _curl(served, argv)
    assert (r.status_code, r.json()) == (200, json.loads(printed)), r.text


def test_an_unknown_model_answers_the_documents_404(served: Served) -> None:
    """Example 4: ``curl -i`` prints the status line, the content type and the error body."""
    argv, printed = curl_examples()[3]
    head, _, text = printed.partition("\n\n")
    r = _curl(served, argv)
    assert f"HTTP/1.1 {r.status_code} {r.reason}" == head.splitlines()[0]
    assert r.headers["Content-Type"] == "application/json"
    assert r.json() == json.loads(text)


def test_the_url_forms_with_a_version(served: Served) -> None:
    """The document's URL forms: ``/versions/${VERSION}`` on status, metadata and predict."""
    base = f"{served.rest}/v1/models/{HALF_PLUS_THREE}"
    status = requests.get(f"{base}/versions/123", timeout=60).json()
    assert [v["version"] for v in status["model_version_status"]] == ["123"]
    metadata = requests.get(f"{base}/versions/123/metadata", timeout=60).json()
    assert metadata["model_spec"] == {"name": HALF_PLUS_THREE, "signature_name": "", "version": "123"}
    regress = metadata["metadata"]["signature_def"]["signature_def"]["tensorflow/serving/regress"]
    # as TF Serving reports it: the SignatureDef's declaration, not the graph's placeholder type
    assert regress["inputs"]["inputs"]["dtype"] == "DT_FLOAT"
    assert regress["inputs"]["inputs"]["name"] == "tf_example:0"
    r = served.post(f"/v1/models/{HALF_PLUS_THREE}/versions/123:predict", '{"instances": [1.0, 2.0, 5.0]}')
    assert r.json() == {"predictions": [3.5, 4.0, 5.5]}


def test_row_format_scalar_strings(served: Served) -> None:
    """Example 5: three scalar string tensors."""
    r = served.post("/v1/models/doc_strings:predict", body('[ "foo", "bar", "baz" ]'))
    assert (r.status_code, r.json()) == (200, {"predictions": ["foo", "bar", "baz"]}), r.text


def test_row_format_two_tensors_of_shape_1_2(served: Served) -> None:
    """Example 6."""
    r = served.post("/v1/models/doc_pairs:predict", body("[[1, 2]]"))
    assert (r.status_code, r.json()) == (200, {"predictions": [[[1.0, 2.0]], [[3.0, 4.0]]]}), r.text


TAG_SIGNAL_SENSOR = [{"tag": "foo", "signal": [1, 2, 3, 4, 5], "sensor": [[1.0, 2.0], [3.0, 4.0]]},
                     {"tag": "bar", "signal": [3, 4, 1, 2, 5], "sensor": [[4.0, 5.0], [6.0, 8.0]]}]


def test_row_format_named_inputs_as_printed_and_corrected(served: Served) -> None:
    """Example 7: the document's text has a stray ``]``: a JSON parse error, 400, as TF
    Serving's parser answers it; with the bracket taken out, each instance's three tensors."""
    printed = body('"tag": "foo"')
    assert '"signal": [3, 4, 1, 2, 5]],' in printed, "the document's row example no longer has its stray bracket"
    r = served.post("/v1/models/doc_tag_signal_sensor:predict", printed)
    assert r.status_code == 400 and r.json()["error"], r.text
    r = served.post("/v1/models/doc_tag_signal_sensor:predict", printed.replace("5]],", "5],"))
    assert (r.status_code, r.json()) == (200, {"predictions": TAG_SIGNAL_SENSOR}), r.text


def test_columnar_format_named_inputs(served: Served) -> None:
    """Example 8."""
    r = served.post("/v1/models/doc_tag_signal_sensor:predict", body('"inputs"'))
    columns = {k: [row[k] for row in TAG_SIGNAL_SENSOR] for k in TAG_SIGNAL_SENSOR[0]}
    assert (r.status_code, r.json()) == (200, {"outputs": columns}), r.text


def test_classify_with_binary_features(served: Served) -> None:
    """Example 9: ``image`` as {"b64": ...}, ``caption`` as text; the model answers the caption
    as the class and the decoded image's length as the score ("image bytes": 11)."""
    r = served.post("/v1/models/doc_tag_signal_sensor:classify", body("classify_objects"))
    assert (r.status_code, r.json()) == (200, {"results": [[["seaside", 11.0]], [["mountains", 19.0]]]}), r.text


def test_json_conformance_as_printed_and_corrected(served: Served) -> None:
    """Example 10: ``Nan`` is not one of the tokens the document lists (NaN, Infinity,
    -Infinity): refused; written ``NaN``, under ``examples``, the non-finite values go in and out."""
    printed = body("sensor_readings")
    r = served.post("/v1/models/doc_sensor_readings:regress", printed)
    assert r.status_code == 400 and r.json()["error"], r.text
    fixed = printed.replace("Nan", "NaN").replace('"example"', '"examples"')
    r = served.post("/v1/models/doc_sensor_readings:regress", fixed)
    assert r.status_code == 200, r.text
    assert "Infinity" in r.text and math.isinf(r.json()["results"][0])
    r = served.post(f"/v1/models/{HALF_PLUS_THREE}:predict", '{"instances": [NaN, Infinity, -Infinity]}')
    values = r.json()["predictions"]
    assert math.isnan(values[0]) and values[1:] == [math.inf, -math.inf], r.text


# -- the gRPC APIs on the same models -------------------------------------------------------------
def _stub(served: Served, kind: Any) -> tuple[Any, Any]:
    channel = grpc.insecure_channel(served.grpc_address)
    return channel, kind(channel)


def _regress_request(name: str, signature: str) -> Any:
    request = regression_pb2.RegressionRequest()
    request.model_spec.name, request.model_spec.signature_name = name, signature
    for x in (1.0, 2.0):
        request.input.example_list.examples.add().features.feature["x"].float_list.value.append(x)
    return request


def test_grpc_predict(served: Served) -> None:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = HALF_PLUS_THREE
    request.inputs["x"].dtype = 1  # DT_FLOAT
    request.inputs["x"].float_val.extend([1.0, 2.0, 5.0])
    request.inputs["x"].tensor_shape.dim.add().size = 3
    channel, stub = _stub(served, prediction_service_pb2_grpc.PredictionServiceStub)
    with channel:
        result = stub.Predict(request, RPC_TIMEOUT)
    assert list(result.outputs["y"].float_val) == [3.5, 4.0, 5.5]
    assert (result.model_spec.name, result.model_spec.version.value) == (HALF_PLUS_THREE, 123)


def test_grpc_regress_feeds_examples_by_the_tensors_type(served: Served) -> None:
    channel, stub = _stub(served, prediction_service_pb2_grpc.PredictionServiceStub)
    with channel:
        result = stub.Regress(_regress_request(HALF_PLUS_THREE, "tensorflow/serving/regress"), RPC_TIMEOUT)
    assert [r.value for r in result.result.regressions] == [3.5, 4.0]
    assert result.model_spec.signature_name == "tensorflow/serving/regress"


def test_grpc_classify(served: Served) -> None:
    request = classification_pb2.ClassificationRequest()
    request.model_spec.name, request.model_spec.signature_name = "doc_tag_signal_sensor", "classify_objects"
    for image, caption in ((b"image bytes", b"seaside"), (b"awesome image bytes", b"mountains")):
        features = request.input.example_list.examples.add().features.feature
        features["image"].bytes_list.value.append(image)
        features["caption"].bytes_list.value.append(caption)
    channel, stub = _stub(served, prediction_service_pb2_grpc.PredictionServiceStub)
    with channel:
        result = stub.Classify(request, RPC_TIMEOUT)
    got = [[(c.label, c.score) for c in cs.classes] for cs in result.result.classifications]
    assert got == [[("seaside", 11.0)], [("mountains", 19.0)]]


def test_grpc_multi_inference(served: Served) -> None:
    regress = _regress_request(HALF_PLUS_THREE, "tensorflow/serving/regress")
    request = inference_pb2.MultiInferenceRequest()
    task = request.tasks.add()
    task.model_spec.CopyFrom(regress.model_spec)
    task.method_name = "tensorflow/serving/regress"
    request.input.CopyFrom(regress.input)
    channel, stub = _stub(served, prediction_service_pb2_grpc.PredictionServiceStub)
    with channel:
        result = stub.MultiInference(request, RPC_TIMEOUT)
    assert [r.value for r in result.results[0].regression_result.regressions] == [3.5, 4.0]


def test_grpc_get_model_metadata(served: Served) -> None:
    request = get_model_metadata_pb2.GetModelMetadataRequest()
    request.model_spec.name = HALF_PLUS_THREE
    request.metadata_field.append("signature_def")
    channel, stub = _stub(served, prediction_service_pb2_grpc.PredictionServiceStub)
    with channel:
        result = stub.GetModelMetadata(request, RPC_TIMEOUT)
    defs = get_model_metadata_pb2.SignatureDefMap()
    result.metadata["signature_def"].Unpack(defs)
    assert set(defs.signature_def) == {"serving_default", "tensorflow/serving/regress"}
    assert defs.signature_def["tensorflow/serving/regress"].inputs["inputs"].dtype == 1  # declared DT_FLOAT


def test_grpc_get_model_status(served: Served) -> None:
    request = get_model_status_pb2.GetModelStatusRequest()
    request.model_spec.name = HALF_PLUS_THREE
    channel, stub = _stub(served, model_service_pb2_grpc.ModelServiceStub)
    with channel:
        result = stub.GetModelStatus(request, RPC_TIMEOUT)
    assert [(s.version, s.state, s.status.error_code) for s in result.model_version_status] == [(123, 30, 0)]


def test_binary_values_in_the_document_decode_as_the_test_assumes() -> None:
    """Example 9's scores are the image lengths; the document's base64 says which bytes."""
    images = re.findall(r'"b64": "([^"]+)"', body("classify_objects"))
    assert [base64.b64decode(i) for i in images] == [b"image bytes", b"awesome image bytes"]
