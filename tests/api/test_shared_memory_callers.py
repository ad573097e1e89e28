"""Shared memory only for the callers it is meant for (issue 47): every use of a region is
answered only for a caller on this host (a loopback peer or the Unix socket) unless
``[shared_memory] allow_remote``, and ``allowed_keys`` limits which objects may be opened.

A remote peer cannot be a target here (tests reach loopback only), so the refusal is checked
where the peer is judged, with the real registry, real ``/dev/shm`` objects and the real gRPC
call context carrying a remote peer; through the real service (front workers on, gRPC calls
forwarded with their peer), tritonclient's shared-memory calls keep working from loopback over
REST and gRPC, and ``allowed_keys`` refuses other objects with 403 / PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

tc_http = pytest.importorskip("tritonclient.http")
tc_grpc = pytest.importorskip("tritonclient.grpc")
import tritonclient.utils.shared_memory as tshm  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from appliance.api.kserve import shared_memory as shm  # noqa: E402
from appliance.core.config import SharedMemoryConfig  # noqa: E402
from appliance.core.errors import PermissionDenied  # noqa: E402
from appliance.core.shared_memory import SharedMemory  # noqa: E402
from tests.support.servers import free_port  # noqa: E402

ALLOWED = "edge-test-allowed-"
X = np.random.default_rng(3).standard_normal((1, 64)).astype(np.float32)


@pytest.mark.parametrize("peer, local", [
    ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("::ffff:127.0.0.1", True), ("", False),
    ("unix:/run/edge-appliance/rest.sock", True), ("unix:", True), ("ipv4:127.0.0.1:5123", True), ("ipv6:[::1]:5123", True),
    ("ipv4:::1:5123", True),  # what the lean gRPC server writes for an IPv6 peer
    ("ipv6:%5B::1%5D:5123", True), ("ipv6:%5B2001:db8::1%5D:443", False),  # grpcio >= 1.48 percent-encodes the brackets
    ("192.0.2.7", False), ("ipv4:192.0.2.7:5123", False), ("ipv6:[2001:db8::1]:443", False), ("10.0.0.1", False),
    ("front worker", False), (None, False), ("::ffff:192.0.2.7", False),
])
def test_who_is_on_this_host(peer: str | None, local: bool) -> None:
    assert shm.same_host(peer) is local


@pytest.fixture(scope="module", autouse=True)
def resource_tracker() -> None:
    """tritonclient's regions are multiprocessing's shared memory, whose first use starts
    multiprocessing's resource tracker (one per process, ending with it): started here, before
    the tests' own leak checks look."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()


class Objects:
    """POSIX shared-memory objects made with tritonclient's utilities, destroyed at teardown."""

    def __init__(self) -> None:
        self.handles: list[Any] = []

    def make(self, prefix: str = "edge-test-") -> str:
        key = f"/{prefix}{uuid.uuid4().hex[:12]}"
        self.handles.append(tshm.create_shared_memory_region(key.lstrip("/"), key, X.nbytes))
        tshm.set_shared_memory_region(self.handles[-1], [X])
        return key

    def close(self) -> None:
        for handle in self.handles:
            tshm.destroy_shared_memory_region(handle)


@pytest.fixture
def objects() -> Iterator[Objects]:
    made = Objects()
    yield made
    made.close()


def registry(allow_remote: bool = False, allowed_keys: tuple[str, ...] = ()) -> SharedMemory:
    cfg = SharedMemoryConfig(allow_remote=allow_remote, allowed_keys=list(allowed_keys))
    return SharedMemory(lambda: cfg)


def as_caller(peer: str | None, fn: Any, *args: Any) -> Any:
    token = shm.CALLER.set(peer)
    try:
        return fn(*args)
    finally:
        shm.CALLER.reset(token)


