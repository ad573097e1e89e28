"""LiteRT / TFLite backend: GPU or EdgeTPU delegate when present, XNNPACK on CPU otherwise.

Interpreters are not thread-safe and allocate on every resize, so a servable keeps a
small pool of interpreters; each remembers the input shapes it was last allocated for
and only re-allocates when a batch of a new size arrives (with ``allowed_batch_sizes``
that happens once per size). Models without signature defs (input ``x``, shape
``[1, 1]``) are served by their input/output details as signature ``serving_default``.

Signatures, as TF Serving's TFLite session finds them (servables/tensorflow/tflite_session.cc
``TfLiteSession::Create``): LiteRT's own signature runners; else the SignatureDefs that
TF Serving's converter stored in the file's ``signature_defs_metadata`` (a FlexBuffer map of
serialized SignatureDefs: aliases ``x``/``y`` for tensors ``tflite_input``/``y``); else one
``serving_default`` built from the input and output tensors.

Shapes, as TF Serving's session treats them (``SetInputAndInvokeMiniBatch``): an input
whose shape differs from what the interpreter holds is resized to the request's shape
(any shape, not only the batch dimension: ``[3]`` into a ``[1,1]`` model), and the
interpreter judges it. Where it refuses, the error is TF Serving's text ("Failed to resize
input tensor: ...", "Failed to allocate tensors", "Failed to invoke TfLite interpreter"),
as an InputFailure (INVALID_ARGUMENT; TF Serving says INTERNAL, see ``_refused``). So the servable is not ``strict_shapes``: a request that
does not fit the declared shape runs alone, never merged into a batch
(appliance/core/handle.py).

tf.Example parsing, as TF Serving's session runs it (tflite_session.cc registers TFLite's
``ParseExample``/``ParseExampleV2`` custom kernels, tensorflow/lite/kernels/parse_example/):
LiteRT's Python interpreter has no such op and cannot be given one, so a model whose every op
is ParseExample (TF Serving's testdata parse_example_tflite) is served by ``_ExampleParser``,
that kernel's rules in Python: dense features of float, int64 and bytes, each filling its
output's stride, defaults for missing ones, "Failed to invoke TfLite interpreter" (its detail
logged) for an Example that does not fit. A model that mixes ParseExample with other ops is
refused at load with that reason.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import importlib.util
import logging
import mmap
import os
import queue
import struct
import threading
from typing import Any, Mapping

import numpy as np

from . import generative
from .base import (
    DEFAULT_SIGNATURE,
    Availability,
    InputFailure,
    LoadFailure,
    MissingDependency,
    SignatureInfo,
    TensorSpec,
)

log = logging.getLogger("runtimes.tflite")

NAME = "tflite"
ARTIFACT = "model.tflite"

# Library names looked for when the config names none; the first that loads wins.
GPU_DELEGATE_LIBS = ("libtensorflowlite_gpu_delegate.so", "libtensorflowlite_gpu_gl.so")
EDGETPU_DELEGATE_LIBS = ("libedgetpu.so.1", "libedgetpu.so.1.0")
INSTALL_HINT = "pip install 'edge-appliance[tflite]' (ai-edge-litert) or tflite-runtime"


def interpreter_module() -> Any:
    """The installed LiteRT interpreter module: ai_edge_litert, else tflite_runtime."""
    for name in ("ai_edge_litert.interpreter", "tflite_runtime.interpreter"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise MissingDependency(f"no LiteRT interpreter is installed; {INSTALL_HINT}")


def _litert_installed() -> str | None:
    for name in ("ai_edge_litert", "tflite_runtime"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def litert_version(module: str) -> str | None:
    """The installed distribution's version of ``module`` (from its metadata: no import).
    It matters: aarch64 gets ai-edge-litert 1.4.0 where x86-64 gets 2.x."""
    dist = {"ai_edge_litert": "ai-edge-litert", "tflite_runtime": "tflite-runtime"}.get(module, module)
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


class TFLiteBackend:
    """See module docstring. Options: ``num_threads``, ``delegate`` (auto|gpu|edgetpu|none),
    ``gpu_delegate_path``, ``edgetpu_delegate_path``, ``pool_size``."""

    name = NAME

    def probe(self, device: Mapping[str, Any]) -> Availability:
        lib = _litert_installed()
        if lib is None:
            return Availability(False, f"LiteRT is not installed; {INSTALL_HINT}")
        delegates = device.get("delegates", {})
        found = [k for k, v in delegates.items() if v]
        extra = f", delegate libraries found: {', '.join(found)}" if found else ", no delegate library found (XNNPACK on CPU)"
        version = litert_version(lib)
        return Availability(True, f"{lib} {version or '(version unknown)'} importable{extra}",
                            {"library": lib, "version": version})

    def can_serve(self, version_dir: str) -> str | None:
        path = os.path.join(version_dir, ARTIFACT)
        return path if os.path.isfile(path) else None

    def load(self, version_dir: str, options: Mapping[str, Any]) -> "TFLiteServable":
        """Option ``max_tensor_bytes``: refuse (RESOURCE_EXHAUSTED) a model one of whose
        tensors declares more bytes than that, before LiteRT allocates anything."""
        path = self.can_serve(version_dir)
        if path is None:
            raise LoadFailure(f"no {ARTIFACT} in {version_dir}", "NOT_FOUND")
        limit = options.get("max_tensor_bytes")
        if limit:
            check_declared_sizes(path, int(limit))
        return TFLiteServable(path, dict(options))


# Bytes per element of TF Lite's TensorType (schema.fbs), by enum value; others count 4.
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
                          f"{_dims(shape)}: {size} bytes", "RESOURCE_EXHAUSTED")


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


def _load_delegate(module: Any, kind: str, options: Mapping[str, Any]) -> tuple[Any, str]:
    """Try the configured or well-known delegate libraries; (delegate or None, reason)."""
    configured = options.get(f"{kind}_delegate_path")
    names = (configured,) if configured else (GPU_DELEGATE_LIBS if kind == "gpu" else EDGETPU_DELEGATE_LIBS)
    errors = []
    for lib in names:
        # Open the library ourselves first: when dlopen fails inside LiteRT's Delegate
        # constructor, the half-built object's __del__ raises AttributeError ("Exception
        # ignored in Delegate.__del__") on every start with a missing delegate.
        try:
            ctypes.CDLL(lib)
        except OSError as exc:  # dlopen's message names the library already
            errors.append(str(exc) if lib in str(exc) else f"{lib}: {exc}")
            continue
        try:
            return module.load_delegate(lib), f"{kind} delegate {lib} loaded"
        except (ValueError, OSError, RuntimeError) as exc:
            errors.append(f"{lib}: {exc}")
    hint = "install libedgetpu1-std" if kind == "edgetpu" else "build or install the LiteRT GPU delegate"
    return None, f"{kind} delegate not loaded ({'; '.join(errors)}); {hint}, or set tflite.{kind}_delegate_path"


class _Program:
    """One signature of one interpreter: tensor indices plus the shapes last allocated."""

    def __init__(self, wrapper: Any, subgraph: int, inputs: dict[str, int], outputs: dict[str, int]):
        self.wrapper, self.subgraph = wrapper, subgraph
        self.inputs, self.outputs = inputs, outputs
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.refused = False  # the last run's resize or allocation failed
        self.declared: dict[str, tuple[int, ...] | None] = {}  # input shapes of the signature (error texts)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Resize to the feeds' shapes where they changed, set, invoke (TF Serving's order and texts)."""
        w, sg = self.wrapper, self.subgraph
        self.refused = False
        if any(self.shapes.get(n) != a.shape for n, a in feeds.items()):
            self.shapes = {}  # a failed resize must not look allocated
            for name, arr in feeds.items():
                try:
                    if arr.ndim > MAX_RANK:
                        raise ValueError(f"rank {arr.ndim} is above {MAX_RANK}")
                    w.ResizeInputTensor(self.inputs[name], np.array(arr.shape, dtype=np.int32), False, sg)
                except (ValueError, RuntimeError) as exc:
                    self.refused = True
                    index = self.inputs[name]
                    held = int(np.prod(w.TensorSize(index, sg))) * arr.itemsize  # the tensor's bytes now
                    raise _refused(f"Failed to resize input tensor: {w.TensorName(index, sg)} from {held} to "
                                   f"{arr.nbytes} bytes.", exc) from exc
            try:
                w.AllocateTensors(sg)
            except (ValueError, RuntimeError) as exc:
                shapes = "; ".join(f"input '{n}' of shape {_dims(a.shape)}, the model declares "
                                   f"{_dims(self.declared.get(n))}" for n, a in feeds.items())
                self.refused = True  # half-prepared now: the servable replaces this interpreter
                raise _refused(f"Failed to allocate tensors ({shapes})", exc) from exc
            self.shapes = {n: a.shape for n, a in feeds.items()}
        for name, arr in feeds.items():
            w.SetTensor(self.inputs[name], arr, sg)
        try:
            w.Invoke(sg)
        except (ValueError, RuntimeError) as exc:
            raise _refused("Failed to invoke TfLite interpreter", exc) from exc
        return {name: w.GetTensor(idx, sg) for name, idx in self.outputs.items()}


