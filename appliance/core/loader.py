"""The loader of one model version: TF Serving's ``Loader`` seam (cheap to construct, the
work in ``load()``), between the manager (the mechanism) and the backends (runtimes/).

``Loader(env, model, version, path).load(reference)`` makes a version ready to serve, or
raises ``LoadError`` with a canonical error code and the reason:

1. the source's artifact check (``version_check``: links, bytes changed since verified);
2. the **trial** (appliance/core/loader_child.py), in a child process with memory and time
   limits (appliance/core/loader_trial.py): every artifact loads, a backend is chosen by
   measurement, the choice is warmed up. Its verdict is cached per device and version
   directory, so a restart goes straight to step 5;
3. **whole**: an artifact that did not load, or, where no backend here runs it, failed its
   check (appliance/core/artifacts.py), fails the version with that artifact's error code
   (DATA_LOSS for a truncated ``saved_model.pb``, on a TensorFlow device and a LiteRT-only one
   alike), unless ``allow_partial_versions`` is set: then it serves *degraded*, saying what is
   missing. A whole version whose chosen backend lacks signatures another artifact declares
   (a SavedModel's classify on a LiteRT-only device) serves *degraded* too, saying which and why;
4. **compatible**: a version newer than the ``reference`` (the serving version, or the last
   good one after a restart) serves at least its signatures, inputs and dtypes
   (appliance/core/loader_api.py), unless the publisher declared the change (``api_change``
   in the version's MANIFEST.json, or ``accept_api_change`` in the model's settings);
5. the chosen backend loads in the serving process (TensorFlow is imported there only when a
   TensorFlow backend won), warms up again, and gets its batcher. A marker in the ledger
   spans this step, so a crash here is known at the next start (appliance/core/ledger.py).

Where the manager was given backend objects of its own (test doubles), the trial runs in
this process instead of a child, and its servable is the one that serves.
Thread-safety: a Loader is used by one thread (the manager's).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import runtimes
from runtimes import RuntimeFailure, Servable

from appliance.core.batcher import Batcher
from appliance.core.config import Config, ModelConfig
from appliance.core.errors import ApplianceError
from appliance.core.ledger import MAX_INTERRUPTED, Ledger, mtime
from appliance.core.loader_api import Api, differences
from appliance.core.loader_child import examine, failure_code
from appliance.core.loader_trial import Limits, load_deadline_s, memory_budget, run_in_child
from appliance.core.text import check_assets as check_text_assets
from appliance.core.warmup import warm_up

if TYPE_CHECKING:
    from appliance.core.metrics import Metrics

MANIFEST = "MANIFEST.json"  # sync/manifest.py's name; read here for the publisher's ``api_change``
FEED_SHARE = 4  # a synthetic timing or warm-up call feeds at most this share of the memory limit
LOAD_FAULT_ENV = "EDGE_APPLIANCE_LOAD_FAULT"  # tests only (``_fault_point``)
# Part of a cached verdict's key: 2 since the trial checks the artifacts it cannot run and says
# what the version lacks here, so a verdict cached before that is not reused (it never checked).
VERDICT_SCHEMA = 2


class LoadError(Exception):
    """A version that must not serve: ``code`` is the canonical error code of the cause;
    ``decision`` the backend decision record when the trial got that far."""

    def __init__(self, message: str, code: str, decision: dict[str, Any] | None = None):
        super().__init__(message)
        self.code, self.decision = code, decision


@dataclass
class LoadEnv:
    """What every load on this device shares (the manager owns it)."""

    config: Config
    device: Mapping[str, Any]
    backends: Mapping[str, runtimes.Backend]
    ledger: Ledger
    fingerprint: str
    metrics: "Metrics | None" = None
    version_check: Callable[[str], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def isolated(self) -> bool:
        """Trials run in a child unless the backends are objects of the caller's own."""
        return all(type(b) is runtimes.BACKENDS.get(n) for n, b in self.backends.items())


@dataclass
class Loaded:
    """A version ready to serve, and what its load found."""

    servable: Servable
    batcher: Batcher | None
    decision: dict[str, Any]
    api: Api
    load_ms: float = 0.0
    warmup_ms: float = 0.0
    trial_ms: float = 0.0
    warnings: dict[str, str] = field(default_factory=dict)  # {signature: why its synthetic warm-up failed}
    degraded: str = ""  # what a partial version lacks (allow_partial_versions)
    api_change: str = ""  # the declared API change this version was let through with


