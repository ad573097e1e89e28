"""SavedModel loading shared by the TensorFlow backends (``tf_cpu``, ``tf_gpu``).

TF Serving runs a SavedModel as a graph in a session, feeding and fetching the tensor
names of its signature defs; so do we. ``tf.saved_model.load`` (TF2) cannot prune a
TF1 classify/regress signature whose ``ParseExample`` is fed by a placeholder of unknown
rank, while ``tf.compat.v1`` loading into a ``Session`` serves every signature of TF1
and TF2 exports alike. ``Session.run`` is thread-safe, so one session serves all
batch threads; each signature gets a pre-built callable to keep the per-call cost low.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import threading
from types import ModuleType
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from .base import CANONICAL_CODES, InputFailure, LoadFailure, MissingDependency, SignatureInfo, TensorSpec
from .json_types import ReadJSONObject

ARTIFACTS = ("saved_model.pb", "saved_model.pbtxt")
INSTALL_HINT = "install the TensorFlow extra: pip install 'edge-appliance[tf]'"
_frozen = False  # TensorFlow's modules moved out of the collector's scans (tensorflow())


def tensorflow() -> ModuleType:
    """Import TensorFlow on first use; a LiteRT-only device never gets here."""
    global _frozen
    if importlib.util.find_spec("tensorflow") is None:
        raise MissingDependency(f"serving a SavedModel needs TensorFlow; {INSTALL_HINT}")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf  # noqa: PLC0415 - lazy by design

    if not _frozen:
        # TensorFlow's ~290k module objects live as long as the process: out of every later
        # scan of the garbage collector (a full collection, as each unload runs, went from
        # ~170 ms with the GIL held to a few ms). Done before the first model loads, so no
        # model's objects are frozen with them (LiteRT ones loaded before are: few cycles there).
        gc.freeze()
        _frozen = True
    return tf


def find_saved_model(version_dir: str) -> str | None:
    for name in ARTIFACTS:
        if os.path.isfile(os.path.join(version_dir, name)):
            return version_dir
    return None


class _Dim(Protocol):
    size: int


class _Shape(Protocol):
    unknown_rank: bool
    dim: Sequence[_Dim]


class _TensorInfo(Protocol):
    """A SignatureDef's ``TensorInfo`` protobuf (TensorFlow ships no types): what is read of it."""

    name: str
    dtype: int  # the DataType enum
    tensor_shape: _Shape


# A session callable (``Session._make_callable_from_options``): the feeds in, the fetches out.
SessionCallable = Callable[..., Sequence[np.ndarray]]


def _numpy_dtype(tf: ModuleType, enum: int) -> np.dtype:
    dtype = tf.dtypes.as_dtype(enum)
    return np.dtype(object) if dtype == tf.string else np.dtype(dtype.as_numpy_dtype)


def _tensor_spec(tf: ModuleType, alias: str, info: _TensorInfo) -> TensorSpec:
    if info.tensor_shape.unknown_rank:
        shape = None
    else:
        shape = tuple(int(d.size) for d in info.tensor_shape.dim)
    return TensorSpec(alias, _numpy_dtype(tf, info.dtype), shape, info.name)


def _threads(value: object) -> int:
    return int(value) if isinstance(value, (int, float, str)) and value else 0


def session_config(tf: ModuleType, options: ReadJSONObject, use_gpu: bool) -> object:
    """The session's ``ConfigProto`` (a protobuf message, passed on to TensorFlow unread)."""
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=_threads(options.get("intra_op_threads")),
        inter_op_parallelism_threads=_threads(options.get("inter_op_threads")),
        allow_soft_placement=True,
    )
    if use_gpu:
        config.gpu_options.allow_growth = True
    else:
        config.device_count["GPU"] = 0
    return config


