#!/usr/bin/env bash
# The README's second command: install everything the tests use, then run the whole suite.
# Real parts: TensorFlow and LiteRT build the models, SeaweedFS is the S3 bucket, Debian's
# chromium renders the status page, systemd-analyze checks the unit.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh tf,tflite,s3,test

need=()
command -v chromium >/dev/null || need+=(chromium)
command -v systemd-analyze >/dev/null || need+=(systemd)
command -v ip >/dev/null || need+=(iproute2)
command -v h2load >/dev/null || need+=(nghttp2-client)  # nghttp2's h2load: an HTTP/2 client for the gRPC port's interop test
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "missing system packages (${need[*]}): sudo apt-get install ${need[*]}; the tests that need them will skip" >&2
  fi
fi
# grpc-js, Node's gRPC client, for the gRPC port's interop test (tests/test_h2_grpc.py): into a
# cache outside the tree (the test skips only where node and npm are missing).
GRPC_JS_DIR="${EDGE_GRPC_JS_DIR:-$HOME/.cache/edge-appliance/grpc-js}"
if command -v npm >/dev/null && [ ! -d "$GRPC_JS_DIR/node_modules/@grpc/grpc-js" ]; then
  mkdir -p "$GRPC_JS_DIR"
  npm install --no-audit --no-fund --silent --prefix "$GRPC_JS_DIR" "@grpc/grpc-js@^1.14" >/dev/null \
    || echo "could not install @grpc/grpc-js into $GRPC_JS_DIR; the grpc-js test will try again" >&2
fi
# Screenshots of the status page (tests/test_ui.py) go here; the tests write nowhere else in the tree.
export EDGE_TEST_ARTIFACTS="${EDGE_TEST_ARTIFACTS:-$PWD/test-artifacts}"
# ARM64=1: then the aarch64 check (scripts/arm64-check.sh: the LiteRT-only install served
# under qemu-user emulation). Opt-in: it takes longer than CI's whole budget.
if [ "${ARM64:-0}" = 1 ]; then
  .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
  exec scripts/arm64-check.sh
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
