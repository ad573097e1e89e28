"""LiteRT / TFLite backend: GPU or EdgeTPU delegate when present, XNNPACK on CPU otherwise.

Interpreters are not thread-safe and allocate on every resize, so a servable keeps a
small pool of interpreters; each remembers the input shapes it was last allocated for
and only re-allocates when a batch of a new size arrives (with ``allowed_batch_sizes``
that happens once per size). Models without signature defs (input ``x``, shape
``[1, 1]``) are served by their input/output details as signature ``serving_default``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import queue
import threading
from typing import Any, Mapping

import numpy as np

from .base import (
    DEFAULT_SIGNATURE,
    Availability,
    InputFailure,
    LoadFailure,
    MissingDependency,
    SignatureInfo,
    TensorSpec,
)

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

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        w, sg = self.wrapper, self.subgraph
        if any(self.shapes.get(n) != a.shape for n, a in feeds.items()):
            self.shapes = {}  # a failed resize must not look allocated
            for name, arr in feeds.items():
                w.ResizeInputTensor(self.inputs[name], np.array(arr.shape, dtype=np.int32), False, sg)
            w.AllocateTensors(sg)
            self.shapes = {n: a.shape for n, a in feeds.items()}
        for name, arr in feeds.items():
            w.SetTensor(self.inputs[name], arr, sg)
        w.Invoke(sg)
        return {name: w.GetTensor(idx, sg) for name, idx in self.outputs.items()}


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
            for key in sig_list:
                runner = interp.get_signature_runner(key)
                ins, outs = runner.get_input_details(), runner.get_output_details()
                sg = runner._subgraph_index
                programs[key] = _Program(wrapper, sg, {n: d["index"] for n, d in ins.items()},
                                         {n: d["index"] for n, d in outs.items()})
                info[key] = SignatureInfo(key, {n: _spec(n, d, True) for n, d in ins.items()},
                                          {n: _spec(n, d, True) for n, d in outs.items()})
        else:
            ins = {_clean_name(d["name"]): d for d in interp.get_input_details()}
            outs = {_clean_name(d["name"]): d for d in interp.get_output_details()}
            programs[DEFAULT_SIGNATURE] = _Program(wrapper, 0, {n: d["index"] for n, d in ins.items()},
                                                   {n: d["index"] for n, d in outs.items()})
            info[DEFAULT_SIGNATURE] = SignatureInfo(
                DEFAULT_SIGNATURE, {n: _spec(n, d, True) for n, d in ins.items()},
                {n: _spec(n, d, True) for n, d in outs.items()})
        programs["__info__"] = info
        return programs

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
            feeds = {n: np.ascontiguousarray(a, dtype=info.inputs[n].dtype) for n, a in inputs.items()}
            return programs[signature].run(feeds)
        except (ValueError, RuntimeError) as exc:  # RuntimeError: AllocateTensors refusing the shape
            raise InputFailure(f"LiteRT rejected the input: {exc}") from exc
        finally:
            self._pool.put(programs)

    def close(self) -> None:
        while True:
            try:
                self._pool.get_nowait()
            except queue.Empty:
                break
        self._delegates = []
