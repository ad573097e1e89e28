#!/usr/bin/env bash
# The README's first command: install what a small device runs (the service with LiteRT, no
# TensorFlow) and run it on its embedded default (a local-folder bucket holding the sample
# model), REST on port 8501. Ctrl-C (or SIGTERM) stops it: it drains what is in flight and exits.
#
#   VENV=DIR     the virtualenv to make or reuse (default: .venv; scripts/test.sh adds the rest to it)
#   EXTRAS=LIST  the extras to install (default: tflite; EXTRAS=tflite,tf adds TensorFlow, ~2 GB)
#   anything after the command goes to `appliance serve` (--port, --state, --models ...)
#
# Every step that takes more than a moment says so first; pip prints each package it fetches.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
extras="${EXTRAS:-tflite}"
py="${PYTHON:-python3}"
step() { printf 'run.sh [%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [ ! -x "$venv/bin/python" ]; then
  if ! "$py" -c 'import ensurepip, venv' 2>/dev/null; then
    # Debian ships venv/ensurepip separately.
    if [ "$(id -u)" = 0 ]; then
      step "installing python3-venv with apt-get"
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    else
      echo "python3-venv is missing: sudo apt-get install python3-venv" >&2; exit 1
    fi
  fi
  step "creating the virtualenv $venv"
  "$py" -m venv "$venv"
fi
stamp="$venv/.installed-$(echo "$extras" | tr ',' '-')-$(sha256sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  step "installing edge-appliance[$extras] from this checkout into $venv (pip names each package as it goes)"
  "$venv/bin/python" -m pip install --disable-pip-version-check -e ".[${extras}]"
  touch "$stamp"
  step "installed: $(du -sh "$venv" | cut -f1) in $venv"
fi
step "starting the service (Ctrl-C stops it); the try: line below appears once the sample model answers"
exec "$venv/bin/appliance" serve "$@"