class SessionServable:
    """A SavedModel in a ``tf.compat.v1.Session`` (see module docstring)."""

    def __init__(self, export_dir: str, options: ReadJSONObject, backend: str, use_gpu: bool):
        tf = tensorflow()
        self.backend = backend
        self.platform = "tensorflow_savedmodel"
        self.strict_shapes = False  # TensorFlow judges shapes itself, as TF Serving lets it
        self.reads_examples = True
        self._tf = tf
        self._graph = tf.Graph()
        self._session = tf.compat.v1.Session(graph=self._graph, config=session_config(tf, options, use_gpu))
        configured = options.get("tags")
        tags = [str(t) for t in configured] if isinstance(configured, (list, tuple)) and configured else ["serve"]
        try:
            with self._graph.as_default():
                meta = tf.compat.v1.saved_model.loader.load(self._session, tags, export_dir)
        except Exception as exc:  # TensorFlow raises many types for a bad export
            self._session.close()
            raise LoadFailure(f"TensorFlow could not load the SavedModel in {export_dir}: {exc}",
                              _load_code(exc)) from exc
        self.signatures: dict[str, SignatureInfo] = {}
        self._defs = meta.signature_def
        for key, sig in meta.signature_def.items():
            if key.startswith("__"):  # __saved_model_init_op is not a serving signature
                continue
            self.signatures[key] = SignatureInfo(
                key,
                {a: _tensor_spec(tf, a, i) for a, i in sig.inputs.items()},
                {a: _tensor_spec(tf, a, i) for a, i in sig.outputs.items()},
                sig.method_name,
            )
        self._feed_dtypes = self._graph_dtypes(tf)
        self._callables: dict[tuple[str, tuple[str, ...]], SessionCallable] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _graph_dtypes(self, tf: ModuleType) -> dict[str, np.dtype]:
        """{tensor name: the graph tensor's own dtype} of every signature input. A SignatureDef
        may declare another dtype than its tensor has (TF Serving's saved_model_half_plus_three:
        ``tf_example:0`` declared DT_FLOAT, a string placeholder); TF Serving feeds the session by
        the tensor (serialized Examples as strings), and reports the declaration in metadata."""
        found: dict[str, np.dtype] = {}
        for sig in self.signatures.values():
            for spec in sig.inputs.values():
                try:
                    tensor = self._graph.get_tensor_by_name(spec.tensor_name)
                except (KeyError, ValueError):  # a name not in the graph: TensorFlow says so at run
                    continue
                found[spec.tensor_name] = _numpy_dtype(tf, tensor.dtype.as_datatype_enum)
        return found

    def _feed(self, spec: TensorSpec, value: np.ndarray) -> np.ndarray:
        """``value`` as the graph tensor takes it. Strings against numbers are left as sent, so
        TensorFlow's session answers the mismatch in its own words, as it does for TF Serving."""
        dtype = self._feed_dtypes.get(spec.tensor_name, spec.dtype)
        value = np.asarray(value)
        if (value.dtype.kind in "OSU") != (dtype == np.dtype(object)):
            return value
        return np.asarray(value, dtype=dtype)

    def _callable(self, signature: SignatureInfo, names: tuple[str, ...]) -> SessionCallable:
        key = (signature.name, names)
        fn = self._callables.get(key)
        if fn is None:
            from tensorflow.core.protobuf import config_pb2  # noqa: PLC0415 - TensorFlow is loaded by now

            with self._lock:
                # CallableOptions, not make_callable: the Python feed path refuses values whose
                # shape differs from the tensor's static shape, which the C++ session (and so
                # TF Serving) accepts, e.g. half_plus_two's x fed [3] where the graph says [?, 1].
                options = config_pb2.CallableOptions(
                    feed=[signature.inputs[n].tensor_name for n in names],
                    fetch=[signature.outputs[o].tensor_name for o in signature.outputs])
                fn = self._session._make_callable_from_options(options)
                self._callables[key] = fn
        return fn

    def run(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        info = self.signatures.get(signature)
        if info is None:
            raise InputFailure(f"signature {signature!r} not found")
        names = tuple(inputs)
        try:
            feeds = [self._feed(info.inputs[n], inputs[n]) for n in names]
            values = self._callable(info, names)(*feeds)
        except (self._tf.errors.InvalidArgumentError, ValueError, TypeError) as exc:
            raise InputFailure(_short_tf_error(exc)) from exc
        return {name: np.asarray(v) for name, v in zip(info.outputs, values)}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._session.close()


def _load_code(exc: Exception) -> str:
    """The canonical code of a failed SavedModel load, as TF Serving's status carries it:
    TensorFlow's own for its errors ("Op type not registered": NOT_FOUND), DATA_LOSS for a
    ``saved_model.pb`` that does not parse (TF Serving: "Can't parse saved_model.pb as binary
    proto"), INVALID_ARGUMENT for any other export TensorFlow refuses."""
    number = getattr(exc, "error_code", None)
    if isinstance(number, int) and 0 < number < len(CANONICAL_CODES):
        return CANONICAL_CODES[number]
    if "Cannot parse file" in str(exc) or "Error parsing message" in str(exc):
        return "DATA_LOSS"
    return "INVALID_ARGUMENT"


def _short_tf_error(exc: Exception) -> str:
    """TensorFlow messages carry graph dumps and stack traces; keep the first line."""
    message = getattr(exc, "message", None) or str(exc)
    return message.strip().splitlines()[0] if message.strip() else type(exc).__name__
