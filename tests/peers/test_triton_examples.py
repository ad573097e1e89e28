"""Triton's own Python client examples, unchanged, against ``appliance serve``.

The examples (triton-inference-server/client ``src/python/examples``, vendored under
tests/peers/triton/examples/ with Triton's LICENSE) run as Triton's users run them: a child
process, ``python EXAMPLE -u URL`` (the URL the only thing changed, by its own flag), against
the real service serving the models they name (tests/support/triton_models.py). An example
exits non-zero on any wrong answer or error message it checks, so its exit status is the
verdict. Examples that cannot apply here are listed in ``SKIPS`` with the reason (also in
tests/peers/SKIPS.md).

The service runs with ``[kserve] model_control = "explicit"`` and ``model_control_scope =
"inference"`` (the documented way to let the unchanged model-control examples, which send no
token, load and unload) and ``server_id = "triton"`` (Triton's ``--id``, which the
health/metadata examples check).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import free_port

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("tritonclient.http")

# Above the longest test: the module's server start (each version's trial starts TensorFlow in a
# child process: about a minute each for six models on a loaded machine; waits of up to 900 s
# each) plus two examples of up to 300 s.
pytestmark = pytest.mark.timeout(2700)
SERVED = ("simple", "simple_int8", "simple_string", "simple_identity", "image_cls", "densenet_onnx")

EXAMPLES = Path(__file__).parent / "triton" / "examples"
EXAMPLE_TIMEOUT_S = 300  # one example's run; a loaded CI machine starts Python and grpcio slowly

# Every example of the directory is either run here or skipped with its reason.
HTTP = ("simple_http_infer_client.py", "simple_http_async_infer_client.py", "simple_http_aio_infer_client.py",
        "simple_http_string_infer_client.py", "simple_http_health_metadata.py", "simple_http_shm_client.py",
        "simple_http_shm_string_client.py", "reuse_infer_objects_client.py")
GRPC = ("simple_grpc_infer_client.py", "simple_grpc_async_infer_client.py", "simple_grpc_aio_infer_client.py",
        "simple_grpc_string_infer_client.py", "simple_grpc_health_metadata.py", "simple_grpc_shm_client.py",
        "simple_grpc_shm_string_client.py", "simple_grpc_custom_args_client.py", "simple_grpc_keepalive_client.py",
        "grpc_explicit_byte_content_client.py", "grpc_explicit_int_content_client.py",
        "grpc_explicit_int8_content_client.py", "grpc_client.py")
CONTROL = ("simple_grpc_model_control.py", "simple_http_model_control.py")  # run last, in order: they unload "simple"
SKIPS = {
    "simple_http_cudashm_client.py": "CUDA shared memory: no GPU on this server (the CUDA region calls answer "
                                     "that they are unavailable)",
    "simple_grpc_cudashm_client.py": "CUDA shared memory: no GPU on this server",
    "simple_http_sequence_sync_infer_client.py": "sequence models (stateful, sequence batcher) are not served here; "
                                                 "sequence parameters are refused with a 400 naming them",
    "simple_grpc_sequence_sync_infer_client.py": "sequence models are not served here",
    "simple_grpc_sequence_stream_infer_client.py": "sequence models are not served here",
    "simple_grpc_aio_sequence_stream_infer_client.py": "sequence models are not served here",
    "simple_grpc_custom_repeat.py": "repeat_int32 is a decoupled model (many responses per request): not served here",
    "ensemble_image_client.py": "ensembles (Triton's model pipelines) are not served here",
    "memory_growth_test.py": "custom_identity_int32 is a custom C++ backend; the test is a long leak soak",
    "image_client.py -i http": "over HTTP it imports attrdict, which does not import on Python >= 3.10 "
                               "(collections.Mapping); run here over gRPC, with and without --streaming",
}
# Image classification over gRPC (the classification extension, class_count 3, and a stream):
# the model and image are named by the examples' own flags.
IMAGE = ("-m", "image_cls", "-c", "3", "-s", "NONE")
IMAGE_RUNS = {"image_client.py grpc": ("image_client.py", "-i", "grpc"),
              "image_client.py grpc streaming": ("image_client.py", "-i", "grpc", "--streaming"),
              "grpc_image_client.py": ("grpc_image_client.py",)}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Triton's example models, plus two more: simple_grpc_model_control.py wants eight models
    in the repository index (simple_http_model_control.py seven: one is removed before it).
    The two are never loaded (``startup_models``): they count in the index all the same."""
    from tests.support.triton_models import triton_models

    built = triton_models()
    base = tmp_path_factory.mktemp("triton-repo") / "models"
    for name in sorted(p.name for p in built.iterdir() if p.is_dir()):
        shutil.copytree(built / name, base / name)
    for extra in ("simple_extra_a", "simple_extra_b"):
        shutil.copytree(built / "simple", base / extra)
    return base


