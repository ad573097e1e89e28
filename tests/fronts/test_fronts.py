"""Front worker processes (``[server] workers``): inference decoded on every core, batched in
the one serving process (appliance/fronts/pool.py, appliance/fronts/).

Every server here names ``--workers`` itself: the default (one per CPU) would make these
tests single-process on a one-CPU machine and prove nothing there.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import psutil
import pytest
import requests

from tests.support.servers import poll_until

MLP = "keras_mlp_tflite"
ROW = [round(0.01 * i, 2) for i in range(64)]


def models(models_dir: Path, tmp_path: Path, *names: str) -> Path:
    base = tmp_path / "models"
    for name in names:
        shutil.copytree(models_dir / name, base / name)
    return base


def served_by_workers(server: Any) -> int:
    return sum(w["served"] for w in server.status()["workers"])


def worker_pids(server: Any) -> list[int]:
    return [w["pid"] for w in server.status()["workers"]]


# The same requests to one process and to workers: every answer the same, byte for byte.
CASES = [
    ("POST", f"/v1/models/{MLP}:predict", {"instances": [ROW, ROW]}),
    ("POST", f"/v1/models/{MLP}:predict", {"inputs": {"x": [ROW]}}),
    ("POST", f"/v1/models/{MLP}/versions/1:predict", {"instances": [ROW]}),
    ("POST", "/v1/models/multisig_tflite:predict", {"signature_name": "mul", "inputs": {"a": [[2] * 4], "b": [[3] * 4]}}),
    ("POST", f"/v2/models/{MLP}/infer", {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": ROW}]}),
    ("POST", f"/v2/models/{MLP}/versions/1/infer",
     {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": ROW}], "outputs": [{"name": "probs"}]}),
    # client mistakes, answered with the manager's and the decoders' own words
    ("POST", "/v1/models/nope:predict", {"instances": [ROW]}),
    ("POST", f"/v1/models/{MLP}/versions/9:predict", {"instances": [ROW]}),
    ("POST", f"/v1/models/{MLP}/labels/stable:predict", {"instances": [ROW]}),
    ("POST", f"/v1/models/{MLP}:predict", b"{not json"),
    ("POST", f"/v1/models/{MLP}:predict", {"instances": [[1.0, 2.0]]}),
    ("POST", f"/v1/models/{MLP}:predict", {"signature_name": "nope", "instances": [ROW]}),
    ("POST", f"/v1/models/{MLP}:predict", {"inputs": {"y": [ROW]}}),
    ("POST", f"/v1/models/{MLP}:predict", {"instances": [ROW[:10], ROW]}),
    ("POST", "/v2/models/nope/infer", {"inputs": []}),
    ("POST", f"/v2/models/{MLP}/infer", {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "INT8", "data": ROW}]}),
    # forwarded to the serving process: metadata, status, health, the rest
    ("GET", f"/v1/models/{MLP}", None),
    ("GET", f"/v1/models/{MLP}/metadata", None),
    ("GET", f"/v2/models/{MLP}", None),
    ("GET", "/v2/health/ready", None),
    ("GET", "/healthz", None),
    ("GET", "/v1/models/nope", None),
    ("POST", "/api/sync", {}),
    ("GET", "/no/such/page", None),
]


def call(server: Any, method: str, path: str, body: Any) -> tuple[int, str, bytes]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body)
    r = requests.request(method, server.url + path, data=data, timeout=30)
    return r.status_code, r.headers.get("Content-Type", ""), r.content


def test_workers_answer_as_one_process_does(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    base = models(models_dir, tmp_path, MLP, "multisig_tflite")
    one = start_server("--models", str(base), "--backend", "tflite", "--workers", "1")
    two = start_server("--models", str(base), "--backend", "tflite", "--workers", "2")
    assert "workers" not in one.status()
    assert len(two.status()["workers"]) == 2
    for method, path, body in CASES:
        assert call(two, method, path, body) == call(one, method, path, body), (method, path, body)
    hot = sum(1 for method, path, _ in CASES if method == "POST" and path.endswith((":predict", "/infer")))
    two.wait_for(lambda: served_by_workers(two) >= hot, 30, f"the workers to count {hot} inference requests")


def test_one_worker_means_one_process(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    server = start_server("--models", str(models(models_dir, tmp_path, MLP)), "--backend", "tflite", "--workers", "1")
    assert psutil.Process(server.proc.pid).children() == []
    assert server.post(f"/v1/models/{MLP}:predict", {"instances": [ROW]}).status_code == 200


def test_a_port_the_workers_hold_is_refused_to_a_second_service(start_server: Any, models_dir: Path,
                                                                 tmp_path: Path) -> None:
    """SO_REUSEPORT would let a second service of the same user join the port and take half
    its connections: start-up refuses a port where anything listens, as TF Serving does."""
    base = models(models_dir, tmp_path, MLP)
    first = start_server("--models", str(base), "--backend", "tflite", "--workers", "2")
    second = start_server("--models", str(base), "--backend", "tflite", "--workers", "2",
                          "--state", str(tmp_path / "second"), port=first.port, ready=False)
    assert second.proc.wait(60) == 1
    assert f"cannot listen on 127.0.0.1:{first.port}" in second.log_text()
    assert first.post(f"/v1/models/{MLP}:predict", {"instances": [ROW]}).status_code == 200


def test_the_workers_requests_are_counted_by_the_service(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    server = start_server("--models", str(models(models_dir, tmp_path, MLP)), "--backend", "tflite", "--workers", "2")
    with requests.Session() as session:
        for _ in range(40):
            assert session.post(f"{server.url}/v1/models/{MLP}:predict", json={"instances": [ROW]}).status_code == 200
        assert session.post(f"{server.url}/v1/models/{MLP}:predict", data=b"[").status_code == 400

    def counted() -> bool:
        text = server.get("/monitoring/prometheus/metrics").text
        return (f'API="predict",entrypoint="REST",model_name="{MLP}",status="OK"}} 40.0' in text
                and f'API="predict",entrypoint="REST",model_name="{MLP}",status="INVALID_ARGUMENT"}} 1.0' in text)

    server.wait_for(counted, 30, "the metrics to count the workers' 40 answers and 1 refusal")
    server.wait_for(lambda: server.status()["models"][MLP]["requests"]["requests_per_s"] > 0, 30,
                    "the page's request rate to include them")
    server.wait_for(lambda: served_by_workers(server) >= 41, 30, "the workers' own count of what they served")


class Clients:
    """Threads posting predicts on keep-alive sessions until stopped; every outcome kept."""

    def __init__(self, url: str, threads: int):
        self.url = url
        self.stop = threading.Event()
        self.outcomes: list[tuple[float, str, str]] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, name=f"client-{i}") for i in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        with requests.Session() as session:
            while not self.stop.is_set():
                try:
                    r = session.post(self.url, json={"instances": [ROW]}, timeout=60)
                    kind = "ok" if r.status_code == 200 and "predictions" in r.json() else f"http {r.status_code}"
                    detail = r.text[:200]
                except requests.ConnectionError as exc:
                    refused = "Connection refused" in str(exc) or "[Errno 111]" in str(exc)
                    kind, detail = ("refused" if refused else "cut"), repr(exc)[:200]
                    session.close()
                except requests.RequestException as exc:
                    kind, detail = "cut", repr(exc)[:200]
                with self._lock:
                    self.outcomes.append((time.monotonic(), kind, detail))
                if kind == "refused":
                    return

    def count(self, kind: str = "ok") -> int:
        with self._lock:
            return sum(1 for _, k, _ in self.outcomes if k == kind)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)

    def failures(self, allowed: tuple[str, ...] = ("ok",)) -> list[tuple[float, str, str]]:
        with self._lock:
            return [o for o in self.outcomes if o[1] not in allowed]


def test_a_killed_worker_is_replaced_and_costs_only_its_connections(start_server: Any, models_dir: Path,
                                                                     tmp_path: Path) -> None:
    server = start_server("--models", str(models(models_dir, tmp_path, MLP)), "--backend", "tflite", "--workers", "2")
    clients = Clients(f"{server.url}/v1/models/{MLP}:predict", threads=6)
    try:
        server.wait_for(lambda: clients.count() >= 100, 60, "100 answered requests")
        victim = worker_pids(server)[0]
        assert victim in {c.pid for c in psutil.Process(server.proc.pid).children(recursive=True)}  # ours, by PID
        os.kill(victim, signal.SIGKILL)
        server.wait_for(lambda: victim not in worker_pids(server) and all(w["up"] for w in server.status()["workers"]),
                        60, "a new worker in the killed one's place")
        before = clients.count()
        server.wait_for(lambda: clients.count() >= before + 100, 60, "100 more answered requests")
    finally:
        clients.finish()
    failures = clients.failures()
    # The killed worker's connections end; nothing else fails. Each client can lose the request
    # in flight on its connection and, at most, the first on its new one: on SIGKILL the kernel
    # frees the process's memory before it closes its files, so for those milliseconds the dead
    # worker's listener is still in the SO_REUSEPORT group and a reconnection may be queued on
    # it, then reset (the suite on a loaded box saw 8 cuts with 6 clients).
    assert all(kind == "cut" for _, kind, _ in failures), failures
    assert len(failures) <= 2 * 6, failures
    events = [e for e in server.status()["events"] if e["kind"] == "worker_exited"]
    assert events and str(victim) in events[0]["message"] and "signal 9" in events[0]["message"]


def test_hot_swap_then_sigterm_under_load_fail_nothing(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    base = models(models_dir, tmp_path, MLP)
    server = start_server("--models", str(base), "--backend", "tflite", "--workers", "2", "--poll-interval", "0.2")
    clients = Clients(f"{server.url}/v1/models/{MLP}:predict", threads=6)
    try:
        server.wait_for(lambda: clients.count() >= 100, 60, "100 answered requests")
        stage = tmp_path / "stage"
        shutil.copytree(base / MLP / "1", stage)
        stage.rename(base / MLP / "2")
        server.wait_for(lambda: server.status()["models"][MLP]["serving_version"] == 2 and
                        [v["state"] for v in server.status()["models"][MLP]["versions"]] == ["AVAILABLE", "END"],
                        60, "version 2 to replace version 1")
        before = clients.count()
        server.wait_for(lambda: clients.count() >= before + 100, 60, "100 answers after the swap")
        assert server.get(f"/v1/models/{MLP}/metadata").json()["model_spec"]["version"] == "2"
        sigterm_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    finally:
        clients.finish()
    assert clients.failures(allowed=("ok", "refused")) == []
    assert any(t > sigterm_at and kind == "ok" for t, kind, _ in clients.outcomes) or clients.count("refused")
    assert "did not exit in time" not in server.log_text()


def test_the_view_is_pushed_and_a_stale_one_never_gives_a_wrong_answer(models_dir: Path, tmp_path: Path) -> None:
    """The serving view reaches a worker when the manager's state changes (pushed, not polled);
    one that lacks a model is completed by asking (RESOLVE); inputs decoded for a version whose
    signature the answering version does not share run on the version decoded for while it is
    loaded (here v1, the MLP, beside a v2 with other inputs), and once it is gone the answer is
    a retryable 503, never a wrong one. On the front path's loop, as the HTTP server runs it."""
    import asyncio

    from appliance.api.app import create_app
    from appliance.core.appliance import Appliance
    from appliance.core.config import Config, ModelConfig
    from appliance.fronts import messages as m
    from appliance.fronts.app import Forwarder, FrontApp, hot_mounts
    from appliance.fronts.link import Link
    from appliance.fronts.remote import RemoteCore
    from appliance.fronts.serving import FrontService
    from appliance.fronts.view import ModelView, ServingView, version_view
    from appliance.transport.channel import ChannelProtocol, Codec
    from runtimes import SignatureInfo

    base = models(models_dir, tmp_path, MLP)
    shutil.copytree(models_dir / "multisig_tflite" / "1", base / MLP / "2")  # v2: other inputs
    config = Config()
    config.state_dir = str(tmp_path / "state")
    config.models = [ModelConfig(name=MLP, base_path=str(base / MLP), version_policy="all")]
    config.runtime.backend = "tflite"
    core = Appliance(config).start()
    front = FrontService(core, create_app(config, core), threads=2)
    front.start()
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    ours, theirs = socket.socketpair()
    remote: list[RemoteCore] = []

    def pushed(message: Any) -> None:
        if isinstance(message, m.ViewPush) and remote:
            remote[0].handles.view = m.view_from_plain(message)

    link = Link(pushed)
    remote.append(RemoteCore(config, link))

    async def connect() -> None:
        _, proto = await loop.connect_accepted_socket(
            lambda: ChannelProtocol(Codec(m.ToWorker), link.on_message, link.on_lost), ours)
        link.attach(loop, proto)

    try:
        asyncio.run_coroutine_threadsafe(connect(), loop).result(10)
        front.attach(0, theirs)
        poll_until(lambda: core.ready() and set(remote[0].handles.view.models.get(MLP, ModelView({}, {}, None))
                                                .versions) == {1, 2}, 60, "both versions in the pushed view")
        app = FrontApp(remote[0], hot_mounts(remote[0]), Forwarder(link))
        body = json.dumps({"instances": [ROW]}).encode()

        def answer(path: str) -> tuple[str, dict[str, Any]]:
            environ = {"REQUEST_METHOD": "POST", "PATH_INFO": path, "REQUEST_URI": path,
                       "CONTENT_LENGTH": str(len(body)), "wsgi.input": io.BytesIO(body), "wsgi.url_scheme": "http"}
            fast = app.route(environ)
            assert fast is not None
            status, _, data = asyncio.run_coroutine_threadsafe(fast(environ), loop).result(30)
            return status, json.loads(data)

        v1 = remote[0].handles.view.models[MLP].versions[1]
        # decoded for v1 (the MLP) while the serving process answers unversioned requests with v2
        remote[0].handles.view = ServingView(1, {MLP: ModelView({}, {1: v1}, 1)})
        status, out = answer(f"/v1/models/{MLP}:predict")
        assert status == "200 OK", out
        assert np.asarray(out["predictions"]).shape == (1, 10)
        # a view that lacks the model: asked for (RESOLVE), answered by what the manager picks
        remote[0].handles.view = ServingView(1, {})
        status, out = answer(f"/v1/models/{MLP}/versions/1:predict")
        assert status == "200 OK", out
        # decoded for a version that is gone, with inputs no loaded version takes: 503, retry
        real = v1.signatures["serving_default"]
        wrong = SignatureInfo("serving_default", {"y": real.inputs["x"]}, dict(real.outputs))
        gone = version_view(7, "/gone", "tflite", False, {"serving_default": wrong})
        remote[0].handles.view = ServingView(1, {MLP: ModelView({}, {7: gone}, 7)})
        status, out = answer(f"/v1/models/{MLP}:predict")
        assert status.startswith("503"), out
        assert "retry" in out["error"] and "version 7" in out["error"], out
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        front.close()
        core.close()