_SILENT = "LiteRT gave no reason (an allocation that failed, most often)"


def _load_code(text: str) -> str:
    """The canonical code of LiteRT's refusal to load, by cause (a model's status names it):
    bytes that are no model are lost data, an op this LiteRT lacks is not found (TensorFlow's
    "Op type not registered" is NOT_FOUND too), anything else a model it cannot take."""
    if not text.strip():
        return "RESOURCE_EXHAUSTED"  # LiteRT says nothing when an allocation fails
    if "not a valid Flatbuffer" in text or "model identifier" in text:
        return "DATA_LOSS"
    if "unresolved custom op" in text or "Didn't find op" in text or "Op builtin_code out of range" in text:
        return "NOT_FOUND"
    return "INVALID_ARGUMENT"


def _dims(shape: Any) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]" if shape is not None else "an unknown shape"


def _refused(text: str, exc: Exception) -> InputFailure:
    """TF Serving's error text (an allocation refusal adds the inputs and shapes after it:
    TF Serving's names nothing); LiteRT's own reason goes to the log, as TF Serving's
    interpreter error reporter writes it to stderr. TF Serving's code is INTERNAL; here it stays an input
    failure (INVALID_ARGUMENT, 400): the interpreter refuses the request's shape, and the
    batcher retries the members of a refused batch alone only for input failures."""
    log.info("%s: LiteRT said: %s", text, exc)
    return InputFailure(text)