def test_a_remote_caller_reaches_no_region_over_rest(objects: Objects) -> None:
    regions = registry()
    key = objects.make()
    body = ('{"key": "%s", "byte_size": %d}' % (key, X.nbytes)).encode()
    for action, method, payload in (("register", "POST", body), ("status", "GET", b""), ("unregister", "POST", b"")):
        with pytest.raises(PermissionDenied, match="callers on this device.*192.0.2.7.*allow_remote"):
            as_caller("192.0.2.7", shm.answer, regions, shm.SYSTEM, "r", action, method, payload)
    with pytest.raises(PermissionDenied):  # no adapter said who it is: refused too
        shm.answer(regions, shm.SYSTEM, "r", "register", "POST", body)
    assert regions.status() == []
    assert as_caller("127.0.0.1", shm.answer, regions, shm.SYSTEM, "r", "register", "POST", body)[0] == 200
    with pytest.raises(PermissionDenied):  # nor may it name a region a local app registered
        as_caller("192.0.2.7", shm.named_slice, regions, {shm.REGION: "r", shm.BYTE_SIZE: X.nbytes}, "input 'x'")
    assert as_caller("unix:", shm.named_slice, regions, {shm.REGION: "r", shm.BYTE_SIZE: X.nbytes}, "input 'x'")  # the Unix socket
    opened = registry(allow_remote=True)
    assert as_caller("192.0.2.7", shm.answer, opened, shm.SYSTEM, "r", "register", "POST", body)[0] == 200
    regions.unregister()
    opened.unregister()


def test_a_remote_grpc_peer_gets_permission_denied(objects: Objects) -> None:
    import grpc

    from appliance.api.kserve.grpc_service import V2GRPC
    from appliance.api.kserve.service import V2Service
    from appliance.protos.kserve import grpc_predict_v2_pb2 as pb
    from appliance.transport.grpc.calls import Abort, Context

    regions = registry()
    handler = V2GRPC(V2Service(None, regions=regions)).handler()  # type: ignore[arg-type]  # no model is asked for
    details = type("Details", (), {"method": "/inference.GRPCInferenceService/SystemSharedMemoryRegister",
                                    "invocation_metadata": ()})()
    register = handler.service(details).unary_unary
    request = pb.SystemSharedMemoryRegisterRequest(name="r", key=objects.make(), byte_size=X.nbytes)
    with pytest.raises(Abort) as refused:
        asyncio.run(register(request, Context((), None, "ipv4:192.0.2.7:40000")))
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED and "192.0.2.7" in refused.value.details
    asyncio.run(register(request, Context((), None, "ipv4:127.0.0.1:40000")))
    assert [r["name"] for r in regions.status()] == ["r"]
    regions.unregister()


def test_allowed_keys_limit_what_a_region_opens(objects: Objects) -> None:
    regions = registry(allowed_keys=(ALLOWED,))
    with pytest.raises(PermissionDenied, match="allowed_keys"):
        regions.register("other", objects.make(), 0, X.nbytes)
    regions.register("mine", objects.make(ALLOWED), 0, X.nbytes)
    assert [r["name"] for r in regions.status()] == ["mine"]
    regions.unregister()


# --- the real service: loopback keeps working, allowed_keys holds -----------------------------------
@pytest.fixture(scope="module")
def service(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = tmp_path_factory.mktemp("shm-callers") / "appliance.toml"
    grpc_port = free_port()
    config.write_text(f'[discovery]\nenabled = false\n[grpc]\nport = {grpc_port}\n'
                      f'[shared_memory]\nallowed_keys = ["{ALLOWED}"]\n'
                      f'[[models]]\nname = "mlp"\nbase_path = "{models_dir / "keras_mlp_tflite"}"\nbackend = "tflite"\n')
    srv = module_server("--config", str(config), "--grpc-port", str(grpc_port), "--workers", "2")
    srv.grpc_port = grpc_port
    return srv


@pytest.mark.parametrize("api", ["http", "grpc"])
def test_triton_clients_on_this_host_keep_working(service: Any, objects: Objects, api: str) -> None:
    mod = tc_http if api == "http" else tc_grpc
    port = service.port if api == "http" else service.grpc_port
    client = mod.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.register_system_shared_memory("other", objects.make(), X.nbytes)
        assert "allowed_keys" in str(refused.value)
        assert "403" in str(refused.value.status()) or "PERMISSION_DENIED" in str(refused.value.status())
        in_key, out_key = objects.make(ALLOWED), objects.make(ALLOWED)
        client.register_system_shared_memory("in", in_key, X.nbytes)
        client.register_system_shared_memory("out", out_key, X.nbytes)
        inp = mod.InferInput("x", list(X.shape), "FP32")
        inp.set_shared_memory("in", X.nbytes)
        out = mod.InferRequestedOutput("probs")
        out.set_shared_memory("out", 40)
        output = client.infer("mlp", [inp], outputs=[out]).get_output("probs")
        shape = list(output["shape"] if api == "http" else output.shape)
        assert shape == [1, 10]
    finally:
        client.unregister_system_shared_memory()
        client.close()
