#!/usr/bin/env bash
# The README's second command: install everything the tests use, then run the whole suite.
# Real parts: TensorFlow and LiteRT build the models, SeaweedFS is the S3 bucket, Debian's
# chromium renders the status page, systemd-analyze checks the unit.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh tf,tflite,s3,llm,test

need=()
command -v chromium >/dev/null || need+=(chromium)
command -v systemd-analyze >/dev/null || need+=(systemd)
command -v ip >/dev/null || need+=(iproute2)
command -v h2load >/dev/null || need+=(nghttp2-client)  # nghttp2's h2load: an HTTP/2 client for the gRPC port's interop test
# The OCI image's tests (tests/deploy/test_image.py): podman with runc, and mmdebstrap for the Debian
# base images (scripts/image.sh); their caches (base images, layers, pip downloads) live in
# podman's storage, outside the checkout, so a later run on this machine reuses them.
command -v podman >/dev/null || need+=(podman runc conmon catatonit uidmap containernetworking-plugins)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "test.sh: installing ${need[*]} with apt-get" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "missing system packages (${need[*]}): sudo apt-get install ${need[*]}; the tests that need them will skip" >&2
  fi
fi
# grpc-js, Node's gRPC client, for the gRPC port's interop test (tests/transport/test_h2_grpc.py): into a
# cache outside the tree (the test skips only where node and npm are missing).
GRPC_JS_DIR="${EDGE_GRPC_JS_DIR:-$HOME/.cache/edge-appliance/grpc-js}"
if command -v npm >/dev/null && [ ! -d "$GRPC_JS_DIR/node_modules/@grpc/grpc-js" ]; then
  mkdir -p "$GRPC_JS_DIR"
  echo "test.sh: installing @grpc/grpc-js into $GRPC_JS_DIR" >&2
  npm install --no-audit --no-fund --silent --prefix "$GRPC_JS_DIR" "@grpc/grpc-js@^1.14" >/dev/null \
    || echo "could not install @grpc/grpc-js into $GRPC_JS_DIR; the grpc-js test will try again" >&2
fi
# KServe's own clients for tests/peers/test_kserve_clients.py: a venv of their own outside the tree (the
# kserve package pins pydantic, starlette and psutil away from ours); the test skips, naming the
# script, where it could not be made.
scripts/peer_venv_kserve.sh || echo "could not make KServe's client venv (scripts/peer_venv_kserve.sh); its test will skip" >&2
# podman's Quadlet generator for tests/deploy/test_deploy.py: Debian's podman 4.3 has none (Quadlet came
# with 4.4), so it is taken from Debian's newer podman package (trixie) into a cache, with a
# private apt state: nothing is installed or changed on the host.
QUADLET_DIR="$HOME/.cache/edge-appliance/quadlet"
if [ ! -x /usr/libexec/podman/quadlet ] && [ ! -x "$QUADLET_DIR/usr/libexec/podman/quadlet" ]; then
  echo "test.sh: fetching podman's Quadlet generator into $QUADLET_DIR" >&2
  apt_dir=$(mktemp -d)
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$QUADLET_DIR"
  echo "deb http://deb.debian.org/debian trixie main" > "$apt_dir/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o APT::Sandbox::User=root)
  if apt-get "${apt_opts[@]}" update -qq >/dev/null 2>&1 \
      && (cd "$apt_dir" && apt-get "${apt_opts[@]}" download -qq podman >/dev/null 2>&1); then
    dpkg-deb --fsys-tarfile "$apt_dir"/podman_*.deb | tar -x -C "$QUADLET_DIR" ./usr/libexec/podman/quadlet
  else
    echo "could not fetch podman's Quadlet generator; its test will skip" >&2
  fi
  rm -rf "$apt_dir"
fi
# Bytecode: the suite starts a few hundred services and CLI runs, each a fresh Python importing
# the checkout's modules, and two workers that import every test module (pytest rewrites their
# asserts). Where PYTHONDONTWRITEBYTECODE is set (some CI images and sandboxes set it) each of
# those compiles from source again: about 1 s of CPU a service start (7.2 -> 6.1 s measured) and
# 6.5 s a worker's collection (29.3 -> 22.8 s). The .pyc files go to __pycache__ folders, which
# .gitignore and the image's build context leave out; site-packages already has its own.
unset PYTHONDONTWRITEBYTECODE
# Screenshots of the status page (tests/ui/test_ui.py) go here; the tests write nowhere else in the tree.
export EDGE_TEST_ARTIFACTS="${EDGE_TEST_ARTIFACTS:-$PWD/test-artifacts}"
# ARM64=1: then the aarch64 check (scripts/arm64-check.sh: the LiteRT-only install served
# under qemu-user emulation). Opt-in: it takes longer than CI's whole budget.
# The suite runs on pytest-xdist workers, one test file per worker at a time (--dist loadfile:
# a file's module fixtures, one server or one SeaweedFS, are built once). Most of the time is
# spent waiting on child processes, so two workers halve the wall time even on 2 cores; more
# than 4 buys little and costs memory. EDGE_TEST_WORKERS overrides (0: no workers, in-process).
# The type checker first ([tool.mypy] in pyproject.toml: the whole package, strict where the
# processes meet): a type that broke fails the run before any test starts. Its cache lives outside
# the tree, so a second run checks only what changed.
.venv/bin/python -m mypy --cache-dir "${EDGE_MYPY_CACHE:-$HOME/.cache/edge-appliance/mypy}"
workers="${EDGE_TEST_WORKERS:-$(n=$(nproc); [ "$n" -lt 2 ] && n=2; [ "$n" -gt 4 ] && n=4; echo "$n")}"
xdist=()
[ "$workers" != 0 ] && xdist=(-n "$workers" --dist loadfile)
# Each run writes where its time went (test-artifacts/durations.txt, tests/support/durations.py);
# with it, the files are collected heaviest first and handed out in that order (xdist's own
# reorder, by number of tests, would put a long file of few tests last, one worker idle while
# the other finishes it). A clean checkout (CI) has no test-artifacts/: the record committed in
# the tree (tests/durations.txt) orders it instead. Without either, xdist's order stands.
if [ "$workers" != 0 ] && { [ -f "$EDGE_TEST_ARTIFACTS/durations.txt" ] || [ -f tests/durations.txt ]; }; then
  xdist+=(--no-loadscope-reorder)
fi
# Timeouts and waits stretch with the load (tests/support/load.py); the header says by how much.
echo "test.sh: running the suite ($workers workers; load average $(cut -d' ' -f1-3 /proc/loadavg)); the first run builds the test models before the first test" >&2
if [ "${ARM64:-0}" = 1 ]; then
  .venv/bin/python -m pytest -q -p no:cacheprovider "${xdist[@]}" "$@"
  exec scripts/arm64-check.sh
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${xdist[@]}" "$@"
