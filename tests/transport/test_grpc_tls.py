"""TLS on the gRPC port (issue 37), with TF Serving's own client: ``tensorflow-serving-api``'s
PredictionServiceStub over ``grpc.secure_channel`` against the real ``appliance serve`` (front
workers on, their default), both ways of turning it on:

- ``[grpc] tls = true`` with ``[security]``'s certificate, key and client CA;
- TF Serving's ``--ssl_config_file`` (``appliance tfs``, the PEM texts inside an SSLConfig).

With client certificates required, a client holding one the CA signed is answered; one with
none, one signed by another CA, and a plaintext client are refused in the handshake and the
service keeps answering. A bad SSLConfig stops start-up naming the key (exit 2, no port left
serving).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("tensorflow_serving.apis.prediction_service_pb2_grpc")
tf = pytest.importorskip("tensorflow")
from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc  # noqa: E402

from appliance.core.config import Config, GRPCConfig  # noqa: E402
from appliance.core.errors import ConfigError  # noqa: E402
from appliance.core.grpc_tls import grpc_tls, parse_ssl_config  # noqa: E402
from tests.support.servers import ROOT, Server, free_port, spawn  # noqa: E402
from tests.transport.test_tls import make_cert  # noqa: E402

X = np.full((2, 64), 0.25, np.float32)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("pki")
    server_cert, server_key, _, _ = make_cert(d, "server")
    client_ca, _, cca, cca_key = make_cert(d, "client-ca")
    client_cert, client_key, _, _ = make_cert(d, "client", issuer=(cca, cca_key))
    stranger_cert, stranger_key, _, _ = make_cert(d, "stranger")  # self-signed: not from client-ca
    return {"cert": server_cert, "key": server_key, "client_ca": client_ca, "client": (client_cert, client_key),
            "stranger": (stranger_cert, stranger_key), "dir": d}


def predict(port: int, pki: dict[str, Any], client: str | None) -> np.ndarray:
    """TF Serving's client over TLS: the server checked against our CA, ``client``'s certificate
    presented (None: no certificate)."""
    key = chain = None
    if client is not None:
        cert_path, key_path = pki[client]
        chain, key = cert_path.read_bytes(), key_path.read_bytes()
    credentials = grpc.ssl_channel_credentials(root_certificates=pki["cert"].read_bytes(), private_key=key,
                                               certificate_chain=chain)
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "mlp"
        request.inputs["x"].CopyFrom(tf.make_tensor_proto(X))
        return tf.make_ndarray(stub.Predict(request, timeout=20).outputs["probs"])


def assert_refused(port: int, pki: dict[str, Any], client: str | None) -> None:
    with pytest.raises(grpc.RpcError) as err:
        predict(port, pki, client)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value


def assert_plaintext_refused(port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/tensorflow.serving.PredictionService/Predict")(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def tls_service(module_server: Any, models_dir: Path, pki: dict[str, Any],
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``[grpc] tls = true``: the REST port's certificate, client certificates required."""
    config = tmp_path_factory.mktemp("grpc-tls") / "appliance.toml"
    port = free_port()
    config.write_text(f'[discovery]\nenabled = false\n[grpc]\nport = {port}\ntls = true\n'
                      f'[security]\ntls_cert_file = "{pki["cert"]}"\ntls_key_file = "{pki["key"]}"\n'
                      f'tls_client_ca_file = "{pki["client_ca"]}"\n'
                      f'[[models]]\nname = "mlp"\nbase_path = "{models_dir / "keras_mlp_tflite"}"\nbackend = "tflite"\n')
    srv = module_server("--config", str(config), "--grpc-port", str(port), ready=False)
    srv.grpc_port = port
    srv.wait_for(lambda: _answers(port, pki), 120, "a gRPC Predict over TLS")
    yield srv


def _answers(port: int, pki: dict[str, Any]) -> bool:
    try:
        return predict(port, pki, "client").shape == (2, 10)
    except grpc.RpcError:
        return False


