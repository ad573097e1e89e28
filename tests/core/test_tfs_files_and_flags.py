"""tensorflow_model_server's config files and flags: a TF Serving start-up line and a
``models.config`` start the service unchanged; the config file is followed while serving."""

from __future__ import annotations

import shutil
import sys
import threading
from pathlib import Path

import pytest

from appliance.core import tfs_files as tfs_config
from appliance.commands import tfs as tfs_flags
from appliance.core.config_file import load as load_config
from appliance.core.errors import ConfigError
from tests.support.servers import Server, free_port, poll_until, spawn

MODELS_CONFIG = """
model_config_list {{
  config {{
    name: "hpt"
    base_path: "{hpt}"
    model_platform: "tensorflow"
    model_version_policy {{ specific {{ versions: 1 versions: 2 }} }}
    version_labels {{ key: "stable" value: 1 }}
    version_labels {{ key: "canary" value: 2 }}
  }}
  config {{
    name: "mlp"
    base_path: "{mlp}"
    model_platform: "tflite"
  }}
}}
"""
BATCHING = """max_batch_size { value: 16 }
batch_timeout_micros { value: 500 }
max_enqueued_batches { value: 8 }
num_batch_threads { value: 2 }
allowed_batch_sizes: 4
allowed_batch_sizes: 16
"""


# -- the flags, parsed ---------------------------------------------------------------------
def test_tf_serving_flags_map_to_config_keys() -> None:
    overrides, ours, warnings = tfs_flags.parse([
        "--port=8500", "--rest_api_port", "8501", "--model_name=m", "--model_base_path=/models/m",
        "--enable_batching", "--batching_parameters_file=/b.txt", "--file_system_poll_wait_seconds=3",
        "--tensorflow_intra_op_parallelism=2", "--tensorflow_inter_op_parallelism", "1",
        "--rest_api_num_threads=8", "--rest_api_timeout_in_ms=5000", "--prefer_tflite_model=true",
        "--enable_model_warmup=false", "--per_process_gpu_memory_fraction=0.5", "--state", "/s"])
    assert overrides["grpc.port"] == 8500 and overrides["server.port"] == 8501
    assert overrides["model_name"] == "m" and overrides["models_dir"] == "/models/m"
    assert overrides["batching.enable_batching"] is True and overrides["tfs.batching_parameters_file"] == "/b.txt"
    assert overrides["poll_interval_s"] == 3.0 and overrides["server.threads"] == 8
    assert overrides["runtime.tf.intra_op_threads"] == 2 and overrides["runtime.tf.inter_op_threads"] == 1
    assert overrides["limits.request_timeout_s"] == 5.0 and overrides["runtime.prefer_tflite_below_mb"] > 0
    assert ours == {"state": "/s"}
    assert any("per_process_gpu_memory_fraction" in w and "ignored" in w for w in warnings)
    assert any("enable_model_warmup" in w for w in warnings)