# Above this rank a resize is refused before LiteRT sees it: resizing an allocated interpreter
# to rank 16 crashes the process (SIGSEGV, ai-edge-litert 2.3), and no kernel takes more than 8.
MAX_RANK = 8
SIGDEFS_METADATA = "signature_defs_metadata"  # TF Lite's signature_def_util.cc kSignatureDefsMetadataName
_PREDICT = "tensorflow/serving/predict"
_SignatureDefs = dict[str, tuple[dict[str, str], dict[str, str], str]]


def lite_signature_defs(path: str) -> _SignatureDefs:
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
        entries = flexbuffers.GetRoot(_buffer_bytes(model, data, meta.Buffer())).AsMap
        message = _signature_def_class()
        out: _SignatureDefs = {}
        for k in range(len(entries)):
            sig = message.FromString(entries.Values[k].AsStringBytes)
            out[entries.Keys[k].AsKey] = ({a: t.name for a, t in sig.inputs.items()},
                                          {a: t.name for a, t in sig.outputs.items()}, sig.method_name)
        return out
    return {}


def _message_class(file: Any, name: str) -> Any:
    """The class of message ``name`` of ``file`` (a FileDescriptorProto) in a pool of its own."""
    from google.protobuf import descriptor_pool, message_factory

    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{file.package}.{name}"))


def _buffer_bytes(model: Any, data: bytes, index: int) -> bytes:
    """Buffer ``index`` of a flatbuffer model: inline, or (models past 2 GB) at an offset in the file."""
    buffer = model.Buffers(index)
    if buffer.DataLength():
        return bytes(buffer.DataAsNumpy().tobytes())
    return data[buffer.Offset():buffer.Offset() + buffer.Size()] if buffer.Offset() else b""


