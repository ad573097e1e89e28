#!/usr/bin/env bash
# The GPU check: one prepared run for the first machine with an NVIDIA GPU (budget: under
# 8 minutes on a fresh 16-core box with network access to PyPI).
#
#   scripts/gpu-check.sh             # everything below; fails at once without a GPU
#   scripts/gpu-check.sh --dry-run   # no GPU needed: says what the GPU gate found, then runs
#                                    # the parts that need none (build the bench CNN, time
#                                    # tf-cpu and tflite, probe) with the venv at hand
#
# Steps: GPU gate (nvidia-smi lists a GPU and /dev/nvidia* exist) -> install (.venv by
# scripts/setup-venv.sh tf,tflite,llm,test, plus tensorflow[and-cuda] at the installed TF version:
# the tf-gpu runtime needs the CUDA/cuDNN wheels) -> build the bench CNN (tests/support/modelgen.py)
# -> `appliance probe --json --models` (what `auto` chooses, with its timings) -> pytest -m
# gpu -> samples/s of tf-gpu, tf-cpu, tflite on the CNN -> TF-TRT FP16 and FP32 through the
# tf-gpu backend's own conversion and cache. TensorFlow dropped TensorRT after 2.17 (the 2.18
# notes: "TensorRT support is disabled in CUDA builds"), so TF-TRT runs in a second venv
# (.venv-trt: tensorflow[and-cuda]==$TRT_TF plus TensorRT $TRT_VERSION) unless --no-trt.
#
# Env: VENV (default .venv; an existing venv is reused), OUT (default /tmp/gpu-check),
# TRT_TF (2.17.1), TRT_VERSION (8.6.1), GPU_CHECK_BATCH (32), GPU_CHECK_SECONDS (5).
set -euo pipefail
cd "$(dirname "$0")/.."

dry=0 trt=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    --no-trt) trt=0 ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done
VENV="${VENV:-.venv}"
OUT="${OUT:-/tmp/gpu-check}"
TRT_TF="${TRT_TF:-2.17.1}"
TRT_VERSION="${TRT_VERSION:-8.6.1}"
started=$(date +%s)
step() { echo; echo "== [$(( $(date +%s) - started ))s] $*"; }
die() { echo; echo "gpu-check: FAILED: $*" >&2; exit 1; }

# -- 1. the GPU gate ---------------------------------------------------------------------
step "GPU gate"
gpu_problem=""
if ! command -v nvidia-smi >/dev/null; then
  gpu_problem="nvidia-smi not found (no NVIDIA driver installed)"
elif ! gpus=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1) || [ -z "$gpus" ]; then
  gpu_problem="nvidia-smi lists no GPU: ${gpus:-empty output}"
elif ! ls /dev/nvidia[0-9]* >/dev/null 2>&1; then
  gpu_problem="nvidia-smi answers but no /dev/nvidia[0-9] device node exists (container without the GPU passed in?)"
fi
if [ -n "$gpu_problem" ]; then
  if [ "$dry" = 0 ]; then
    echo "gpu-check: NO GPU: $gpu_problem" >&2
    echo "gpu-check: this check measures tf-gpu and TF-TRT and cannot run here; use --dry-run for the CPU parts" >&2
    exit 3
  fi
  echo "no GPU ($gpu_problem): dry run, the CPU parts only"
else
  echo "$gpus"
fi
rm -rf "$OUT/results.jsonl"; mkdir -p "$OUT/models"
results="$OUT/results.jsonl"
py="$VENV/bin/python"

# -- 2. install -----------------------------------------------------------------------------
if [ "$dry" = 1 ] && [ -x "$py" ]; then
  step "install: dry run, using the venv at $VENV as it is"
else
  step "install: $VENV with tf,tflite,llm,test"
  if [ "$VENV" = .venv ]; then scripts/setup-venv.sh tf,tflite,llm,test; fi
  [ -x "$py" ] || die "no python in $VENV"
  if [ "$dry" = 0 ]; then
    tfv=$("$py" -c 'import importlib.metadata as m; print(m.version("tensorflow"))') || die "TensorFlow is not installed in $VENV"
    step "install: tensorflow[and-cuda]==$tfv (CUDA and cuDNN wheels for the tf-gpu runtime)"
    "$py" -m pip install -q "tensorflow[and-cuda]==$tfv" || die "pip could not install tensorflow[and-cuda]==$tfv (offline? set VENV to a prepared venv)"
  fi
fi
# TF-TRT needs TensorFlow <= 2.17 with TensorRT: install that venv while the CNN builds and the tests run.
trt_pid=""
if [ "$dry" = 0 ] && [ "$trt" = 1 ] && ! "$py" -c 'import tensorflow as tf, sys; sys.exit(0 if tf.sysconfig.get_build_info().get("is_tensorrt_build") else 1)' 2>/dev/null; then
  step "install (in the background): .venv-trt with tensorflow[and-cuda]==$TRT_TF and tensorrt==$TRT_VERSION"
  (
    [ -x .venv-trt/bin/python ] || "$(command -v python3)" -m venv .venv-trt
    .venv-trt/bin/python -m pip install -q --extra-index-url https://pypi.nvidia.com \
      "tensorflow[and-cuda]==$TRT_TF" "tensorrt==$TRT_VERSION" psutil
  ) > "$OUT/install-trt.log" 2>&1 &
  trt_pid=$!
fi
"$py" - <<'PY' || die "the venv cannot import what the check needs"
import importlib.util as u
missing = [m for m in ("tensorflow", "ai_edge_litert", "pytest", "numpy") if u.find_spec(m) is None]
if missing:
    raise SystemExit(f"missing in the venv: {missing}")
PY

