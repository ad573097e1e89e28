"""Request limits of ``[limits]`` and ``server.max_body_bytes``: config, the byte scan, the
gzip layer, and a real server configured with small limits."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests

from appliance.core import config as config_mod
from appliance.api.tfserving import json_format as tfs_json
from appliance.api.body import GzipBodies, read_body
from appliance.core.config import LimitsConfig
from appliance.core.errors import ConfigError, InvalidArgument, PayloadTooLarge

NO_DISCOVERY = "[discovery]\nenabled = false\n"


# --- config ---------------------------------------------------------------------------------
def test_defaults_protect_a_small_device() -> None:
    limits = config_mod.load().limits
    assert limits.max_json_depth == 100
    assert limits.max_tensor_elements == 4 * 1024 * 1024
    assert limits.max_instances == 4096


@pytest.mark.parametrize("key, value", [("max_json_depth", 1), ("max_json_depth", 1001),
                                        ("max_tensor_elements", 0), ("max_instances", 0)])
def test_bad_values_name_the_key(key: str, value: int) -> None:
    with pytest.raises(ConfigError) as info:
        config_mod.load(overrides={f"limits.{key}": value})
    assert f"limits.{key}" in str(info.value)


# --- counting and nesting -------------------------------------------------------------------
def test_count_values_is_exact() -> None:
    assert tfs_json.count_values(b'{"instances": [[1, 2], [3, 4]], "signature_name": "a,b,[c"}') == 5
    assert tfs_json.count_values(b'[[], {}, [1], {"a": [true, null]}]') == 3
    assert tfs_json.count_values(b'{"s": "x\\"],[,,", "t": [1,2]}') == 3  # an escaped quote does not end the string


def test_loads_refuses_deep_nesting_and_too_many_values() -> None:
    small = LimitsConfig(max_json_depth=3, max_tensor_elements=4)
    assert tfs_json.loads(b'{"a": [[1]], "b": [[1, [[[[2]]]]]]}', small)  # ragged past the first element: for numpy
    for deep in (b'{"a": [[[1]]]}', b'{"a": 1, "b": {"c": {"d": [2]}}}', b"[" * 2000 + b"]" * 2000,
                 b"[NaN, " + b"[" * 2000 + b"]" * 2001):
        with pytest.raises(InvalidArgument, match="limits.max_json_depth"):
            tfs_json.loads(deep, small)
    with pytest.raises(InvalidArgument, match="limits.max_tensor_elements"):
        tfs_json.loads(b"[" + b"1," * (4 + tfs_json.ENVELOPE_VALUES) + b"1]", small)
    assert tfs_json.loads(b"[" + b" " * 200 + b"1, 2]", small) == [1, 2]  # long, but few values


# --- bodies -----------------------------------------------------------------------------------
def environ(body: bytes, encoding: str = "", length: bool = True) -> dict[str, Any]:
    env: dict[str, Any] = {"wsgi.input": io.BytesIO(body), "REQUEST_METHOD": "POST", "PATH_INFO": "/v2/x"}
    if length:
        env["CONTENT_LENGTH"] = str(len(body))
    if encoding:
        env["HTTP_CONTENT_ENCODING"] = encoding
    return env


def test_read_body_limits_plain_and_inflated_sizes() -> None:
    assert read_body(environ(b"x" * 100), 100) == b"x" * 100
    assert read_body(environ(gzip.compress(b"y" * 100), "gzip"), 100) == b"y" * 100
    with pytest.raises(PayloadTooLarge, match="101 bytes"):
        read_body(environ(b"x" * 101), 100)
    with pytest.raises(PayloadTooLarge):
        read_body(environ(b"x" * 101, length=False), 100)
    with pytest.raises(PayloadTooLarge, match="inflates"):
        read_body(environ(gzip.compress(b"y" * 101), "x-gzip"), 100)


def test_gzip_layer_hands_on_a_plain_body_or_refuses() -> None:
    seen: list[tuple[bytes, str, str | None]] = []

    def app(env: dict[str, Any], start_response: Any) -> list[bytes]:
        seen.append((env["wsgi.input"].read(), env["CONTENT_LENGTH"], env.get("HTTP_CONTENT_ENCODING")))
        start_response("200 OK", [])
        return [b"ok"]

    core = SimpleNamespace(config=SimpleNamespace(server=SimpleNamespace(max_body_bytes=1000)))
    layer = GzipBodies(app, core)
    statuses: list[str] = []
    assert layer(environ(gzip.compress(b'{"a": 1}'), "gzip"), lambda s, h: statuses.append(s)) == [b"ok"]
    assert seen == [(b'{"a": 1}', "8", None)]
    body = layer(environ(gzip.compress(b" " * 5000), "gzip"), lambda s, h: statuses.append(s))
    assert statuses[-1].startswith("413") and b"max_body_bytes" in b"".join(body)
    layer(environ(b"plain", "deflate"), lambda s, h: statuses.append(s))
    assert statuses[-1].startswith("400") and len(seen) == 1


# --- a real server with small limits -------------------------------------------------------------
@pytest.fixture(scope="module")
def server(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = tmp_path_factory.mktemp("limits-config") / "appliance.toml"
    model = models_dir / "keras_mlp_tflite"
    config.write_text(f"poll_interval_s = 5.0\n{NO_DISCOVERY}[server]\nmax_body_bytes = 65536\n"
                      "[limits]\nmax_json_depth = 8\nmax_tensor_elements = 256\nmax_instances = 3\n"
                      f'[[models]]\nname = "mlp"\nbase_path = "{model}"\n')
    return module_server("--config", str(config), timeout=120)


def predict(server: Any, body: Any, verb: str = "predict") -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body)
    return requests.post(f"{server.url}/v1/models/mlp:{verb}", data=data, timeout=30)


def error(resp: requests.Response, status: int, *words: str) -> None:
    assert resp.status_code == status, resp.text[:300]
    for word in words:
        assert word in resp.json()["error"]


def test_instances_over_the_limit(server: Any) -> None:
    assert predict(server, {"instances": [[0.5] * 64] * 3}).status_code == 200
    error(predict(server, {"instances": [[0.5] * 64] * 4}), 400, "limits.max_instances", "4")
    error(predict(server, {"examples": [{"x": 1.0}] * 4}, "classify"), 400, "limits.max_instances")


def test_elements_over_the_limit(server: Any) -> None:
    assert predict(server, {"inputs": {"x": [[0.5] * 64] * 3}}).status_code == 200  # 192 elements
    error(predict(server, {"inputs": {"x": [[0.5] * 64] * 5}}), 400, "limits.max_tensor_elements")  # before parsing
    error(predict(server, {"inputs": {"x": [0.5] * 260}}), 400, "limits.max_tensor_elements", "260")  # after


def test_depth_over_the_configured_limit(server: Any) -> None:
    error(predict(server, b'{"instances": [[[[[[[[0.5]]]]]]]]}'), 400, "limits.max_json_depth", "8")


def test_body_over_the_limit(server: Any) -> None:
    error(predict(server, b'{"instances": [[' + b"0.5," * 20000 + b"0.5]]}"), 413, "max_body_bytes")
    bomb = gzip.compress(b" " * 100_000 + b'{"instances": [[0.5]]}')
    resp = requests.post(f"{server.url}/v1/models/mlp:predict", data=bomb, timeout=30,
                         headers={"Content-Encoding": "gzip"})
    error(resp, 413, "inflates")
