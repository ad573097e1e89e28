"""Triton's system shared-memory extension (issue 37) with tritonclient's own utilities, over REST
and gRPC, against the real ``appliance serve`` (front workers on, their default): an app makes
a region with ``tritonclient.utils.shared_memory``, registers it, names it for the inputs and
the outputs, and reads the outputs from the region: the same numbers as the JSON answer.

Then every bad region, each a 400 (INVALID_ARGUMENT over gRPC) naming what was wrong, the
service answering the next request: a region past its object's end, a tensor past its region,
a size that disagrees with the shape, an output region too small, an unknown region, a key
naming nothing, a symbolic link, a directory, a path outside the shared-memory directory, the
service's reserved prefix, an object truncated or unlinked while registered, a region
unregistered while a request uses it (the batcher frozen by the test hook, so the request is
in flight for certain), the limits on count and size (shown in /api/status), and the
inference token on registration.
"""

from __future__ import annotations

import base64
import os
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

tc_http = pytest.importorskip("tritonclient.http")
tc_grpc = pytest.importorskip("tritonclient.grpc")
import tritonclient.utils.shared_memory as shm  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.support.servers import free_port, poll_until  # noqa: E402
from tests.support.modelgen import reference_predict_tflite  # noqa: E402

TOKEN = "i" * 32
X = np.random.default_rng(7).standard_normal((2, 64)).astype(np.float32)
IN_BYTES, OUT_BYTES = X.nbytes, 2 * 10 * 4


