"""The trial of a version: load every artifact it ships, choose a backend, warm the choice up.

``examine(backends, request)`` is the one function; it runs in a short-lived child process
(``python -m appliance.core.loader_child``, started by appliance/core/loader_trial.py), so a
crash, an out-of-memory kill or a runaway load costs that process only, and whatever runtime
the measurement imported (TensorFlow: ~650 MB) goes when it exits. The serving process then
loads the one backend chosen (appliance/core/loader.py).

What the trial does, in order:

1. every backend that can run here and serve an artifact of the version loads it: a version
   is *whole* when each artifact it ships loads with at least one backend (a truncated
   ``saved_model.pb`` beside a good ``model.tflite`` is not); an artifact no backend here
   runs (a SavedModel on a LiteRT-only device) is checked without running it
   (appliance/core/artifacts.py), so a corrupt one fails the version on every device;
2. ``runtimes.select`` chooses among the loaded ones (pinned, only, policy, or measured on
   synthetic calls no bigger than the memory limit allows);
3. the chosen servable is warmed up (the version's warm-up file, or one synthetic call per
   signature); the signatures other artifacts declare and it lacks (``lacks``: what only
   TensorFlow serves, on a LiteRT-only device) make the version *degraded* (loader.py).

The verdict is JSON (appliance/core/loader_trial.py reads it): ``ok``, ``code`` and ``reason``
when not, the decision record, the chosen servable's API, each artifact's outcome, the
warm-up's report and the trial's own figures.

Child protocol: the request is JSON on stdin; stdout carries one JSON line with the child's
resident memory once its runtimes are imported (the parent's memory watchdog counts from
there), then the verdict as the last line. Everything the libraries print goes to stderr.
This module imports numpy, ``runtimes`` and the warm-up reader only.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys
import time
from typing import Any, Mapping

import runtimes
from runtimes import Backend, RuntimeFailure, Servable
from runtimes.select import Considered, consider

from appliance.core.artifacts import check as check_artifact
from appliance.core.errors import ApplianceError
from appliance.core.loader_api import api_of
from appliance.core.warmup import warm_up

PR_SET_PDEATHSIG = 1  # prctl(2): the kernel signals this process when its parent dies
THREAD_STACK = 8 << 20  # glibc's default thread stack: each thread a runtime starts reserves it
ADDRESS_SLACK = 256 << 20  # two malloc arenas (MALLOC_ARENA_MAX=2) and the loader's own mappings


def examine(backends: Mapping[str, Backend], request: Mapping[str, Any]) -> tuple[dict[str, Any], Servable | None]:
    """The verdict on the version at ``request["path"]`` and the chosen servable, warmed up
    (None when the version failed). The caller owns the servable (closes it)."""
    path, device = request["path"], request["device"]
    considered = consider(backends, device, path)
    loaded, failures = _load_all(backends, considered, path, request["options"])
    artifacts = _artifacts(considered, loaded, failures)
    artifacts.update(_unrun(backends, considered, path, artifacts))
    started = time.perf_counter()
    decision, chosen = runtimes.select(backends, device, path, lambda name: _preloaded(name, loaded, failures),
                                       request["policy"], _cache(request), "trial")
    for name, servable in loaded.items():
        _declare(artifacts, considered, name, servable)
        if servable is not chosen:
            servable.close()
    verdict: dict[str, Any] = {"decision": decision.to_dict(), "artifacts": artifacts,
                               "select_ms": round((time.perf_counter() - started) * 1000, 1)}
    if chosen is None:
        code = next((exc.code for exc in failures.values()), "NOT_FOUND" if not loaded else "INVALID_ARGUMENT")
        return {**verdict, "ok": False, "code": code, "reason": decision.reason}, None
    verdict["lacks"] = _lacks(chosen, artifacts)
    return _warmed(verdict, chosen, path, request.get("max_feed_bytes"))


def _warmed(verdict: dict[str, Any], chosen: Servable, path: str,
            max_feed_bytes: int | None) -> tuple[dict[str, Any], Servable | None]:
    started = time.perf_counter()
    try:
        report = warm_up(chosen, path, max_feed_bytes=max_feed_bytes)
    except (RuntimeFailure, ApplianceError, ValueError, MemoryError) as exc:
        chosen.close()
        return {**verdict, "ok": False, "code": failure_code(exc),
                "reason": f"the warm-up on {chosen.backend} failed: {exc}"}, None
    verdict.update(ok=True, api=api_of(chosen.signatures), backend=chosen.backend,
                   warmup={"kind": report.kind, "ran": report.ran, "warnings": report.warnings},
                   warmup_ms=round((time.perf_counter() - started) * 1000, 1))
    return verdict, chosen


def failure_code(exc: BaseException) -> str:
    """The canonical code of a failed load or warm-up, by cause (never UNKNOWN for a known one)."""
    if isinstance(exc, RuntimeFailure):
        return exc.code
    if isinstance(exc, ApplianceError):
        return exc.grpc_code
    if isinstance(exc, MemoryError):
        return "RESOURCE_EXHAUSTED"
    if isinstance(exc, ValueError) and "TFRecord" in str(exc):
        return "DATA_LOSS"  # TF Serving's words for a warm-up file that is not a TFRecord
    return "UNKNOWN"


def _load_all(backends: Mapping[str, Backend], considered: list[Considered], path: str,
              options: Mapping[str, Any]) -> tuple[dict[str, Servable], dict[str, RuntimeFailure]]:
    """Every backend that can serve an artifact of the version, loaded (or why not)."""
    loaded: dict[str, Servable] = {}
    failures: dict[str, RuntimeFailure] = {}
    for c in considered:
        if not c.available:
            continue
        try:
            loaded[c.backend] = backends[c.backend].load(path, options.get(c.backend, {}))
        except RuntimeFailure as exc:
            failures[c.backend] = exc
        except MemoryError as exc:
            failures[c.backend] = RuntimeFailure(f"{c.backend} ran out of memory loading it ({exc})",
                                                 "RESOURCE_EXHAUSTED")
    return loaded, failures


def _artifacts(considered: list[Considered], loaded: Mapping[str, Servable],
               failures: Mapping[str, RuntimeFailure]) -> dict[str, dict[str, Any]]:
    """{artifact file name: {"ok", "backends", "error", "code"}}: an artifact loads when any
    backend that serves it loaded it."""
    out: dict[str, dict[str, Any]] = {}
    for c in considered:
        if not c.available or c.artifact is None:
            continue
        name = _artifact_name(c.artifact)
        entry = out.setdefault(name, {"ok": False, "backends": [], "error": "", "code": ""})
        entry["backends"].append(c.backend)
        if c.backend in loaded:
            entry.update(ok=True, error="", code="")
        elif not entry["ok"] and c.backend in failures:
            entry.update(error=str(failures[c.backend]), code=failures[c.backend].code)
    return out


def _unrun(backends: Mapping[str, Backend], considered: list[Considered], path: str,
           artifacts: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The artifacts of the version that no backend here runs (a SavedModel on a LiteRT-only
    device), checked without running them: ``checked`` says how, ``needs`` which backends would
    run it and why they cannot here."""
    out: dict[str, dict[str, Any]] = {}
    for c in considered:
        found = None if c.available else backends[c.backend].can_serve(path)
        if found is None:
            continue
        name = _artifact_name(found)
        if name in artifacts:
            continue
        if name not in out:
            result = check_artifact(path, name)
            out[name] = {"ok": result.ok, "backends": [], "error": result.error, "code": result.code,
                         "checked": result.how or "failed", "signatures": result.signatures, "needs": {}}
        out[name]["needs"][c.backend] = c.reason
    return out


