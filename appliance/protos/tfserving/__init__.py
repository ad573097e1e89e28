"""TF Serving's gRPC messages (``tensorflow.serving.*`` and the ``tensorflow.*`` ones they
use), without TensorFlow.

``tensorflow_serving.desc`` is a serialized FileDescriptorSet written by
``scripts/gen_tfs_protos.py`` from the ``tensorflow-serving-api`` package's own modules,
so every field number is TF Serving's. It is loaded here into a private descriptor pool
(never protobuf's default one, where TensorFlow's copies of the same messages may live in
the same process) and the classes are built from it: only protobuf is needed at run time.

``pb.PredictRequest``, ``pb.TensorProto``, ``pb.PredictionLog``, ... : the classes by short
name (the last part of the full name; the names used are unique across these files).
``wire`` maps ``TensorProto`` and ``tf.Example`` to and from numpy.
"""

from __future__ import annotations

import os
from google.protobuf.message import Message

from google.protobuf import descriptor, descriptor_pb2, descriptor_pool

_DESC = os.path.join(os.path.dirname(__file__), "tensorflow_serving.desc")
POOL = descriptor_pool.DescriptorPool()


def _message_class(descriptor: descriptor.Descriptor) -> type[Message]:
    try:
        from google.protobuf.message_factory import GetMessageClass
    except ImportError:  # protobuf < 4.22
        from google.protobuf.message_factory import MessageFactory

        return MessageFactory(POOL).GetPrototype(descriptor)
    return GetMessageClass(descriptor)


class _Messages:
    """Attribute access to the message classes: ``pb.PredictRequest``."""

    def __init__(self) -> None:
        with open(_DESC, "rb") as f:
            files = descriptor_pb2.FileDescriptorSet.FromString(f.read()).file
        for proto in files:
            POOL.Add(proto)
        self._names = {
            "PredictRequest": "tensorflow.serving.PredictRequest",
            "PredictResponse": "tensorflow.serving.PredictResponse",
            "ClassificationRequest": "tensorflow.serving.ClassificationRequest",
            "ClassificationResponse": "tensorflow.serving.ClassificationResponse",
            "RegressionRequest": "tensorflow.serving.RegressionRequest",
            "RegressionResponse": "tensorflow.serving.RegressionResponse",
            "MultiInferenceRequest": "tensorflow.serving.MultiInferenceRequest",
            "MultiInferenceResponse": "tensorflow.serving.MultiInferenceResponse",
            "GetModelMetadataRequest": "tensorflow.serving.GetModelMetadataRequest",
            "GetModelMetadataResponse": "tensorflow.serving.GetModelMetadataResponse",
            "SignatureDefMap": "tensorflow.serving.SignatureDefMap",
            "GetModelStatusRequest": "tensorflow.serving.GetModelStatusRequest",
            "GetModelStatusResponse": "tensorflow.serving.GetModelStatusResponse",
            "ReloadConfigRequest": "tensorflow.serving.ReloadConfigRequest",
            "ReloadConfigResponse": "tensorflow.serving.ReloadConfigResponse",
            "ModelSpec": "tensorflow.serving.ModelSpec",
            "ModelServerConfig": "tensorflow.serving.ModelServerConfig",
            "TensorProto": "tensorflow.TensorProto",
            "TensorShapeProto": "tensorflow.TensorShapeProto",
            "SignatureDef": "tensorflow.SignatureDef",
            "TensorInfo": "tensorflow.TensorInfo",
            "Example": "tensorflow.Example",
            "PredictionLog": "tensorflow.serving.PredictionLog",
            "SavedModel": "tensorflow.SavedModel",
        }
        self._classes: dict[str, type[Message]] = {}

    def __getattr__(self, name: str) -> type[Message]:
        try:
            full = self._names[name]
        except KeyError:
            raise AttributeError(name) from None
        cls = self._classes.get(name)
        if cls is None:
            cls = self._classes[name] = _message_class(POOL.FindMessageTypeByName(full))
        return cls

    def enum_value(self, enum: str, name: str) -> int:
        return int(POOL.FindEnumTypeByName(enum).values_by_name[name].number)


pb = _Messages()

__all__ = ["POOL", "pb"]