# -- 3. the bench CNN --------------------------------------------------------------------------
step "build the bench CNN (SavedModel + model.tflite) in $OUT/models"
"$py" scripts/gpu_check.py build "$OUT/models" || die "building the bench CNN failed"

# -- 4. what auto chooses ----------------------------------------------------------------------
step "appliance probe --json --models $OUT/models"
"$py" -m appliance.cli probe --json --models "$OUT/models" > "$OUT/probe.json" || die "appliance probe failed"
"$py" - "$OUT/probe.json" "$dry" <<'PY' || die "the device profile does not show the GPU to TensorFlow's runtime"
import json, sys
probe = json.load(open(sys.argv[1]))
dev, be = probe["device"], probe["backends"]
print(f"device: GPU {dev.get('gpu_name') or 'none'}, TensorFlow {dev.get('tensorflow_version')} ({dev.get('tensorflow_build')} build), "
      f"TensorRT libraries {'found' if dev.get('tensorrt') else 'not found'}")
for name, b in be.items():
    print(f"  {name:8} {'available' if b['available'] else 'unavailable':12} {b['reason']}")
if sys.argv[2] == "0" and not be["tf-gpu"]["available"]:
    raise SystemExit("tf-gpu is not available on a machine with a GPU: " + be["tf-gpu"]["reason"])
PY
if [ "$dry" = 0 ]; then
  "$py" - <<'PY' || die "TensorFlow does not see the GPU (CUDA libraries missing or not matching the driver)"
import tensorflow as tf
gpus = tf.config.list_physical_devices("GPU")
print("TensorFlow sees:", gpus, tf.sysconfig.get_build_info().get("cuda_version"))
raise SystemExit(0 if gpus else 1)
PY
fi

# -- 5. the gpu-marked tests ---------------------------------------------------------------------
if [ "$dry" = 0 ]; then
  step "pytest -m gpu"
  if ! "$py" -m pytest -q -p no:cacheprovider -m gpu -rs tests/ > "$OUT/pytest-gpu.log" 2>&1; then
    tail -30 "$OUT/pytest-gpu.log"; die "gpu-marked tests failed (log: $OUT/pytest-gpu.log)"
  fi
  tail -8 "$OUT/pytest-gpu.log"
  grep -q "skipped" "$OUT/pytest-gpu.log" && echo "note: some gpu tests skipped; see the reasons above"
else
  step "pytest -m gpu: skipped in a dry run (the tests skip themselves without a GPU)"
fi

# -- 6. samples/s --------------------------------------------------------------------------------
backends=tf-cpu,tflite
[ "$dry" = 0 ] && backends=tf-gpu,$backends
step "samples/s of $backends on the bench CNN"
"$py" scripts/gpu_check.py time "$OUT/models" "$backends" "$results" || die "timing the backends failed"

# -- 7. TF-TRT FP16 and FP32 -------------------------------------------------------------------------
if [ "$dry" = 1 ] || [ "$trt" = 0 ]; then
  step "TF-TRT: skipped ($([ "$dry" = 1 ] && echo "dry run" || echo "--no-trt")); the installed TensorFlow says:"
  "$py" scripts/gpu_check.py trt "$OUT/models" FP16 "$results" || true
else
  step "TF-TRT with the installed TensorFlow (expected to say why not after 2.17)"
  GPU_CHECK_PROBE_JSON="$OUT/probe.json" "$py" scripts/gpu_check.py trt "$OUT/models" FP16 "$results"
  if "$py" -c 'import tensorflow as tf, sys; sys.exit(0 if tf.sysconfig.get_build_info().get("is_tensorrt_build") else 1)' 2>/dev/null; then
    trt_py="$py"
  else
    step "waiting for the .venv-trt install (log: $OUT/install-trt.log)"
    if ! wait "$trt_pid"; then
      tail -20 "$OUT/install-trt.log"
      die "pip could not install tensorflow[and-cuda]==$TRT_TF with tensorrt==$TRT_VERSION (log: $OUT/install-trt.log)"
    fi
    trt_py=.venv-trt/bin/python
  fi
  # pip's TensorRT keeps libnvinfer in tensorrt_libs; TensorFlow dlopens it by name.
  trt_libs=$("$trt_py" -c 'import os, tensorrt_libs; print(os.path.dirname(tensorrt_libs.__file__))' 2>/dev/null || true)
  for precision in FP16 FP32; do
    step "TF-TRT $precision ($("$trt_py" -c 'import importlib.metadata as m; print("TensorFlow", m.version("tensorflow"))'))"
    LD_LIBRARY_PATH="${trt_libs:+$trt_libs:}${LD_LIBRARY_PATH:-}" GPU_CHECK_PROBE_JSON="$OUT/probe.json" \
      "$trt_py" scripts/gpu_check.py trt "$OUT/models" "$precision" "$results" || echo "TF-TRT $precision crashed (see above)"
  done
fi

# -- 8. the table ----------------------------------------------------------------------------------
step "results ($results)"
status=0
"$py" scripts/gpu_check.py report "$results" "$OUT/probe.json" || status=$?
if [ "$dry" = 0 ]; then
  "$py" - "$results" <<'PY' || status=1
import json, sys
rows = {r["backend"]: r for r in map(json.loads, open(sys.argv[1]))}
bad = [name for name in ("tf-gpu", "tf-trt FP16", "tf-trt FP32") if "samples_per_s" not in rows.get(name, {})]
if bad:
    print(f"\ngpu-check: no figure for {', '.join(bad)}: see the reasons in the table", file=sys.stderr)
    sys.exit(1)
PY
fi
echo; echo "gpu-check: $([ "$status" = 0 ] && echo OK || echo "FAILED (see above)") in $(( $(date +%s) - started )) s$([ "$dry" = 1 ] && echo " (dry run: no GPU figures)")"
exit "$status"
