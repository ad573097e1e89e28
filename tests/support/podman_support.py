"""Containers of the OCI image under real podman, for tests/deploy/test_image.py and bench/image_bench.py.

``build(flavor)`` runs ``scripts/image.sh build`` (its layer cache makes a rebuild of unchanged
code take seconds). ``Container`` is one ``podman run``: started detached with this machine's
limits (``scripts/image.sh podman-args``), removed with its anonymous volumes by ``remove()``.
Host networking binds the service on the host, so the tests give it 127.0.0.1 and free ports:
only loopback traffic, and mDNS is off (it would multicast on the host's interfaces).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.servers import ROOT, free_port, poll_until

IMAGE_SH = ROOT / "scripts" / "image.sh"
STATE = "/var/lib/edge-appliance"
UID = 10001


def available() -> str:
    """Empty when podman can run here, else why not (for a skip)."""
    if shutil.which("podman") is None:
        return "podman is not installed (scripts/test.sh installs it from Debian's packages when run as root)"
    return ""


def podman(*args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=check)


def limit_args() -> list[str]:
    out = subprocess.run([str(IMAGE_SH), "podman-args"], capture_output=True, text=True, check=True).stdout
    return out.split()


def build(flavor: str = "lite", arch: str | None = None, timeout: float = 3600) -> str:
    """The image's tag, built (or found in the layer cache) by scripts/image.sh."""
    cmd = [str(IMAGE_SH), "build", flavor] + (["--arch", arch] if arch else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}"
    return done.stdout.strip().splitlines()[-1]


def inspect(ref: str, kind: str = "container") -> dict[str, Any]:
    done = podman(kind, "inspect", ref, check=True)
    return json.loads(done.stdout)[0]


@dataclass
class Container:
    """One container of the image; ``port``/``grpc_port`` are where its service listens."""

    image: str
    port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    name: str = field(default_factory=lambda: f"ea-test-{uuid.uuid4().hex[:10]}")
    started: bool = False

    def run(self, *serve_args: str, volumes: tuple[str, ...] = (), extra: tuple[str, ...] = (),
            network: str = "host", detach: bool = True, timeout: float = 120,
            own_ports: bool = True) -> subprocess.CompletedProcess[str]:
        """``podman run`` it: ``serve`` on 127.0.0.1 and this container's ports (``own_ports``
        False: the image's defaults) and without mDNS; a first word other than "serve" in
        ``serve_args`` replaces the command."""
        if own_ports and (not serve_args or serve_args[0] == "serve"):
            serve_args = ("serve", "--host", "127.0.0.1", "--port", str(self.port), "--grpc-port",
                          str(self.grpc_port), "--no-discovery", *serve_args[1:])
        cmd = ["run", "--name", self.name, "--network", network, *limit_args(), *extra]
        for v in volumes:
            cmd += ["-v", v]
        cmd += (["-d"] if detach else []) + [self.image, *serve_args]
        self.started = True
        return podman(*cmd, timeout=timeout)

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def logs(self) -> tuple[str, str]:
        done = podman("logs", self.name)
        return done.stdout, done.stderr

    def log_text(self) -> str:
        out, err = self.logs()
        return f"--- stdout (tail) ---\n{out[-3000:]}\n--- stderr (tail) ---\n{err[-3000:]}"

    def state(self) -> dict[str, Any]:
        return dict(inspect(self.name)["State"])

    def running(self) -> bool:
        return bool(self.state().get("Running"))

    def exited(self) -> str | None:
        """For poll_until's ``alive``: a message once the container has stopped."""
        state = self.state()
        if state.get("Running"):
            return None
        return f"container {self.name} exited with {state.get('ExitCode')}\n{self.log_text()}"

    def wait_ready(self, timeout: float = 180) -> None:
        import requests

        poll_until(lambda: requests.get(self.url("/readyz"), timeout=2).status_code == 200, timeout,
                   f"{self.name} /readyz 200", context=self.log_text, alive=self.exited)

    def remove(self) -> None:
        """The container and its anonymous volumes (the image's VOLUMEs it was not given):
        ``rm --volumes`` leaves some behind when the container ended at once, so they are named
        and removed here too."""
        if not self.started:
            return
        mounts = podman("inspect", "--format", "{{range .Mounts}}{{.Name}} {{end}}", self.name).stdout.split()
        podman("rm", "--force", "--volumes", "--time", "5", self.name, timeout=60)
        anonymous = [m for m in mounts if len(m) == 64 and all(c in "0123456789abcdef" for c in m)]
        if anonymous:
            podman("volume", "rm", "--force", *anonymous, timeout=60)


def wait_exit(container: Container, timeout: float = 60) -> int:
    """The container's exit code once it has stopped by itself."""
    state = poll_until(lambda: (lambda s: s if not s.get("Running") and s.get("Status") == "exited" else None)(
        container.state()), timeout, f"{container.name} to exit", context=container.log_text)
    return int(state["ExitCode"])


def sample_version(dest: Path) -> Path:
    """A copy of the bundled sample's version folder (half_plus_two, model.tflite)."""
    src = ROOT / "appliance" / "sample_models" / "half_plus_two" / "1"
    shutil.copytree(src, dest)
    return dest


def elapsed_since(t0: float) -> float:
    return time.monotonic() - t0
