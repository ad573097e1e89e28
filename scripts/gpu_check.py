"""The measuring half of scripts/gpu-check.sh (run it through that script).

    python scripts/gpu_check.py build DIR                  # DIR/cnn/1: the bench CNN (SavedModel + model.tflite)
    python scripts/gpu_check.py time DIR BACKEND[,..] OUT  # samples/s of each backend on DIR/cnn/1 -> OUT (JSON lines)
    python scripts/gpu_check.py trt DIR PRECISION OUT      # TF-TRT convert (FP16|FP32), check, time -> OUT
    python scripts/gpu_check.py report OUT PROBE_JSON      # the table, and what `auto` chose

Every figure is one backend's ``run`` on a batch of BATCH images (96x96x3), repeated
for SECONDS after WARMUP calls: samples/s = rows done / wall time. Each line written to
OUT says what ran, or why it could not.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCH = int(os.environ.get("GPU_CHECK_BATCH", "32"))
SECONDS = float(os.environ.get("GPU_CHECK_SECONDS", "5"))
WARMUP = 5
SHAPE = (96, 96, 3)


def build(out: str) -> None:
    from tests.support import modelgen

    target = Path(out) / "cnn" / "1"
    if (target / "model.tflite").exists() and (target / "saved_model.pb").exists():
        print(f"bench CNN already built in {target}")
        return
    modelgen.build_bench_models(out, names=("cnn",))
    print(f"bench CNN built in {target}: " + ", ".join(sorted(p.name for p in target.iterdir())))


def _device() -> dict[str, Any]:
    from appliance.core import device

    return device.profile()


def _measure(servable: Any) -> dict[str, Any]:
    import numpy as np

    signature = "serving_default" if "serving_default" in servable.signatures else next(iter(servable.signatures))
    name = next(iter(servable.signatures[signature].inputs))
    feeds = {name: np.random.default_rng(0).standard_normal((BATCH, *SHAPE)).astype(np.float32)}
    first = None
    for _ in range(WARMUP):
        first = servable.run(signature, feeds)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < SECONDS:
        servable.run(signature, feeds)
        calls += 1
    elapsed = time.perf_counter() - start
    out = next(iter(first.values())) if first else None
    return {"samples_per_s": round(calls * BATCH / elapsed, 1), "batch": BATCH, "calls": calls,
            "seconds": round(elapsed, 2), "output_shape": list(getattr(out, "shape", ()))}


def _write(path: str, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row))


def time_backends(models: str, names: str, out: str) -> None:
    import runtimes

    version_dir = str(Path(models) / "cnn" / "1")
    device = _device()
    backends = runtimes.default_backends()
    for name in names.split(","):
        backend = backends[name]
        availability = backend.probe(device)
        row: dict[str, Any] = {"backend": name, "available": availability.available, "reason": availability.reason}
        if availability.available:
            opts: dict[str, Any] = {"device": device, "tftrt": False} if name == "tf-gpu" else {}
            try:
                servable = backend.load(version_dir, opts)
                try:
                    row.update(_measure(servable))
                    row["note"] = getattr(servable, "conversion", "") or getattr(servable, "delegate_reason", "")
                finally:
                    servable.close()
            except Exception as exc:  # a backend that fails here is a finding, not a crash of the check
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
        _write(out, row)


def trt(models: str, precision: str, out: str) -> None:
    """TF-TRT through the tf-gpu backend's own conversion and cache path."""
    import tensorflow as tf
    from runtimes.tf_gpu import TFGPUBackend

    info = tf.sysconfig.get_build_info()
    row: dict[str, Any] = {"backend": f"tf-trt {precision}", "tensorflow": tf.__version__,
                           "is_tensorrt_build": bool(info.get("is_tensorrt_build"))}
    if not row["is_tensorrt_build"]:
        row["error"] = (f"TensorFlow {tf.__version__} is built without TensorRT (TensorRT support ended with "
                        "TensorFlow 2.17); no TF-TRT conversion is possible with it")
        _write(out, row)
        return
    # This venv holds TensorFlow, TensorRT and numpy only: the profile comes from the main venv's probe.
    probe = os.environ.get("GPU_CHECK_PROBE_JSON", "")
    device = {**(json.loads(Path(probe).read_text())["device"] if probe else _device()), "tensorrt": True}
    version_dir = str(Path(models) / "cnn" / "1")
    cache = str(Path(models).parent / "tftrt-cache")
    opts = {"device": device, "cache_dir": cache, "model_name": "cnn", "version": 1, "precision": precision,
            "tftrt": True}
    start = time.perf_counter()
    try:
        servable = TFGPUBackend().load(version_dir, opts)
    except Exception as exc:
        row["error"] = f"load failed: {type(exc).__name__}: {exc}"[:500]
        _write(out, row)
        return
    row["convert_and_load_s"] = round(time.perf_counter() - start, 1)
    row["note"] = servable.conversion
    try:
        if "converted" not in servable.conversion and "from cache" not in servable.conversion:
            row["error"] = "not converted: " + servable.conversion
        else:
            row.update(_measure(servable))
    except Exception as exc:
        row["error"] = f"run failed: {type(exc).__name__}: {exc}"[:500]
    finally:
        servable.close()
    _write(out, row)


def report(out: str, probe_path: str) -> int:
    rows = [json.loads(line) for line in Path(out).read_text().splitlines() if line.strip()]
    print(f"\n== samples/s, bench CNN 96x96x3, batch {BATCH}, {SECONDS:g} s each ==")
    for row in rows:
        figure = f"{row['samples_per_s']:>10.1f}" if "samples_per_s" in row else f"{'n/a':>10}"
        why = row.get("error") or (row.get("reason") if not row.get("available", True) else row.get("note", ""))
        print(f"  {row['backend']:<14}{figure}   {why or ''}")
    try:
        probe = json.loads(Path(probe_path).read_text())
        decision = probe.get("decisions", {}).get("cnn") or {}
        print(f"\n== auto chooses: {decision.get('chosen') or 'NONE'} ({decision.get('how')}): {decision.get('reason')}")
        for c in decision.get("considered", []):
            timed = (f"batch 1: {c['batch1_ms']:.2f} ms, batch N: {c['batch_n_ms']:.2f} ms"
                     if isinstance(c.get("batch1_ms"), (int, float)) and isinstance(c.get("batch_n_ms"), (int, float))
                     else "not timed")
            print(f"  {c['backend']:<8} {'usable' if c.get('available') else 'not usable':<11} {timed}; {c.get('reason')}")
    except (OSError, ValueError) as exc:
        print(f"\n== auto: no probe output ({exc})")
        return 1
    missing = [r["backend"] for r in rows if "samples_per_s" not in r]
    return 1 if any(m in ("tf-gpu",) for m in missing) else 0


def main(argv: list[str]) -> int:
    cmd, *args = argv
    if cmd == "build":
        build(*args)
    elif cmd == "time":
        time_backends(*args)
    elif cmd == "trt":
        trt(*args)
    elif cmd == "report":
        return report(*args)
    else:
        raise SystemExit(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