def _signature_def_class() -> Any:
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
    return _message_class(file, "SignatureDef")


def _example_class() -> Any:
    """TensorFlow's tf.Example (tensorflow/core/example/example.proto, feature.proto), declared
    on protobuf's descriptors as ``_signature_def_class`` is."""
    from google.protobuf import descriptor_pb2

    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="edge_appliance/tflite_example.proto",
                                              package="edge_appliance.tflite", syntax="proto3")
    for name, kind in (("BytesList", f.TYPE_BYTES), ("FloatList", f.TYPE_FLOAT), ("Int64List", f.TYPE_INT64)):
        file.message_type.add(name=name).field.add(name="value", number=1, type=kind, label=f.LABEL_REPEATED)
    feature = file.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, name, kind in ((1, "bytes_list", "BytesList"), (2, "float_list", "FloatList"),
                               (3, "int64_list", "Int64List")):
        feature.field.add(name=name, number=number, type=f.TYPE_MESSAGE, label=f.LABEL_OPTIONAL, oneof_index=0,
                          type_name=f".edge_appliance.tflite.{kind}")
    features = file.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=f.TYPE_MESSAGE, label=f.LABEL_OPTIONAL,
                    type_name=".edge_appliance.tflite.Feature")
    features.field.add(name="feature", number=1, type=f.TYPE_MESSAGE, label=f.LABEL_REPEATED,
                       type_name=".edge_appliance.tflite.Features.FeatureEntry")
    file.message_type.add(name="Example").field.add(name="features", number=1, type=f.TYPE_MESSAGE,
                                                    label=f.LABEL_OPTIONAL, type_name=".edge_appliance.tflite.Features")
    return _message_class(file, "Example")


_CUSTOM = 32  # BuiltinOperator_CUSTOM
_PARSE_OPS = (b"ParseExample", b"ParseExampleV2")
# TensorType -> (numpy dtype, TensorFlow's DataTypeString, the tf.Example list that fills it)
_FEATURE_TYPES = {0: (np.dtype(np.float32), "float", "float_list"), 4: (np.dtype(np.int64), "int64", "int64_list"),
                  5: (np.dtype(object), "string", "bytes_list")}
_LIST_TYPES = {"float_list": "float", "int64_list": "int64", "bytes_list": "string"}