@pytest.fixture(scope="module")
def server(module_server: Any, repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = tmp_path_factory.mktemp("triton-config") / "appliance.toml"
    grpc_port = free_port()
    # the default (lean) gRPC transport: ModelStreamInfer through appliance/transport/grpc/streams.py;
    # on a loaded machine a trial's deadline raised (six TensorFlow trials passed the default 60 s)
    # and no shedding: the examples check every inference they send (health probes are never shed)
    config.write_text(f"poll_interval_s = 0.5\n[grpc]\nport = {grpc_port}\n"
                      "[runtime]\nload_timeout_base_s = 600\n[limits]\nmax_queue_wait_s = 0\n"
                      "[discovery]\nenabled = false\n"
                      '[kserve]\nserver_id = "triton"\nmodel_control = "explicit"\nmodel_control_scope = "inference"\n'
                      f"startup_models = {list(SERVED)!r}\n".replace("'", '"'))
    srv = module_server("--config", str(config), "--models", str(repository), "--grpc-port", str(grpc_port),
                        timeout=900)
    srv.grpc_port = grpc_port
    srv.wait_for(lambda: all(srv.get(f"/v2/models/{m}/ready").status_code == 200 for m in SERVED),
                 900, "every example model ready")
    return srv


def run_example(name: str, *args: str) -> str:
    """Run one example unchanged; its output (it failed the test when it exited non-zero)."""
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=EXAMPLES, capture_output=True,
                          text=True, timeout=EXAMPLE_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} {' '.join(args)} exited {done.returncode}:\n{output[-4000:]}"
    return output


def test_every_example_is_run_or_skipped_with_a_reason() -> None:
    listed = set(HTTP) | set(GRPC) | set(CONTROL) | {k.split()[0] for k in SKIPS} | {v[0] for v in IMAGE_RUNS.values()}
    present = {p.name for p in EXAMPLES.glob("*.py")}
    assert present == listed, f"not listed: {sorted(present - listed)}; listed, absent: {sorted(listed - present)}"
    skips_md = (Path(__file__).parent / "SKIPS.md").read_text()
    assert all(name in skips_md for name in SKIPS), "tests/peers/SKIPS.md lists every skip"


@pytest.mark.parametrize("name", HTTP)
def test_http_example(server: Any, name: str) -> None:
    run_example(name, "-u", f"127.0.0.1:{server.port}")


@pytest.mark.parametrize("name", GRPC)
def test_grpc_example(server: Any, name: str) -> None:
    run_example(name, "-u", f"127.0.0.1:{server.grpc_port}")


@pytest.mark.parametrize("run", sorted(IMAGE_RUNS))
def test_image_classification_example(server: Any, run: str, tmp_path: Path) -> None:
    """The top 3 classes with the model's labels (labels.txt), in Triton's "score (index) = label"."""
    from PIL import Image
    import numpy as np

    image = tmp_path / "image.png"
    Image.fromarray((np.indices((40, 40)).sum(0) * 3 % 255).astype("uint8")[..., None].repeat(3, 2)).save(image)
    name, *args = IMAGE_RUNS[run]
    out = run_example(name, *IMAGE, *args, "-u", f"127.0.0.1:{server.grpc_port}", str(image))
    assert "PASS" in out and out.count(" = label_") == 3, out


