"""The aarch64 smoke suite run by scripts/arm64-check.sh (see there).

    python scripts/arm64_smoke.py prepare OUT            # on the host, with TensorFlow: the models
    python scripts/arm64_smoke.py device MODELS OUT.json  # on the device, in the LiteRT-only venv

``prepare`` builds with tests/support/modelgen.py a TFLite model folder (``folder/``: the Keras MLP,
the two-signature model, the model without signature defs), a ``half_plus_three`` LiteRT
model (``v2/``: the hot-swap version) and the MLP's answer on this host's LiteRT
(``reference.json``), so the device's answers are compared across architectures.

``device`` uses only what the LiteRT-only install has: the ``appliance`` command of the
venv it runs in, grpcio, and the project's own message modules (appliance/protos/tfserving,
appliance/protos/kserve; tensorflow-serving-api would need TensorFlow). Every step waits for
a condition with a deadline that names it, and any wrong answer fails the run.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

READY_TIMEOUT = 600  # seconds: a first start under qemu-user imports numpy, grpc, LiteRT emulated
MLP_INPUT = [[(i % 7) / 7.0 - 0.4 for i in range(64)]]


# ------------------------------------------------------------------ host: models
def prepare(out: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import numpy as np
    import tensorflow as tf

    from tests.support import modelgen

    modelgen.build_keras_mlp_tflite(out / "folder" / "mlp" / "1")
    modelgen.build_multisig_tflite(out / "folder" / "multisig" / "1")
    modelgen.build_nosig_tflite(out / "folder" / "nosig" / "1")

    class HalfPlusThree(tf.Module):  # the sample's LiteRT model (scripts/make_sample_model.py), b = 3
        @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
        def serve(self, x):
            return {"y": 0.5 * x + 3.0}

    module = HalfPlusThree()
    converter = tf.lite.TFLiteConverter.from_concrete_functions([module.serve.get_concrete_function()], module)
    (out / "v2").mkdir(parents=True)
    (out / "v2" / "model.tflite").write_bytes(converter.convert())
    ref = modelgen.reference_predict_tflite(str(out / "folder" / "mlp" / "1" / "model.tflite"),
                                            {"x": np.array(MLP_INPUT, np.float32)})
    probs = next(iter(ref.values())) if isinstance(ref, dict) else ref
    (out / "reference.json").write_text(json.dumps({"mlp": np.asarray(probs).tolist()}))
    print(f"smoke models in {out}")


# ------------------------------------------------------------------ device: helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, server: "Server | None" = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if server is not None and server.proc.poll() is not None:
            raise AssertionError(f"the service exited ({server.proc.returncode}) while waiting for {what}:\n"
                                 f"{server.log_tail()}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                         f"{server.log_tail() if server else ''}")


def http(method: str, url: str, body: Any = None, timeout: float = 60) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, code = r.read(), r.status
    except urllib.error.HTTPError as exc:
        raw, code = exc.read(), exc.code
    try:
        return code, json.loads(raw)
    except ValueError:
        return code, raw.decode(errors="replace")


def appliance_cmd() -> str:
    return str(Path(sys.executable).parent / "appliance")  # the venv's console script, as a device runs it


class Server:
    def __init__(self, args: list[str], state: Path, log: Path):
        self.port, self.grpc_port = free_port(), free_port()
        self.state, self.log = state, log
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [appliance_cmd(), "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--grpc-port", str(self.grpc_port), "--state", str(state), "--no-discovery", *args]
        self.t0 = time.perf_counter()
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd="/",
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""

    def ready(self) -> bool:
        try:
            return http("GET", self.url + "/readyz", timeout=5)[0] == 200
        except OSError:
            return False

    def wait_ready(self) -> float:
        wait_for(self.ready, READY_TIMEOUT, f"/readyz 200 on {self.url}", self)
        return time.perf_counter() - self.t0

    def get(self, path: str) -> Any:
        code, body = http("GET", self.url + path)
        assert code == 200, f"GET {path}: {code} {body}"
        return body

    def predict(self, model: str, body: Any) -> Any:
        code, answer = http("POST", f"{self.url}/v1/models/{model}:predict", body)
        assert code == 200, f"{model}:predict -> {code} {answer}"
        return answer

    def rss_mb(self) -> float:
        import psutil

        return round(psutil.Process(self.proc.pid).memory_info().rss / 2**20, 1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
                raise AssertionError(f"the service ignored SIGTERM for 120 s\n{self.log_tail()}")
        assert self.proc.returncode == 0, f"the service exited with {self.proc.returncode}\n{self.log_tail()}"


def close(a: list[float], b: list[float], tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


def flat(value: Any) -> list[float]:
    if isinstance(value, list):
        return [x for v in value for x in flat(v)]
    return [float(value)]


# ------------------------------------------------------------------ device: gRPC
def tfs_predict(port: int, model: str, name: str, values: list[float], shape: list[int]) -> tuple[list[float], int]:
    """TF Serving's PredictionService/Predict with the project's own messages."""
    import grpc
    import numpy as np

    from appliance.protos.tfserving import pb

    req = pb.PredictRequest()
    req.model_spec.name = model
    tensor = req.inputs[name]
    tensor.dtype = pb.enum_value("tensorflow.DataType", "DT_FLOAT")
    for d in shape:
        tensor.tensor_shape.dim.add().size = d
    tensor.float_val.extend(values)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary("/tensorflow.serving.PredictionService/Predict",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=pb.PredictResponse.FromString)
        resp = call(req, timeout=60)
    out = next(iter(resp.outputs.values()))
    got = list(out.float_val) or np.frombuffer(out.tensor_content, np.float32).tolist()
    return got, resp.model_spec.version.value


def v2_infer(port: int, model: str, name: str, values: list[float], shape: list[int]) -> list[float]:
    """KServe v2 GRPCInferenceService/ModelInfer (and ServerReady) with the project's messages."""
    import grpc
    import numpy as np

    from appliance.protos.kserve import pb

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        def call(method: str, req: Any, resp: Any) -> Any:
            return channel.unary_unary(f"/inference.GRPCInferenceService/{method}",
                                       request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=resp.FromString)(req, timeout=60)

        assert call("ServerReady", pb.ServerReadyRequest(), pb.ServerReadyResponse).ready, "v2 ServerReady: false"
        req = pb.ModelInferRequest(model_name=model)
        inp = req.inputs.add()
        inp.name, inp.datatype = name, "FP32"
        inp.shape.extend(shape)
        inp.contents.fp32_contents.extend(values)
        resp = call("ModelInfer", req, pb.ModelInferResponse)
    if resp.raw_output_contents:
        return np.frombuffer(resp.raw_output_contents[0], np.float32).tolist()
    return list(resp.outputs[0].contents.fp32_contents)