def test_tls_with_a_client_certificate_answers_as_plaintext_did(tls_service: Any, pki: dict[str, Any],
                                                                 models_dir: Path) -> None:
    from tests.support.modelgen import reference_predict_tflite

    got = predict(tls_service.grpc_port, pki, "client")
    want = reference_predict_tflite(models_dir / "keras_mlp_tflite" / "1" / "model.tflite", {"x": X})["probs"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("client", [None, "stranger"])
def test_clients_without_a_certificate_from_the_ca_are_refused(tls_service: Any, pki: dict[str, Any],
                                                               client: str | None) -> None:
    assert_refused(tls_service.grpc_port, pki, client)
    assert predict(tls_service.grpc_port, pki, "client").shape == (2, 10)  # the service serves on


def test_a_plaintext_client_is_refused(tls_service: Any, pki: dict[str, Any]) -> None:
    assert_plaintext_refused(tls_service.grpc_port)
    assert predict(tls_service.grpc_port, pki, "client").shape == (2, 10)


def test_status_says_the_port_is_encrypted(tls_service: Any, pki: dict[str, Any]) -> None:
    import requests

    cert, key = pki["client"]
    status = requests.get(f"https://127.0.0.1:{tls_service.port}/api/status", verify=str(pki["cert"]),
                          cert=(str(cert), str(key)), timeout=10).json()
    assert status["grpc"]["tls"] is True and status["grpc"]["client_certificates"] == "required"
    assert status["grpc"]["served_by"] == "front workers"  # each worker's listener speaks TLS


def ssl_config(pki: dict[str, Any], client_verify: bool) -> str:
    """TF Serving's SSLConfig text: the PEM texts themselves, as its docs show."""
    def pem(path: Path) -> str:
        return path.read_text().replace("\n", "\\n")
    return (f'server_key: "{pem(pki["key"])}"\nserver_cert: "{pem(pki["cert"])}"\n'
            f'custom_ca: "{pem(pki["client_ca"])}"\nclient_verify: {"true" if client_verify else "false"}\n')


def test_tf_servings_ssl_config_file_on_a_tf_serving_start_up_line(tmp_path: Path, models_dir: Path,
                                                                    pki: dict[str, Any]) -> None:
    (tmp_path / "ssl.config").write_text(ssl_config(pki, client_verify=True))
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "appliance.cli", "tfs", f"--rest_api_port={port}", f"--port={grpc_port}",
           "--model_name=mlp", f"--model_base_path={models_dir / 'keras_mlp_tflite'}",
           f"--ssl_config_file={tmp_path / 'ssl.config'}", "--host", "127.0.0.1", "--state", str(tmp_path / "state"),
           "--no-discovery"]
    server: Server = spawn(cmd, port, tmp_path / "state", tmp_path / "tfs.log")
    try:
        server.wait_for(lambda: _answers(grpc_port, pki), 120, "a gRPC Predict over TLS")
        assert_refused(grpc_port, pki, None)
        assert_refused(grpc_port, pki, "stranger")
        assert_plaintext_refused(grpc_port)
        assert server.get("/readyz").status_code == 200  # REST stays plaintext, as in TF Serving
    finally:
        server.stop()


def test_client_verify_false_asks_for_no_certificate(tmp_path: Path, pki: dict[str, Any]) -> None:
    (tmp_path / "ssl.config").write_text(ssl_config(pki, client_verify=False))
    tls = grpc_tls(Config(grpc=GRPCConfig(ssl_config_file=str(tmp_path / "ssl.config"))))
    assert tls is not None and not tls.require_client_certificate and tls.context.verify_mode.name == "CERT_NONE"


@pytest.mark.parametrize("text, words", [
    ('server_key: "x"\nserver_cert: "y"\n', ["grpc.ssl_config_file", "PEM"]),
    ('server_cert: "only a cert"\n', ["grpc.ssl_config_file", "server_key and server_cert"]),
    ('server_key: "x" bogus_field: 1\n', ["grpc.ssl_config_file", "bogus_field"]),
])
def test_a_bad_ssl_config_is_refused_by_key(tmp_path: Path, text: str, words: list[str]) -> None:
    (tmp_path / "ssl.config").write_text(text)
    with pytest.raises(ConfigError) as err:
        grpc_tls(Config(grpc=GRPCConfig(ssl_config_file=str(tmp_path / "ssl.config"))))
    assert all(word in str(err.value) for word in words), str(err.value)


def test_the_ssl_config_parser_is_protobufs() -> None:
    message = parse_ssl_config('server_key: "k"\nclient_verify: true\n')
    assert message.server_key == "k" and message.client_verify and not message.custom_ca


def test_a_bad_ssl_config_file_stops_start_up_naming_the_key(tmp_path: Path) -> None:
    """As a bad REST certificate does (tests/transport/test_tls.py): exit 2 with the key and the
    reason, no traceback, and no REST port left serving with /readyz 503 (what it did before)."""
    (tmp_path / "ssl.config").write_text('server_key: "x"\nserver_cert: "y"\n')
    config = tmp_path / "bad.toml"
    config.write_text(f'[grpc]\nssl_config_file = "{tmp_path / "ssl.config"}"\n')
    port = free_port()
    done = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", "--config", str(config), "--host", "127.0.0.1",
                           "--port", str(port), "--grpc-port", str(free_port()), "--state", str(tmp_path / "state"),
                           "--no-discovery"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "edge-appliance: config grpc.ssl_config_file:" in done.stderr and "PEM" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
