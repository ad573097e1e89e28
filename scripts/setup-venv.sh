#!/usr/bin/env bash
# Create (or update) the project's virtualenv in .venv with the given extras.
#   scripts/setup-venv.sh tf,tflite          # full device install
#   scripts/setup-venv.sh tf,tflite,s3,test  # everything the test suite needs
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
stamp=".venv/.installed-$(echo "$extras" | tr ',' '-')-$(sha256sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[${extras}]"
  touch "$stamp"
fi
