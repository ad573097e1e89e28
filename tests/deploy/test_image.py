"""The OCI image (issue 32) under real podman: built by scripts/image.sh, run as a platform would.

The lite image (LiteRT only) is built once for the module (the layer cache makes that seconds
when nothing changed). Each test runs its own container on host networking with 127.0.0.1 and
free ports (the health check's test uses the image's own defaults inside a network namespace of
its own, with the port published on loopback). Bad input -- a read-only, foreign-owned or missing
state volume, a port already taken, an image of another architecture -- must end the container
at once with a message that says what is wrong and a non-zero status, never a loop of restarts.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from tests.support.servers import ROOT, free_port, poll_until
from tests.support.podman_support import STATE, UID, Container, available, build, inspect, podman, sample_version, wait_exit

pytestmark = [pytest.mark.skipif(bool(available()), reason=available() or "podman"), pytest.mark.timeout(3600)]

PREDICT = {"instances": [1.0, 2.0, 5.0]}
EXPECTED = [2.5, 3.0, 4.5]
APPLIANCE = str(ROOT / ".venv" / "bin" / "appliance")


@pytest.fixture(scope="module")
def lite() -> str:
    return build("lite")


@pytest.fixture
def container(lite: str) -> Iterator[Container]:
    made: list[Container] = []

    def make() -> Container:
        made.append(Container(lite))
        return made[-1]

    yield make  # type: ignore[misc]
    for c in made:
        c.remove()


@pytest.fixture
def volume() -> Iterator[Any]:
    names: list[str] = []

    def make() -> str:
        names.append(f"ea-test-state-{os.urandom(5).hex()}")
        podman("volume", "create", names[-1], check=True)
        return names[-1]

    yield make
    for name in names:
        podman("volume", "rm", "--force", name)


# --- what the image is ------------------------------------------------------------------------
def test_the_lite_image_is_small_non_root_and_says_what_it_is(lite: str) -> None:
    image = inspect(lite, "image")
    config = image["Config"]
    assert image["Size"] <= 350e6, f"lite image is {image['Size'] / 1e6:.0f} MB (issue 32: at most 350)"
    assert config["User"] == f"{UID}:{UID}"
    assert config["Entrypoint"] == ["appliance"] and config["Cmd"] == ["serve"]
    assert set(config["ExposedPorts"]) == {"8501/tcp", "8500/tcp"}
    assert STATE in config["Volumes"] and "/models" in config["Volumes"]
    assert config["StopSignal"] in ("SIGTERM", "15")
    assert image["Healthcheck"]["Test"] == ["CMD", "appliance", "health"]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == "0.1.0"
    for key in ("org.opencontainers.image.revision", "org.opencontainers.image.source"):
        assert labels.get(key), key
    # No installer, no compiler, no TensorFlow in the runtime image.
    probe = podman("run", "--rm", "--network", "none", *_limits(), "--entrypoint", "/bin/sh", lite, "-c",
                   "for c in pip pip3 gcc cc c++ curl; do command -v $c; done; "
                   "python3 -c 'import pip' 2>/dev/null && echo import-pip; "
                   "python3 -c 'import tensorflow' 2>/dev/null && echo import-tensorflow; true")
    assert probe.returncode == 0 and probe.stdout.strip() == "", probe.stdout + probe.stderr


def test_the_embedded_default_answers_as_a_non_root_user_with_json_logs(container: Any) -> None:
    c = container()
    started = c.run(extra=("--read-only",))  # as compose.yaml, the Quadlet unit and the DaemonSet run it
    assert started.returncode == 0, started.stderr
    c.wait_ready()
    r = requests.post(c.url("/v1/models/half_plus_two:predict"), json=PREDICT, timeout=10)
    assert r.status_code == 200 and r.json() == {"predictions": EXPECTED}, r.text
    ids = podman("exec", c.name, "sh", "-c", "id -u; id -g; grep '^Uid:' /proc/1/status").stdout.split()
    assert ids[:2] == [str(UID), str(UID)] and ids[3:] == [str(UID)] * 4, ids
    out, err = c.logs()
    lines = [json.loads(line) for line in out.splitlines()]  # stdout: JSON lines only
    assert any(line.get("event") == "loaded" for line in lines), out[-2000:]
    assert "edge-appliance ready:" in err  # the plain lines for a person stay on stderr
    assert "NOTIFY_SOCKET" not in out + err  # no systemd here: sd_notify says nothing
    state = requests.get(c.url("/api/status"), timeout=10).json()
    assert state["models"]["half_plus_two"]["serving_version"] == 1


def test_its_grpc_runs_on_the_lean_server(container: Any) -> None:
    """The image carries libnghttp2 (issue 49: the lite image fell back to grpcio at every start,
    said only in a log line): gRPC answers on the lean server and no fallback is listed."""
    from tests.service.test_grpc_fallback import predict_over_grpc

    c = container()
    started = c.run()
    assert started.returncode == 0, started.stderr
    c.wait_ready()
    status = requests.get(c.url("/api/status"), timeout=10).json()
    assert status["grpc"]["transport"] == "lean" and status["grpc"]["http2"].startswith("libnghttp2 1."), status["grpc"]
    assert not [p for p in status["problems"] if p["kind"] == "fallback"], status["problems"]
    assert predict_over_grpc(c.grpc_port) == EXPECTED
    out, err = c.logs()
    assert "lean gRPC server cannot run" not in out + err


def test_its_health_check_turns_healthy(container: Any) -> None:
    """The image's HEALTHCHECK as it stands (``appliance health`` on the default port 8501), in a
    network namespace of the container's own; podman has no systemd timer here, so the test
    runs each check as the timer would."""
    c = container()
    published = free_port()
    started = c.run("serve", "--no-discovery", network="bridge", extra=("-p", f"127.0.0.1:{published}:8501"),
                    own_ports=False)
    assert started.returncode == 0, started.stderr
    c.port = published

    def healthy() -> bool:
        podman("healthcheck", "run", c.name, timeout=60)
        return inspect(c.name)["State"]["Health"]["Status"] == "healthy"

    poll_until(healthy, 180, "the health check to turn healthy", context=c.log_text, alive=c.exited)
    assert requests.post(c.url("/v1/models/half_plus_two:predict"), json=PREDICT, timeout=10).json() == \
        {"predictions": EXPECTED}


# --- a fleet device's life: hot swap under load, stop, restart --------------------------------
def test_a_published_version_hot_swaps_under_load_then_stop_drains_and_restart_keeps_it(
        container: Any, volume: Any, tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    bucket.chmod(0o777)  # the device writes its reports there as uid 10001
    _publish(bucket, sample_version(tmp_path / "v1"), 1)
    c = container()
    started = c.run("serve", "--bucket", "file:///bucket", "--poll-interval", "0.5",
                    volumes=(f"{volume()}:{STATE}", f"{bucket}:/bucket"))
    assert started.returncode == 0, started.stderr
    c.wait_ready()
    fetched_before = _fetches(c)

    with _Load(c) as load:
        poll_until(lambda: load.answers["1"] >= 20, 60, "requests answered by v1", context=c.log_text)
        _publish(bucket, sample_version(tmp_path / "v2"), 2)
        poll_until(lambda: _serving(c) == 2, 120, "v2 serving inside the container", context=c.log_text,
                   alive=c.exited)
        poll_until(lambda: load.answers["2"] >= 20, 60, "requests answered by v2", context=c.log_text)
    assert load.failures == [], load.failures[:5]
    assert load.answers["1"] >= 20 and load.answers["2"] >= 20, load.answers
    assert _fetches(c) == fetched_before + 1

    # podman stop: SIGTERM, the drain, exit 0, well inside the 15 s the issue allows.
    t0 = time.monotonic()
    stopped = podman("stop", "--time", "30", c.name, timeout=60)
    took = time.monotonic() - t0
    assert stopped.returncode == 0, stopped.stderr
    assert c.state()["ExitCode"] == 0, c.log_text()
    assert took < 15, f"podman stop took {took:.1f} s"
    assert "stopping: draining requests in flight" in c.logs()[0]

    # The bucket goes away: the restarted container can only serve what its state volume kept.
    bucket.rename(tmp_path / "bucket-gone")
    bucket.mkdir()
    assert podman("start", c.name).returncode == 0
    c.wait_ready()
    assert _serving(c) == 2
    assert requests.post(c.url("/v1/models/half_plus_two:predict"), json=PREDICT, timeout=10).json() == \
        {"predictions": EXPECTED}
    assert _fetches(c) == fetched_before + 1, "the restart downloaded a version again"


# --- bad input: a clear message and a non-zero exit -------------------------------------------
def test_a_read_only_state_volume_is_refused_with_why(container: Any, volume: Any) -> None:
    c = container()
    done = c.run(volumes=(f"{volume()}:{STATE}:ro",), detach=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{STATE} cannot be written (Read-only file system)" in done.stderr, done.stderr
    assert "no ':ro'" in done.stderr


def test_a_state_folder_the_service_user_cannot_write_is_refused_with_the_fix(container: Any,
                                                                              tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)  # root's, as `mkdir` on the host or a Kubernetes hostPath makes it
    c = container()
    done = c.run(volumes=(f"{state}:{STATE}",), detach=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"runs as uid {UID}" in done.stderr and f"chown -R {UID}:{UID}" in done.stderr, done.stderr
    assert f"{STATE}:U" in done.stderr


def test_a_missing_state_folder_is_refused_before_the_container_starts(container: Any, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-folder"
    c = container()
    done = c.run(volumes=(f"{missing}:{STATE}",), detach=False)
    assert done.returncode != 0
    assert str(missing) in done.stderr and "no such file or directory" in done.stderr.lower(), done.stderr


@pytest.mark.parametrize("which", ["rest", "grpc"])
def test_a_port_already_taken_ends_the_container_with_the_address(container: Any, which: str) -> None:
    c = container()
    taken = c.port if which == "rest" else c.grpc_port
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        done = c.run(detach=False)
    assert done.returncode == 1, done.stdout + done.stderr
    if which == "rest":
        assert f"cannot listen on 127.0.0.1:{taken}: Address already in use" in done.stderr, done.stderr
    else:
        assert "Failed to start server" in done.stderr and str(taken) in done.stderr, done.stderr


def test_an_image_of_another_architecture_fails_at_once_saying_so(tmp_path: Path) -> None:
    """The arm64 image on this x86-64 host, with no emulator registered: the kernel refuses the
    entrypoint (exec format error), podman says which platform the image is for, the container
    ends non-zero at once."""
    if os.uname().machine != "x86_64" or Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists():
        pytest.skip("needs an x86-64 host without an aarch64 emulator registered")
    arm64 = build("lite", arch="arm64")
    c = Container(arm64)
    try:
        done = c.run(detach=False, timeout=120)
        assert done.returncode != 0
        text = done.stdout + done.stderr
        assert "exec format error" in text.lower(), text
        assert "arm64" in text, text  # podman's warning names the image's platform
    finally:
        c.remove()


# --- helpers ------------------------------------------------------------------------------------
def _limits() -> list[str]:
    from tests.support.podman_support import limit_args

    return limit_args()


def _publish(bucket: Path, version_dir: Path, version: int) -> None:
    done = subprocess.run([APPLIANCE, "publish", "--bucket", f"file://{bucket}", "--model", "half_plus_two",
                           "--version", str(version), str(version_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for root, dirs, files in os.walk(bucket):  # readable by the container's uid
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)


def _serving(c: Container) -> int | None:
    return requests.get(c.url("/api/status"), timeout=10).json()["models"]["half_plus_two"].get("serving_version")


def _fetches(c: Container) -> int:
    """Versions downloaded so far by this container (all its runs): its JSON log's sync_fetch events."""
    return sum(1 for line in c.logs()[0].splitlines() if '"event": "sync_fetch"' in line)


