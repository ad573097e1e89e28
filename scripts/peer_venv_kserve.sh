#!/usr/bin/env bash
# KServe's own Python clients (InferenceRESTClient, InferenceGRPCClient) for tests/peers/test_kserve_clients.py
# (issue 44). The kserve package pins pydantic, starlette, psutil and others to versions the project's
# venv does not hold, so it gets a venv of its own, outside the checkout; the test runs its client
# script (tests/peers/kserve/kserve_clients.py) with that venv's python, never installs at test time,
# and skips naming this script when the venv is missing or incomplete.
#   scripts/peer_venv_kserve.sh            # creates or completes the venv (idempotent)
#   EDGE_KSERVE_VENV=DIR scripts/peer_venv_kserve.sh
set -euo pipefail
KSERVE_VERSION="${EDGE_KSERVE_VERSION:-0.21.0}"
VENV="${EDGE_KSERVE_VENV:-$HOME/.cache/edge-appliance/peer-venvs/kserve}"
# .complete names the version installed; written last, so a venv cut short is never taken for one
if [ "$(cat "$VENV/.complete" 2>/dev/null)" = "kserve==$KSERVE_VERSION" ]; then
  exit 0
fi
echo "peer_venv_kserve.sh: installing kserve $KSERVE_VERSION into $VENV" >&2
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "kserve==$KSERVE_VERSION"
"$VENV/bin/python" -c "from kserve import InferenceRESTClient, InferenceGRPCClient"
echo "kserve==$KSERVE_VERSION" > "$VENV/.complete"
