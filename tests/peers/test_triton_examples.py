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

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.servers import free_port

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("tritonclient.http")

# Above the longest test: the module's server start (TensorFlow trials of six models on a
# loaded machine, up to 300 s + 300 s for every model ready) plus two examples of up to 300 s.
pytestmark = pytest.mark.timeout(1500)

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
    "image_client.py": "needs the classification extension (item 6 of issue 44)",
    "grpc_image_client.py": "needs the classification extension (item 6 of issue 44)",
}


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Triton's example models, plus two more: simple_grpc_model_control.py wants eight models
    in the repository index (simple_http_model_control.py seven: one is removed before it)."""
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
    config.write_text(f"poll_interval_s = 0.5\n[grpc]\nport = {grpc_port}\n[discovery]\nenabled = false\n"
                      '[kserve]\nserver_id = "triton"\nmodel_control = "explicit"\nmodel_control_scope = "inference"\n')
    srv = module_server("--config", str(config), "--models", str(repository), "--grpc-port", str(grpc_port),
                        timeout=300)
    srv.grpc_port = grpc_port
    srv.wait_for(lambda: all(srv.get(f"/v2/models/{m}/ready").status_code == 200 for m in _names(repository)),
                 300, "every example model ready")
    return srv


def _names(repository: Path) -> list[str]:
    return sorted(p.name for p in repository.iterdir() if p.is_dir())


def run_example(name: str, *args: str) -> str:
    """Run one example unchanged; its output (it failed the test when it exited non-zero)."""
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=EXAMPLES, capture_output=True,
                          text=True, timeout=EXAMPLE_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} {' '.join(args)} exited {done.returncode}:\n{output[-4000:]}"
    return output


def test_every_example_is_run_or_skipped_with_a_reason() -> None:
    listed = set(HTTP) | set(GRPC) | set(CONTROL) | set(SKIPS)
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


@pytest.mark.parametrize("name", sorted(SKIPS))
def test_skipped_example(name: str) -> None:
    pytest.skip(SKIPS[name])


def test_model_control_examples(server: Any, repository: Path) -> None:
    """gRPC's example wants eight models in the index, HTTP's seven: one model folder is
    removed in between, as an operator would, and the repository rescan shows it."""
    out = run_example("simple_grpc_model_control.py", "-u", f"127.0.0.1:{server.grpc_port}")
    assert "PASS" in out, out
    shutil.rmtree(repository / "simple_extra_b")
    server.wait_for(lambda: len(server.post("/v2/repository/index", b"").json()) == 7, 60,
                    "the repository index without simple_extra_b")
    out = run_example("simple_http_model_control.py", "-u", f"127.0.0.1:{server.port}")
    assert "PASS: model control" in out, out
