"""A LiteRT-only device in a process of the test venv: TensorFlow cannot be found.

Put this folder first on ``PYTHONPATH`` of a process the test starts (``LITERT_ONLY_ENV`` in
tests/support/versions_support.py): Python imports ``sitecustomize`` at start-up, and this one
wraps the path finder so that ``tensorflow`` (and anything under it, and the test extra's
torch and litert-torch) is not found, exactly as
where it is not installed: ``importlib.util.find_spec("tensorflow")`` is None and an import
raises ModuleNotFoundError. The service's children (a version's trial) inherit the variable,
so they see the same device. Everything else (LiteRT included) imports as usual. Building a
real venv without TensorFlow takes minutes (tests/deploy/test_lite_install.py does it, marked slow).
"""

from __future__ import annotations

import sys
from importlib.machinery import PathFinder
from typing import Any

# What scripts/run.sh's venv lacks (with or without its llm extra) and the test venv has:
# TensorFlow and what comes with it, and the test extra's torch and litert-torch
# (scripts/tiny_chat_model.py's converter)
HIDDEN = ("tensorflow", "tensorflow_serving", "tf_keras", "keras", "torch", "litert_torch")


class _WithoutTensorFlow(PathFinder):
    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.split(".")[0] in HIDDEN:
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [_WithoutTensorFlow if f is PathFinder else f for f in sys.meta_path]