class Loader:
    def __init__(self, env: LoadEnv, cfg: ModelConfig, version: int, path: str):
        self.env, self.cfg, self.version, self.path = env, cfg, version, path
        self.name = cfg.name
        self._inline: Servable | None = None  # the trial's servable, where the trial ran in this process

    # -- the whole load ------------------------------------------------------------------
    def load(self, reference: tuple[int, Api] | None = None) -> Loaded:
        """Make the version ready to serve (module docstring), comparing its API with
        ``reference`` (version, API) when given. Raises ``LoadError``."""
        self._check_source()
        self._check_text_assets()
        interrupted = self.env.ledger.interrupted(self.name, self.version, self.path)
        if interrupted >= MAX_INTERRUPTED:
            self._crashed(interrupted)
        started = time.perf_counter()
        verdict = self.trial(fresh=interrupted > 0)
        trial_ms = (time.perf_counter() - started) * 1000
        try:
            loaded = self._serve(verdict, reference)
        except LoadError as exc:
            exc.decision = exc.decision or verdict.get("decision")
            raise
        finally:
            self._inline = None
        loaded.trial_ms = trial_ms
        loaded.batcher = make_batcher(self.env, self.cfg, self.version, loaded.servable)
        return loaded

    def _check_text_assets(self) -> None:
        """A generative version's vocabulary and chat template read, parse and render a plain
        chat (appliance/core/text.py), or it is refused now, not with a 500 per chat request."""
        try:
            check_text_assets(self.path)
        except ApplianceError as exc:
            raise LoadError(exc.message, "INVALID_ARGUMENT") from exc

    def _serve(self, verdict: Mapping[str, Any], reference: tuple[int, Api] | None) -> Loaded:
        """Steps 3 to 5 on the trial's verdict."""
        if not verdict.get("ok"):
            if self._inline is not None:
                self._inline.close()
            raise LoadError(str(verdict.get("reason")), str(verdict.get("code") or "INTERNAL"))
        try:
            degraded = self._wholeness(verdict)
            api_change = self._check_api(verdict["api"], reference)
        except LoadError:
            if self._inline is not None:
                self._inline.close()
            raise
        loaded = self._in_process(verdict)
        loaded.degraded, loaded.api_change = degraded, api_change
        return loaded

    def _check_source(self) -> None:
        if self.env.version_check is None:
            return
        try:  # the source's artifact checks, at load time (no TOCTOU)
            self.env.version_check(self.path)
        except Exception as exc:  # whatever the source refuses with (sync's Refused)
            raise LoadError(str(exc), "FAILED_PRECONDITION") from exc

    def _crashed(self, times: int) -> None:
        reason = (f"the service ended {times} times while loading this version into the serving process "
                  "(a crash, an out-of-memory kill or a power cut); it is not loaded again until its "
                  "directory changes")
        self.env.ledger.quarantine(self.name, self.version, self.path, reason, "ABORTED")
        self.env.ledger.loaded(self.name, self.version)
        raise LoadError(reason, "ABORTED")

    # -- step 2: the trial -----------------------------------------------------------------
    def trial(self, fresh: bool = False) -> dict[str, Any]:
        """The trial's verdict (cached for this device and directory unless ``fresh``)."""
        key = self._verdict_key()
        cached = None if fresh or not self.env.isolated else self.env.ledger.verdict(key)
        if cached is not None:
            return _as_cached(cached)
        request = self._request()
        if self.env.isolated:
            limits = Limits(request["memory_bytes"], load_deadline_s(self.path, self.env.config.runtime))
            verdict = run_in_child(request, limits, self.env.cancel)
        else:
            verdict, self._inline = examine(self.env.backends, request)
        if verdict.get("ok") and self.env.isolated:
            self.env.ledger.set_verdict(key, verdict)
        return verdict

    def _verdict_key(self) -> str:
        """Per device, directory (as it is now) and selection policy: one directory served
        under several model names is tried once."""
        policy = self._policy()
        return (f"{self.env.fingerprint}:{os.path.realpath(self.path)}:{mtime(self.path)}:"
                f"{policy['backend']}:{policy['prefer_tflite_below_mb']}:{VERDICT_SCHEMA}")

    def _policy(self) -> dict[str, Any]:
        rt = self.env.config.runtime
        return {"backend": self.cfg.backend or rt.backend, "prefer_tflite_below_mb": rt.prefer_tflite_below_mb}

    def _request(self) -> dict[str, Any]:
        budget = memory_budget(self.env.config.runtime.load_memory_mb)
        options = backend_options(self.env, self.name, self.version)
        options["tflite"]["max_tensor_bytes"] = budget
        return {"path": self.path, "backends": list(self.env.backends), "options": options,
                "device": dict(self.env.device), "memory_bytes": budget,
                "policy": {**self._policy(), "max_feed_bytes": budget // FEED_SHARE},
                "max_feed_bytes": budget // FEED_SHARE}

    # -- steps 3 and 4: whole and compatible ----------------------------------------------------
    def _wholeness(self, verdict: Mapping[str, Any]) -> str:
        """'' for a whole version that serves all it declares; what it lacks for one that serves
        in part (a broken artifact under allow_partial_versions, or signatures only a backend
        this device lacks serves); else raises."""
        artifacts = verdict.get("artifacts") or {}
        broken = {n: a for n, a in artifacts.items() if not a.get("ok")}
        if not broken:
            return lacking(verdict)
        text = "; ".join(f"{n} {'failed its check' if a.get('checked') else 'did not load'} ({a.get('error')})"
                         for n, a in broken.items())
        whole = [n for n, a in artifacts.items() if a.get("ok")]
        if not (self.cfg.allow_partial_versions or self.env.config.runtime.allow_partial_versions):
            raise LoadError(f"the version is not whole: {text}, while {', '.join(whole)} did; a version serves "
                            "only when every artifact it ships loads (allow_partial_versions = true serves "
                            "such a version, shown as degraded)",
                            next(iter(broken.values())).get("code") or "FAILED_PRECONDITION")
        return f"{text}; served from {', '.join(whole)} on {verdict.get('backend')}"

    def _check_api(self, api: Api, reference: tuple[int, Api] | None) -> str:
        """'' or the declared change the version passes with; raises for an undeclared break."""
        if reference is None or self.version in self.env.ledger.good(self.name):
            return ""
        old_version, old_api = reference
        found = differences(old_api, api)
        if not found:
            return ""
        declared = self.api_change_declared()
        if declared:
            return f"{declared} (differences from version {old_version}: {'; '.join(found)})"
        raise LoadError(f"version {self.version} serves less than version {old_version}: {'; '.join(found)}. "
                        "A publisher who means to change the API says so: `appliance publish --api-change WHY` "
                        f"(api_change in MANIFEST.json), or accept_api_change = [{self.version}] in the "
                        "model's [[models]] settings", "FAILED_PRECONDITION")

    def api_change_declared(self) -> str:
        """Why the API may change with this version, as its publisher or the operator said; ''."""
        if self.version in self.cfg.accept_api_change:
            return f"accept_api_change names version {self.version} in the configuration"
        try:
            with open(os.path.join(self.path, MANIFEST), encoding="utf-8") as f:
                note = json.load(f).get("api_change")
        except (OSError, ValueError, AttributeError):
            return ""
        return f"the publisher declared an API change: {note}" if isinstance(note, str) and note.strip() else ""

    # -- step 5: in the serving process ----------------------------------------------------------
    def _in_process(self, verdict: Mapping[str, Any]) -> Loaded:
        decision = dict(verdict["decision"])
        if self._inline is not None:  # the trial ran here: its servable serves, already warm
            return Loaded(self._inline, None, decision, verdict["api"], load_ms=0.0,
                          warnings=dict(verdict["warmup"]["warnings"]))
        name = str(verdict["backend"])
        self.env.ledger.loading(self.name, self.version, self.path)
        _fault_point(self.name, self.version)
        try:
            return self._load_chosen(name, verdict, decision)
        finally:
            self.env.ledger.loaded(self.name, self.version)  # not reached when the process dies

    def _load_chosen(self, name: str, verdict: Mapping[str, Any], decision: dict[str, Any]) -> Loaded:
        options = backend_options(self.env, self.name, self.version)[name]
        started = time.perf_counter()
        servable = None
        try:
            servable = self.env.backends[name].load(self.path, options)
            load_ms = (time.perf_counter() - started) * 1000
            warm = time.perf_counter()
            warm_up(servable, self.path, only=verdict["warmup"]["ran"])
        except (RuntimeFailure, ValueError, MemoryError) as exc:
            if servable is not None:
                servable.close()
            raise LoadError(f"{name} passed the trial but failed in the serving process: {exc}",
                            failure_code(exc)) from exc
        return Loaded(servable, None, decision, verdict["api"], load_ms=load_ms,
                      warmup_ms=(time.perf_counter() - warm) * 1000, warnings=dict(verdict["warmup"]["warnings"]))


def lacking(verdict: Mapping[str, Any]) -> str:
    """What a whole version cannot serve on this device, in words ('' when nothing): the
    signatures an artifact declares that the chosen backend lacks, and why the backends that
    would serve them do not run here (the trial's ``lacks``: appliance/core/loader_child.py)."""
    said = []
    for artifact, entry in sorted((verdict.get("lacks") or {}).items()):
        needs = entry.get("needs") or {}
        where = (f"which no backend here serves ({'; '.join(f'{b}: {r}' for b, r in sorted(needs.items()))})"
                 if needs else f"whose backend was not chosen ({(verdict.get('decision') or {}).get('reason')})")
        said.append(f"lacks signature{'s' if len(entry['signatures']) > 1 else ''} {', '.join(entry['signatures'])} "
                    f"that {artifact} declares, {where}")
    return "; ".join(said) + (f"; served on {verdict.get('backend')}" if said else "")


def _fault_point(model: str, version: int) -> None:
    """Tests only: with ``EDGE_APPLIANCE_LOAD_FAULT=<model>:<version>`` the process dies here, in
    that version's in-process load, as an out-of-memory kill would (SIGKILL). Unset in
    production, where this does nothing."""
    if os.environ.get(LOAD_FAULT_ENV) == f"{model}:{version}":
        os.kill(os.getpid(), signal.SIGKILL)


def _as_cached(verdict: Mapping[str, Any]) -> dict[str, Any]:
    """A cached verdict, its decision marked as measured earlier (what the status page shows)."""
    decision = dict(verdict["decision"])
    if decision.get("how") == "measured":
        decision.update(how="cached", reason=f"{decision.get('reason', '')} (measured earlier, cached)")
    return {**verdict, "decision": decision}


def backend_options(env: LoadEnv, name: str, version: int) -> dict[str, dict[str, Any]]:
    """Each backend's load options on this device, from ``[runtime]`` and ``[batching]``."""
    config, device = env.config, env.device
    rt = config.runtime
    threads = config.batching.num_batch_threads or device.get("cpu_count", 1)
    cpus = device.get("cpu_count", 1)
    tflite = {
        # Batch slots run side by side: give each interpreter its share of the cores, not all of them;
        # a batch that runs alone gets them all (runtimes/tflite.py run_wide) unless num_threads is set.
        "num_threads": rt.tflite.num_threads or max(1, cpus // threads),
        "wide_threads": 0 if rt.tflite.num_threads or cpus <= max(1, cpus // threads) else cpus,
        "delegate": rt.tflite.delegate,
        "gpu_delegate_path": rt.tflite.gpu_delegate_path,
        "edgetpu_delegate_path": rt.tflite.edgetpu_delegate_path,
        "gpu_present": device.get("delegates", {}).get("gpu", False),
        "edgetpu_present": device.get("delegates", {}).get("edgetpu", False),
        "pool_size": threads + 1,
    }
    tf = {
        "intra_op_threads": rt.tf.intra_op_threads,
        "inter_op_threads": rt.tf.inter_op_threads,
        "tftrt": rt.tf.tftrt,
        "precision": rt.tf.precision,
        "cache_dir": os.path.join(config.state_dir, "cache"),
        "model_name": name,
        "version": version,
        "device": dict(device),
    }
    # LiteRT-LM (.litertlm bundles) keeps its compiled-model cache beside TensorFlow's
    litertlm = {"cache_dir": os.path.join(config.state_dir, "cache"), "engines": rt.litertlm.engines}
    return {"tflite": tflite, "tf-cpu": tf, "tf-gpu": dict(tf), "litertlm": litertlm}


def make_batcher(env: LoadEnv, cfg: ModelConfig, version: int, servable: Servable) -> Batcher | None:
    """The version's batch queue, or None when batching is off for the model."""
    params = env.config.batching_for(cfg)
    if not params.enable_batching:
        return None
    threads = params.num_batch_threads or env.device.get("cpu_count", 1)
    observe = env.metrics.batch_observer(cfg.name, servable.backend, version) if env.metrics is not None else None
    return Batcher(servable.run, params, f"{cfg.name}:{version}", threads, observe=observe,
                   run_wide=getattr(servable, "run_wide", None))  # optional (runtimes/base.py)


__all__ = ["LoadEnv", "LoadError", "Loaded", "Loader", "backend_options", "make_batcher"]
