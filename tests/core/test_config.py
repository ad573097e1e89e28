"""Configuration: TOML file + CLI overrides; every bad value is refused with its key's name.

``appliance.config.load`` is called directly for the rules, and ``appliance serve
--config bad.toml`` is run as a real child process for the start-up refusal.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from appliance.core.config import Config
from appliance.core.config_file import load
from appliance.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "appliance.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def refused(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, text), {"state_dir": str(tmp_path / "state")})
    return info.value


def test_defaults_without_a_file(tmp_path: Path) -> None:
    config = load(None, {"state_dir": str(tmp_path)})
    assert isinstance(config, Config)
    assert config.server.port == 8501  # TF Serving's REST port
    assert config.runtime.backend == "auto"
    assert config.state_dir == str(tmp_path)
    assert config.batching.max_batch_size >= 1


def test_grpc_may_not_listen_where_rest_does(tmp_path: Path) -> None:
    """Both listen with SO_REUSEPORT: one port would mix REST and gRPC clients a connection at
    a time; one socket path, each would unlink the other's. From the file and from the flags
    (overrides) alike, named, with what to do."""
    err = refused(tmp_path, """
        [server]
        port = 9200
        [grpc]
        port = 9200
        """)
    assert err.key == "grpc.port" and "REST port" in str(err) and "--grpc-port" in str(err)
    with pytest.raises(ConfigError, match="grpc.port"):
        load(None, {"state_dir": str(tmp_path), "server.port": 8500})  # the default gRPC port
    assert load(None, {"state_dir": str(tmp_path), "server.port": 8500, "grpc.port": 0}).grpc.port == 0
    err = refused(tmp_path, """
        [server]
        socket_path = "/run/edge/api.sock"
        [grpc]
        socket_path = "/run/edge//api.sock"
        """)
    assert err.key == "grpc.socket_path" and "REST socket" in str(err)


def test_file_values_are_read(tmp_path: Path) -> None:
    config = load(write(tmp_path, """
        poll_interval_s = 0.5
        [server]
        port = 9123
        max_body_bytes = 4096
        [batching]
        max_batch_size = 8
        allowed_batch_sizes = [2, 4, 8]
        [runtime]
        backend = "tflite"
        [runtime.tflite]
        num_threads = 2
        [[models]]
        name = "m"
        base_path = "/srv/models/m"
        version_policy = "specific"
        versions = [3, 5]
        labels = { stable = 3, canary = 5 }
        batching = { max_batch_size = 4, allowed_batch_sizes = [4] }
    """), {"state_dir": str(tmp_path)})
    assert config.server.port == 9123 and config.server.max_body_bytes == 4096
    assert config.poll_interval_s == 0.5
    assert config.batching.allowed_batch_sizes == [2, 4, 8]
    assert config.runtime.backend == "tflite" and config.runtime.tflite.num_threads == 2
    (model,) = config.models
    assert (model.name, model.version_policy, model.versions) == ("m", "specific", [3, 5])
    assert model.labels == {"stable": 3, "canary": 5}
    merged = config.batching_for(model)
    assert merged.max_batch_size == 4 and merged.allowed_batch_sizes == [4]
    assert config.batching.max_batch_size == 8  # the model's override does not leak into [batching]


def test_int_is_accepted_for_a_float_key(tmp_path: Path) -> None:
    config = load(write(tmp_path, "poll_interval_s = 3\n"), {"state_dir": str(tmp_path)})
    assert config.poll_interval_s == 3.0


@pytest.mark.parametrize("text, key", [
    ("bogus = 1\n", "bogus"),
    ("[server]\nprot = 8501\n", "server.prot"),
    ("[batching]\nmax_batch = 4\n", "batching.max_batch"),
    ("[runtime.tflite]\nthreads = 2\n", "runtime.tflite.threads"),
    ('[[models]]\nname = "m"\nbase_path = "/x"\nversion = 3\n', "version"),
    ('[[models]]\nname = "m"\nbase_path = "/x"\nbatching = { max_batch = 2 }\n', "max_batch"),
])
def test_unknown_key_is_named(tmp_path: Path, text: str, key: str) -> None:
    error = refused(tmp_path, text)
    assert key in str(error), str(error)
    assert "unknown" in str(error).lower()


@pytest.mark.parametrize("text, key", [
    ('[server]\nport = "8501"\n', "server.port"),
    ("[server]\nport = 8501.5\n", "server.port"),
    ("[server]\nport = 70000\n", "server.port"),
    ('[batching]\nenable_batching = "yes"\n', "batching.enable_batching"),
    ("[batching]\nmax_batch_size = true\n", "batching.max_batch_size"),
    ('[batching]\nallowed_batch_sizes = "4"\n', "batching.allowed_batch_sizes"),
    ("[batching]\nmax_batch_size = 0\n", "batching.max_batch_size"),
    ('poll_interval_s = "soon"\n', "poll_interval_s"),
    ("poll_interval_s = -1\n", "poll_interval_s"),
    ('[runtime]\nbackend = "cuda"\n', "runtime.backend"),
    ('[runtime.tflite]\ndelegate = "npu"\n', "runtime.tflite.delegate"),
    ('[runtime.tf]\nprecision = "INT4"\n', "runtime.tf.precision"),
    ("server = 3\n", "server"),
    ('[[models]]\nname = "m"\nbase_path = "/x"\nversion_policy = "newest"\n', "version_policy"),
    ('[[models]]\nname = "m"\nbase_path = "/x"\nversion_policy = "specific"\n', "versions"),
    ('[[models]]\nname = "m"\nbase_path = "/x"\nlabels = { stable = "one" }\n', "stable"),
    ('[[models]]\nname = "m"\nbase_path = "/x"\nbackend = "gpu"\n', "backend"),
    ('[[models]]\nbase_path = "/x"\n', "name"),
])
def test_wrong_value_is_named(tmp_path: Path, text: str, key: str) -> None:
    error = refused(tmp_path, text)
    assert key in str(error), str(error)


@pytest.mark.parametrize("sizes, max_size, why", [
    ([4, 2, 8], 8, "increasing"),
    ([2, 2, 8], 8, "increasing"),
    ([0, 8], 8, "positive"),
    ([2, 4], 8, "max_batch_size"),  # TF Serving: the last entry must equal max_batch_size
])
def test_bad_allowed_batch_sizes(tmp_path: Path, sizes: list[int], max_size: int, why: str) -> None:
    error = refused(tmp_path, f"[batching]\nmax_batch_size = {max_size}\nallowed_batch_sizes = {sizes}\n")
    assert "batching.allowed_batch_sizes" in str(error), str(error)
    assert why in str(error), str(error)


def test_bad_allowed_batch_sizes_of_one_model(tmp_path: Path) -> None:
    error = refused(tmp_path, """
        [[models]]
        name = "det"
        base_path = "/x"
        batching = { max_batch_size = 8, allowed_batch_sizes = [4] }
    """)
    assert "models.det.batching.allowed_batch_sizes" in str(error), str(error)


@pytest.mark.parametrize("key", ["batch_timeout_micros", "num_batch_threads"])
def test_negative_batching_value_names_its_key(tmp_path: Path, key: str) -> None:
    """The message must name the dotted key itself, not only its table."""
    error = refused(tmp_path, f"[batching]\n{key} = -1\n")
    assert f"batching.{key}" in str(error), str(error)


def test_model_configured_twice(tmp_path: Path) -> None:
    error = refused(tmp_path, """
        [[models]]
        name = "m"
        base_path = "/a"
        [[models]]
        name = "m"
        base_path = "/b"
    """)
    assert "models[1].name" in str(error) and "twice" in str(error)


def test_invalid_toml_and_missing_file(tmp_path: Path) -> None:
    error = refused(tmp_path, "[server\nport = 1\n")
    assert "TOML" in str(error)
    with pytest.raises(ConfigError) as info:
        load(str(tmp_path / "nope.toml"))
    assert "nope.toml" in str(info.value)


def test_cli_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, """
        models_dir = "/from/file"
        [server]
        port = 9000
        host = "0.0.0.0"
        [runtime]
        backend = "tf-cpu"
    """)
    config = load(path, {"server.port": 9100, "runtime.backend": "tflite", "models_dir": "/from/cli",
                         "server.host": None, "state_dir": str(tmp_path)})
    assert config.server.port == 9100
    assert config.runtime.backend == "tflite"
    assert config.models_dir == "/from/cli"
    assert config.server.host == "0.0.0.0"  # None means: flag not given, the file's value stays


def test_cli_override_is_validated_too(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(None, {"runtime.backend": "nope", "state_dir": str(tmp_path)})
    assert "runtime.backend" in str(info.value)


def _serve(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "appliance.cli", "serve", "--state", str(tmp_path / "state"),
         "--host", "127.0.0.1", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("text, key", [
    ("[server]\nprot = 1\n", "server.prot"),
    ("[batching]\nmax_batch_size = 8\nallowed_batch_sizes = [2, 4]\n", "batching.allowed_batch_sizes"),
    ('[runtime]\nbackend = "cuda"\n', "runtime.backend"),
])
def test_serve_refuses_a_bad_config(tmp_path: Path, text: str, key: str) -> None:
    done = _serve(tmp_path, "--config", write(tmp_path, text, "bad.toml"), "--port", "1")
    assert done.returncode != 0
    assert key in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_serve_refuses_a_missing_config_file(tmp_path: Path) -> None:
    done = _serve(tmp_path, "--config", str(tmp_path / "missing.toml"))
    assert done.returncode != 0
    assert "missing.toml" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_the_config_names_exactly_the_registered_backends() -> None:
    """config.py repeats the backend names so that reading a config imports no numpy;
    runtimes.BACKENDS is the registry: the two may never drift apart."""
    import runtimes
    from appliance.core.config import BACKEND_CHOICES

    assert BACKEND_CHOICES == ("auto", *runtimes.BACKEND_NAMES)


def test_litertlm_engines_is_a_key_and_reaches_the_backend(tmp_path: Path) -> None:
    """docs/generation.md names [runtime.litertlm] engines; it was refused as unknown."""
    from types import SimpleNamespace

    from appliance.core.loader import backend_options

    config = load(write(tmp_path, "[runtime.litertlm]\nengines = 4\n"), {"state_dir": str(tmp_path / "state")})
    env = SimpleNamespace(config=config, device={"cpu_count": 2})
    assert backend_options(env, "m", 1)["litertlm"]["engines"] == 4  # type: ignore[arg-type]  # the fields read
    assert refused(tmp_path, "[runtime.litertlm]\nengines = 0\n").key == "runtime.litertlm.engines"


def test_the_stream_queue_keys_are_checked(tmp_path: Path) -> None:
    config = load(None, {"state_dir": str(tmp_path)})
    assert (config.generation.max_queued_per_model, config.generation.queue_timeout_s) == (256, 60.0)
    assert config.generation.reserved_streams_per_model == 0  # fair shares come from the queue, not reservations
    assert refused(tmp_path, "[generation]\nqueue_timeout_s = -1\n").key == "generation.queue_timeout_s"
    assert refused(tmp_path, "[generation]\nmax_queued_per_model = -1\n").key == "generation.max_queued_per_model"
