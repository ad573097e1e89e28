"""Triton's own qa tests, as files, against ``appliance serve``.

The files (triton-inference-server/server ``qa/L0_http/http_test.py``,
``qa/L0_http/python_http_aio_test.py``, ``qa/L0_grpc/python_grpc_aio_test.py``,
``qa/L0_grpc/python_unit_test.py`` and the ``qa/common/test_util.py`` they import; vendored
under tests/peers/triton/qa/ with Triton's LICENSE) run as Triton's qa runs them: a child
process runs each file's unittest cases from the file's own folder next to ``../common``.
The one thing changed is the URL: they hard-code ``localhost:8000`` / ``localhost:8001``,
rewritten to the loopback ports this test chose, in a copy. A case listed in ``SKIPS`` is
deselected, with its reason (also in tests/peers/SKIPS.md); every other case must pass.

Two services, as Triton's qa has two servers: http_test.py and python_unit_test.py's
GrpcTest run with ``--model-control-mode=explicit`` (``[kserve] model_control = "explicit"``,
every model loaded at start), the aio tests on the default mode (load and unload refused
"if polling is enabled"), each on the models its qa script gives it
(tests/support/triton_qa_models.py). The aio files count the repository index (eight for
gRPC's, seven for HTTP's): one model folder is removed between the two, as for the examples.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import free_port

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("tritonclient.http")

# Above the longest test: a service's start (each version's trial starts TensorFlow in a child
# process: about a minute each on a loaded machine, nine models; waits of up to 1200 s) plus
# one file of up to 600 s.
pytestmark = pytest.mark.timeout(3600)

QA = Path(__file__).parent / "triton" / "qa"
FILE_TIMEOUT_S = 600  # one file's run: a loaded machine starts Python, TensorFlow-free, slowly
EXPLICIT_MODELS = ("onnx_zero_1_float32", "onnx_zero_1_float16", "onnx_zero_3_float32", "onnx_zero_1_object",
                   "onnx_zero_1_object_1_element", "simple_identity", "simple_identity_int64", "string_identity",
                   "simple")
POLLING_MODELS = ("simple", "simple_identity", "simple_identity_int64", "string_identity", "onnx_zero_1_float32",
                  "onnx_zero_1_object", "onnx_zero_3_float32", "onnx_zero_1_float16")  # eight: gRPC's aio count

SKIPS = {
    "http_test.py::HttpTest::test_loading_large_invalid_model":
        "builds a 2 GiB string and sends its 2.9 GB base64 in one JSON body: more memory than the shared test "
        "machine has to spare; the body bound it checks is [server] max_body_bytes (413), tested in "
        "tests/api/test_v2_rest.py",
    "http_test.py::HttpTest::test_descriptive_status_code":
        "needs onnx_zero_1_float32_queue, a model whose own config queues one request (Triton's per-model "
        "default_queue_policy); queue bounds here are server-wide ([batching] max_enqueued_batches); a full "
        "queue is 503 here too",
    "http_test.py::HttpTest::test_negative_dimensions":
        "Triton answers a negative dimension with 500 (a JSON parser error); here it is 400, a client error "
        "naming the shape",
    "http_test.py::HttpTest::test_repository_index_deeply_nested_json":
        "Triton parses 250,000 levels of nesting and then refuses the value; here JSON nested past the parser's "
        "depth bound is refused before it is parsed (400 too, other words)",
    "http_test.py::HttpTest::test_content_encoding_chunked_manually":
        "requests sends its hand-chunked body with both Transfer-Encoding: chunked and Content-Length; the HTTP "
        "server refuses a request with both (RFC 9112 6.3: a request-smuggling sign); a chunked body alone is served",
    "python_unit_test.py::GrpcTest::test_bytes_contents_many_elements_serialization":
        "one request of 10,485,760 BYTES rows to string_identity (Triton's has no batch dimension): here the "
        "batcher takes the first dimension as rows, at most max_enqueued_batches x max_batch_size (2,048) a "
        "request, and refuses it naming that bound; also over [limits] max_tensor_elements (4 Mi)",
    "python_unit_test.py::RestrictedProtocolTest":
        "Triton's --grpc-restricted-protocol (a header key/value per protocol group) is not an option here; "
        "protocol groups are guarded by bearer tokens instead ([security] inference_token / admin_token, "
        "docs/security.md)",
    "python_grpc_aio_test.py::TestGrpcAioClient::test_update_trace_settings":
        "the trace extension (Triton's request tracing) is not served",
    "python_grpc_aio_test.py::TestGrpcAioClient::test_get_trace_settings":
        "the trace extension (Triton's request tracing) is not served",
    "python_http_aio_test.py::TestHttpAioClient::test_update_trace_settings":
        "the trace extension (Triton's request tracing) is not served",
    "python_http_aio_test.py::TestHttpAioClient::test_get_trace_settings":
        "the trace extension (Triton's request tracing) is not served",
}
# (file, its qa folder, the selection Triton's script runs, the service it needs)
FILES = {
    "http_test.py": ("L0_http", None, "explicit"),
    "python_unit_test.py": ("L0_grpc", "GrpcTest", "explicit"),
    "python_grpc_aio_test.py": ("L0_grpc", None, "polling"),
    "python_http_aio_test.py": ("L0_http", None, "polling"),  # after gRPC's: one folder fewer
}


def _repository(base: Path, names: tuple[str, ...]) -> Path:
    from tests.support.triton_qa_models import qa_models

    built = qa_models()
    for name in names:
        shutil.copytree(built / name, base / name)
    return base


def _start(module_server: Any, tmp: Path, repo: Path, names: tuple[str, ...], kserve: str) -> Any:
    config = tmp / "appliance.toml"
    grpc_port = free_port()
    # On a loaded machine: a trial's deadline raised (nine TensorFlow trials pass the default 60 s),
    # and no shedding: the qa files count every inference they send (health probes are never shed).
    config.write_text(f"poll_interval_s = 0.5\n[grpc]\nport = {grpc_port}\n[discovery]\nenabled = false\n"
                      "[runtime]\nload_timeout_base_s = 600\n[limits]\nmax_queue_wait_s = 0\n"
                      f'[kserve]\nserver_id = "triton"\n{kserve}')
    srv = module_server("--config", str(config), "--models", str(repo), "--grpc-port", str(grpc_port), timeout=1200)
    srv.grpc_port = grpc_port
    srv.wait_for(lambda: all(srv.get(f"/v2/models/{m}/ready").status_code == 200 for m in names), 1200,
                 "every qa model ready")
    return srv


@pytest.fixture(scope="module")
def explicit(module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("qa-explicit")
    repo = _repository(tmp / "models", EXPLICIT_MODELS)
    startup = ", ".join(f'"{m}"' for m in EXPLICIT_MODELS)
    return _start(module_server, tmp, repo, EXPLICIT_MODELS, 'model_control = "explicit"\n'
                  f'model_control_scope = "inference"\nstartup_models = [{startup}]\n')


@pytest.fixture(scope="module")
def polling(module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("qa-polling")
    # model_control_scope "inference": load and unload reach the mode check (Triton's qa sends no token)
    srv = _start(module_server, tmp, _repository(tmp / "models", POLLING_MODELS), POLLING_MODELS,
                 'model_control_scope = "inference"\n')
    srv.repository = tmp / "models"
    return srv


def cases(name: str) -> list[str]:
    """The file's test cases, ``Class.test_x``, in file order (its unittest classes' methods)."""
    tree = ast.parse((QA / name).read_text())
    return [f"{node.name}.{item.name}" for node in tree.body if isinstance(node, ast.ClassDef)
            for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
            and item.name.startswith("test")]


def selected(name: str) -> list[str]:
    """The cases Triton's script runs of the file, less those skipped here."""
    _, selection, _ = FILES[name]
    skipped = {key.split("::", 1)[1].replace("::", ".") for key in SKIPS if key.startswith(name + "::")}
    return [case for case in cases(name) if (selection is None or case.startswith(selection + "."))
            and case not in skipped and case.split(".")[0] not in skipped]


