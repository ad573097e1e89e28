"""What a ``.tflite`` file declares, read from its flatbuffer without an interpreter, and TF
Serving's words for what an interpreter refuses.

- ``check_declared_sizes``: the bytes the tensors a model computes declare, refused past a
  limit before LiteRT allocates anything (a 1 KB file may declare 8 GiB);
- ``lite_signature_defs``: the SignatureDefs TF Serving's converter stores in the file's
  metadata (read on protobuf's descriptors: TensorFlow's wire format, without TensorFlow);
- ``refused`` / ``dims_text``: TF Serving's error texts for a request the interpreter refuses.

Imports numpy only at import time; the schema module and protobuf when a function runs.
"""

from __future__ import annotations

import logging
import mmap
import struct
from typing import Any, Iterable, Mapping, Protocol, TypedDict

import numpy as np
from numpy.typing import NDArray

from .base import InputFailure, LoadFailure

log = logging.getLogger("runtimes.tflite")

# Bytes per element of TF Lite's TensorType (schema.fbs), by enum value; others count 4.
class TensorDetail(TypedDict, total=False):
    """One tensor as LiteRT's ``get_input_details()`` / ``get_output_details()`` describe it
    (and ``ExampleParser`` writes them): the keys the servable reads."""

    name: str
    index: int
    shape: NDArray[np.int32]
    shape_signature: NDArray[np.int32]  # -1 where a dimension is resizable; absent in old LiteRT
    dtype: "type | np.dtype[np.generic]"  # numpy's scalar type (np.float32, np.bytes_ ...) or a dtype


class Runner(Protocol):
    """One signature of one interpreter, as the servable runs it (runtimes/tflite.py's
    ``_Program``, a split model's ``SplitProgram``, a parse-only model's ``ParseProgram``)."""

    inputs: dict[str, int]  # alias -> tensor index
    outputs: dict[str, int]
    declared: dict[str, tuple[int, ...] | None]  # the signature's input shapes (error texts)

    @property
    def refused(self) -> bool:
        """Whether the last run's resize or allocation failed (the interpreter is replaced)."""
        ...

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...


_TYPE_BYTES = {0: 4, 1: 2, 2: 4, 3: 1, 4: 8, 6: 1, 7: 2, 8: 8, 9: 1, 10: 8, 11: 16, 12: 8, 15: 4, 16: 2}


def check_declared_sizes(path: str, limit: int) -> None:
    """``LoadFailure`` (RESOURCE_EXHAUSTED) when the tensors the model computes (its inputs,
    outputs and intermediates, not its weights) declare more than ``limit`` bytes in all: a
    1 KB file may declare an input of [1, 2^31-1] floats, 8 GiB that allocating, timing or
    warming it up would try to take. Read from the flatbuffer (mapped, not read); skipped
    where this LiteRT has no schema module or the file is no flatbuffer (the load says so)."""
    try:
        from ai_edge_litert import schema_py_generated as schema
    except ImportError:
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            model = schema.Model.GetRootAsModel(data, 0)
            sizes = [t for g in range(model.SubgraphsLength()) for t in _computed_tensors(model, model.Subgraphs(g))]
        except (struct.error, IndexError, ValueError, TypeError):
            return
    total = sum(size for _, _, size in sizes)
    if total > limit:
        name, shape, size = max(sizes, key=lambda t: t[2])
        raise LoadFailure(f"the tensors the model computes declare {total} bytes, more than the {limit} bytes a "
                          f"load may take (runtime.load_memory_mb); the largest, {name!r}, declares shape "
                          f"{dims_text(shape)}: {size} bytes", "RESOURCE_EXHAUSTED")


def _computed_tensors(model: Any, graph: Any) -> list[tuple[str, list[int], int]]:
    """(name, shape, bytes) of each tensor of ``graph`` that holds no constant data."""
    out = []
    for i in range(graph.TensorsLength()):
        tensor = graph.Tensors(i)
        buffer = model.Buffers(tensor.Buffer()) if tensor.Buffer() else None
        if buffer is not None and (buffer.DataLength() or buffer.Offset()):
            continue  # weights: in the file, mapped, not allocated
        shape = [int(d) for d in tensor.ShapeAsNumpy()] if tensor.ShapeLength() else []
        size = _TYPE_BYTES.get(tensor.Type(), 4)
        for d in shape:
            size *= max(d, 1)
        out.append((tensor.Name().decode("utf-8", "replace"), shape, size))
    return out