@pytest.mark.parametrize("name", sorted(SKIPS))
def test_skipped_example(name: str) -> None:
    pytest.skip(SKIPS[name])


def test_classification_over_rest_matches_the_raw_output(server: Any) -> None:
    """REST ``{"parameters": {"classification": 2}}``: each row's two best classes as
    "score:index:label", best first, the scores those of the raw output."""
    import numpy as np

    x = np.stack([np.full((32, 32, 3), v, np.float32) for v in (0.2, -0.7)]).reshape(2, 32, 32, 3)
    request = {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [2, 32, 32, 3], "data": x.ravel().tolist()}]}
    raw = server.post("/v2/models/image_cls/infer", request).json()["outputs"][0]
    scores = np.array(raw["data"], np.float32).reshape(2, 10)
    classified = server.post("/v2/models/image_cls/infer", {
        **request, "outputs": [{"name": "OUTPUT", "parameters": {"classification": 2}}]}).json()["outputs"][0]
    assert (classified["datatype"], classified["shape"]) == ("BYTES", [2, 2])
    for row, got in zip(scores, np.array(classified["data"]).reshape(2, 2)):
        best = np.argsort(-row, kind="stable")[:2]
        assert list(got) == [f"{row[i]:f}:{i}:label_{i}" for i in best]


# --- Triton's request rules (its qa/L0_http/http_test.py cases, on these models) ----------------
def _infer_url(server: Any, model: str) -> str:
    return f"{server.url}/v2/models/{model}/infer"


def test_raw_binary_request_is_the_models_one_input(server: Any) -> None:
    """``Inference-Header-Content-Length: 0``: the whole body is the one input; the shape
    follows from its size; outputs come back binary after a JSON header."""
    import numpy as np
    import requests

    x = np.random.default_rng(3).standard_normal((2, 32, 32, 3)).astype(np.float32)
    raw = requests.post(_infer_url(server, "image_cls"), data=x.tobytes(),
                        headers={"Inference-Header-Content-Length": "0"}, timeout=60)
    assert raw.status_code == 200, raw.text
    size = int(raw.headers["Inference-Header-Content-Length"])
    header = json.loads(raw.content[:size])
    assert header["outputs"][0]["shape"] == [2, 10]
    by_json = server.post("/v2/models/image_cls/infer", {"inputs": [
        {"name": "INPUT", "datatype": "FP32", "shape": [2, 32, 32, 3], "data": x.ravel().tolist()}]}).json()
    np.testing.assert_allclose(np.frombuffer(raw.content[size:], np.float32),
                               np.array(by_json["outputs"][0]["data"], np.float32), rtol=1e-5, atol=1e-6)
    bad = requests.post(_infer_url(server, "simple_identity"), data=b"427",
                        headers={"Inference-Header-Content-Length": "0"}, timeout=60)
    assert bad.status_code == 400 and "For BYTE datatype raw input 'INPUT0', the model must have input shape [1]" \
        in bad.json()["error"]
    two = requests.post(_infer_url(server, "simple"), data=b"\0" * 64, headers={"Inference-Header-Content-Length": "0"},
                        timeout=60)
    assert two.status_code == 400 and "must only have 1 input" in two.json()["error"]


@pytest.mark.parametrize("depth, ok", [(50, True), (120, False)])
def test_json_nesting_limit_is_tritons(server: Any, depth: int, ok: bool) -> None:
    data = json.loads("[" * depth + '"hello"' + "]" * depth)
    got = server.post("/v2/models/simple_identity/infer",
                      {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 1], "data": data}]})
    if ok:
        assert got.status_code == 200 and got.json()["outputs"][0]["data"] == ["hello"], got.text
    else:
        assert got.status_code == 400
        assert "JSON nesting depth exceeds maximum allowed limit (100)" in got.json()["error"]


