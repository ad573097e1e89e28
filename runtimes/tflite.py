"""LiteRT / TFLite backend: GPU or EdgeTPU delegate when present, XNNPACK on CPU otherwise.

Interpreters are not thread-safe and allocate on every resize, so a servable keeps a
small pool of interpreters; each remembers the input shapes it was last allocated for
and only re-allocates when a batch of a new size arrives (with ``allowed_batch_sizes``
that happens once per size). Each pooled interpreter has ``num_threads``, its batch slot's
share of the cores; with ``wide_threads`` a batch that runs alone (``run_wide``) gets one more
interpreter, made the first time one does, with that many threads: a lone request on a
two-core device runs the bench CNN in 0.75 ms instead of 1.4 (bench/RESULTS.md), as TF
Serving gives a lone request its whole intra-op pool. One interpreter more in memory (its
arena and XNNPACK's packed weights), only where a batch has run alone. Models without signature defs (input ``x``, shape
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
as an InputFailure (INVALID_ARGUMENT; TF Serving says INTERNAL, see ``tflite_file.refused``). So the servable is not ``strict_shapes``: a request that
does not fit the declared shape runs alone, never merged into a batch
(appliance/core/handle.py).

tf.Example parsing: a model whose every op is ParseExample is served by
runtimes/tflite_examples.py ``ExampleParser``, that kernel's rules in Python; a model whose
signatures parse first and compute after (TF Serving's classify and regress, converted with
``allow_custom_ops``) is cut where it parses (runtimes/tflite_split.py): the parsing here, the
rest on LiteRT, so such a servable ``reads_examples`` as a TensorFlow one does. What the file
declares (SignatureDefs in its metadata, the sizes of its tensors) is read without an
interpreter by runtimes/tflite_file.py.
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
from types import ModuleType
from typing import Callable, Mapping, Protocol

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
from .tflite_examples import ExampleParser
from .tflite_split import Split, SplitProgram, has_parse_ops
from .tflite_split import split as split_parsing
from .json_types import JSONValue, ReadJSONObject, ReadJSONValue
from .tflite_file import (PREDICT, Runner, SignatureDefs, TensorDetail, check_declared_sizes, dims_text,
                          lite_signature_defs, refused)

log = logging.getLogger("runtimes.tflite")

NAME = "tflite"
CLASSIFY, REGRESS = "tensorflow/serving/classify", "tensorflow/serving/regress"
ARTIFACT = "model.tflite"

# Library names looked for when the config names none; the first that loads wins.
GPU_DELEGATE_LIBS = ("libtensorflowlite_gpu_delegate.so", "libtensorflowlite_gpu_gl.so")
EDGETPU_DELEGATE_LIBS = ("libedgetpu.so.1", "libedgetpu.so.1.0")
INSTALL_HINT = "pip install 'edge-appliance[tflite]' (ai-edge-litert) or tflite-runtime"


def interpreter_module() -> ModuleType:
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
    """See module docstring. Options: ``num_threads``, ``wide_threads``, ``delegate``
    (auto|gpu|edgetpu|none), ``gpu_delegate_path``, ``edgetpu_delegate_path``, ``pool_size``."""

    name = NAME

    def probe(self, device: ReadJSONObject) -> Availability:
        lib = _litert_installed()
        if lib is None:
            return Availability(False, f"LiteRT is not installed; {INSTALL_HINT}")
        delegates = device.get("delegates", {})
        found = [k for k, v in delegates.items() if v] if isinstance(delegates, Mapping) else []
        extra = f", delegate libraries found: {', '.join(found)}" if found else ", no delegate library found (XNNPACK on CPU)"
        version = litert_version(lib)
        return Availability(True, f"{lib} {version or '(version unknown)'} importable{extra}",
                            {"library": lib, "version": version})

    def can_serve(self, version_dir: str) -> str | None:
        path = os.path.join(version_dir, ARTIFACT)
        return path if os.path.isfile(path) else None

    def load(self, version_dir: str, options: ReadJSONObject) -> "TFLiteServable":
        """Option ``max_tensor_bytes``: refuse (RESOURCE_EXHAUSTED) a model one of whose
        tensors declares more bytes than that, before LiteRT allocates anything."""
        path = self.can_serve(version_dir)
        if path is None:
            raise LoadFailure(f"no {ARTIFACT} in {version_dir}", "NOT_FOUND")
        limit = _count(options.get("max_tensor_bytes"))
        if limit:
            check_declared_sizes(path, limit)
        return TFLiteServable(path, dict(options))


def _count(value: ReadJSONValue) -> int:
    """An integer option (a number, or a numeric string as a config may write it); 0 when unset."""
    return int(value) if isinstance(value, (int, float, str)) and value else 0


def _load_delegate(module: ModuleType, kind: str, options: ReadJSONObject) -> tuple[object | None, str]:
    """Try the configured or well-known delegate libraries; (delegate or None, reason)."""
    configured = options.get(f"{kind}_delegate_path")
    names = (str(configured),) if configured else (GPU_DELEGATE_LIBS if kind == "gpu" else EDGETPU_DELEGATE_LIBS)
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


class _Wrapper(Protocol):
    """LiteRT's C++ interpreter wrapper (``Interpreter._interpreter``): what ``_Program`` calls."""

    def ResizeInputTensor(self, index: int, shape: np.ndarray, strict: bool, subgraph: int) -> None: ...
    def TensorSize(self, index: int, subgraph: int) -> np.ndarray: ...
    def TensorName(self, index: int, subgraph: int) -> str: ...
    def AllocateTensors(self, subgraph: int) -> None: ...
    def SetTensor(self, index: int, value: np.ndarray, subgraph: int) -> None: ...
    def Invoke(self, subgraph: int) -> None: ...
    def GetTensor(self, index: int, subgraph: int) -> np.ndarray: ...