def _declare(artifacts: dict[str, dict[str, Any]], considered: list[Considered], backend: str,
             servable: Servable) -> None:
    """Record the signatures ``backend``'s loaded servable found in its artifact."""
    for c in considered:
        if c.backend == backend and c.artifact is not None:
            entry = artifacts.get(_artifact_name(c.artifact))
            if entry is not None:
                entry["signatures"] = sorted(set(entry.get("signatures", [])) | set(servable.signatures))


def _lacks(chosen: Servable, artifacts: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """{artifact: {"signatures": the ones it declares that ``chosen`` lacks, "needs": {backend:
    why it cannot run here}}}, for the artifacts that declare more than ``chosen`` serves."""
    out = {}
    for name, entry in artifacts.items():
        missing = sorted(set(entry.get("signatures") or []) - set(chosen.signatures))
        if missing and entry.get("ok"):
            out[name] = {"signatures": missing, "needs": dict(entry.get("needs") or {})}
    return out


def _artifact_name(artifact: str) -> str:
    """The file a user knows the artifact by (a SavedModel backend names its directory)."""
    if not os.path.isdir(artifact):
        return os.path.basename(artifact)
    return next((n for n in ("saved_model.pb", "saved_model.pbtxt") if os.path.isfile(os.path.join(artifact, n))),
                "saved_model.pb")


def _preloaded(name: str, loaded: Mapping[str, Servable], failures: Mapping[str, RuntimeFailure]) -> Servable:
    if name in loaded:
        return loaded[name]
    raise failures.get(name) or RuntimeFailure(f"{name} did not load")


def _cache(request: Mapping[str, Any]) -> dict[str, Any] | None:
    """The decision measured earlier for this version, when the caller passes one."""
    cached = request.get("cached")
    return {"trial": cached} if cached else None


# -- the child process --------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """Never outlive the serving process (a trial left running would hold its memory)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the parent's watchdog still kills it
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _import_runtimes(backends: Mapping[str, Backend], considered: list[Considered]) -> None:
    """Import the frameworks of the candidates before any limit applies: their code is trusted,
    the model is not (TensorFlow maps ~1.7 GB of address space just by being imported)."""
    wanted = {c.backend for c in considered if c.available}
    if "tflite" in wanted:
        from runtimes.tflite import interpreter_module

        interpreter_module()
    if wanted & {"tf-cpu", "tf-gpu"}:
        from runtimes.savedmodel import tensorflow

        tensorflow()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _limit_address_space(budget: int, device: Mapping[str, Any]) -> None:
    """RLIMIT_AS at what the process maps now plus ``budget``, room for the runtimes' threads
    and slack: an allocation past it fails in the library (a clean error) instead of the
    kernel's OOM killer picking a process. Not on an NVIDIA device: CUDA reserves tens of GB of
    address space it never touches (the parent's resident-memory watchdog still applies)."""
    if device.get("nvidia_gpu"):
        return
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    threads = 3 * int(device.get("cpu_count") or os.cpu_count() or 1) * THREAD_STACK
    limit = mapped + budget + threads + ADDRESS_SLACK
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> int:
    request = json.load(sys.stdin)
    _die_with_parent(int(request["parent"]))
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr: stdout carries the protocol only
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash leaves no core file of the model's size
    backends = {name: runtimes.BACKENDS[name]() for name in request["backends"]}
    _import_runtimes(backends, consider(backends, request["device"], request["path"]))
    out.write(json.dumps({"resident_bytes": _resident_bytes()}) + "\n")
    out.flush()
    _limit_address_space(int(request["memory_bytes"]), request["device"])
    verdict, servable = examine(backends, request)
    if servable is not None:
        servable.close()
    verdict["peak_resident_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out.write(json.dumps(verdict, default=str) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
