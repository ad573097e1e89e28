"""Hostile and partial model versions for the version-safety tests, built from real models.

- ``good(dst)``: TF Serving's half_plus_two as the README ships it (``saved_model.pb`` and
  ``model.tflite``, with warm-up requests): both artifacts carry all five signatures (classify
  and regress too), so the faster backend serves it.
- ``half_broken(dst)``: the same with a truncated ``saved_model.pb`` and an intact ``model.tflite``.
- ``broken(dst)``: both artifacts garbage.
- ``huge_shape(src, dst)``: a ~1 KB ``.tflite`` whose input declares [1, 2^31-1] floats (8 GiB).

Version folders are staged beside the base path and renamed in, as TF Serving's sources expect.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from tests.support.servers import ROOT

SAMPLE = ROOT / "appliance" / "sample_models" / "half_plus_two" / "1"
HUGE = 2**31 - 1


def good(dst: Path) -> Path:
    shutil.copytree(SAMPLE, dst)
    return dst


def half_broken(dst: Path) -> Path:
    good(dst)
    pb = dst / "saved_model.pb"
    data = pb.read_bytes()
    pb.write_bytes(data[: len(data) // 2])
    return dst


def broken(dst: Path) -> Path:
    good(dst)
    (dst / "saved_model.pb").write_bytes(b"not a SavedModel " * 64)
    (dst / "model.tflite").write_bytes(b"not a flatbuffer " * 64)
    return dst


def huge_shape(src_tflite: Path, dst: Path) -> Path:
    """``src_tflite`` with every rank-2 tensor's last dimension set to 2^31-1 in the flatbuffer."""
    from ai_edge_litert import schema_py_generated as schema

    data = bytearray(src_tflite.read_bytes())
    graph = schema.Model.GetRootAsModel(data, 0).Subgraphs(0)
    for i in range(graph.TensorsLength()):
        shape = graph.Tensors(i).ShapeAsNumpy()  # a view on ``data``: writable
        if isinstance(shape, np.ndarray) and shape.size == 2:
            shape[-1] = HUGE
    dst.mkdir(parents=True)
    (dst / "model.tflite").write_bytes(bytes(data))
    return dst


def add_version(build: Any, base: Path, version: int | str, *args: Any) -> Path:
    """``build(stage, *args)`` beside ``base``, then renamed to ``base/<version>`` in one step."""
    base.mkdir(parents=True, exist_ok=True)
    stage = base.parent / f".stage-{base.name}-{version}"
    build(*args, stage) if args else build(stage)
    target = base / str(version)
    stage.rename(target)
    return target


def copy_of(src: Path) -> Any:
    """A builder copying ``src`` (a version directory)."""
    return lambda dst: shutil.copytree(src, dst)


def model_status(server: Any, model: str) -> dict[str, Any]:
    return server.status()["models"][model]


def version_record(server: Any, model: str, version: int) -> dict[str, Any] | None:
    return next((v for v in model_status(server, model)["versions"] if v["version"] == version), None)


def failed(server: Any, model: str, version: int) -> dict[str, Any] | None:
    """The version's record once its load failed (END with an error), else None."""
    record = version_record(server, model, version)
    return record if record and record["state"] == "END" and record["error"] else None


def tfs_status(server: Any, model: str, version: int) -> dict[str, Any]:
    """TF Serving's GetModelStatus answer for one version (REST)."""
    return server.get(f"/v1/models/{model}/versions/{version}").json()["model_version_status"][0]


def classify(server: Any, model: str = "hpt") -> Any:
    """half_plus_two's classify_x_to_y on x = 2 (what a SavedModel-only signature answers)."""
    body = {"signature_name": "classify_x_to_y", "examples": [{"x": 2.0}]}
    return server.post(f"/v1/models/{model}:classify", body)
