#!/usr/bin/env bash
# The README's first command: install, then run the service on its embedded default
# (a local-folder bucket holding a small real sample model), REST on port 8501.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh "${EXTRAS:-tf,tflite}"
exec .venv/bin/appliance serve "$@"