def test_sequence_parameters_are_refused_naming_them(server: Any) -> None:
    import tritonclient.grpc as grpcclient
    import numpy as np

    zeros = {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [0] * 16}
    got = server.post("/v2/models/simple/infer", {"parameters": {"sequence_id": 7, "sequence_start": True},
                                                  "inputs": [zeros, {**zeros, "name": "INPUT1"}]})
    assert got.status_code == 400 and "sets sequence_id, sequence_start" in got.json()["error"]
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for item in inputs:
        item.set_data_from_numpy(np.zeros((1, 16), np.int32))
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        with pytest.raises(Exception, match="sets sequence_id, sequence_start, sequence_end"):
            client.infer("simple", inputs, sequence_id=7, sequence_start=True, sequence_end=True)
    finally:
        client.close()


# --- the Open Inference Protocol's own OpenAPI file (kserve/open-inference-protocol) --------------
OIP = Path(__file__).parent / "oip" / "open_inference_rest.yaml"


def _oip_validator(name: str) -> Any:
    """A validator of one of the protocol's component schemas, ``$ref``s resolved in the file."""
    import jsonschema
    import yaml

    spec = yaml.safe_load(OIP.read_text())
    schema = {**spec["components"]["schemas"][name], "components": spec["components"]}
    return jsonschema.Draft4Validator(schema)


@pytest.mark.parametrize("schema, method, path, body", [
    ("metadata_server_response", "GET", "/v2", None),
    ("metadata_model_response", "GET", "/v2/models/simple", None),
    ("metadata_model_response", "GET", "/v2/models/simple/versions/1", None),
    ("metadata_model_error_response", "GET", "/v2/models/nope", None),
    ("inference_response", "POST", "/v2/models/simple/infer",
     {"id": "1", "inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": list(range(16))}
                            for n in ("INPUT0", "INPUT1")]}),
    ("inference_response", "POST", "/v2/models/simple_identity/infer",
     {"inputs": [{"name": "INPUT0", "datatype": "BYTES", "shape": [1, 2], "data": ["a", "b"]}],
      "outputs": [{"name": "OUTPUT0"}]}),
    ("inference_error_response", "POST", "/v2/models/simple/infer", {"inputs": []}),
    ("inference_error_response", "POST", "/v2/models/nope/infer",
     {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [1]}]}),
])
def test_answers_validate_against_the_protocols_openapi_file(server: Any, schema: str, method: str, path: str,
                                                             body: Any) -> None:
    answer = server.get(path) if method == "GET" else server.post(path, body)
    assert answer.headers["Content-Type"].startswith("application/json"), answer.headers
    errors = sorted(e.message for e in _oip_validator(schema).iter_errors(answer.json()))
    assert not errors, f"{schema} of {method} {path}: {errors}\n{answer.text[:500]}"
    assert (answer.status_code < 400) == (not schema.endswith("error_response")), answer.text


# Last: the model-control examples load and unload "simple" (loaded again at the end).
def test_model_control_examples(server: Any, repository: Path) -> None:
    """gRPC's example wants eight models in the index, HTTP's seven: one model folder is
    removed in between, as an operator would, and the repository rescan shows it."""
    out = run_example("simple_grpc_model_control.py", "-u", f"127.0.0.1:{server.grpc_port}")
    assert "PASS" in out, out
    shutil.rmtree(repository / "simple_extra_b")
    server.wait_for(lambda: len(server.post("/v2/repository/index", b"").json()) == 7, 60,
                    "the repository index without simple_extra_b")
    try:
        out = run_example("simple_http_model_control.py", "-u", f"127.0.0.1:{server.port}")
        assert "PASS: model control" in out, out
    finally:  # the examples end with "simple" unloaded: loaded again for whatever runs next
        assert server.post("/v2/repository/models/simple/load", b"", timeout=900).status_code == 200
