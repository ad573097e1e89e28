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
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.metadata
import importlib.util
import logging
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
        path = self.can_serve(version_dir)
        if path is None:
            raise LoadFailure(f"no {ARTIFACT} in {version_dir}")
        return TFLiteServable(path, dict(options))


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
        buffer = model.Buffers(meta.Buffer())
        raw = buffer.DataAsNumpy().tobytes() if buffer.DataLength() else data[buffer.Offset():buffer.Offset() + buffer.Size()]
        entries = flexbuffers.GetRoot(raw).AsMap
        message = _signature_def_class()
        out: _SignatureDefs = {}
        for k in range(len(entries)):
            sig = message.FromString(entries.Values[k].AsStringBytes)
            out[entries.Keys[k].AsKey] = ({a: t.name for a, t in sig.inputs.items()},
                                          {a: t.name for a, t in sig.outputs.items()}, sig.method_name)
        return out
    return {}


def _signature_def_class() -> Any:
    """TensorFlow's SignatureDef message (the fields read here: aliases, tensor names, method),
    declared on protobuf's descriptors: the wire format is TensorFlow's, without TensorFlow."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

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
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("edge_appliance.tflite.SignatureDef"))


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
        first = self._new_interpreter()
        self.signatures = first.pop("__info__")
        self._pool.put(first)

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
        threads = self.options.get("num_threads")
        try:
            interp = self.module.Interpreter(
                model_path=self.path, num_threads=threads, experimental_delegates=self._delegates or None
            )
        except (ValueError, RuntimeError) as exc:
            if not self._delegates:
                raise LoadFailure(f"LiteRT could not load {self.path}: {exc}") from exc
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
        elif self._signature_defs():
            self._from_sigdefs(wrapper, interp, programs, info)
        else:
            ins = {_clean_name(d["name"]): d for d in interp.get_input_details()}
            outs = {_clean_name(d["name"]): d for d in interp.get_output_details()}
            programs[DEFAULT_SIGNATURE] = _Program(wrapper, 0, {n: d["index"] for n, d in ins.items()},
                                                   {n: d["index"] for n, d in outs.items()})
            info[DEFAULT_SIGNATURE] = SignatureInfo(
                DEFAULT_SIGNATURE, {n: _spec(n, d, True) for n, d in ins.items()},
                {n: _spec(n, d, True) for n, d in outs.items()})
        for key, sig in info.items():
            programs[key].declared = {n: spec.shape for n, spec in sig.inputs.items()}
        programs["__info__"] = info
        return programs

    def _signature_defs(self) -> _SignatureDefs:
        if self._sigdefs is None:
            try:
                self._sigdefs = lite_signature_defs(self.path)
            except (struct.error, IndexError, ValueError) as exc:  # tflite_session.cc's refusal
                raise LoadFailure(f"Invalid SignatureDefs found in TfLite model: {exc}") from exc
        return self._sigdefs

    def _from_sigdefs(self, wrapper: Any, interp: Any, programs: dict[str, Any],
                      info: dict[str, SignatureInfo]) -> None:
        """Signatures from the file's TF Serving SignatureDefs: aliases onto the tensors they
        name (``tflite_input:0`` or, as TF Serving's FixTfLiteTensorName, ``tflite_input``)."""
        tensors = {d["name"]: d for d in (*interp.get_input_details(), *interp.get_output_details())}
        for key, (ins, outs, method) in self._signature_defs().items():
            found = {}
            for alias, tensor in (*ins.items(), *outs.items()):
                detail = tensors.get(tensor) or tensors.get(tensor.split(":")[0])
                if detail is None:
                    kind = "input" if alias in ins else "output"
                    raise LoadFailure(f"Signature {kind} {alias} references an unknown tensor: {tensor} "
                                      f"(signature {key} of {self.path})")
                found[alias] = detail
            programs[key] = _Program(wrapper, 0, {a: found[a]["index"] for a in ins},
                                     {a: found[a]["index"] for a in outs})
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
