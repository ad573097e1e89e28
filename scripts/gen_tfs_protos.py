"""Regenerate appliance/protos/tfserving/tensorflow_serving.desc: TF Serving's gRPC messages and
services, and ``PredictionLog`` (the records of ``assets.extra/tf_serving_warmup_requests``) and ``SavedModel``
(what a device without TensorFlow checks a ``saved_model.pb`` against), as one serialized
FileDescriptorSet.

    .venv/bin/pip install --no-deps tensorflow-serving-api   # next to tensorflow
    .venv/bin/python scripts/gen_tfs_protos.py

Why a descriptor set and not generated *_pb2 modules: TF Serving's .proto files import a
good part of TensorFlow's (tensor, types, meta_graph and all it pulls in), and the
``tensorflow-serving-api`` package's modules import TensorFlow itself. The set is taken
from those very modules (so every field number is TF Serving's own), and
appliance/protos/tfserving/__init__.py loads it into a private descriptor pool with nothing but
protobuf: a LiteRT-only device serves TF Serving's gRPC API without TensorFlow, and a test
process holding the real client stubs (and TensorFlow's own copies of the messages) has
no duplicate-symbol clash.
"""

from __future__ import annotations

import sys
from pathlib import Path

from google.protobuf import descriptor_pb2

OUT = Path(__file__).resolve().parent.parent / "appliance" / "protos" / "tfserving" / "tensorflow_serving.desc"
ROOTS = ("tensorflow_serving.apis.prediction_service_pb2", "tensorflow_serving.apis.model_service_pb2",
         "tensorflow_serving.apis.prediction_log_pb2",
         # SavedModel itself (saved_model.proto: a version and its MetaGraphDefs): a device without
         # TensorFlow still parses a version's saved_model.pb, so a corrupt one fails the version
         # there too (appliance/core/artifacts.py)
         "tensorflow.core.protobuf.saved_model_pb2")


def main() -> int:
    import importlib

    files: dict[str, descriptor_pb2.FileDescriptorProto] = {}

    def add(fd: object) -> None:
        name = fd.name  # type: ignore[attr-defined]
        if name in files:
            return
        for dep in fd.dependencies:  # type: ignore[attr-defined]
            add(dep)
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)  # type: ignore[attr-defined]
        files[name] = proto  # dependencies first: the pool needs them in order

    for module in ROOTS:
        add(importlib.import_module(module).DESCRIPTOR)
    out = descriptor_pb2.FileDescriptorSet(file=list(files.values()))
    OUT.write_bytes(out.SerializeToString(deterministic=True))
    print(f"wrote {OUT} ({len(files)} files, {OUT.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