@pytest.mark.parametrize("argv, words", [
    (["--no_such_flag=1"], ["unknown flag", "no_such_flag"]),
    (["--enable_batching=maybe"], ["enable_batching", "true or false"]),
    (["--port=eighty"], ["--port", "integer"]),
    (["--model_name=m"], ["--model_base_path"]),
])
def test_bad_flags_are_named(argv: list[str], words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        tfs_flags.parse(argv)
    for word in words:
        assert word in str(err.value)


# -- the files, parsed ---------------------------------------------------------------------
def test_model_config_file_becomes_the_models(tmp_path: Path) -> None:
    path = tmp_path / "models.config"
    path.write_text(MODELS_CONFIG.format(hpt="/m/hpt", mlp="/m/mlp"))
    (tmp_path / "batching.txt").write_text(BATCHING)
    config = load_config(None, {"tfs.model_config_file": str(path),
                                "tfs.batching_parameters_file": str(tmp_path / "batching.txt")})
    hpt, mlp = config.models
    assert (hpt.name, hpt.base_path, hpt.version_policy, hpt.versions) == ("hpt", "/m/hpt", "specific", [1, 2])
    assert hpt.labels == {"stable": 1, "canary": 2} and mlp.version_policy == "latest"
    assert (config.batching.max_batch_size, config.batching.batch_timeout_micros, config.batching.max_enqueued_batches,
            config.batching.num_batch_threads, config.batching.allowed_batch_sizes) == (16, 500, 8, 2, [4, 16])


@pytest.mark.parametrize("text, words", [
    # protobuf's C++ text parser (TF Serving's) puts an unknown field at the token after its name
    ('model_config_list {\n  config {\n    name: "a"\n    base_pat: "/x"\n  }\n}\n',
     ['Error parsing text-format tensorflow.serving.ModelServerConfig: 4:13: Message type '
      '"tensorflow.serving.ModelConfig" has no field named "base_pat".']),
    ('model_config_list {\n\tconfig {\n\t\tbase_pat\t# why\n  : "/x"\n  }\n}\n',  # a tab is 8 columns there
     ['ModelServerConfig: 4:3: Message type "tensorflow.serving.ModelConfig" has no field named "base_pat".']),
    ('model_config_list {\n  config {\n    name: "a"\n    base_path: "/x"\n    model_platform: "pytorch"\n  }\n}\n',
     ["pytorch"]),
    ('model_config_list {\n  config { name: "a" base_path: "/x" \n',
     ["Error parsing text-format tensorflow.serving.ModelServerConfig: ", "Invalid protobuf file: '"]),
])
def test_a_malformed_model_config_file_names_the_line_and_field(tmp_path: Path, text: str, words: list[str]) -> None:
    path = tmp_path / "models.config"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        tfs_config.read_model_config_file(str(path))
    for word in words:
        assert word in str(err.value), str(err.value)


def test_a_malformed_batching_file_names_the_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "batching.txt"
    path.write_text("max_batch_size { value: 16 }\nmax_batch_sise { value: 3 }\n")
    with pytest.raises(ConfigError) as err:
        tfs_config.read_batching_parameters(str(path))
    assert "line 2" in str(err.value) and "max_batch_sise" in str(err.value)


def test_tf_servings_own_monitoring_config_is_read_as_protobuf_text(tmp_path: Path) -> None:
    """testdata/monitoring_config.txt writes ':' before the message and ',' between fields."""
    tfs_config.read_monitoring_config(str(Path(__file__).resolve().parents[1] / "data" / "tfserving" / "monitoring_config.txt"))
    path = tmp_path / "monitoring.txt"
    path.write_text('prometheus_config < enable: true; path: "/monitoring/prometheus/metrics" > # TF Serving\'s path\n')
    tfs_config.read_monitoring_config(str(path))
    for text, words in (('prometheus_config { enable: true path: "/metrics" }', ["served at", "not /metrics"]),
                        ("prometheus_config { enabled: true }",
                         ["Error parsing text-format tensorflow.serving.MonitoringConfig: 1:28: Message type "
                          '"tensorflow.serving.PrometheusConfig" has no field named "enabled".'])):
        path.write_text(text)
        with pytest.raises(ConfigError) as err:
            tfs_config.read_monitoring_config(str(path))
        assert err.value.key == "tfs.monitoring_config_file"
        assert all(word in str(err.value) for word in words), str(err.value)


# -- live ----------------------------------------------------------------------------------
def start_tfs(tmp_path: Path, flags: list[str]) -> Server:
    """``appliance tfs`` on free ports: gRPC only where ``flags`` name its port (TF Serving's
    8500 may be another service's: the README's own, tests/service/test_private_home.py)."""
    port = free_port()
    if not any(flag.startswith("--port=") for flag in flags):
        flags = [*flags, "--port=0"]
    cmd = [sys.executable, "-m", "appliance.cli", "tfs", f"--rest_api_port={port}", *flags,
           "--host", "127.0.0.1", "--state", str(tmp_path / "state"), "--no-discovery"]
    return spawn(cmd, port, tmp_path / "state", tmp_path / "tfs.log")


def test_a_tf_serving_start_up_line_starts_the_service(tmp_path: Path, models_dir: Path) -> None:
    grpc = pytest.importorskip("grpc")
    from appliance.protos.tfserving import pb

    (tmp_path / "batching.txt").write_text(BATCHING)
    grpc_port = free_port()
    server = start_tfs(tmp_path, [f"--port={grpc_port}", "--model_name=m",
                                  f"--model_base_path={models_dir / 'keras_mlp_tflite'}", "--enable_batching",
                                  f"--batching_parameters_file={tmp_path / 'batching.txt'}",
                                  "--per_process_gpu_memory_fraction=0.5"])
    try:
        assert "per_process_gpu_memory_fraction is accepted and ignored" in server.log_text()
        r = server.post("/v1/models/m:predict", {"instances": [[0.5] * 64]})
        assert r.status_code == 200 and len(r.json()["predictions"][0]) == 10
        assert server.status()["config"]["batching"]["max_batch_size"] == 16
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            request = pb.GetModelStatusRequest()
            request.model_spec.name = "m"
            status = ch.unary_unary("/tensorflow.serving.ModelService/GetModelStatus",
                                    request_serializer=pb.GetModelStatusRequest.SerializeToString,
                                    response_deserializer=pb.GetModelStatusResponse.FromString)(request, timeout=30)
            assert status.model_version_status[0].version == 1
    finally:
        server.stop()


def test_the_model_config_file_is_followed_while_serving(tmp_path: Path, models_dir: Path) -> None:
    hpt = tmp_path / "hpt"
    shutil.copytree(models_dir / "half_plus_two" / "1", hpt / "1")
    shutil.copytree(models_dir / "half_plus_two" / "1", hpt / "2")
    path = tmp_path / "models.config"
    path.write_text(MODELS_CONFIG.format(hpt=hpt, mlp=models_dir / "keras_mlp_tflite"))
    server = start_tfs(tmp_path, [f"--model_config_file={path}", "--model_config_file_poll_wait_seconds=1"])
    failures: list[str] = []
    done = threading.Event()

    def steady() -> None:  # the model that stays must never fail meanwhile
        while not done.is_set():
            r = server.post("/v1/models/hpt/labels/stable:predict", {"instances": [1.0]})
            if r.status_code != 200:
                failures.append(f"{r.status_code} {r.text[:200]}")

    load = threading.Thread(target=steady)
    load.start()
    try:
        assert server.post("/v1/models/mlp:predict", {"instances": [[0.5] * 64]}).status_code == 200
        # add a model, remove one, move a label
        moved = MODELS_CONFIG.format(hpt=hpt, mlp=models_dir / "keras_mlp_tflite").replace(
            'key: "canary" value: 2', 'key: "canary" value: 1').replace('name: "mlp"', 'name: "mlp2"')
        path.write_text(moved)
        poll_until(lambda: server.post("/v1/models/mlp2:predict", {"instances": [[0.5] * 64]}).status_code == 200,
                   60, "mlp2 added")
        poll_until(lambda: server.post("/v1/models/mlp:predict", {"instances": [[0.5] * 64]}).status_code == 404,
                   60, "mlp removed (404)")
        canary = server.get("/v1/models/hpt/labels/canary").json()["model_version_status"]
        assert [s["version"] for s in canary] == ["1"]
        # a malformed file: refused with its line, the running config keeps serving
        broken = moved.replace('model_platform: "tflite"', 'model_platfrom: "tflite"')
        line = broken.splitlines().index('    model_platfrom: "tflite"') + 1
        path.write_text(broken)
        poll_until(lambda: any(e["kind"] == "reload_failed" and "model_platfrom" in e["message"]
                               for e in server.status()["events"]), 60, "the refusal")
        refusal = next(e["message"] for e in server.status()["events"]  # not a read of the half-written file
                       if e["kind"] == "reload_failed" and "model_platfrom" in e["message"])
        assert f"ModelServerConfig: {line}:" in refusal and str(path) in refusal, refusal
        assert server.post("/v1/models/mlp2:predict", {"instances": [[0.5] * 64]}).status_code == 200
    finally:
        done.set()
        load.join(30)
        server.stop()
    assert failures == [], failures[:5]