def run_qa_file(name: str, http_port: int, grpc_port: int, tmp: Path) -> list[str]:
    """Run one qa file as Triton's script does (``python FILE``, unittest), a copy with its URLs
    rewritten, in its own folder beside ``../common``; the cases that passed."""
    folder = FILES[name][0]
    (tmp / "common").mkdir(parents=True)
    shutil.copy(QA / "common" / "test_util.py", tmp / "common" / "test_util.py")
    (tmp / folder).mkdir()
    text = (QA / name).read_text()
    text = text.replace("localhost:8000", f"127.0.0.1:{http_port}").replace("localhost:8001", f"127.0.0.1:{grpc_port}")
    (tmp / folder / name).write_text(text)
    chosen = selected(name)
    done = subprocess.run([sys.executable, name, "-v", *chosen], cwd=tmp / folder, capture_output=True, text=True,
                          timeout=FILE_TIMEOUT_S)
    output = done.stdout + done.stderr
    passed = [case for case in chosen if re.search(rf"^{case.split('.')[1]} \(__main__\.{re.escape(case)}\)"
                                                   rf"(?:\n.*?)? \.\.\. ok$", output, re.M)]
    assert done.returncode == 0 and passed == chosen, \
        f"{name}: not passed {sorted(set(chosen) - set(passed))}\n{output[-6000:]}"
    return passed


def test_every_qa_file_is_run_and_every_skip_names_a_case() -> None:
    present = {p.name for p in QA.glob("*.py")}
    assert present == set(FILES), f"not run: {sorted(present - set(FILES))}"
    assert all(key.split("::")[0] in FILES for key in SKIPS)
    skips_md = (Path(__file__).parent / "SKIPS.md").read_text()
    assert all(key.rsplit("::", 1)[1] in skips_md for key in SKIPS), "tests/peers/SKIPS.md lists every skip"


@pytest.mark.parametrize("name", ["http_test.py", "python_unit_test.py"])
def test_qa_file_explicit_mode(explicit: Any, name: str, tmp_path: Path) -> None:
    run_qa_file(name, explicit.port, explicit.grpc_port, tmp_path)


def test_qa_aio_files(polling: Any, tmp_path: Path) -> None:
    """gRPC's aio file counts eight models in the index, HTTP's seven: one folder goes between."""
    run_qa_file("python_grpc_aio_test.py", polling.port, polling.grpc_port, tmp_path / "grpc")
    shutil.rmtree(polling.repository / "onnx_zero_1_float16")
    polling.wait_for(lambda: len(polling.post("/v2/repository/index", b"").json()) == 7, 120,
                     "the repository index without onnx_zero_1_float16")
    run_qa_file("python_http_aio_test.py", polling.port, polling.grpc_port, tmp_path / "http")


@pytest.mark.parametrize("case", sorted(SKIPS))
def test_skipped_qa_case(case: str) -> None:
    pytest.skip(SKIPS[case])
