"""The OCI image's figures (issue 32): sizes and layers, build times, cold start inside vs outside.

    .venv/bin/python bench/image_bench.py [--cold] [--runs 3]

- **Sizes**: each image present (lite, full, lite-arm64), its layers largest first and, for the
  venv layer, the largest packages in it.
- **Build times**: ``scripts/image.sh build lite`` with nothing changed (the layer cache), from a
  fresh clone of this checkout (a CI run on a clean checkout of the same machine), and after a
  code change (only the project's layer). ``--cold`` also builds from an empty podman storage
  (a clean machine: the Debian bases with mmdebstrap, every wheel, every layer), in a
  throw-away storage root so this machine's cache stays as it is.
- **Cold start to ready**: the embedded default from an empty state directory (publish, sync,
  backend choice, load) and a restart on the kept state, to ``/readyz`` 200; inside the container
  (``podman run`` included) against the same ``appliance serve`` in this checkout's venv outside
  it, alternated, LiteRT pinned on both (``--backend tflite``: the host venv has TensorFlow too,
  the lite image does not). Median of ``--runs``.

Prints markdown for bench/RESULTS.md. Only loopback traffic; mDNS off.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.servers import ROOT, free_port  # noqa: E402
from tests.support.podman_support import IMAGE_SH, Container, podman  # noqa: E402

LITE = "localhost/edge-appliance:lite"


def sh(*cmd: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def timed(*cmd: str, env: dict[str, str] | None = None) -> float:
    t0 = time.perf_counter()
    sh(*cmd, env=env)
    return time.perf_counter() - t0


# --- sizes ---------------------------------------------------------------------------------------
def sizes() -> list[str]:
    lines = ["### Image sizes and their largest layers", ""]
    for tag in ("lite", "full", "lite-arm64"):
        ref = f"localhost/edge-appliance:{tag}"
        if podman("image", "exists", ref).returncode != 0:
            continue
        lines += ["```text", sh(str(IMAGE_SH), "layers", ref).rstrip(), "```", ""]
        lines += [f"Largest packages in the venv layer of `{ref}` (MB on disk):", "", "```text",
                  packages(ref), "```", ""]
    return lines


def packages(ref: str) -> str:
    out = podman("run", "--rm", "--network", "none", *limits(), "--entrypoint", "/bin/sh", ref, "-c",
                 "cd /opt/edge-appliance/venv/lib/python3.11/site-packages && du -sm * | sort -rn | head -12").stdout
    return out.rstrip()


def limits() -> list[str]:
    return sh(str(IMAGE_SH), "podman-args").split()


# --- build times ---------------------------------------------------------------------------------
def build_times(cold: bool) -> list[str]:
    rows = []
    if cold:
        rows.append(("cold: empty podman storage (Debian bases with mmdebstrap, every wheel, every layer)",
                     cold_build()))
    rows.append(("cached: nothing changed", timed(str(IMAGE_SH), "build", "lite")))
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "clone"
        sh("git", "clone", "-q", str(ROOT), str(clone))
        for path in sh("git", "status", "--porcelain", "--untracked-files=all", cwd=ROOT).splitlines():
            name = path[3:]  # the working tree as it is, uncommitted changes included
            if (ROOT / name).is_file():
                (clone / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, clone / name)
        rows.append(("cached: a fresh clone of this checkout (CI on a clean checkout, same machine)",
                     timed(str(clone / "scripts" / "image.sh"), "build", "lite")))
        init = clone / "appliance" / "__init__.py"
        init.write_text(init.read_text() + "\n# a code change\n")
        rows.append(("a code change: only the project's layer (then the clone's image is rebuilt back)",
                     timed(str(clone / "scripts" / "image.sh"), "build", "lite")))
    timed(str(IMAGE_SH), "build", "lite")  # the checkout's own image again
    return ["### Build time of the lite image", "", "| build | s |", "|---|---|",
            *[f"| {what} | {s:.0f} |" for what, s in rows], ""]


def cold_build() -> float:
    """scripts/image.sh build lite into a throw-away podman storage (and buildah's cache mounts in it)."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        conf = Path(tmp) / "storage.conf"
        conf.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{tmp}/graph"\nrunroot = "{tmp}/run"\n')
        env = {"CONTAINERS_STORAGE_CONF": str(conf), "TMPDIR": tmp}
        try:
            return timed(str(IMAGE_SH), "build", "lite", env=env)
        finally:
            subprocess.run(["podman", "--root", f"{tmp}/graph", "--runroot", f"{tmp}/run", "system", "reset",
                            "--force"], capture_output=True, env={**os.environ, **env})


# --- cold start ------------------------------------------------------------------------------------
def ready_after(url: str, t0: float, alive: object, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/readyz", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except requests.RequestException:
            pass
        if callable(alive) and alive():
            raise SystemExit(f"the service ended before it was ready: {alive()}")
        time.sleep(0.05)
    raise SystemExit(f"not ready after {timeout} s: {url}")


def outside(state: Path) -> float:
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(ROOT / ".venv" / "bin" / "appliance"), "serve", "--state", str(state), "--host",
                             "127.0.0.1", "--port", str(port), "--grpc-port", str(free_port()), "--no-discovery",
                             "--backend", "tflite"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        return ready_after(f"http://127.0.0.1:{port}", t0, lambda: proc.poll() is not None and f"exit {proc.returncode}")
    finally:
        proc.terminate()
        proc.wait(60)


def inside(volume: str) -> float:
    c = Container(LITE)
    t0 = time.perf_counter()
    started = c.run("serve", "--backend", "tflite", volumes=(f"{volume}:/var/lib/edge-appliance",))
    if started.returncode != 0:
        raise SystemExit(started.stderr)
    try:
        return ready_after(c.url(), t0, c.exited)
    finally:
        c.remove()


def cold_starts(runs: int) -> list[str]:
    results: dict[str, list[float]] = {k: [] for k in ("first inside", "first outside", "restart inside",
                                                        "restart outside")}
    for _ in range(runs):
        volume = f"ea-bench-{os.urandom(4).hex()}"
        podman("volume", "create", volume)
        with tempfile.TemporaryDirectory() as tmp:
            state = Path(tmp) / "state"
            try:
                results["first inside"].append(inside(volume))
                results["first outside"].append(outside(state))
                results["restart inside"].append(inside(volume))
                results["restart outside"].append(outside(state))
            finally:
                podman("volume", "rm", "--force", volume)
    med = {k: statistics.median(v) for k, v in results.items()}
    return ["### Cold start to /readyz 200: inside the container against outside it", "",
            f"Median of {runs}, alternated. Embedded default, LiteRT pinned (`--backend tflite`) on both.", "",
            "| start | inside (`podman run` included), s | outside (`.venv/bin/appliance serve`), s | inside / outside |",
            "|---|---|---|---|",
            *[f"| {what} | {med[what + ' inside']:.2f} | {med[what + ' outside']:.2f} | "
              f"{med[what + ' inside'] / med[what + ' outside']:.2f} |" for what in ("first", "restart")],
            "", "Every run: " + json.dumps({k: [round(x, 2) for x in v] for k, v in results.items()}), ""]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cold", action="store_true", help="also build from an empty podman storage")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip", default="", help="comma-separated: sizes,build,start")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    sh(str(IMAGE_SH), "build", "lite")
    head = [f"## The OCI image, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
            f"Host: {os.uname().machine}, {os.cpu_count()} CPUs, shared; load average "
            f"{os.getloadavg()[0]:.1f} at the start. podman {sh('podman', '--version').split()[-1]} with runc. "
            f"Command: `.venv/bin/python bench/image_bench.py{' --cold' if args.cold else ''} --runs {args.runs}`.", ""]
    body = (sizes() if "sizes" not in skip else []) + (build_times(args.cold) if "build" not in skip else []) \
        + (cold_starts(args.runs) if "start" not in skip else [])
    print("\n".join(head + body + [f"Load average at the end: {os.getloadavg()[0]:.1f}.", ""]))


if __name__ == "__main__":
    main()