class _SignatureRunner(Protocol):
    _subgraph_index: int

    def get_input_details(self) -> dict[str, TensorDetail]: ...
    def get_output_details(self) -> dict[str, TensorDetail]: ...


class _Interpreter(Protocol):
    """LiteRT's ``Interpreter``: what ``TFLiteServable._programs`` reads of it."""

    _interpreter: _Wrapper

    def get_signature_list(self) -> dict[str, dict[str, list[str]]]: ...
    def allocate_tensors(self) -> None: ...
    def get_signature_runner(self, key: str) -> _SignatureRunner: ...
    def get_input_details(self) -> list[TensorDetail]: ...
    def get_output_details(self) -> list[TensorDetail]: ...


Programs = dict[str, Runner]  # signature key -> its runner, on one interpreter
Signatures = dict[str, SignatureInfo]
MakeProgram = Callable[[dict[str, int], dict[str, int]], Runner]  # ({alias: input index}, {alias: output index})


class _Program:
    """One signature of one interpreter: tensor indices plus the shapes last allocated."""

    def __init__(self, wrapper: _Wrapper, subgraph: int, inputs: dict[str, int], outputs: dict[str, int]):
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
                    raise refused(f"Failed to resize input tensor: {w.TensorName(index, sg)} from {held} to "
                                   f"{arr.nbytes} bytes.", exc) from exc
            try:
                w.AllocateTensors(sg)
            except (ValueError, RuntimeError) as exc:
                shapes = "; ".join(f"input '{n}' of shape {dims_text(a.shape)}, the model declares "
                                   f"{dims_text(self.declared.get(n))}" for n, a in feeds.items())
                self.refused = True  # half-prepared now: the servable replaces this interpreter
                raise refused(f"Failed to allocate tensors ({shapes})", exc) from exc
            self.shapes = {n: a.shape for n, a in feeds.items()}
        for name, arr in feeds.items():
            w.SetTensor(self.inputs[name], arr, sg)
        try:
            w.Invoke(sg)
        except (ValueError, RuntimeError) as exc:
            raise refused("Failed to invoke TfLite interpreter", exc) from exc
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


# Above this rank a resize is refused before LiteRT sees it: resizing an allocated interpreter
# to rank 16 crashes the process (SIGSEGV, ai-edge-litert 2.3), and no kernel takes more than 8.
MAX_RANK = 8
def _clean_name(tensor_name: str) -> str:
    """``serving_default_x:0`` -> ``x``: the name a client would use."""
    name = tensor_name.split(":")[0]
    return name[len("serving_default_"):] if name.startswith("serving_default_") else name


def _spec(name: str, detail: TensorDetail, resizable: bool) -> TensorSpec:
    shape = [int(d) for d in detail.get("shape_signature", detail["shape"])]
    dtype = np.dtype(object) if detail["dtype"] in (np.bytes_, np.str_, object) else np.dtype(detail["dtype"])
    if resizable and not shape:
        # LiteRT's converter writes a placeholder of unknown rank (TF1's ``placeholder(float32)``,
        # the sample's ``x``) as rank 0: served as TensorFlow serves it, any shape, resized per call.
        return TensorSpec(name, dtype, None, detail["name"])
    if resizable:
        shape[0] = -1  # batch dimension: resized per batch
    return TensorSpec(name, dtype, tuple(shape), detail["name"])


def _with_info(programs: Programs, info: Signatures) -> tuple[Programs, Signatures]:
    for key, sig in info.items():
        programs[key].declared = {n: spec.shape for n, spec in sig.inputs.items()}
    return programs, info