# ------------------------------------------------------------------ device: the suite
def device(models: Path, out_json: Path) -> None:
    import importlib.metadata

    import appliance

    results: dict[str, Any] = {"machine": platform.machine(), "python": platform.python_version()}
    step = lambda msg: print(f"  ok  {msg}", flush=True)  # noqa: E731
    assert platform.machine() == "aarch64", f"not on aarch64 but {platform.machine()}"
    assert "site-packages" in appliance.__file__, f"appliance imported from {appliance.__file__}, not the install"
    litert = importlib.metadata.version("ai-edge-litert")
    results["litert"] = f"ai-edge-litert {litert}"
    step(f"aarch64 Python {results['python']}, {results['litert']}, appliance from the venv")

    # appliance probe: the device, and which LiteRT it found
    probe = subprocess.run([appliance_cmd(), "probe"], capture_output=True, text=True, timeout=300, cwd="/")
    assert probe.returncode == 0, probe.stderr
    print("    " + probe.stdout.strip().replace("\n", "\n    "))
    assert "aarch64" in probe.stdout.split("\n")[0], probe.stdout
    tflite_line = next(line for line in probe.stdout.splitlines() if line.strip().startswith("tflite"))
    assert " available" in tflite_line and f"ai_edge_litert {litert}" in tflite_line, tflite_line
    pj = json.loads(subprocess.run([appliance_cmd(), "probe", "--json"], capture_output=True, text=True,
                                   timeout=300, cwd="/", check=True).stdout)
    assert pj["device"]["machine"] == "aarch64" and not pj["backends"]["tf-cpu"]["available"], pj
    step(f"appliance probe: aarch64, tflite available with ai_edge_litert {litert}, tf-cpu unavailable")

    work = Path(tempfile.mkdtemp(prefix="arm64-smoke-"))
    config = work / "appliance.toml"
    # Fast polls for the swap below. A longer queue-wait budget than the default 2 s: emulated
    # code runs several times slower than a board's, and while v2 loads next to the swap
    # traffic the default budget sheds requests (503 + Retry-After, seen once on LiteRT 1.4.0).
    # Shedding stays on, scaled; any non-200 answer during the swap still fails the check.
    config.write_text("[sync]\npoll_interval_s = 1.0\njitter = 0.0\n\n[limits]\nmax_queue_wait_s = 30.0\n")

    # the embedded default: no models, no bucket: the bundled sample through a folder bucket
    state = work / "state"
    server = Server(["--config", str(config)], state, work / "embedded.log")
    try:
        results["first_start_s"] = round(server.wait_ready(), 1)
        step(f"embedded default ready after {results['first_start_s']} s (first start)")
        answer = server.predict("half_plus_two", {"instances": [1.0, 2.0, 5.0]})
        assert answer == {"predictions": [2.5, 3.0, 4.5]}, answer
        step("REST predict half_plus_two [1, 2, 5] -> [2.5, 3.0, 4.5]")
        got, version = tfs_predict(server.grpc_port, "half_plus_two", "x", [1.0, 2.0, 5.0], [3])
        assert got == [2.5, 3.0, 4.5] and version == 1, (got, version)
        step("gRPC tensorflow.serving.PredictionService/Predict -> [2.5, 3.0, 4.5], version 1")
        got = v2_infer(server.grpc_port, "half_plus_two", "x", [1.0, 2.0, 5.0], [3])
        assert got == [2.5, 3.0, 4.5], got
        step("gRPC inference.GRPCInferenceService/ModelInfer -> [2.5, 3.0, 4.5]")
        status = server.get("/api/status")
        v1 = status["models"]["half_plus_two"]["versions"][0]
        assert status["device"]["machine"] == "aarch64", status["device"]
        assert v1["backend"] == "tflite" and v1["state"] == "AVAILABLE", v1
        assert "tensorflow" not in status["service"]["imported"], status["service"]
        assert "ai_edge_litert" in status["service"]["imported"], status["service"]
        assert status["service"]["ready"] is True, status["service"]
        step("/api/status: aarch64, half_plus_two v1 AVAILABLE on tflite, TensorFlow never imported")
        results["rss_idle_mb"] = server.rss_mb()

        # hot swap: publish v2 (b = 3) into the folder bucket while requests flow
        bucket = f"file://{state}/bucket"
        seen: dict[str, int] = {}
        failures: list[str] = []
        stop = threading.Event()

        def traffic() -> None:
            deadline = time.monotonic() + READY_TIMEOUT
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    code, body = http("POST", f"{server.url}/v1/models/half_plus_two:predict",
                                      {"instances": [1.0, 2.0, 5.0]}, timeout=60)
                    key = json.dumps(body) if code == 200 else f"{code} {body}"
                except OSError as exc:
                    key = f"error {exc}"
                seen[key] = seen.get(key, 0) + 1
                if not key.startswith("{"):
                    failures.append(key)

        worker = threading.Thread(target=traffic, daemon=True)  # requests flow before, during and after
        worker.start()
        wait_for(lambda: sum(seen.values()) >= 3, 120, "the first requests of the swap traffic", server)
        t_pub = time.perf_counter()
        pub = subprocess.run([appliance_cmd(), "publish", str(models / "v2"), "--bucket", bucket,
                              "--model", "half_plus_two", "--version", "2", "--compat", "aarch64",
                              "--compat", "tflite"], capture_output=True, text=True, timeout=300, cwd="/")
        assert pub.returncode == 0, pub.stderr + pub.stdout
        new = {"predictions": [3.5, 4.0, 5.5]}
        wait_for(lambda: server.predict("half_plus_two", {"instances": [1.0, 2.0, 5.0]}) == new, READY_TIMEOUT,
                 "version 2 (half_plus_three) to answer after `appliance publish`", server)
        results["swap_s"] = round(time.perf_counter() - t_pub, 1)
        new_key = json.dumps(new)
        wait_for(lambda: seen.get(new_key, 0) >= 3, 120, "the swap traffic to see version 2", server)
        stop.set()
        worker.join(120)
        results["swap_requests"] = sum(seen.values())
        old_key = json.dumps({"predictions": [2.5, 3.0, 4.5]})
        assert not failures and set(seen) == {old_key, new_key}, f"answers during the swap: {seen}"
        results["swap_answers"] = {"v1": seen[old_key], "v2": seen[new_key]}
        got, version = tfs_predict(server.grpc_port, "half_plus_two", "x", [1.0, 2.0, 5.0], [3])
        assert got == [3.5, 4.0, 5.5] and version == 2, (got, version)
        wait_for(lambda: [v["version"] for v in server.get("/api/status")["models"]["half_plus_two"]["versions"]
                          if v["state"] == "AVAILABLE"] == [2], 120, "version 1 to be drained and unloaded", server)
        step(f"hot swap from {bucket}: v2 serving {results['swap_s']} s after publish; {results['swap_requests']} "
             f"requests across it ({seen[old_key]} answered by v1, {seen[new_key]} by v2), none failed")

        # a version made for another machine is refused; v2 keeps serving
        pub = subprocess.run([appliance_cmd(), "publish", str(models / "v2"), "--bucket", bucket,
                              "--model", "half_plus_two", "--version", "3", "--compat", "x86_64"],
                             capture_output=True, text=True, timeout=300, cwd="/")
        assert pub.returncode == 0, pub.stderr + pub.stdout

        def refused() -> bool:
            events = server.get("/api/status")["events"]
            return any(e.get("version") == 3 and "x86_64" in json.dumps(e) for e in events)

        wait_for(refused, 300, "version 3 (compat x86_64) to be refused in /api/status events", server)
        assert server.predict("half_plus_two", {"instances": [1.0]}) == {"predictions": [3.5]}
        step("a version published for x86_64 is refused on aarch64; v2 keeps serving")
        code, _ = http("GET", server.url + "/readyz")
        assert code == 200, code
    finally:
        server.stop()
    step("SIGTERM: the service drained and exited 0")

    # restarts: the backend decision is cached, the synced store is served
    restarts = []
    for i in range(2):
        server = Server(["--config", str(config)], state, work / "embedded.log")
        try:
            restarts.append(round(server.wait_ready(), 1))
            assert server.predict("half_plus_two", {"instances": [1.0]}) == {"predictions": [3.5]}
        finally:
            server.stop()
    results["restarts_s"] = restarts
    results["cold_start_s"] = round(statistics.median(restarts), 1)
    step(f"restarts ready after {restarts} s, serving v2 from the store")

    # a TFLite model folder (TF Serving base directory)
    folder = work / "folder"
    shutil.copytree(models / "folder", folder)
    reference = json.loads((models / "reference.json").read_text())
    server = Server(["--models", str(folder), "--poll-interval", "1"], work / "state-folder", work / "folder.log")
    try:
        seconds = server.wait_ready()
        step(f"TFLite folder (mlp, multisig, nosig) ready after {seconds:.1f} s")
        probs = server.predict("mlp", {"instances": MLP_INPUT})["predictions"]
        assert close(flat(probs), flat(reference["mlp"])), (probs, reference["mlp"])
        step("REST mlp: the aarch64 answer matches x86-64 LiteRT's to 1e-4")
        got, _ = tfs_predict(server.grpc_port, "mlp", "x", MLP_INPUT[0], [1, 64])
        assert close(got, flat(reference["mlp"])), got
        got = v2_infer(server.grpc_port, "mlp", "x", MLP_INPUT[0], [1, 64])
        assert close(got, flat(reference["mlp"])), got
        step("gRPC mlp (TF Serving Predict and KServe v2 ModelInfer) match too")
        a, b = [[1.0, 2.0, 3.0, 4.0]], [[10.0, 20.0, 30.0, 40.0]]
        for sig, want in (("add", [11.0, 22.0, 33.0, 44.0]), ("mul", [10.0, 40.0, 90.0, 160.0])):
            answer = server.predict("multisig", {"signature_name": sig, "inputs": {"a": a, "b": b}})["outputs"]
            got = flat(next(iter(answer.values())) if isinstance(answer, dict) else answer)
            assert got == want, (sig, answer)
        step("REST multisig: signatures add and mul")
        answer = server.predict("nosig", {"instances": [[3.0]]})
        assert flat(answer["predictions"]) == [7.0], answer
        step("REST nosig (no signature defs): 2x + 1 at 3 -> 7")
        status = server.get("/api/status")
        for name in ("mlp", "multisig", "nosig"):
            version = status["models"][name]["versions"][0]
            assert version["backend"] == "tflite" and version["state"] == "AVAILABLE", (name, version)
        assert "tensorflow" not in status["service"]["imported"], status["service"]
        results["rss_idle_folder_mb"] = server.rss_mb()
        step("/api/status: every folder model AVAILABLE on tflite")
    finally:
        server.stop()
    shutil.rmtree(work, ignore_errors=True)
    out_json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]))
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "device":
        try:
            device(Path(sys.argv[2]), Path(sys.argv[3]))
        except AssertionError as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            return 1
        print("arm64 smoke: all checks passed")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