class _ExampleParser:
    """TFLite's ParseExample/ParseExampleV2 kernel for a model of nothing else (see module
    docstring): the dense features each op reads, from the flatbuffer; ``run`` parses."""

    class _Dense:
        def __init__(self, key: str, tensor: int, kind: int, dims: tuple[int, ...], default: list[Any]):
            self.key, self.tensor, self.dims, self.default = key, tensor, dims, default
            self.dtype, self.type_name, self.field = _FEATURE_TYPES[kind]
            self.stride = int(np.prod(dims)) if dims else 1  # elements per example (kernel: elements_per_stride)
            self.rows = dims[0] if dims else 1  # rows per example in the output (kernel: original_size)

    def __init__(self, serialized: int, dense: list["_ExampleParser._Dense"],
                 details: tuple[list[dict[str, Any]], ...]):
        self.serialized, self.dense, self.details = serialized, dense, details
        self.example = _example_class()

    @classmethod
    def read(cls, path: str) -> "_ExampleParser | None":
        """The parser for the model at ``path``; None when it holds an op other than
        ParseExample (LiteRT then judges it), or when this LiteRT has no schema to read it."""
        try:
            from ai_edge_litert import schema_py_generated as schema
            from flatbuffers import flexbuffers
        except ImportError:
            return None
        with open(path, "rb") as f:
            data = f.read()
        model = schema.Model.GetRootAsModel(data, 0)
        if model.SubgraphsLength() != 1:
            return None
        graph = model.Subgraphs(0)
        ops = [graph.Operators(i) for i in range(graph.OperatorsLength())]
        codes = [model.OperatorCodes(op.OpcodeIndex()) for op in ops]
        if not ops or any(max(c.BuiltinCode(), c.DeprecatedBuiltinCode()) != _CUSTOM or c.CustomCode() not in _PARSE_OPS
                          for c in codes):
            return None

        def constant(index: int) -> bytes:
            return _buffer_bytes(model, data, graph.Tensors(index).Buffer())

        inputs = [int(i) for i in graph.InputsAsNumpy()]
        dense: list[_ExampleParser._Dense] = []
        serialized = -1
        for op, code in zip(ops, codes):
            where = f"{code.CustomCode().decode()} in {path}"
            options = flexbuffers.GetRoot(op.CustomOptionsAsNumpy().tobytes()) if op.CustomOptionsLength() else None
            if options is None or not options.IsMap:  # the NodeDef form: its shapes need TensorFlow's protos
                raise LoadFailure(f"{where}: custom options that are not a flexbuffer map are not read here")
            settings = {k: options.AsMap[k].AsInt for k in ("num_sparse", "Nsparse", "Ndense") if k in options.AsMap}
            if settings.get("num_sparse", settings.get("Nsparse", 0)):
                raise LoadFailure(f"{where}: sparse features are not parsed here (only dense ones)")
            args, outs = [int(i) for i in op.InputsAsNumpy()], [int(i) for i in op.OutputsAsNumpy()]
            if serialized not in (-1, args[0]) or args[0] not in inputs:
                raise LoadFailure(f"{where}: parses a tensor that is not the model's input")
            serialized = args[0]
            if code.CustomCode() == b"ParseExampleV2":  # serialized, names, sparse, dense, ragged keys, defaults
                keys, defaults = _tflite_strings(constant(args[3])), args[5:]
            else:  # serialized, names, dense_keys x Ndense, dense_defaults x Ndense
                count = settings.get("Ndense", 0)
                keys = [k for i in args[2:2 + count] for k in _tflite_strings(constant(i))]
                defaults = args[2 + count:2 + 2 * count]
            for key, default, out in zip(keys, defaults, outs):
                tensor = graph.Tensors(out)
                if tensor.Type() not in _FEATURE_TYPES:
                    raise LoadFailure(f"{where}: feature {key!r} is of TensorType {tensor.Type()} (float, int64 and "
                                      "string are parsed)")
                dims = tuple(int(d) for d in tensor.ShapeAsNumpy()) if tensor.ShapeLength() else ()
                raw = constant(default)
                values = (_tflite_strings(raw) if tensor.Type() == 5 else
                          np.frombuffer(raw, dtype=_FEATURE_TYPES[tensor.Type()][0]).tolist())
                item = cls._Dense(key.decode(), out, tensor.Type(), dims, values)
                if values and len(values) != item.stride:
                    raise LoadFailure(f"{where}: the default of feature {item.key!r} has {len(values)} values, its "
                                      f"output {item.stride} per example")
                dense.append(item)

        def detail(index: int) -> dict[str, Any]:
            tensor = graph.Tensors(index)
            shape = tensor.ShapeAsNumpy() if tensor.ShapeLength() else np.zeros(0, np.int32)
            signature = tensor.ShapeSignatureAsNumpy() if tensor.ShapeSignatureLength() else shape
            return {"name": tensor.Name().decode(), "index": index, "shape": shape, "shape_signature": signature,
                    "dtype": np.bytes_ if tensor.Type() == 5 else _FEATURE_TYPES.get(tensor.Type(), (np.float32,))[0]}

        outputs = [int(i) for i in graph.OutputsAsNumpy()]
        return cls(serialized, dense, ([detail(i) for i in inputs], [detail(i) for i in outputs]))

    def run(self, serialized: np.ndarray) -> dict[int, np.ndarray]:
        """{output tensor index: values} for a batch of serialized tf.Examples."""
        examples = [bytes(v) for v in np.asarray(serialized, dtype=object).reshape(-1)]
        columns = {d.tensor: [] for d in self.dense}  # type: dict[int, list[Any]]
        for index, blob in enumerate(examples):
            try:
                features = self.example.FromString(blob).features.feature
            except Exception as exc:  # protobuf's DecodeError: the kernel's "Failed to parse example"
                raise _refused("Failed to invoke TfLite interpreter", ValueError(f"Failed to parse example ({exc})"))
            for d in self.dense:
                columns[d.tensor].extend(self._values(d, features, index))
        return {d.tensor: np.array(columns[d.tensor], dtype=d.dtype).reshape((len(examples) * d.rows, *d.dims[1:]))
                for d in self.dense}

    def _values(self, d: "_ExampleParser._Dense", features: Any, index: int) -> list[Any]:
        """parse_example.cc FastParseSerializedExample for one dense feature of one example."""
        where = f"Name: <unknown>, Key: {d.key}, Index: {index}.  "
        feature = features[d.key] if d.key in features else None
        kind = feature.WhichOneof("kind") if feature is not None else None
        if kind is None:  # absent, or present with no list: the default
            if not d.default:
                raise _refused("Failed to invoke TfLite interpreter", ValueError(
                    f"Name: <unknown>, Feature: {d.key} (data type: {d.type_name}) is required but could not be "
                    "found."))
            return d.default
        if kind != d.field:
            raise _refused("Failed to invoke TfLite interpreter", ValueError(
                f"{where}Data types don't match. Data type: {_LIST_TYPES[kind]} but expected type: {d.type_name}"))
        values = list(getattr(feature, kind).value)
        if len(values) != d.stride:
            raise _refused("Failed to invoke TfLite interpreter", ValueError(
                f"{where}Number of {_LIST_TYPES[kind].replace('string', 'bytes')} values != expected.  Values size:"
                f"{len(values)} but output shape: [{','.join(map(str, d.dims))}]"))
        return values

    def program(self, inputs: dict[str, int], outputs: dict[str, int]) -> "_ParseProgram":
        return _ParseProgram(self, inputs, outputs)


