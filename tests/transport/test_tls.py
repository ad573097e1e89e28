"""HTTPS on the REST port (``[security] tls_cert_file``/``tls_key_file``): the real service
with a self-signed certificate made here, client certificates (mTLS) on the real server,
TLS connections under the same slow-client deadlines, and bad key files refused by name."""

from __future__ import annotations

import datetime
import ipaddress
import json
import shutil
import socket
import ssl
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from appliance.core.config import ConfigError, LimitsConfig, SecurityConfig
from appliance.core.tls import tls_context
from appliance.transport.http.server import HTTPServer
from tests.support.servers import ROOT, free_port

BODY = json.dumps({"instances": [[0.1] * 64]})


def make_cert(directory: Path, name: str, issuer: tuple[Any, Any] | None = None) -> tuple[Path, Path, Any, Any]:
    """A certificate for localhost/127.0.0.1 (self-signed CA, or signed by ``issuer``)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_cert, issuer_key = issuer if issuer else (None, key)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject)
            .issuer_name(issuer_cert.subject if issuer_cert else subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), True)
            .sign(issuer_key, hashes.SHA256()))
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_path.chmod(0o600)
    return cert_path, key_path, cert, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("certs")
    server_cert, server_key, ca, ca_key = make_cert(d, "server")
    client_ca, _, cca, cca_key = make_cert(d, "client-ca")
    client_cert, client_key, _, _ = make_cert(d, "client", issuer=(cca, cca_key))
    stranger_cert, stranger_key, _, _ = make_cert(d, "stranger")  # self-signed: not from client-ca
    return {"cert": server_cert, "key": server_key, "client_ca": client_ca, "client": (client_cert, client_key),
            "stranger": (stranger_cert, stranger_key), "dir": d}


@pytest.fixture(scope="module")
def https_service(module_server: Any, models_dir: Path, certs: dict[str, Any],
                  tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("tls")
    shutil.copytree(models_dir / "keras_mlp_tflite", tmp / "models" / "mlp")
    config = tmp / "tls.toml"
    config.write_text(f'models_dir = "{tmp / "models"}"\n[discovery]\nenabled = false\n'
                      f'[security]\ntls_cert_file = "{certs["cert"]}"\ntls_key_file = "{certs["key"]}"\n')
    server = module_server("--config", str(config), "--backend", "tflite", ready=False)
    server.url = f"https://127.0.0.1:{server.port}"
    server.wait_for(lambda: _ready(server.url, certs["cert"]), 120, "the HTTPS server to be ready")
    return server


def _ready(url: str, ca: Path) -> bool:
    try:
        return requests.get(url + "/readyz", verify=str(ca), timeout=2).status_code == 200
    except requests.RequestException:
        return False


def test_service_speaks_https_only(https_service: Any, certs: dict[str, Any]) -> None:
    url, ca = https_service.url, str(certs["cert"])
    with requests.Session() as session:  # keep-alive over TLS, several requests per connection
        for _ in range(5):
            r = session.post(f"{url}/v1/models/mlp:predict", data=BODY, verify=ca, timeout=30)
            assert r.status_code == 200 and len(r.json()["predictions"][0]) == 10
    with pytest.raises(requests.exceptions.SSLError):  # the certificate is checked: unknown CA refused
        requests.get(f"{url}/healthz", timeout=10)
    with pytest.raises(requests.ConnectionError):  # plain HTTP on the TLS port gets nowhere
        requests.get(f"http://127.0.0.1:{https_service.port}/healthz", timeout=10)
    status = requests.get(f"{url}/api/status", verify=ca, timeout=30)
    assert status.json()["http"]["tls"] is True
    assert status.json()["config"]["security"]["tls_key_file"] == str(certs["key"])  # the path, never the key
    assert "PRIVATE KEY" not in status.text


def test_concurrent_large_requests_over_tls(https_service: Any, certs: dict[str, Any]) -> None:
    """Big bodies both ways through many TLS records, from several clients at once."""
    url, ca = https_service.url, str(certs["cert"])
    rows = json.dumps({"instances": [[0.25] * 64] * 300})  # ~100 kB in (7 TLS records), 300 rows out

    def call(_: int) -> int:
        r = requests.post(f"{url}/v1/models/mlp:predict", data=rows, verify=ca, timeout=60)
        return len(r.json()["predictions"]) if r.status_code == 200 else -r.status_code

    with ThreadPoolExecutor(4) as pool:  # 4 x 10 batches: under the queue bound
        assert list(pool.map(call, range(12))) == [300] * 12


@pytest.fixture
def tls_server(certs: dict[str, Any], http_servers: Callable[..., HTTPServer]) -> Callable[..., HTTPServer]:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [environ["wsgi.url_scheme"].encode()]

    def start(limits: LimitsConfig | None = None, **security: Any) -> HTTPServer:
        sec = SecurityConfig(tls_cert_file=str(certs["cert"]), tls_key_file=str(certs["key"]), **security)
        return http_servers(app, 2, limits, sec)

    return start


def test_client_certificates_when_a_client_ca_is_set(tls_server: Callable[..., HTTPServer],
                                                     certs: dict[str, Any]) -> None:
    server = tls_server(tls_client_ca_file=str(certs["client_ca"]))
    url, ca = f"https://127.0.0.1:{server.port}/", str(certs["cert"])
    assert requests.get(url, verify=ca, cert=tuple(map(str, certs["client"])), timeout=10).text == "https"
    for cert in (None, tuple(map(str, certs["stranger"]))):
        with pytest.raises(requests.RequestException):
            requests.get(url, verify=ca, cert=cert, timeout=10)
    assert server.stats["tls_handshake_failed"] >= 1
    # the refusals cost the server nothing: the good client is still served
    assert requests.get(url, verify=ca, cert=tuple(map(str, certs["client"])), timeout=10).text == "https"


def test_a_stalled_handshake_is_cut_at_the_header_deadline(tls_server: Callable[..., HTTPServer],
                                                           certs: dict[str, Any]) -> None:
    server = tls_server(LimitsConfig(idle_timeout_s=60, header_timeout_s=1, request_timeout_s=2))
    stalled = socket.create_connection(("127.0.0.1", server.port))  # TCP, never a ClientHello
    stalled.settimeout(20)
    # and a TLS client that completes the handshake but then trickles its headers
    ctx = ssl.create_default_context(cafile=str(certs["cert"]))
    slow = ctx.wrap_socket(socket.create_connection(("127.0.0.1", server.port)), server_hostname="localhost")
    slow.sendall(b"GET / HTTP/1.1\r\n")
    slow.settimeout(20)
    assert stalled.recv(100) == b""
    reply = b""
    try:
        while chunk := slow.recv(4096):
            reply += chunk
    except (ssl.SSLError, OSError):
        pass
    assert reply.startswith(b"HTTP/1.1 408")
    stalled.close()
    slow.close()
    assert requests.get(f"https://127.0.0.1:{server.port}/", verify=str(certs["cert"]), timeout=10).text == "https"


def test_bad_tls_files_are_refused_by_key(certs: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        tls_context(SecurityConfig(tls_cert_file=str(tmp_path / "nope.pem"), tls_key_file=str(certs["key"])))
    assert "security.tls_cert_file" in str(err.value) and "nope.pem" in str(err.value)
    wrong_key = make_cert(tmp_path, "other")[1]  # a key that does not match the certificate
    with pytest.raises(ConfigError) as err:
        tls_context(SecurityConfig(tls_cert_file=str(certs["cert"]), tls_key_file=str(wrong_key)))
    assert "security.tls_cert_file" in str(err.value)
    # the service refuses to start on it, naming the key, instead of serving plain HTTP
    config = tmp_path / "bad.toml"
    config.write_text(f'[discovery]\nenabled = false\n[security]\ntls_cert_file = "{certs["cert"]}"\n'
                      f'tls_key_file = "{wrong_key}"\n')
    out = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", "--config", str(config), "--host",
                          "127.0.0.1", "--port", str(free_port()), "--state", str(tmp_path / "state"),
                          "--grpc-port", "0", "--no-discovery"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode != 0 and "security.tls_cert_file" in out.stderr