@contextlib.contextmanager
def serving_side(models_dir: Path, tmp_path: Path, app: Any) -> Iterator[tuple[Any, Any]]:
    """A ``FrontService`` over the MLP with ``app`` as its WSGI app, and ``call(kind, payload)``:
    a request (made with ``link.next_id()``) sent as a worker sends it, its reply awaited."""
    import asyncio

    from appliance.core.appliance import Appliance
    from appliance.core.config import Config, ModelConfig
    from appliance.fronts import messages as m
    from appliance.fronts.link import Link
    from appliance.fronts.serving import FrontService
    from appliance.transport.channel import ChannelProtocol, Codec

    config = Config()
    config.state_dir = str(tmp_path / "state")
    config.models = [ModelConfig(name=MLP, base_path=str(models(models_dir, tmp_path, MLP) / MLP))]
    config.runtime.backend = "tflite"
    core = Appliance(config).start()
    front = FrontService(core, app, threads=2)
    front.start()
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    ours, theirs = socket.socketpair()
    link = Link(lambda message: None)

    async def connect() -> None:
        _, proto = await loop.connect_accepted_socket(
            lambda: ChannelProtocol(Codec(m.ToWorker), link.on_message, link.on_lost), ours)
        link.attach(loop, proto)

    def call(make: Callable[[int], Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(link.call(make(link.next_id())), loop).result(30)

    try:
        asyncio.run_coroutine_threadsafe(connect(), loop).result(10)
        front.attach(0, theirs)
        poll_until(core.ready, 60, "the MLP loaded")
        yield front, call
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(10)
        front.close()
        core.close()


def test_forwarded_inference_is_answered_on_the_serving_loop(models_dir: Path, tmp_path: Path) -> None:
    """A request a worker forwards whole that the serving process's front path takes (a v2
    infer naming shared-memory regions is one: only that process reads the regions) is
    answered on its loop by the API family, as in one process: not through the WSGI app and
    its thread pool; so is ``GET /v1/models/{name}`` (TF Serving's model status, on OpenAI's model
    path). Anything else forwarded still goes to the app."""
    from appliance.fronts import messages as m

    called: list[str] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        called.append(environ["PATH_INFO"])
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"the app"]

    def forwarded(method: str, path: str, body: bytes = b"") -> Any:
        environ = {"REQUEST_METHOD": method, "PATH_INFO": path, "REQUEST_URI": path, "CONTENT_LENGTH": str(len(body)),
                   "CONTENT_TYPE": "application/json", "wsgi.url_scheme": "http"}
        return call(lambda ident: m.Forward(ident, environ, body))

    with serving_side(models_dir, tmp_path, app) as (front, call):
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": ROW}]}).encode()
        reply = forwarded("POST", f"/v2/models/{MLP}/infer", body)
        assert isinstance(reply, m.Answer) and reply.status == "200 OK", reply
        assert np.asarray(json.loads(reply.body)["outputs"][0]["data"]).size == 10
        reply = forwarded("POST", "/v2/models/nope/infer", body)
        assert reply.status.startswith("404") and b"nope" in reply.body, reply  # the family's own error, on the loop too
        assert called == []
        reply = forwarded("GET", f"/v1/models/{MLP}")  # TF Serving's model status: on the loop too (issue 45)
        assert reply.status == "200 OK" and b"model_version_status" in reply.body and called == [], reply
        reply = forwarded("GET", f"/v1/models/{MLP}/metadata")
        assert (reply.status, reply.body, called) == ("200 OK", b"the app", [f"/v1/models/{MLP}/metadata"])
        assert front._runs == 0  # those answered on the loop counted in flight while they ran, and out


def test_a_lone_run_from_the_workers_is_told_it_is_alone(models_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A RUN that is the only one in flight from all the workers reaches the batch queue with a
    request context saying so, passed along the call (core/request_context.py; a quick model's
    lone call then runs on the serving loop, core/batcher.py); once it is answered, or has
    failed, the next is alone again. So is a request forwarded whole (its environ carries the
    context to its REST family)."""
    from appliance.core import batcher as batcher_module
    from appliance.core.request_context import RequestContext
    from appliance.fronts import messages as m

    told: list[bool] = []
    submit = batcher_module.Batcher.submit

    async def recording(self: Any, signature: str, inputs: Any, context: RequestContext | None = None) -> Any:
        assert context is not None, "the serving side passed no request context"
        told.append(context.is_alone())
        return await submit(self, signature, inputs, context)

    monkeypatch.setattr(batcher_module.Batcher, "submit", recording)
    row = np.asarray([ROW], dtype=np.float32)
    with serving_side(models_dir, tmp_path, lambda environ, start_response: []) as (front, call):
        def run(version: int | None) -> Any:
            return call(lambda ident: m.Run(ident, MLP, version, None, {}, "serving_default", {"x": row}, 1))

        for _ in range(3):
            reply = run(None)
            assert isinstance(reply, m.Ran) and reply.outputs["probs"].shape == (1, 10), reply
        assert isinstance(run(9), m.Failed)  # no such version: failed, and no longer in flight
        assert isinstance(run(None), m.Ran)
        assert told == [True] * 4 and front._runs == 0
        # a request a worker forwards whole, answered by its REST family on this loop: the
        # context rides on its environ, and the family hands it to ``run`` (KServe, TF Serving)
        infer = json.dumps({"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": ROW}]}).encode()
        predict = json.dumps({"instances": [ROW]}).encode()
        for path, body in ((f"/v2/models/{MLP}/infer", infer), (f"/v1/models/{MLP}:predict", predict)):
            environ = {"REQUEST_METHOD": "POST", "PATH_INFO": path, "REQUEST_URI": path,
                       "CONTENT_LENGTH": str(len(body)), "CONTENT_TYPE": "application/json", "wsgi.url_scheme": "http"}
            reply = call(lambda ident: m.Forward(ident, environ, body))
            assert isinstance(reply, m.Answer) and reply.status == "200 OK", reply
        assert told == [True] * 6 and front._runs == 0
        # a gRPC call a worker forwards: the context rides on its call context (KServe ModelInfer)
        from appliance.protos.kserve import pb

        grpc_request = pb.ModelInferRequest(model_name=MLP)
        grpc_request.inputs.add(name="x", datatype="FP32", shape=[1, 64]).contents.fp32_contents.extend(ROW)
        reply = call(lambda ident: m.GrpcCall(ident, "/inference.GRPCInferenceService/ModelInfer",
                                              grpc_request.SerializeToString(), m.metadata(()), None, "ipv4:127.0.0.1:1"))
        assert isinstance(reply, m.GrpcDone), reply
        assert told == [True] * 7 and front._runs == 0


def test_grpc_through_the_workers_answers_as_one_process(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    """The gRPC port served by the workers (Predict there; model status forwarded): the real
    TF Serving client gets the answers, codes and texts one process gives."""
    import grpc

    pytest.importorskip("tensorflow_serving.apis.prediction_service_pb2_grpc")
    from tensorflow_serving.apis import get_model_status_pb2, model_service_pb2_grpc, predict_pb2
    from tensorflow_serving.apis import prediction_service_pb2_grpc

    from appliance.api.tfserving.grpc_service import to_tensor
    from tests.support.servers import free_port

    base = models(models_dir, tmp_path, MLP)
    servers = [start_server("--models", str(base), "--backend", "tflite", "--workers", w, "--grpc-port", str(free_port()))
               for w in ("1", "2")]
    assert servers[1].status()["grpc"]["served_by"] == "front workers"
    assert "served_by" not in servers[0].status()["grpc"]

    def calls(server: Any) -> list[Any]:
        port = int(server.status()["grpc"]["addresses"][0].rsplit(":", 1)[1])
        out = []
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            predict = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict
            status = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus
            for name in (MLP, "nope"):
                request = predict_pb2.PredictRequest()
                request.model_spec.name = name
                to_tensor(np.asarray([ROW], np.float32), request.inputs["x"])
                for call, message in ((predict, request),
                                      (status, get_model_status_pb2.GetModelStatusRequest(model_spec={"name": name}))):
                    try:
                        out.append(call(message, timeout=30).SerializeToString(deterministic=True))
                    except grpc.RpcError as exc:
                        out.append((exc.code(), exc.details()))
        return out

    one, two = (calls(s) for s in servers)
    assert one == two
    assert isinstance(one[0], bytes) and one[2][0] == grpc.StatusCode.NOT_FOUND
    servers[1].wait_for(lambda: 'entrypoint="GRPC"' in servers[1].get("/monitoring/prometheus/metrics").text, 30,
                        "the workers' gRPC calls in the service's metrics")


def test_v2_statistics_count_what_the_workers_answered(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    """Triton's statistics are the serving process's: inference the workers decode and answer
    (REST and gRPC ModelInfer) counts there, and ModelStatistics / /stats (forwarded) show it."""
    tc_grpc = pytest.importorskip("tritonclient.grpc")
    from tests.support.servers import free_port

    grpc_port = free_port()
    server = start_server("--models", str(models(models_dir, tmp_path, MLP)), "--backend", "tflite",
                          "--workers", "2", "--grpc-port", str(grpc_port))
    assert server.status()["grpc"]["served_by"] == "front workers"
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64], "data": ROW}]}
    for _ in range(3):
        assert server.post(f"/v2/models/{MLP}/infer", body).status_code == 200
    client = tc_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    try:
        x = tc_grpc.InferInput("x", [1, 64], "FP32")
        x.set_data_from_numpy(np.asarray([ROW], np.float32))
        client.infer(MLP, [x])
        stats = client.get_inference_statistics(MLP).model_stats[0]
    finally:
        client.close()
    assert stats.inference_stats.success.count == 4 and stats.inference_count == 4
    assert server.get(f"/v2/models/{MLP}/stats").json()["model_stats"][0]["inference_stats"]["success"]["count"] == 4
