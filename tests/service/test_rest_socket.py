"""REST on a Unix domain socket (``[server] socket_path``, issue 37), with curl's
``--unix-socket`` against the real ``appliance serve`` (front workers on, their default): TF
Serving's and KServe v2's predict answered as on the TCP port, the inference token still
asked for, the socket's mode deciding who may connect (a client running as ``nobody`` is
refused by the kernel, then let in once the mode allows others), a stale socket file of a
crashed run replaced, anything else at the path refused, and the file removed at stop."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.support.servers import ROOT, free_port, launch

TOKEN = "t" * 32
ROW = [0.25] * 64
CURL = shutil.which("curl")
pytestmark = pytest.mark.skipif(CURL is None, reason="curl is needed (Debian: apt-get install curl)")


@pytest.fixture()
def short_dir() -> Iterator[Path]:
    """A directory whose paths fit sun_path (107 bytes): pytest's tmp_path may not."""
    path = Path(tempfile.mkdtemp(prefix="rs-", dir="/tmp"))
    path.chmod(0o755)  # others may reach the socket: its own mode decides
    yield path
    shutil.rmtree(path, ignore_errors=True)


def serve(tmp_path: Path, models_dir: Path, sock: Path, mode: str = "0660") -> Any:
    config = tmp_path / "appliance.toml"
    config.write_text(f'[server]\nsocket_path = "{sock}"\nsocket_mode = "{mode}"\n'
                      f'[security]\ninference_token = "{TOKEN}"\n[discovery]\nenabled = false\n'
                      f'[[models]]\nname = "mlp"\nbase_path = "{models_dir / "keras_mlp_tflite"}"\nbackend = "tflite"\n')
    return launch(["--config", str(config)], tmp_path)


def curl(sock: Path, path: str, body: Any = None, token: str | None = TOKEN, user: str | None = None) -> tuple[int, str]:
    """(curl's exit code, body) of a request over the Unix socket; ``user``: run curl as that user."""
    cmd = [CURL, "-s", "--unix-socket", str(sock), "-w", "\n%{http_code}", f"http://localhost{path}"]
    if body is not None:
        cmd += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    if token:
        cmd += ["-H", f"Authorization: Bearer {token}"]
    if user:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *cmd]  # numeric ids
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    return out.returncode, out.stdout


def test_rest_over_the_unix_socket(tmp_path: Path, models_dir: Path, short_dir: Path) -> None:
    sock = short_dir / "api.sock"
    server = serve(tmp_path, models_dir, sock)
    try:
        assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o660
        code, out = curl(sock, "/v1/models/mlp:predict", {"instances": [ROW]})
        body, status = out.rsplit("\n", 1)
        assert code == 0 and status == "200" and len(json.loads(body)["predictions"][0]) == 10
        tcp = server.post("/v1/models/mlp:predict", {"instances": [ROW]}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert json.loads(body) == tcp.json()  # the same answer as the TCP port's
        v2 = {"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": ROW}]}
        code, out = curl(sock, "/v2/models/mlp/infer", v2)
        assert out.rsplit("\n", 1)[1] == "200" and json.loads(out.rsplit("\n", 1)[0])["outputs"][0]["shape"] == [1, 10]
        assert curl(sock, "/v1/models/mlp:predict", {"instances": [ROW]}, token=None)[1].endswith("\n401")
        # The socket's callers are on this device: shared memory is theirs (a peer with no address is not)
        key = f"/edge-test-sock-{os.getpid()}"
        fd = os.open(f"/dev/shm{key}", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, 256)
            code, out = curl(sock, "/v2/systemsharedmemory/region/r0/register", {"key": key, "offset": 0, "byte_size": 256})
            assert out.rsplit("\n", 1)[1] == "200", out
            code, out = curl(sock, "/v2/systemsharedmemory/region/r0/unregister", {})
            assert out.rsplit("\n", 1)[1] == "200", out
        finally:
            os.close(fd)
            os.unlink(f"/dev/shm{key}")
        status = server.get("/api/status", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert status["rest_socket"]["path"] == str(sock) and status["rest_socket"]["mode"] == "0660"
    finally:
        server.stop()
    assert not sock.exists(), "the socket file outlived the service"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run a client as another user")
def test_the_sockets_mode_decides_who_may_connect(tmp_path: Path, models_dir: Path, short_dir: Path) -> None:
    sock = short_dir / "api.sock"
    server = serve(tmp_path, models_dir, sock, mode="0660")
    try:
        code, _ = curl(sock, "/v1/models/mlp:predict", {"instances": [ROW]}, user="65534")
        assert code == 7, "a user outside the socket's owner and group connected"  # curl: couldn't connect
    finally:
        server.stop()
    server = serve(tmp_path, models_dir, sock, mode="0666")
    try:
        code, out = curl(sock, "/v1/models/mlp:predict", {"instances": [ROW]}, user="65534")
        assert code == 0 and out.endswith("\n200")
    finally:
        server.stop()


def test_a_stale_socket_is_replaced_and_anything_else_refused(tmp_path: Path, models_dir: Path,
                                                              short_dir: Path) -> None:
    sock = short_dir / "api.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))  # bound and closed without listening: what a crash leaves behind
    stale.close()
    server = serve(tmp_path, models_dir, sock)
    try:
        assert curl(sock, "/v1/models/mlp", token=TOKEN)[1].endswith("\n200")
    finally:
        server.stop()
    sock.write_text("not a socket")
    out = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", "--config", str(tmp_path / "appliance.toml"),
                          "--host", "127.0.0.1", "--port", str(free_port()), "--state", str(tmp_path / "state-refused"),
                          "--grpc-port", "0", "--no-discovery"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 1 and f"{sock}: it exists and is not a socket" in out.stderr, out.stderr[-2000:]
    assert sock.read_text() == "not a socket"  # never removed: it was not ours
