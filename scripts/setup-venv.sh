#!/usr/bin/env bash
# Create (or update) the project's virtualenv in .venv with the given extras.
#   scripts/setup-venv.sh tf,tflite          # full device install
#   scripts/setup-venv.sh tf,tflite,s3,llm,test  # everything the test suite needs
# Re-running is cheap: pip skips what is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-tf,tflite}"
py="${PYTHON:-python3}"

if ! "$py" -c 'import ensurepip, venv' 2>/dev/null; then
  # Debian ships venv/ensurepip separately.
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
  else
    echo "python3-venv is missing: sudo apt-get install python3-venv" >&2; exit 1
  fi
fi
[ -x .venv/bin/python ] || "$py" -m venv .venv
# scripts/run.sh makes its venv --without-pip and has uv install pip into it; a venv made
# otherwise without pip gets it here. setuptools too: Python 3.11's venv brings it and a test
# dependency may import it undeclared, but run.sh's venv has none.
.venv/bin/python -c 'import pip' 2>/dev/null || .venv/bin/python -m ensurepip -q
stamp=".venv/.installed-$(echo "$extras" | tr ',' '-')-$(sha256sum pyproject.toml | cut -c1-12)"
# Say what each step does and how long it took: the full install downloads ~2 GB and takes
# minutes, and a silent minute reads as a hang. pip's own lines (Collecting, Downloading,
# Installing) show where it is; EDGE_PIP_QUIET=1 hides them (the step lines stay).
step() { echo "setup-venv: $*" >&2; }
pip_args=(--progress-bar on)
[ "${EDGE_PIP_QUIET:-0}" = 1 ] && pip_args=(-q)
if [ ! -f "$stamp" ]; then
  started=$SECONDS
  step "upgrading pip (and adding setuptools) in .venv"
  .venv/bin/python -m pip install "${pip_args[@]}" --upgrade pip setuptools
  step "installing edge-appliance[${extras}] into .venv (minutes the first time; pip prints each package)"
  .venv/bin/python -m pip install "${pip_args[@]}" -e ".[${extras}]"
  touch "$stamp"
  step "done in $((SECONDS - started)) s"
else
  step ".venv already has edge-appliance[${extras}] for this pyproject.toml ($stamp)"
fi
