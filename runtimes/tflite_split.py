"""A LiteRT model whose signatures parse serialized ``tf.Example``s first: TF Serving's classify
and regress signatures, converted with ``allow_custom_ops`` (the converter keeps
``ParseExample``/``ParseExampleV2`` as custom ops, as TF Serving's TFLite session runs them with
TFLite's own kernels: servables/tensorflow/tflite_session.cc).

LiteRT's Python interpreter has no such op and cannot be given one, so the model is cut in two
where it parses: ``split(path)`` returns the model without its ParseExample operators (each
parsed feature becomes an input of its subgraph and of the signature, named by the feature's
key) and, per signature that parsed, the ``ExampleParser`` (runtimes/tflite_examples.py: that
kernel's rules in Python) and the name of the serialized input it replaced. ``SplitProgram``
runs one such signature: parse, then the rest of the graph on LiteRT. A model made of
ParseExample ops alone stays with ``ExampleParser`` (TF Serving's parse_example_tflite).

Rewritten with the flatbuffer schema's object API (``ModelT``), in memory; the file is not
touched. Imports numpy only at import time; the schema and flatbuffers when ``split`` runs.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from .tflite_examples import ExampleParser, dense_features, is_parse_op
from .tflite_file import Runner


@dataclass
class Split:
    """The model LiteRT runs (``content``) and what Python parses before it, per signature key."""

    content: bytes
    parsers: dict[str, ExampleParser] = field(default_factory=dict)
    serialized: dict[str, str] = field(default_factory=dict)  # signature key -> the serialized input's name


def has_parse_ops(path: str) -> bool:
    """Whether the model at ``path`` holds a ParseExample op (read from the mapped file)."""
    try:
        from ai_edge_litert import schema_py_generated as schema
    except ImportError:
        return False
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        model = schema.Model.GetRootAsModel(data, 0)
        return any(is_parse_op(model.OperatorCodes(i)) for i in range(model.OperatorCodesLength()))


def split(path: str) -> Split | None:
    """The model cut where it parses (module docstring); None when no signature of it parses
    tf.Examples before other ops (nothing to cut, or ParseExample ops alone)."""
    from ai_edge_litert import schema_py_generated as schema

    with open(path, "rb") as f:
        data = f.read()
    reader = schema.Model.GetRootAsModel(data, 0)
    model = schema.ModelT.InitFromObj(reader)
    out = Split(b"")
    for index in range(reader.SubgraphsLength()):
        graph = reader.Subgraphs(index)
        ops = [graph.Operators(i) for i in range(graph.OperatorsLength())]
        parse = [i for i, op in enumerate(ops) if is_parse_op(reader.OperatorCodes(op.OpcodeIndex()))]
        if not parse or len(parse) == len(ops):
            continue
        serialized, dense = dense_features(reader, data, graph, [ops[i] for i in parse], path)
        _cut(schema, model, index, set(parse), serialized, [(d.key, d.tensor) for d in dense])
        for sig in model.signatureDefs or []:
            if sig.subgraphIndex == index:
                key = sig.signatureKey.decode()
                out.parsers[key] = ExampleParser(serialized, dense, ([], []))
                out.serialized[key] = _serialized_name(reader, index, serialized)
    if not out.parsers:
        return None
    out.content = _packed(model)
    return out


def _cut(schema: Any, model: Any, index: int, parse: set[int], serialized: int,
         features: list[tuple[str, int]]) -> None:
    """Subgraph ``index`` without its ``parse`` operators; the parsed tensors are its inputs, and
    its signatures' inputs in place of the serialized one."""
    graph = model.subgraphs[index]
    graph.operators = [op for i, op in enumerate(graph.operators) if i not in parse]
    graph.inputs = [int(i) for i in graph.inputs if int(i) != serialized] + [t for _, t in features]
    for sig in model.signatureDefs or []:
        if sig.subgraphIndex != index:
            continue
        kept = [t for t in sig.inputs if t.tensorIndex != serialized]
        for name, tensor in features:
            entry = schema.TensorMapT()
            entry.name, entry.tensorIndex = name.encode(), tensor
            kept.append(entry)
        sig.inputs = kept


def _serialized_name(reader: Any, index: int, serialized: int) -> str:
    """The signature's name for the serialized input (``inputs`` in TF Serving's signatures)."""
    for s in range(reader.SignatureDefsLength()):
        sig = reader.SignatureDefs(s)
        if sig.SubgraphIndex() != index:
            continue
        for i in range(sig.InputsLength()):
            if sig.Inputs(i).TensorIndex() == serialized:
                return str(sig.Inputs(i).Name().decode())
    return "inputs"


def _packed(model: Any) -> bytes:
    import flatbuffers

    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


class SplitProgram:
    """One signature of a split model, with ``_Program``'s face (runtimes/tflite.py): the
    serialized tf.Examples parsed here, the parsed features fed to the rest on LiteRT."""

    def __init__(self, parser: ExampleParser, rest: Runner, serialized: str):
        self.parser, self.rest, self.serialized = parser, rest, serialized
        self.inputs, self.outputs = {serialized: -1}, rest.outputs
        self.declared: dict[str, tuple[int, ...] | None] = {}

    @property
    def refused(self) -> bool:
        return bool(self.rest.refused)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        parsed = self.parser.run(feeds[self.serialized])
        others = {n: a for n, a in feeds.items() if n != self.serialized}
        names = {d.tensor: d.key for d in self.parser.dense}
        result = self.rest.run({**others, **{names[t]: v for t, v in parsed.items()}})
        return result


__all__ = ["Split", "SplitProgram", "has_parse_ops", "split"]