class _ParseProgram:
    """A signature of an ``_ExampleParser`` model, with ``_Program``'s face."""

    def __init__(self, parser: _ExampleParser, inputs: dict[str, int], outputs: dict[str, int]):
        self.parser, self.inputs, self.outputs = parser, inputs, outputs
        self.refused = False
        self.declared: dict[str, tuple[int, ...] | None] = {}

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        (values,) = feeds.values()  # the one input: serialized tf.Examples
        parsed = self.parser.run(values)
        return {alias: parsed[index] for alias, index in self.outputs.items()}


def _tflite_strings(raw: bytes) -> list[bytes]:
    """A TFLite string tensor's contents: int32 count, count + 1 int32 offsets, the bytes."""
    if len(raw) < 4:
        return []
    count = struct.unpack_from("<i", raw)[0]
    offsets = struct.unpack_from(f"<{count + 1}i", raw, 4)
    return [raw[offsets[i]:offsets[i + 1]] for i in range(count)]


def _clean_name(tensor_name: str) -> str:
    """``serving_default_x:0`` -> ``x``: the name a client would use."""
    name = tensor_name.split(":")[0]
    return name[len("serving_default_"):] if name.startswith("serving_default_") else name


def _spec(name: str, detail: Mapping[str, Any], resizable: bool) -> TensorSpec:
    shape = [int(d) for d in detail.get("shape_signature", detail["shape"])]
    if resizable and shape:
        shape[0] = -1  # batch dimension: resized per batch
    dtype = np.dtype(object) if detail["dtype"] in (np.bytes_, np.str_, object) else np.dtype(detail["dtype"])
    return TensorSpec(name, dtype, tuple(shape), detail["name"])


def _with_info(programs: dict[str, Any], info: dict[str, SignatureInfo]) -> dict[str, Any]:
    for key, sig in info.items():
        programs[key].declared = {n: spec.shape for n, spec in sig.inputs.items()}
    programs["__info__"] = info
    return programs


