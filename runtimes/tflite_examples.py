"""tf.Example parsing for LiteRT models made of ParseExample ops, as TF Serving's TFLite session
runs them (tflite_session.cc registers TFLite's ``ParseExample``/``ParseExampleV2`` custom
kernels, tensorflow/lite/kernels/parse_example/). LiteRT's Python interpreter has no such op
and cannot be given one, so a model whose every op is ParseExample (TF Serving's testdata
parse_example_tflite) is served by ``ExampleParser``, that kernel's rules in Python: dense
features of float, int64 and bytes, each filling its output's stride, defaults for missing
ones, "Failed to invoke TfLite interpreter" (its detail logged) for an Example that does not
fit. A model that mixes ParseExample with other ops is refused at load with that reason.
"""

from __future__ import annotations

import struct
from typing import Any, Mapping

import numpy as np

from .base import LoadFailure
from .tflite_file import TensorDetail, buffer_bytes, message_class, refused

def example_class() -> Any:
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
    return message_class(file, "Example")


_CUSTOM = 32  # BuiltinOperator_CUSTOM
_PARSE_OPS = (b"ParseExample", b"ParseExampleV2")
# TensorType -> (numpy dtype, TensorFlow's DataTypeString, the tf.Example list that fills it)
_FEATURE_TYPES: dict[int, tuple[np.dtype[Any], str, str]] = {0: (np.dtype(np.float32), "float", "float_list"), 4: (np.dtype(np.int64), "int64", "int64_list"),
                  5: (np.dtype(object), "string", "bytes_list")}
_LIST_TYPES = {"float_list": "float", "int64_list": "int64", "bytes_list": "string"}


class ExampleParser:
    """TFLite's ParseExample/ParseExampleV2 kernel for a model of nothing else (see module
    docstring): the dense features each op reads, from the flatbuffer; ``run`` parses."""

    class _Dense:
        def __init__(self, key: str, tensor: int, kind: int, dims: tuple[int, ...], default: list[Any]):
            self.key, self.tensor, self.dims, self.default = key, tensor, dims, default
            self.dtype, self.type_name, self.field = _FEATURE_TYPES[kind]
            self.stride = int(np.prod(dims)) if dims else 1  # elements per example (kernel: elements_per_stride)
            self.rows = dims[0] if dims else 1  # rows per example in the output (kernel: original_size)

    def __init__(self, serialized: int, dense: list["ExampleParser._Dense"],
                 details: tuple[list[TensorDetail], list[TensorDetail]]):
        self.serialized, self.dense, self.details = serialized, dense, details
        self.example = example_class()

    @classmethod
    def read(cls, path: str) -> "ExampleParser | None":
        """The parser for the model at ``path``; None when it holds an op other than
        ParseExample (LiteRT then judges it), or when this LiteRT has no schema to read it."""
        try:
            from ai_edge_litert import schema_py_generated as schema
            import flatbuffers  # noqa: F401 - dense_features reads flexbuffers with it
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
        if not ops or not all(map(is_parse_op, codes)):
            return None
        serialized, dense = dense_features(model, data, graph, ops, path)
        inputs = [int(i) for i in graph.InputsAsNumpy()]

        def detail(index: int) -> TensorDetail:
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
                raise refused("Failed to invoke TfLite interpreter", ValueError(f"Failed to parse example ({exc})"))
            for d in self.dense:
                columns[d.tensor].extend(self._values(d, features, index))
        return {d.tensor: np.array(columns[d.tensor], dtype=d.dtype).reshape((len(examples) * d.rows, *d.dims[1:]))
                for d in self.dense}

    def _values(self, d: "ExampleParser._Dense", features: Any, index: int) -> list[Any]:
        """parse_example.cc FastParseSerializedExample for one dense feature of one example."""
        where = f"Name: <unknown>, Key: {d.key}, Index: {index}.  "
        feature = features[d.key] if d.key in features else None
        kind = feature.WhichOneof("kind") if feature is not None else None
        if kind is None:  # absent, or present with no list: the default
            if not d.default:
                raise refused("Failed to invoke TfLite interpreter", ValueError(
                    f"Name: <unknown>, Feature: {d.key} (data type: {d.type_name}) is required but could not be "
                    "found."))
            return d.default
        if kind != d.field:
            raise refused("Failed to invoke TfLite interpreter", ValueError(
                f"{where}Data types don't match. Data type: {_LIST_TYPES[kind]} but expected type: {d.type_name}"))
        values = list(getattr(feature, kind).value)
        if len(values) != d.stride:
            raise refused("Failed to invoke TfLite interpreter", ValueError(
                f"{where}Number of {_LIST_TYPES[kind].replace('string', 'bytes')} values != expected.  Values size:"
                f"{len(values)} but output shape: [{','.join(map(str, d.dims))}]"))
        return values

    def program(self, inputs: dict[str, int], outputs: dict[str, int]) -> "ParseProgram":
        return ParseProgram(self, inputs, outputs)


def is_parse_op(code: Any) -> bool:
    """An operator code of TFLite's ParseExample / ParseExampleV2 custom ops."""
    return bool(max(code.BuiltinCode(), code.DeprecatedBuiltinCode()) == _CUSTOM and code.CustomCode() in _PARSE_OPS)


def dense_features(model: Any, data: bytes, graph: Any, ops: list[Any],
                   path: str) -> tuple[int, list["ExampleParser._Dense"]]:
    """(the serialized input's tensor index, the dense features) that the ParseExample ``ops``
    of ``graph`` read, all from one input of the graph; ``LoadFailure`` for what is not parsed here."""
    from flatbuffers import flexbuffers

    codes = [model.OperatorCodes(op.OpcodeIndex()) for op in ops]

    def constant(index: int) -> bytes:
        return buffer_bytes(model, data, graph.Tensors(index).Buffer())

    inputs = [int(i) for i in graph.InputsAsNumpy()]
    dense: list[ExampleParser._Dense] = []
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
            item = ExampleParser._Dense(key.decode(), out, tensor.Type(), dims, values)
            if values and len(values) != item.stride:
                raise LoadFailure(f"{where}: the default of feature {item.key!r} has {len(values)} values, its "
                                  f"output {item.stride} per example")
            dense.append(item)
    return serialized, dense


class ParseProgram:
    """A signature of an ``ExampleParser`` model, with ``_Program``'s face."""

    def __init__(self, parser: ExampleParser, inputs: dict[str, int], outputs: dict[str, int]):
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