def dims_text(shape: Iterable[int] | None) -> str:  # a tuple, a list or a numpy vector of dims
    return "[" + ",".join(str(d) for d in shape) + "]" if shape is not None else "an unknown shape"


def refused(text: str, exc: Exception) -> InputFailure:
    """TF Serving's error text (an allocation refusal adds the inputs and shapes after it:
    TF Serving's names nothing); LiteRT's own reason goes to the log, as TF Serving's
    interpreter error reporter writes it to stderr. TF Serving's code is INTERNAL; here it stays an input
    failure (INVALID_ARGUMENT, 400): the interpreter refuses the request's shape, and the
    batcher retries the members of a refused batch alone only for input failures."""
    log.info("%s: LiteRT said: %s", text, exc)
    return InputFailure(text)


SIGDEFS_METADATA = "signature_defs_metadata"  # TF Lite's signature_def_util.cc kSignatureDefsMetadataName
PREDICT = "tensorflow/serving/predict"
SignatureDefs = dict[str, tuple[dict[str, str], dict[str, str], str]]


def lite_signature_defs(path: str) -> SignatureDefs:
    """{key: ({alias: tensor}, {alias: tensor}, method_name)} of the SignatureDefs a TF Serving
    TFLite model stores in its metadata, as TF Lite's GetSignatureDefMap reads them; {} when it
    stores none, or when this LiteRT install has no flatbuffer schema to read them with."""
    try:
        from ai_edge_litert import schema_py_generated as schema
        from flatbuffers import flexbuffers
    except ImportError:
        return {}
    with open(path, "rb") as f:
        data = f.read()
    model = schema.Model.GetRootAsModel(data, 0)
    for i in range(model.MetadataLength()):
        meta = model.Metadata(i)
        if meta.Name() != SIGDEFS_METADATA.encode():
            continue
        entries = flexbuffers.GetRoot(buffer_bytes(model, data, meta.Buffer())).AsMap
        message = signature_def_class()
        out: SignatureDefs = {}
        for k in range(len(entries)):
            sig = message.FromString(entries.Values[k].AsStringBytes)
            out[entries.Keys[k].AsKey] = ({a: t.name for a, t in sig.inputs.items()},
                                          {a: t.name for a, t in sig.outputs.items()}, sig.method_name)
        return out
    return {}


def message_class(file: Any, name: str) -> Any:
    """The class of message ``name`` of ``file`` (a FileDescriptorProto) in a pool of its own."""
    from google.protobuf import descriptor_pool, message_factory

    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{file.package}.{name}"))


def buffer_bytes(model: Any, data: bytes, index: int) -> bytes:
    """Buffer ``index`` of a flatbuffer model: inline, or (models past 2 GB) at an offset in the file."""
    buffer = model.Buffers(index)
    if buffer.DataLength():
        return bytes(buffer.DataAsNumpy().tobytes())
    return data[buffer.Offset():buffer.Offset() + buffer.Size()] if buffer.Offset() else b""


def signature_def_class() -> Any:
    """TensorFlow's SignatureDef message (the fields read here: aliases, tensor names, method),
    declared on protobuf's descriptors: the wire format is TensorFlow's, without TensorFlow."""
    from google.protobuf import descriptor_pb2

    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="edge_appliance/tflite_signature_def.proto",
                                              package="edge_appliance.tflite", syntax="proto3")
    info = file.message_type.add(name="TensorInfo")
    info.field.add(name="name", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    sig = file.message_type.add(name="SignatureDef")
    for number, field in ((1, "inputs"), (2, "outputs")):
        entry = sig.nested_type.add(name=field.capitalize() + "Entry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
        entry.field.add(name="value", number=2, type=f.TYPE_MESSAGE, label=f.LABEL_OPTIONAL,
                        type_name=".edge_appliance.tflite.TensorInfo")
        sig.field.add(name=field, number=number, type=f.TYPE_MESSAGE, label=f.LABEL_REPEATED,
                      type_name=f".edge_appliance.tflite.SignatureDef.{entry.name}")
    sig.field.add(name="method_name", number=3, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    return message_class(file, "SignatureDef")