class TFLiteServable:
    """A LiteRT model with a pool of interpreters (see module docstring)."""

    backend = NAME
    platform = "tflite"
    strict_shapes = False  # the interpreter is resized to the request and judges it, as TF Serving's session
    reads_examples = False  # no ParseExample op in LiteRT: True where a split model parses them here

    def __init__(self, path: str, options: dict[str, ReadJSONValue]):
        self.path = path
        self.options = options
        self.module = interpreter_module()
        self.delegate_reason = "XNNPACK on CPU"
        self._delegates = self._choose_delegates()
        self._pool: queue.LifoQueue[Programs] = queue.LifoQueue()
        self._created = 0
        self._pool_size = max(1, _count(options.get("pool_size")) or os.cpu_count() or 1)
        self._lock = threading.Lock()
        self._sigdefs: SignatureDefs | None = None  # read once LiteRT has accepted the file
        self._wide: Programs | None = None  # the lone batches' interpreter, once one has run
        self._wide_lock = threading.Lock()
        self._parser: ExampleParser | None = None
        self._split = self._parsing_split(path)  # classify/regress signatures that parse tf.Examples first
        self.reads_examples = self._split is not None
        try:
            first, self.signatures = self._first_interpreter()
        except (RuntimeError, ValueError) as exc:  # allocating a signature-less model, say
            raise LoadFailure(f"LiteRT could not load {path}: {exc or _SILENT}", _load_code(str(exc))) from exc
        self._pool.put(first)

    def _first_interpreter(self) -> tuple[Programs, Signatures]:
        try:
            return self._new_interpreter()
        except (LoadFailure, RuntimeError, ValueError) as exc:
            if "unresolved custom op: ParseExample" not in str(exc):
                raise
            self._parser = ExampleParser.read(self.path)  # TF Serving's session has this op: run it here
            if self._parser is None:
                raise LoadFailure(f"LiteRT could not load {self.path}: {exc} (LiteRT's Python interpreter has no "
                                  "ParseExample op; a model of ParseExample ops alone is parsed here, this one has "
                                  "other ops)", "NOT_FOUND") from exc
            self._created = 0
            return self._new_interpreter()

    @staticmethod
    def _parsing_split(path: str) -> Split | None:
        """The model cut where its signatures parse tf.Examples (runtimes/tflite_split.py), or
        None; a file the schema cannot read is left for LiteRT to judge."""
        try:
            return split_parsing(path) if has_parse_ops(path) else None
        except (struct.error, IndexError, ValueError, TypeError, AttributeError):
            return None

    def _choose_delegates(self) -> list[object]:  # LiteRT's Delegate objects
        choice = self.options.get("delegate", "auto")
        if choice == "none":
            return []
        reasons = []
        for kind in ("edgetpu", "gpu") if choice == "auto" else (str(choice),):
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

    def _new_interpreter(self, threads: int | None = None) -> tuple[Programs, Signatures]:
        """A pooled interpreter (counted in ``_created``); with ``threads``, the wide one (not)."""
        pooled = threads is None
        if self._parser is not None:
            self._created += pooled
            return self._parser_programs()
        if pooled:
            configured = self.options.get("num_threads")
            threads = None if configured is None else _count(configured)
        try:
            interp = self.module.Interpreter(
                **self._model(), num_threads=threads, experimental_delegates=self._delegates or None
            )
        except (ValueError, RuntimeError) as exc:
            if not self._delegates:
                raise LoadFailure(f"LiteRT could not load {self.path}: {exc or _SILENT}", _load_code(str(exc))) from exc
            # A delegate that accepts the library but not the graph: serve on CPU, say why.
            self.delegate_reason += f"; delegate rejected the model ({exc}); XNNPACK on CPU"
            self._delegates = []
            interp = self.module.Interpreter(**self._model(), num_threads=threads)
        self._created += pooled
        return self._programs(interp)

    def _model(self) -> dict[str, str | bytes]:
        """The interpreter's model: the file, or the split model's bytes (held by LiteRT)."""
        return {"model_content": self._split.content} if self._split is not None else {"model_path": self.path}

    def _programs(self, interp: _Interpreter) -> tuple[Programs, Signatures]:
        sig_list = interp.get_signature_list()
        if not sig_list:
            interp.allocate_tensors()  # before we hold the wrapper: LiteRT refuses while it is referenced
        wrapper = interp._interpreter  # the C++ wrapper: lets us skip re-allocation per call
        programs: Programs = {}
        info: Signatures = {}
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
                if self._split is not None and key in self._split.parsers:
                    programs[key], info[key] = self._parsing(key, programs[key], info[key])
        else:
            self._from_details(interp.get_input_details(), interp.get_output_details(),
                               lambda ins, outs: _Program(wrapper, 0, ins, outs), programs, info)
        return _with_info(programs, info)

    def _parsing(self, key: str, rest: Runner, info: SignatureInfo) -> tuple[SplitProgram, SignatureInfo]:
        """Signature ``key`` of a split model as TF Serving declares it: serialized tf.Examples in
        (a string vector), parsed here, the rest of the graph on LiteRT."""
        assert self._split is not None
        parser, serialized = self._split.parsers[key], self._split.serialized[key]
        parsed = {d.key for d in parser.dense}
        inputs = {n: spec for n, spec in info.inputs.items() if n not in parsed}
        inputs[serialized] = TensorSpec(serialized, np.dtype(object), (-1,), serialized)
        # A signature runner keeps no method name: TF Serving's output names tell (signature_constants:
        # classify answers "classes"/"scores", regress "outputs"), as its classifier and regressor read them.
        method = CLASSIFY if {"classes", "scores"} & set(info.outputs) else REGRESS if "outputs" in info.outputs \
            else info.method_name
        return SplitProgram(parser, rest, serialized), SignatureInfo(key, inputs, info.outputs, method)

    def _parser_programs(self) -> tuple[Programs, Signatures]:
        """Signatures of a model served by ``ExampleParser``, found as LiteRT's would be."""
        assert self._parser is not None
        programs: Programs = {}
        info: Signatures = {}
        self._from_details(*self._parser.details, self._parser.program, programs, info)
        return _with_info(programs, info)

    def _from_details(self, inputs: list[TensorDetail], outputs: list[TensorDetail], program: MakeProgram,
                      programs: Programs, info: Signatures) -> None:
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

    def _signature_defs(self) -> SignatureDefs:
        if self._sigdefs is None:
            try:
                self._sigdefs = lite_signature_defs(self.path)
            except (struct.error, IndexError, ValueError) as exc:  # tflite_session.cc's refusal
                raise LoadFailure(f"Invalid SignatureDefs found in TfLite model: {exc}") from exc
        return self._sigdefs

    def _from_sigdefs(self, tensors: dict[str, TensorDetail], program: MakeProgram, programs: Programs,
                      info: Signatures) -> None:
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
                                      {a: _spec(a, found[a], True) for a in outs}, method or PREDICT)

    def _acquire(self) -> Programs:
        try:
            return self._pool.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            grow = self._created < self._pool_size
        if grow:
            return self._new_interpreter()[0]
        return self._pool.get()

    def run(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        info = self._info(signature)
        programs = self._acquire()
        try:
            return self._invoke(programs, info, signature, inputs)
        finally:
            if programs[signature].refused:
                programs = self._replacement()
            self._pool.put(programs)

    def run_wide(self, signature: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``run`` for a batch alone: on the interpreter of ``wide_threads`` (module docstring),
        made now if this is the first; as ``run`` without that option, with a delegate (it is
        not the CPU's threads that run the model), or while another lone batch holds it."""
        wide = _count(self.options.get("wide_threads"))
        if wide <= 1 or self._delegates or self._parser is not None or not self._wide_lock.acquire(blocking=False):
            return self.run(signature, inputs)
        try:
            info = self._info(signature)
            if self._wide is None:
                self._wide = self._new_interpreter(wide)[0]
            try:
                return self._invoke(self._wide, info, signature, inputs)
            finally:
                if self._wide[signature].refused:
                    self._wide = None  # half-prepared (see _replacement): a fresh one next time
        finally:
            self._wide_lock.release()

    def _info(self, signature: str) -> SignatureInfo:
        info = self.signatures.get(signature)
        if info is None:
            raise InputFailure(f"signature {signature!r} not found")
        return info

    @staticmethod
    def _invoke(programs: Programs, info: SignatureInfo, signature: str,
                inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            feeds = {n: np.asarray(a, dtype=info.inputs[n].dtype, order="C") for n, a in inputs.items()}
            return programs[signature].run(feeds)
        except (ValueError, RuntimeError) as exc:
            raise InputFailure(f"LiteRT rejected the input: {exc}") from exc

    def _replacement(self) -> Programs:
        """A fresh interpreter for one whose resize or allocation failed: LiteRT leaves such an
        interpreter half-prepared, and the next resize of it can crash the process (a rank-38
        input after a refused [1] one does)."""
        with self._lock:
            self._created -= 1
        return self._new_interpreter()[0]

    def close(self) -> None:
        self._wide = None
        while True:
            try:
                self._pool.get_nowait()
            except queue.Empty:
                break
        self._delegates = []