@pytest.fixture(scope="module")
def service(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = tmp_path_factory.mktemp("shm") / "appliance.toml"
    grpc_port = free_port()
    config.write_text(f'[discovery]\nenabled = false\n[grpc]\nport = {grpc_port}\n'
                      f'[security]\ninference_token = "{TOKEN}"\n'
                      f'[shared_memory]\nmax_regions = 6\nmax_bytes = 1048576\n'
                      f'[[models]]\nname = "mlp"\nbase_path = "{models_dir / "keras_mlp_tflite"}"\nbackend = "tflite"\n')
    srv = module_server("--config", str(config), "--grpc-port", str(grpc_port),
                        env={"EDGE_APPLIANCE_TEST_HOOKS": "1"})  # SIGUSR1 freezes the batchers
    srv.grpc_port = grpc_port
    srv.status_with_token = lambda: srv.get("/api/status", headers=HEADERS).json()
    srv.want = reference_predict_tflite(models_dir / "keras_mlp_tflite" / "1" / "model.tflite", {"x": X})["probs"]
    return srv


HEADERS = {"authorization": f"Bearer {TOKEN}"}  # lower case: gRPC metadata keys are


@pytest.fixture(params=["http", "grpc"])
def client(request: pytest.FixtureRequest, service: Any) -> Iterator[Any]:
    if request.param == "http":
        c = tc_http.InferenceServerClient(f"127.0.0.1:{service.port}")
        c.api, c.mod = "http", tc_http
    else:
        c = tc_grpc.InferenceServerClient(f"127.0.0.1:{service.grpc_port}")
        c.api, c.mod = "grpc", tc_grpc
    yield c
    c.unregister_system_shared_memory(headers=HEADERS)
    c.close()


class Regions:
    """Regions made with tritonclient's utilities, destroyed (unlinked) at teardown."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def make(self, size: int) -> tuple[str, Any]:
        key = f"/edge-test-{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key.lstrip("/") + "-r", key, size)
        self.handles.append(handle)
        return key, handle

    def close(self) -> None:
        for handle in self.handles:
            try:
                shm.destroy_shared_memory_region(handle)
            except Exception:  # unlinked by the test already
                pass


@pytest.fixture()
def regions() -> Iterator[Regions]:
    made = Regions()
    yield made
    made.close()


def infer_shm(client: Any, in_region: str, out_region: str, in_size: int = IN_BYTES, out_size: int = OUT_BYTES,
              in_offset: int = 0, out_offset: int = 0, shape: tuple[int, ...] = X.shape) -> Any:
    inp = client.mod.InferInput("x", list(shape), "FP32")
    inp.set_shared_memory(in_region, in_size, in_offset)
    out = client.mod.InferRequestedOutput("probs")
    out.set_shared_memory(out_region, out_size, out_offset)
    return client.infer("mlp", [inp], outputs=[out], headers=HEADERS)


def registered(client: Any, regions: Regions, in_size: int = IN_BYTES, out_size: int = OUT_BYTES) -> tuple[Any, Any]:
    in_key, in_handle = regions.make(in_size)
    out_key, out_handle = regions.make(out_size)
    client.register_system_shared_memory("in", in_key, in_size, headers=HEADERS)
    client.register_system_shared_memory("out", out_key, out_size, headers=HEADERS)
    shm.set_shared_memory_region(in_handle, [X])
    return in_handle, out_handle


def json_answer(client: Any) -> np.ndarray:
    inp = client.mod.InferInput("x", list(X.shape), "FP32")
    inp.set_data_from_numpy(X, **({"binary_data": False} if client.api == "http" else {}))
    return client.infer("mlp", [inp], headers=HEADERS).as_numpy("probs")


# -- it works ----------------------------------------------------------------------------------
def test_tritonclient_shared_memory_gives_the_json_answer(client: Any, regions: Regions, service: Any) -> None:
    _, out_handle = registered(client, regions)
    status = client.get_system_shared_memory_status(headers=HEADERS)
    names = sorted(status) if client.api == "grpc" and isinstance(status, dict) else None
    if client.api == "http":
        assert sorted(r["name"] for r in status) == ["in", "out"] and status[0]["byte_size"] > 0
    else:
        assert sorted(status.regions) == ["in", "out"] or names == ["in", "out"]
    result = infer_shm(client, "in", "out")
    output = result.get_output("probs")
    shape = list(output["shape"] if client.api == "http" else output.shape)
    datatype = output["datatype"] if client.api == "http" else output.datatype
    assert shape == [2, 10] and datatype == "FP32"
    if client.api == "http":  # in the region, never in the answer: tritonclient's examples read get_output
        assert "data" not in output and "binary_data_size" not in output.get("parameters", {})
    else:
        assert result.get_response().raw_output_contents == [b""]  # one entry per output, as Triton sends
    got = shm.get_contents_as_numpy(out_handle, np.float32, shape)
    np.testing.assert_allclose(got, json_answer(client), rtol=1e-6)
    np.testing.assert_allclose(got, service.want, rtol=1e-5, atol=1e-6)


def test_offsets_inside_regions(client: Any, regions: Regions) -> None:
    in_key, in_handle = regions.make(IN_BYTES + 64)
    out_key, out_handle = regions.make(OUT_BYTES + 32)
    client.register_system_shared_memory("in", in_key, IN_BYTES + 32, offset=32, headers=HEADERS)
    client.register_system_shared_memory("out", out_key, OUT_BYTES + 32, headers=HEADERS)
    shm.set_shared_memory_region(in_handle, [X], offset=32 + 16)
    infer_shm(client, "in", "out", in_offset=16, out_offset=32)
    got = shm.get_contents_as_numpy(out_handle, np.float32, [2, 10], offset=32)
    np.testing.assert_allclose(got, json_answer(client), rtol=1e-6)


def test_one_input_in_shared_memory_one_output_in_the_answer(client: Any, regions: Regions) -> None:
    registered(client, regions)
    inp = client.mod.InferInput("x", list(X.shape), "FP32")
    inp.set_shared_memory("in", IN_BYTES)
    got = client.infer("mlp", [inp], headers=HEADERS).as_numpy("probs")  # no output region: sent back
    np.testing.assert_allclose(got, json_answer(client), rtol=1e-6)


def test_status_register_unregister(client: Any, regions: Regions, service: Any) -> None:
    key, _ = regions.make(128)
    client.register_system_shared_memory("r1", key, 64, offset=64, headers=HEADERS)
    one = client.get_system_shared_memory_status("r1", headers=HEADERS)
    region = one[0] if client.api == "http" else one.regions["r1"]
    got = region if client.api == "http" else {"name": region.name, "key": region.key, "offset": region.offset,
                                               "byte_size": region.byte_size}
    assert got == {"name": "r1", "key": key, "offset": 64, "byte_size": 64}
    summary = service.get("/api/status", headers=HEADERS).json()["shared_memory"]
    assert summary["regions"] == 1 and summary["bytes"] == 64 and summary["max_regions"] == 6
    client.unregister_system_shared_memory("r1", headers=HEADERS)
    with pytest.raises(InferenceServerException, match="Unable to find system shared memory region: 'r1'"):
        client.get_system_shared_memory_status("r1", headers=HEADERS)
    client.unregister_system_shared_memory("never-registered", headers=HEADERS)  # Triton's answer: fine


def test_cuda_shared_memory_says_what_is_missing(client: Any) -> None:
    status = client.get_cuda_shared_memory_status(headers=HEADERS)
    assert (status == [] if client.api == "http" else len(status.regions) == 0)
    handle = base64.b64encode(b"\0" * 64)  # what tritonclient.utils.cuda_shared_memory.get_raw_handle gives
    with pytest.raises(InferenceServerException, match="CUDA shared memory is not supported on this device"):
        client.register_cuda_shared_memory("gpu", handle.decode() if client.api == "http" else handle, 0, 1024,
                                           headers=HEADERS)


# -- every bad region: its 400, and the service serves on ------------------------------------------
def refused(client: Any, call: Callable[[], Any], *words: str, grpc_code: str = "INVALID_ARGUMENT") -> None:
    with pytest.raises(InferenceServerException) as err:
        call()
    text = str(err.value)
    status = err.value.status()
    assert status in ("400", f"StatusCode.{grpc_code}"), (status, text)
    assert all(word in text for word in words), text
    np.testing.assert_allclose(json_answer(client).shape, (2, 10))  # the next request is answered


def test_bad_registrations(client: Any, regions: Regions, tmp_path: Path) -> None:
    key, _ = regions.make(64)
    register = client.register_system_shared_memory
    refused(client, lambda: register("big", key, 128, headers=HEADERS), "past the end", "64 bytes")
    refused(client, lambda: register("off", key, 32, offset=48, headers=HEADERS), "past the end")
    refused(client, lambda: register("none", "/edge-test-no-such-object", 8, headers=HEADERS),  # Triton's code
            "Unable to open shared memory region", "no POSIX shared memory object", grpc_code="INTERNAL")
    refused(client, lambda: register("esc", "/../../etc/passwd", 8, headers=HEADERS), "invalid shm key")
    refused(client, lambda: register("abs", "etc/passwd", 8, headers=HEADERS), "invalid shm key")
    refused(client, lambda: register("dot", "..", 8, headers=HEADERS), "invalid shm key")
    refused(client, lambda: register("ours", "/edge-appliance-x", 8, headers=HEADERS), "reserved prefix")
    link = Path("/dev/shm") / f"edge-test-link-{uuid.uuid4().hex[:8]}"
    directory = Path("/dev/shm") / f"edge-test-dir-{uuid.uuid4().hex[:8]}"
    link.symlink_to(tmp_path / "elsewhere")
    directory.mkdir()
    try:
        refused(client, lambda: register("lnk", "/" + link.name, 8, headers=HEADERS),
                "something other than a POSIX shared memory object", "symbolic link", grpc_code="INTERNAL")
        refused(client, lambda: register("dir", "/" + directory.name, 8, headers=HEADERS),
                "something other than a POSIX shared memory object", grpc_code="INTERNAL")
    finally:
        link.unlink()
        directory.rmdir()
    register("ok", key, 64, headers=HEADERS)
    refused(client, lambda: register("ok", key, 64, headers=HEADERS), "already in manager")


def test_bad_tensors_in_regions(client: Any, regions: Regions) -> None:
    registered(client, regions)
    refused(client, lambda: infer_shm(client, "in", "out", in_size=IN_BYTES - 4),
            "input 'x'", "disagrees with shape [2, 64]")
    refused(client, lambda: infer_shm(client, "in", "out", in_offset=8), "input 'x'", "Invalid offset + byte size")
    refused(client, lambda: infer_shm(client, "nope", "out"), "Unable to find shared memory region: 'nope'")
    refused(client, lambda: infer_shm(client, "in", "out", out_size=OUT_BYTES - 4),
            "output 'probs'", f"should be at least {OUT_BYTES} bytes")


def test_an_object_truncated_or_unlinked_while_registered(client: Any, regions: Regions) -> None:
    in_handle, _ = registered(client, regions)
    in_key = in_handle._shm_key
    fd = os.open("/dev/shm/" + in_key.lstrip("/"), os.O_RDWR)
    try:
        os.ftruncate(fd, 16)  # a mapping of this would be a SIGBUS: the server maps nothing
        refused(client, lambda: infer_shm(client, "in", "out"), "truncated")
    finally:
        os.close(fd)
    client.unregister_system_shared_memory(headers=HEADERS)
    in_handle, _ = registered(client, regions)
    os.unlink("/dev/shm/" + in_handle._shm_key.lstrip("/"))
    refused(client, lambda: infer_shm(client, "in", "out"), "unlinked")


def test_a_region_unregistered_while_a_request_uses_it(client: Any, regions: Regions, service: Any) -> None:
    """The request's inputs are read, it waits in the frozen batch queue, its output region is
    unregistered meanwhile: its answer is a 400 and the region is left as it was."""
    _, out_handle = registered(client, regions)

    def batching() -> dict[str, Any]:
        return service.status_with_token()["models"]["mlp"]["versions"][0]["batching"]

    frozen = service.log_text().count("batchers frozen")
    service.proc.send_signal(signal.SIGUSR1)  # the test hook: the batchers stop taking batches
    service.wait_for(lambda: service.log_text().count("batchers frozen") > frozen, 30, "the freeze")
    with ThreadPoolExecutor(1) as pool:
        try:
            future = pool.submit(_infer_in_a_client_of_its_own, service, client)
            service.wait_for(lambda: batching()["queue_depth_rows"] == 2, 30, "the request to wait in the queue")
            client.unregister_system_shared_memory("out", headers=HEADERS)
        finally:
            service.proc.send_signal(signal.SIGUSR1)  # the batchers run again
        with pytest.raises(InferenceServerException) as err:
            future.result(60)
    assert "was unregistered while the request used it" in str(err.value)
    assert not np.any(shm.get_contents_as_numpy(out_handle, np.float32, [2, 10]))  # nothing written
    np.testing.assert_allclose(json_answer(client).shape, (2, 10))


def _infer_in_a_client_of_its_own(service: Any, client: Any) -> Any:
    """(another thread) tritonclient's HTTP client runs on gevent: one client per thread."""
    address = f"127.0.0.1:{service.port if client.api == 'http' else service.grpc_port}"
    with client.mod.InferenceServerClient(address) as own:
        own.mod = client.mod
        return own.infer("mlp", [_shm_input(own)], outputs=[_shm_output(own)], headers=HEADERS)


def _shm_input(client: Any) -> Any:
    inp = client.mod.InferInput("x", list(X.shape), "FP32")
    inp.set_shared_memory("in", IN_BYTES)
    return inp


def _shm_output(client: Any) -> Any:
    out = client.mod.InferRequestedOutput("probs")
    out.set_shared_memory("out", OUT_BYTES)
    return out


def test_limits_on_count_and_size(client: Any, regions: Regions, service: Any) -> None:
    keys = [regions.make(4096)[0] for _ in range(7)]
    for i, key in enumerate(keys[:6]):
        client.register_system_shared_memory(f"r{i}", key, 4096, headers=HEADERS)
    refused(client, lambda: client.register_system_shared_memory("r6", keys[6], 4096, headers=HEADERS),
            "max_regions = 6")
    client.unregister_system_shared_memory(headers=HEADERS)
    big, _ = regions.make(2 << 20)
    refused(client, lambda: client.register_system_shared_memory("big", big, 2 << 20, headers=HEADERS),
            "max_bytes = 1048576")
    summary = service.get("/api/status", headers=HEADERS).json()["shared_memory"]
    assert summary["max_bytes"] == 1048576 and summary["regions"] == 0


def test_registration_needs_the_inference_token(client: Any, regions: Regions) -> None:
    key, _ = regions.make(64)
    with pytest.raises(InferenceServerException) as err:
        client.register_system_shared_memory("r", key, 64)
    assert err.value.status() in ("401", "StatusCode.UNAUTHENTICATED")
    with pytest.raises(InferenceServerException):
        client.get_system_shared_memory_status()