class _Load:
    """Four clients sending KServe v2 infer requests in a loop until the block ends (at most 5
    minutes, 20000 requests), counting the answers per model version and keeping every failure."""

    def __init__(self, c: Container) -> None:
        self.c = c
        self.answers: Counter[str] = Counter()
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"load-{i}") for i in range(4)]
        meta = requests.get(c.url("/v2/models/half_plus_two"), timeout=10).json()
        inp = meta["inputs"][0]
        self._body = {"inputs": [{"name": inp["name"], "datatype": inp["datatype"], "shape": [3],
                                  "data": [1.0, 2.0, 5.0]}]}

    def __enter__(self) -> "_Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _run(self) -> None:
        deadline = time.monotonic() + 300
        with requests.Session() as s:
            for _ in range(5000):
                if self._stop.is_set() or time.monotonic() > deadline:
                    return
                try:
                    r = s.post(self.c.url("/v2/models/half_plus_two/infer"), json=self._body, timeout=10)
                    if r.status_code == 200 and r.json()["outputs"][0]["data"] == EXPECTED:
                        self.answers[r.json()["model_version"]] += 1
                    else:
                        self.failures.append(f"{r.status_code} {r.text[:200]}")
                except requests.RequestException as exc:
                    self.failures.append(repr(exc))
