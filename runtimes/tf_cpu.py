"""TensorFlow on the CPU: any SavedModel, TF1 or TF2, served as TF Serving serves it."""

from __future__ import annotations

import importlib.util

from .base import Availability, LoadFailure
from .json_types import ReadJSONObject
from .savedmodel import INSTALL_HINT, SessionServable, find_saved_model

NAME = "tf-cpu"


class TFCPUBackend:
    """Options: ``intra_op_threads``, ``inter_op_threads`` (0 = TensorFlow's choice), ``tags``."""

    name = NAME

    def probe(self, device: ReadJSONObject) -> Availability:
        if importlib.util.find_spec("tensorflow") is None:
            return Availability(False, f"TensorFlow is not installed; {INSTALL_HINT}")
        return Availability(True, f"TensorFlow importable, {device.get('cpu_count', '?')} CPU cores")

    def can_serve(self, version_dir: str) -> str | None:
        return find_saved_model(version_dir)

    def export_dir(self, version_dir: str) -> str:
        export_dir = self.can_serve(version_dir)
        if export_dir is None:
            raise LoadFailure(f"no saved_model.pb in {version_dir}", "NOT_FOUND")
        return export_dir

    def load(self, version_dir: str, options: ReadJSONObject) -> SessionServable:
        return SessionServable(self.export_dir(version_dir), options, NAME, use_gpu=False)