class TFLiteServable:
    """A LiteRT model with a pool of interpreters (see module docstring)."""

    backend = NAME
    platform = "tflite"
    strict_shapes = False  # the interpreter is resized to the request and judges it, as TF Serving's session
    reads_examples = False  # no ParseExample op in LiteRT

    def __init__(self, path: str, options: dict[str, Any]):
        self.path = path
        self.options = options
        self.module = interpreter_module()
        self.delegate_reason = "XNNPACK on CPU"
        self._delegates = self._choose_delegates()
        self._pool: queue.LifoQueue[dict[str, _Program]] = queue.LifoQueue()
        self._created = 0
        self._pool_size = max(1, int(options.get("pool_size") or os.cpu_count() or 1))
        self._lock = threading.Lock()
        self._sigdefs: _SignatureDefs | None = None  # read once LiteRT has accepted the file
        self._parser: _ExampleParser | None = None
        try:
            first = self._first_interpreter()
        except (RuntimeError, ValueError) as exc:  # allocating a signature-less model, say
            raise LoadFailure(f"LiteRT could not load {path}: {exc or _SILENT}", _load_code(str(exc))) from exc
        self.signatures = first.pop("__info__")
        self._pool.put(first)

    def _first_interpreter(self) -> dict[str, Any]:
        try:
            return self._new_interpreter()
        except (LoadFailure, RuntimeError, ValueError) as exc:
            if "unresolved custom op: ParseExample" not in str(exc):
                raise
            self._parser = _ExampleParser.read(self.path)  # TF Serving's session has this op: run it here
            if self._parser is None:
                raise LoadFailure(f"LiteRT could not load {self.path}: {exc} (LiteRT's Python interpreter has no "
                                  "ParseExample op; a model of ParseExample ops alone is parsed here, this one has "
                                  "other ops)", "NOT_FOUND") from exc
            self._created = 0
            return self._new_interpreter()

    def _choose_delegates(self) -> list[Any]:
        choice = self.options.get("delegate", "auto")
        if choice == "none":
            return []
        reasons = []
        for kind in ("edgetpu", "gpu") if choice == "auto" else (choice,):
            if choice == "auto" and not self.options.get(f"{kind}_present", False):
                continue
            delegate, reason = _load_delegate(self.module, kind, self.options)
            reasons.append(reason)
            if delegate is not None:
                self.delegate_reason = reason
                return [delegate]
        if reasons:
            self.delegate_reason = "; ".join(reasons) + "; falling back to XNNPACK on CPU"
        return []

    def _new_interpreter(self) -> dict[str, Any]:
        if self._parser is not None:
            self._created += 1
            return self._parser_programs()
        threads = self.options.get("num_threads")
        try:
            interp = self.module.Interpreter(
                model_path=self.path, num_threads=threads, experimental_delegates=self._delegates or None
            )
        except (ValueError, RuntimeError) as exc:
            if not self._delegates:
                raise LoadFailure(f"LiteRT could not load {self.path}: {exc or _SILENT}", _load_code(str(exc))) from exc
            # A delegate that accepts the library but not the graph: serve on CPU, say why.
            self.delegate_reason += f"; delegate rejected the model ({exc}); XNNPACK on CPU"
            self._delegates = []
            interp = self.module.Interpreter(model_path=self.path, num_threads=threads)
        self._created += 1
        return self._programs(interp)

    def _programs(self, interp: Any) -> dict[str, Any]:
        sig_list = interp.get_signature_list()
        if not sig_list:
            interp.allocate_tensors()  # before we hold the wrapper: LiteRT refuses while it is referenced
        wrapper = interp._interpreter  # the C++ wrapper: lets us skip re-allocation per call
        programs: dict[str, Any] = {}
        info: dict[str, SignatureInfo] = {}
        if sig_list:
            # Generation signatures (prefill/decode, generate_step) keep the model's own shapes:
            # their fixed lengths (input_pos [N], a decode batch of B) are what a client and the
            # generation driver must see; every other signature's batch dimension is resizable.
            resizable = generative.convention(sig_list) is None
            for key in sig_list:
                runner = interp.get_signature_runner(key)
                ins, outs = runner.get_input_details(), runner.get_output_details()
                sg = runner._subgraph_index
                programs[key] = _Program(wrapper, sg, {n: d["index"] for n, d in ins.items()},
                                         {n: d["index"] for n, d in outs.items()})
                info[key] = SignatureInfo(key, {n: _spec(n, d, resizable) for n, d in ins.items()},
                                          {n: _spec(n, d, resizable) for n, d in outs.items()})
        else:
            self._from_details(interp.get_input_details(), interp.get_output_details(),
                               lambda ins, outs: _Program(wrapper, 0, ins, outs), programs, info)
        return _with_info(programs, info)

    def _parser_programs(self) -> dict[str, Any]:
        """Signatures of a model served by ``_ExampleParser``, found as LiteRT's would be."""
        assert self._parser is not None
        programs: dict[str, Any] = {}
        info: dict[str, SignatureInfo] = {}
        self._from_details(*self._parser.details, self._parser.program, programs, info)
        return _with_info(programs, info)

    def _from_details(self, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]], program: Any,
                      programs: dict[str, Any], info: dict[str, SignatureInfo]) -> None:
        """Signatures of a model without signature runners: its TF Serving SignatureDefs, else
        ``serving_default`` over its input and output tensors (``program(inputs, outputs)``
        makes one from {alias: tensor index} maps)."""
        if self._signature_defs():
            self._from_sigdefs({d["name"]: d for d in (*inputs, *outputs)}, program, programs, info)
            return
        ins = {_clean_name(d["name"]): d for d in inputs}
        outs = {_clean_name(d["name"]): d for d in outputs}
        programs[DEFAULT_SIGNATURE] = program({n: d["index"] for n, d in ins.items()},
                                              {n: d["index"] for n, d in outs.items()})
        info[DEFAULT_SIGNATURE] = SignatureInfo(
            DEFAULT_SIGNATURE, {n: _spec(n, d, True) for n, d in ins.items()},
            {n: _spec(n, d, True) for n, d in outs.items()})

    def _signature_defs(self) -> _SignatureDefs:
        if self._sigdefs is None:
            try:
                self._sigdefs = lite_signature_defs(self.path)
            except (struct.error, IndexError, ValueError) as exc:  # tflite_session.cc's refusal
                raise LoadFailure(f"Invalid SignatureDefs found in TfLite model: {exc}") from exc
        return self._sigdefs

    def _from_sigdefs(self, tensors: dict[str, dict[str, Any]], program: Any, programs: dict[str, Any],
                      info: dict[str, SignatureInfo]) -> None:
        """Signatures from the file's TF Serving SignatureDefs: aliases onto the tensors they
        name (``tflite_input:0`` or, as TF Serving's FixTfLiteTensorName, ``tflite_input``)."""
        for key, (ins, outs, method) in self._signature_defs().items():
            found = {}
            for alias, tensor in (*ins.items(), *outs.items()):
                detail = tensors.get(tensor) or tensors.get(tensor.split(":")[0])
                if detail is None:
                    kind = "input" if alias in ins else "output"
                    raise LoadFailure(f"Signature {kind} {alias} references an unknown tensor: {tensor} "
                                      f"(signature {key} of {self.path})")
                found[alias] = detail
            programs[key] = program({a: found[a]["index"] for a in ins}, {a: found[a]["index"] for a in outs})
            info[key] = SignatureInfo(key, {a: _spec(a, found[a], True) for a in ins},
                                      {a: _spec(a, found[a], True) for a in outs}, method or _PREDICT)

    def _acquire(self) -> dict[str, _Program]:
        try:
            return self._pool.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            grow = self._created < self._pool_size
        if grow:
            programs = self._new_interpreter()
            programs.pop("__info__")
            return programs
        return self._pool.get()

    def run(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        info = self.signatures.get(signature)
        if info is None:
            raise InputFailure(f"signature {signature!r} not found")
        programs = self._acquire()
        try:
            feeds = {n: np.asarray(a, dtype=info.inputs[n].dtype, order="C") for n, a in inputs.items()}
            return programs[signature].run(feeds)
        except (ValueError, RuntimeError) as exc:
            raise InputFailure(f"LiteRT rejected the input: {exc}") from exc
        finally:
            if programs[signature].refused:
                programs = self._replacement()
            self._pool.put(programs)

    def _replacement(self) -> dict[str, _Program]:
        """A fresh interpreter for one whose resize or allocation failed: LiteRT leaves such an
        interpreter half-prepared, and the next resize of it can crash the process (a rank-38
        input after a refused [1] one does)."""
        with self._lock:
            self._created -= 1
        programs = self._new_interpreter()
        programs.pop("__info__")
        return programs

    def close(self) -> None:
        while True:
            try:
                self._pool.get_nowait()
            except queue.Empty:
                break
        self._delegates = []
