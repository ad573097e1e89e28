"""TensorFlow on an NVIDIA GPU, with the SavedModel converted by TF-TRT on first load.

The converted model is cached under ``<cache_dir>/tftrt/<model>/<version>-<precision>-<key>``
(``key`` hashes the graph, the GPU name and the TensorFlow version), so the next start
loads it directly. A conversion that fails leaves a note in the cache; the plain
SavedModel is then served on the GPU and ``servable.conversion`` says why.

The converter is injected (``TFGPUBackend(converter=...)``) so the selection and cache
logic can be exercised on machines without a GPU; the default converter is the real
``TrtGraphConverterV2`` path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from typing import Callable, Mapping

from .base import Availability
from .json_types import ReadJSONObject
from .savedmodel import INSTALL_HINT, SessionServable, tensorflow
from .tf_cpu import TFCPUBackend

NAME = "tf-gpu"
PRECISIONS = ("FP32", "FP16")
Converter = Callable[[str, str, str], None]  # (saved_model_dir, output_dir, precision)


def tftrt_convert(src: str, dst: str, precision: str) -> None:
    """Convert with TF-TRT (``tf.experimental.tensorrt.Converter``) and save to ``dst``."""
    tf = tensorflow()
    params = tf.experimental.tensorrt.ConversionParams(precision_mode=precision)
    converter = tf.experimental.tensorrt.Converter(input_saved_model_dir=src, conversion_params=params)
    converter.convert()
    converter.save(dst)


def _graph_key(export_dir: str, device: ReadJSONObject) -> str:
    digest = hashlib.sha256()
    for name in ("saved_model.pb", "saved_model.pbtxt"):
        path = os.path.join(export_dir, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(f.read())
    digest.update(str(device.get("gpu_name", "")).encode())
    digest.update(str(device.get("tensorflow_version", "")).encode())
    return digest.hexdigest()[:16]


class TFGPUBackend(TFCPUBackend):
    """Options: ``precision`` (FP32|FP16), ``tftrt`` (bool), ``cache_dir``, plus tf-cpu's.
    Serves the same artifact as tf-cpu; differs in its probe and in converting first."""

    name = NAME

    def __init__(self, converter: Converter | None = None):
        self.converter = converter or tftrt_convert

    def probe(self, device: ReadJSONObject) -> Availability:
        if importlib.util.find_spec("tensorflow") is None:
            return Availability(False, f"TensorFlow is not installed; {INSTALL_HINT}")
        if not device.get("nvidia_gpu"):
            return Availability(False, "no NVIDIA GPU found (no /dev/nvidia0, no nvidia-smi)")
        if device.get("tensorflow_build") == "cpu":
            return Availability(False, "the installed TensorFlow is the CPU-only build; pip install 'tensorflow[and-cuda]'")
        trt = "TensorRT found" if device.get("tensorrt") else "TensorRT not found: plain GPU graphs, no TF-TRT"
        return Availability(True, f"NVIDIA GPU {device.get('gpu_name') or ''} with TensorFlow; {trt}".replace("  ", " "))

    def load(self, version_dir: str, options: ReadJSONObject) -> SessionServable:
        target, note = self.converted(self.export_dir(version_dir), options)
        servable = SessionServable(target, options, NAME, use_gpu=True)
        servable.conversion = note  # type: ignore[attr-defined]  # a note for status, set only on this backend's servables
        return servable

    def converted(self, export_dir: str, options: ReadJSONObject) -> tuple[str, str]:
        """The directory to load (converted or plain) and a sentence saying which and why."""
        found = options.get("device", {})
        device: ReadJSONObject = found if isinstance(found, Mapping) else {}
        if not options.get("tftrt", True) or not device.get("tensorrt"):
            return export_dir, "TF-TRT off or TensorRT missing: plain SavedModel on the GPU"
        precision = str(options.get("precision", "FP16")).upper()
        cache_root = str(options.get("cache_dir") or "") or os.path.join(tempfile.gettempdir(), "edge-appliance-cache")
        entry = os.path.join(cache_root, "tftrt", str(options.get("model_name", "model")),
                             f"{options.get('version', 0)}-{precision}-{_graph_key(export_dir, device)}")
        if os.path.isfile(os.path.join(entry, "saved_model.pb")):
            return entry, f"TF-TRT {precision} model loaded from cache {entry}"
        failed = entry + ".failed"
        if os.path.isfile(failed):  # never retry a conversion that failed for this graph and GPU
            with open(failed) as f:
                return export_dir, f"TF-TRT conversion failed earlier ({f.read().strip()}); plain SavedModel on the GPU"
        return self._convert(export_dir, entry, precision)

    def _convert(self, export_dir: str, entry: str, precision: str) -> tuple[str, str]:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        work = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(entry))
        try:
            self.converter(export_dir, os.path.join(work, "out"), precision)
            with open(os.path.join(work, "out", "CONVERTED.json"), "w") as f:
                json.dump({"source": export_dir, "precision": precision}, f)
            os.replace(os.path.join(work, "out"), entry)  # atomic: a half-written cache never loads
            return entry, f"converted with TF-TRT {precision} and cached in {entry}"
        except Exception as exc:  # any converter failure means: serve unconverted
            with open(entry + ".failed", "w") as f:
                f.write(f"{type(exc).__name__}: {exc}"[:500])
            return export_dir, f"TF-TRT conversion failed ({type(exc).__name__}: {exc}); plain SavedModel on the GPU"
        finally:
            shutil.rmtree(work, ignore_errors=True)
