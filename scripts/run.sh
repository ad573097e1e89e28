#!/usr/bin/env bash
# The README's first command: install what a small device runs (the service with LiteRT, no
# TensorFlow) and run it on its embedded default (a local-folder bucket holding the sample
# model), REST on port 8501. Ctrl-C (or SIGTERM) stops it: it drains what is in flight and exits.
#
#   VENV=DIR     the virtualenv to make or reuse (default: .venv; scripts/test.sh adds the rest to it)
#   EXTRAS=LIST  the extras to install (default: tflite; EXTRAS=tflite,tf adds TensorFlow, ~2 GB)
#   INSTALLER=pip  install with pip alone (the default, uv, falls back to it by itself)
#   anything after the command goes to `appliance serve` (--port, --state, --models ...)
#
# Every step that takes more than a moment says so first; pip and uv say what they fetch.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
extras="${EXTRAS:-tflite}"
py="${PYTHON:-python3}"
step() { printf 'run.sh [%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# pip, to fetch uv (and to install with where uv cannot): the venv's own if it has one, else the
# wheel Python bundles for ensurepip (Debian's python3-venv keeps it in /usr/share/python-wheels),
# run as a zip: a venv made --without-pip then costs 0.2 s instead of ~5 s of CPU (ensurepip
# unpacks and byte-compiles pip and setuptools, which the service never imports).
pip_wheel() {
  local dir
  for dir in "$("$py" -c 'import ensurepip, os; print(os.path.dirname(ensurepip.__file__))' 2>/dev/null)/_bundled" \
             /usr/share/python-wheels; do
    compgen -G "$dir/pip-*.whl" >/dev/null && { ls "$dir"/pip-*.whl | sort -V | tail -1; return; }
  done
  return 1
}
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
  if pip_wheel >/dev/null; then "$py" -m venv --without-pip "$venv"; else "$py" -m venv "$venv"; fi
fi
if "$venv/bin/python" -c 'import pip' 2>/dev/null; then pip_path=; else pip_path=$(pip_wheel); fi
pip() { PYTHONPATH="$pip_path" "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }

# uv installs what pip would (the same indexes, find-links, constraints and certificates: pip's
# configuration, read by pip itself below, is passed on), but resolves and downloads in parallel
# and installs without byte-compiling: 31 packages in ~4 s of CPU where pip took ~20
# (bench/RESULTS.md, issue 49); scripts/uv-constraints.txt holds where the two would differ.
# One pip process reads the configuration and installs uv (pip run from its wheel is slow to
# import: once, not twice). INSTALLER=pip installs with pip alone.
uv_bootstrap() {  # $1: a file for uv's arguments that say pip's configuration, one a line; $2: install uv (1) or not
  PYTHONPATH="$pip_path" "$venv/bin/python" -c '
import sys
from pip._internal.configuration import Configuration
from pip._internal.cli.main import main
conf = Configuration(isolated=False)
conf.load()
items = dict(conf.items())  # "section.name": an environment variable (":env:") over [install] over [global]
def get(name):
    return next((items[s + "." + name] for s in (":env:", "install", "global") if s + "." + name in items), "")
with open(sys.argv[1], "w") as out:
    for name in ("index-url", "extra-index-url", "find-links", "constraint"):
        for value in get(name).split():
            out.write(f"--{name}={value}\n")
    if get("cert"):  # uv reads its CA bundle from SSL_CERT_FILE
        out.write("SSL_CERT_FILE=" + get("cert") + "\n")
if sys.argv[2] == "1":
    sys.exit(main(["install", "--disable-pip-version-check", "--no-compile", "uv"]))
' "$1" "$2"
}
stamp="$venv/.installed-$(echo "$extras" | tr ',' '-')-$(sha256sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  step "installing edge-appliance[$extras] from this checkout into $venv: pip fetches uv (the installer, one 17 MB wheel), then uv names each step"
  installed=
  conf=$(mktemp)
  uv=$(command -v uv || echo "$venv/bin/uv")  # the user's own uv, if there is one
  if [ "${INSTALLER:-uv}" = uv ] && uv_bootstrap "$conf" "$([ -x "$uv" ] && echo 0 || echo 1)"; then
    mapfile -t envs < <(grep '^SSL_CERT_FILE=' "$conf" || true)
    [ -z "${SSL_CERT_FILE:-}" ] || envs=()  # the user's own wins
    mapfile -t args < <(grep '^--' "$conf" || true)
    # unsafe-best-match: the newest release on any index, as pip (uv's default takes the first
    # index that has the package at all). Its cache is a throwaway folder (UV_CACHE_DIR to keep
    # one): ~200 MB unpacked that a small device would keep for nothing. --link-mode copy: the
    # files uv unpacks (large writes) sit in the page cache as large folios, and a library mapped
    # from them right after counted ~8 MiB more PSS in the serving process (125 MiB for the tree
    # against 114 copied, bench/RESULTS.md), until the page cache forgets them.
    cache=${UV_CACHE_DIR:-$(mktemp -d)}
    if env "${envs[@]}" UV_CACHE_DIR="$cache" "$uv" pip install --python "$venv/bin/python" \
        --index-strategy unsafe-best-match --link-mode copy "${args[@]}" \
        --constraint scripts/uv-constraints.txt -e ".[${extras}]" pip; then
      installed=uv
    fi
    [ -n "${UV_CACHE_DIR:-}" ] || rm -rf "$cache"
  fi
  rm -f "$conf"
  if [ -z "$installed" ]; then
    [ "${INSTALLER:-uv}" = pip ] || step "uv could not install: installing with pip instead (it names each package as it goes)"
    pip install -e ".[${extras}]" pip  # pip too: scripts/test.sh adds the rest with it
  fi
  # uv leaves the byte-compiling to Python, which compiles each module as it imports it and
  # keeps the bytecode in __pycache__ (unless PYTHONDONTWRITEBYTECODE is set). Compiled inside the
  # serving process, the ~560 modules it imports left ~45 MiB more PSS there (bench/first_run.py:
  # 173 MiB for the tree against 124 with bytecode). So a process of its own imports what the
  # service imports (every module of ours, and what they import lazily), writing their bytecode
  # (~2 s of CPU), and exits; compiling all ~1,700 files (uv's --compile-bytecode) cost 8 s.
  if [ "$installed" = uv ]; then
    step "compiling what the service imports to bytecode (once: later starts read it)"
    env -u PYTHONDONTWRITEBYTECODE "$venv/bin/python" -c '
import importlib, pkgutil
import appliance, runtimes, sync, ui
names = [m.name for top in (appliance, runtimes, sync, ui)
         for m in pkgutil.walk_packages(top.__path__, top.__name__ + ".", onerror=lambda name: None)]
names += ["ai_edge_litert.interpreter", "ai_edge_litert.schema_py_generated", "uvloop", "zeroconf.asyncio",
          "grpc._utilities", "cffi.cparser", "flatbuffers.flexbuffers", "cryptography.hazmat.primitives.asymmetric.ed25519",
          "cryptography.hazmat.primitives.serialization", "google.protobuf.text_format"]  # imported lazily
for name in names:
    try:
        importlib.import_module(name)
    except Exception:  # what this install lacks (TensorFlow, boto3, ...): its modules are not served here
        pass
'
  fi
  touch "$stamp"
  step "installed: $(du -sh "$venv" | cut -f1) in $venv"
fi
step "starting the service (Ctrl-C stops it); the try: line below appears once the sample model answers"
exec "$venv/bin/appliance" serve "$@"
