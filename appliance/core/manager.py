"""The model manager: the mechanism that loads, serves, swaps and unloads model versions.

Sources say which versions exist (``ModelSource``: directories on disk, filled by hand or
by ``sync``); ``policy`` says which to aspire to; this module carries it out. All version
transitions happen in ``_transition`` and each is an event in the state database.

Requests hold a version through a handle (``with manager.handle("det") as slot:``). A swap
replaces what new handles get; the old version moves to UNLOADING and is closed when its
last handle is released (drain), in a background thread. Loads run one at a time in the
poll thread, so two big versions are never being loaded at once on a small device.

Thread-safety: every public method may be called from any thread.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

import runtimes
from runtimes import Decision, RuntimeFailure, Servable, generative

from appliance.core import device as device_mod
from appliance.core.batcher import Batcher
from appliance.core.config import Config, ModelConfig, RolloutConfig
from appliance.core.errors import ApplianceError, InvalidArgument, NotFound, Unavailable
from appliance.core.handle import Handle
from appliance.core.sources import Aspired
from appliance.core.memory import release_freed_memory
from appliance.core.policy import State, aspired_versions, plan
from appliance.core.state import StateDB
from appliance.core.text import check_assets as check_text_assets
from appliance.core.warmup import warmup_requests

if TYPE_CHECKING:
    from appliance.core.metrics import Metrics

log = logging.getLogger("appliance.manager")


@dataclass
class VersionSlot:
    """One model version and everything loaded for it."""

    model: str
    version: int
    path: str
    state: State = State.START
    error: str = ""
    servable: Servable | None = None
    batcher: Batcher | None = None
    decision: dict[str, Any] | None = None
    load_ms: float = 0.0
    warmup_ms: float = 0.0
    available_since: float = 0.0
    # Signatures whose synthetic warm-up call failed: {signature: why}. Served all the same
    # (TF Serving does no synthetic warm-up; the failure is shown, not held against the version).
    warnings: dict[str, str] = field(default_factory=dict)
    # Requests holding this version: one entry each. deque.append/pop are atomic under the
    # GIL, so a request counts itself in and out without the manager's lock (Manager.handle).
    inflight: collections.deque = field(default_factory=collections.deque, repr=False)

    @property
    def refs(self) -> int:
        return len(self.inflight)

    def describe(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "state": self.state.value,
            "error": self.error,
            "backend": getattr(self.servable, "backend", None) or (self.decision or {}).get("chosen"),
            "load_ms": round(self.load_ms, 1),
            "warmup_ms": round(self.warmup_ms, 1),
            "available_since": self.available_since or None,
            "in_flight": self.refs,
            "decision": self.decision,
            "batching": self.batcher.snapshot() if self.batcher else None,
            "warmup_warnings": dict(self.warnings),
        }


@dataclass
class ModelEntry:
    config: ModelConfig
    versions: dict[int, VersionSlot] = field(default_factory=dict)
    quarantined: dict[int, tuple[float, str]] = field(default_factory=dict)  # version -> (dir mtime, why)
    # Rollouts (config rollout.mode shadow|canary): the version answering unversioned
    # requests, and a newer one loaded next to it until appliance/core/rollout.py judges it.
    serving: int | None = None
    candidate: int | None = None
    # The channel's rollout policy when a synced channel carries one (it replaces the
    # model's own [models.rollout] in ``config``; ``own_rollout`` keeps the latter).
    own_rollout: RolloutConfig | None = None
    channel_policy: dict[str, Any] | None = None
    channel_candidate: int | None = None  # judged only: never served as the newest version
    source: str = ""  # the version source that named this model (appliance/core/sources.py)
    on_disk: dict[int, str] = field(default_factory=dict)  # {version: directory}, as its source pushed


class Manager:
    def __init__(self, config: Config, db: StateDB, device: Mapping[str, Any],
                 backends: Mapping[str, runtimes.Backend] | None = None, metrics: "Metrics | None" = None,
                 version_check: Callable[[str], None] | None = None):
        """``version_check(path)``: raises when a version directory must not load (links,
        bytes changed since the bucket's manifest was verified: sync/store.py check_version);
        run right before each load."""
        self.config = config
        self.version_check = version_check
        self._channel: dict[str, dict[str, Any]] = {}  # model -> the channel's rollout record (pushed by sync)
        self._refused_sources: set[tuple[str, str]] = set()  # (model, source) told it is another's
        self.metrics = metrics
        self.db = db
        self.device = dict(device)
        self.backends = dict(backends or runtimes.default_backends())
        self._models: dict[str, ModelEntry] = {}
        self._lock = threading.RLock()
        self._drained = threading.Condition(self._lock)
        # (name, version, label) -> the slot ``handle`` chose, for requests that take no lock.
        # Replaced by an empty dict (under the lock) whenever what it chose from changes.
        self._picks: dict[tuple[str, int | None, str | None], VersionSlot] = {}
        # Called (no arguments, any thread, maybe under the manager's lock: they must only
        # schedule work) whenever what ``handle`` chooses from may have changed: a transition,
        # a swap, a rollout pin, a model's settings. TF Serving's ServableStateMonitor role:
        # the front workers' serving view follows these (appliance/fronts/serving.py).
        self.listeners: list[Callable[[], None]] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._decisions = db.kv()
        self._fingerprint = device_mod.fingerprint(self.device)
        self.last_poll = 0.0
        self.rollouts: Any = None  # appliance/core/rollout.py Rollouts, set by the core before start()

    # -- what the sources push ---------------------------------------------------------
    def set_aspired(self, source: str, models: Aspired) -> None:
        """(a version source) Every model ``source`` has, with its settings and versions on
        disk: the whole set each time. The contract is appliance/core/sources.py's."""
        refused: list[str] = []
        with self._lock:
            for name, (cfg, versions) in models.items():
                entry = self._models.get(name)
                if entry is None:
                    entry = self._models[name] = ModelEntry(cfg, own_rollout=cfg.rollout, source=source)
                elif entry.source != source:
                    if (name, source) not in self._refused_sources:  # said once, not at every scan
                        self._refused_sources.add((name, source))
                        refused.append(name)
                    continue
                elif entry.config.base_path != cfg.base_path or entry.own_rollout != cfg.rollout \
                        or _without_rollout(entry.config) != _without_rollout(cfg):
                    entry.own_rollout, entry.channel_policy = cfg.rollout, None  # re-applied at the next pass
                    entry.config = cfg
                entry.on_disk = dict(versions)
            gone = {n: self._models.pop(n) for n, e in list(self._models.items())
                    if e.source == source and n not in models}
            self._changed()
        for name in refused:
            self.db.event("model_refused", f"{name} is already served from another source; {source}'s copy is "
                          "ignored", model=name)
        for name, entry in gone.items():
            for slot in list(entry.versions.values()):
                self._begin_unload(slot, f"model {name} is no longer in {source}")
        self._wake.set()

    def reload(self, config: Config) -> None:
        """Apply a changed configuration (SIGHUP): batching and the other settings read
        from ``config``; the sources push the models it names (appliance/core/appliance.py)."""
        self.config = config
        self.poll_now()

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll_loop, name="model-manager", daemon=True)
            self._thread.start()

    def close(self, drain_timeout: float = 20.0) -> None:
        """Stop polling, drain in-flight requests (bounded), unload everything. Idempotent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._lock:
            slots = [s for e in self._models.values() for s in e.versions.values() if s.servable is not None]
        for slot in slots:
            self._begin_unload(slot, "service stopping", background=False, timeout=drain_timeout)

    def poll_now(self) -> None:
        self._wake.set()

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception:  # the loop must outlive any one bad model or disk error
                log.exception("reconcile failed")
            self._wake.wait()  # a source pushed, a decision was made, or close()
            self._wake.clear()

    # -- reconciliation ------------------------------------------------------------------
    def reconcile(self) -> None:
        """One pass over what the sources pushed: load what is aspired, unload what is superseded."""
        self.last_poll = time.time()
        with self._lock:
            entries = list(self._models.items())
        self._apply_channel_policies(entries)
        for name, entry in entries:
            if self._stop.is_set():
                return
            self._reconcile_model(name, entry)

    def _apply_channel_policies(self, entries: list[tuple[str, ModelEntry]]) -> None:
        """A synced channel's rollout policy (pushed by sync: ``set_channel_rollout``) replaces the
        model's own [models.rollout]: the central team sets it for the whole fleet. A policy
        this device cannot take is refused once, with the reason, and the own one stays."""
        policies = self._channel
        for name, entry in entries:
            record = policies.get(name) or {}
            candidate, policy = record.get("candidate"), record.get("policy")
            entry.channel_candidate = candidate if isinstance(candidate, int) else None
            if policy == entry.channel_policy:
                continue
            entry.channel_policy = policy
            own = entry.own_rollout if entry.own_rollout is not None else entry.config.rollout
            rollout = own
            if policy is not None:
                try:
                    rollout = RolloutConfig(**policy)
                    rollout.validate("rollout")
                except (TypeError, ApplianceError) as exc:
                    self.db.event("rollout_policy_refused", f"{name}: the channel's rollout policy is refused, "
                                  f"the device's own applies: {exc}", model=name)
                    rollout = own
            with self._lock:
                entry.own_rollout = own
                entry.config = dataclasses.replace(entry.config, rollout=rollout)

    def set_channel_rollout(self, name: str, record: dict[str, Any] | None) -> None:
        """(sync) The channel of ``name`` names a candidate and/or a rollout policy
        (``{"candidate": N | None, "policy": {...} | None}``; None: neither). Applied at once."""
        if record:
            self._channel[name] = dict(record)
        else:
            self._channel.pop(name, None)
        self.poll_now()

    def rollout_policy(self, name: str) -> RolloutConfig | None:
        """The rollout policy in force for ``name`` (lock-free: the request path reads it)."""
        entry = self._models.get(name)
        return entry.config.rollout if entry is not None else None

    def _reconcile_model(self, name: str, entry: ModelEntry) -> None:
        cfg = entry.config
        on_disk = dict(entry.on_disk)
        self._forget_changed_quarantine(entry, on_disk)
        servable = on_disk
        if entry.channel_candidate is not None and cfg.rollout.mode == "off" and len(on_disk) > 1:
            # a channel's candidate is there to be judged: without a rollout it is never served
            servable = {v: p for v, p in on_disk.items() if v != entry.channel_candidate}
        aspired = aspired_versions(cfg.version_policy, servable, cfg.latest, cfg.versions, entry.quarantined)
        aspired = self._rollout_aspired(entry, aspired)
        with self._lock:  # an unloaded version whose directory is gone has nothing left to show
            for version in [v for v, s in entry.versions.items() if s.state == State.END and v not in on_disk]:
                del entry.versions[version]
            states = {v: s.state for v, s in entry.versions.items()}
        to_load, to_unload = plan(states, aspired)
        for version in sorted(to_load, reverse=True):  # newest first: it is the one to serve
            if self._stop.is_set():
                return
            self._load(name, entry, version, on_disk[version])
        with self._lock:
            states = {v: s.state for v, s in entry.versions.items()}
        _, to_unload = plan(states, aspired)
        for version in to_unload:
            slot = entry.versions.get(version)
            if slot is not None and slot.state == State.AVAILABLE:
                self._begin_unload(slot, f"superseded (aspired versions: {aspired})")

    def _rollout_aspired(self, entry: ModelEntry, aspired: list[int]) -> list[int]:
        """With a rollout mode, a newer version becomes the candidate beside the serving one
        instead of replacing it; without one, the serving version follows the policy."""
        with self._lock:
            self._changed()  # the serving pin may move below
            live = {v for v, s in entry.versions.items() if s.state == State.AVAILABLE}
            if entry.serving not in live:
                entry.serving = max(live, default=None)
            if entry.config.rollout.mode == "off" or entry.config.version_policy != "latest":
                entry.serving = entry.candidate = None  # no pin: the newest available version answers
                return aspired
            if entry.serving is None:
                return aspired
            newest = max(aspired, default=None)
            entry.candidate = newest if newest is not None and newest > entry.serving else None
            return sorted({entry.serving, *([entry.candidate] if entry.candidate is not None else [])})

    def rollout_versions(self, name: str) -> tuple[int | None, int | None]:
        """(serving, candidate) of a model; candidate only once it is AVAILABLE."""
        with self._lock:
            entry = self._models.get(name)
            if entry is None:
                return None, None
            slot = entry.versions.get(entry.candidate) if entry.candidate is not None else None
            ready = slot is not None and slot.state == State.AVAILABLE
            return entry.serving, (entry.candidate if ready else None)

    def promote(self, name: str, version: int) -> None:
        """Make the candidate ``version`` the serving one in one step (new requests get it at
        once, in-flight ones finish on the old one, which then drains and unloads)."""
        with self._lock:
            entry = self.entry(name)
            slot = entry.versions.get(version)
            if entry.candidate != version or slot is None or slot.state != State.AVAILABLE:
                raise InvalidArgument(f"{name} version {version} is not an available rollout candidate")
            old = entry.versions.get(entry.serving) if entry.serving is not None else None
            entry.serving, entry.candidate = version, None
            self._changed()
        if old is not None and old.version != version:
            self._begin_unload(old, f"version {version} promoted")
        self.poll_now()

    def quarantine(self, name: str, version: int, reason: str) -> None:
        """Stop a candidate: unload it and never load it again unless its directory is replaced."""
        with self._lock:
            entry = self.entry(name)
            slot = entry.versions.get(version)
            if entry.candidate == version:
                entry.candidate = None
            entry.quarantined[version] = (_mtime(slot.path if slot else os.path.join(entry.config.base_path,
                                                                                   str(version))), reason)
        if slot is not None:
            self._begin_unload(slot, f"quarantined: {reason}")
        self.poll_now()

    @staticmethod
    def _forget_changed_quarantine(entry: ModelEntry, on_disk: Mapping[int, str]) -> None:
        """A quarantined version is retried only if its directory was replaced."""
        for version, (mtime, _) in list(entry.quarantined.items()):
            path = on_disk.get(version)
            if path is None or _mtime(path) != mtime:
                entry.quarantined.pop(version, None)

    def _changed(self) -> None:
        """Under the lock: ``handle``'s choices are void; tell the listeners."""
        self._picks = {}
        for listener in self.listeners:
            listener()

    def _transition(self, slot: VersionSlot, state: State, message: str, kind: str, **detail: Any) -> None:
        with self._lock:
            slot.state = state
            self._changed()
        self.db.event(kind, message, model=slot.model, version=slot.version, state=state.value, **detail)
        if state == State.AVAILABLE and self.rollouts is not None:
            self.rollouts.candidate_ready(slot.model)  # a candidate beside the serving version starts its rollout

    # -- loading -----------------------------------------------------------------------
    def _backend_options(self, name: str, version: int) -> dict[str, dict[str, Any]]:
        rt = self.config.runtime
        threads = self.config.batching.num_batch_threads or self.device.get("cpu_count", 1)
        cpus = self.device.get("cpu_count", 1)
        tflite = {
            # Batch slots run side by side: give each interpreter its share of the cores, not all of them.
            "num_threads": rt.tflite.num_threads or max(1, cpus // threads),
            "delegate": rt.tflite.delegate,
            "gpu_delegate_path": rt.tflite.gpu_delegate_path,
            "edgetpu_delegate_path": rt.tflite.edgetpu_delegate_path,
            "gpu_present": self.device.get("delegates", {}).get("gpu", False),
            "edgetpu_present": self.device.get("delegates", {}).get("edgetpu", False),
            "pool_size": threads + 1,
        }
        tf = {
            "intra_op_threads": rt.tf.intra_op_threads,
            "inter_op_threads": rt.tf.inter_op_threads,
            "tftrt": rt.tf.tftrt,
            "precision": rt.tf.precision,
            "cache_dir": os.path.join(self.config.state_dir, "cache"),
            "model_name": name,
            "version": version,
            "device": self.device,
        }
        # LiteRT-LM (.litertlm bundles) keeps its compiled-model cache beside TensorFlow's
        litertlm = {"cache_dir": os.path.join(self.config.state_dir, "cache")}
        return {"tflite": tflite, "tf-cpu": tf, "tf-gpu": tf, "litertlm": litertlm}

    def _load(self, name: str, entry: ModelEntry, version: int, path: str) -> None:
        slot = VersionSlot(name, version, path)
        with self._lock:
            entry.versions[version] = slot
        self._transition(slot, State.LOADING, f"loading {name} version {version} from {path}", "load_start")
        started = time.perf_counter()
        try:
            if self.version_check is not None:  # the source's artifact checks, at load time (no TOCTOU)
                self.version_check(path)
            decision, servable = self.select_backend(name, entry.config, version, path)
            slot.decision = decision.to_dict()
            if servable is None:
                raise RuntimeFailure(decision.reason)
            slot.servable = servable
            slot.load_ms = (time.perf_counter() - started) * 1000
            warm = time.perf_counter()
            check_text_assets(path)  # a generative version's vocabulary and chat template (appliance/core/text.py)
            self._warm_up(slot, servable, path)
            slot.warmup_ms = (time.perf_counter() - warm) * 1000
            if self.metrics is not None:
                self.metrics.observe_warmup(path, slot.warmup_ms / 1000)
        except Exception as exc:  # any failure quarantines this version; others keep serving
            self._fail(entry, slot, exc)
            return
        slot.batcher = self._make_batcher(name, entry.config, version, servable)
        slot.available_since = time.time()
        generation = (slot.decision or {}).get("generation")  # what a generative version is (runtimes/select.py)
        said = (f"; generates ({generation.get('convention')}, decode batch {generation.get('decode_batch')}, "
                f"context {generation.get('context_length')}, vocabulary {generation.get('vocab_size')})"
                if isinstance(generation, dict) else "")
        self._transition(slot, State.AVAILABLE,
                         f"{name} version {version} available on {servable.backend} "
                         f"(load {slot.load_ms:.0f} ms, warm-up {slot.warmup_ms:.0f} ms){said}", "loaded",
                         backend=servable.backend, load_ms=round(slot.load_ms, 1),
                         **({"generation": generation} if generation else {}))

    def select_backend(self, name: str, cfg: ModelConfig, version: int,
                       path: str) -> tuple[Decision, Servable | None]:
        """Choose (measure, or take the cached choice) and load the backend for one version
        directory: what loading does, and what `appliance probe` shows without serving."""
        options = self._backend_options(name, version)
        backends = self.backends
        policy = {"backend": cfg.backend or self.config.runtime.backend,
                  "prefer_tflite_below_mb": self.config.runtime.prefer_tflite_below_mb}
        key = f"decision:{self._fingerprint}:{name}:{version}:{_mtime(path)}"
        return runtimes.select(backends, self.device, path, lambda b: backends[b].load(path, options[b]),
                               policy, self._decisions, key)

    def _warm_up(self, slot: VersionSlot, servable: Servable, path: str) -> None:
        """TF Serving's rule: the version's own ``assets.extra/tf_serving_warmup_requests`` is
        authoritative, and a record that fails refuses the version (raises). Without the file,
        one synthetic call per signature; one that fails is a warning on that signature
        (``slot.warnings``, a ``warmup_warning`` event) and the version still serves, as TF
        Serving, which does no synthetic warm-up, would serve it."""
        requests = warmup_requests(path)
        if requests:
            self._replay_warmup_file(servable, requests)
            return
        # Generation signatures (prefill/decode, generate_step) warm up with one real prompt
        # and step: zeros resized to "batch 1" do not fit a fixed-length prefill's input_pos.
        driver = generative.detect(servable)
        if driver is not None:
            driver.warm_up()
            return
        for sig in servable.signatures.values():
            if not sig.inputs or any(spec.is_string for spec in sig.inputs.values()):
                # no valid synthetic tf.Example; and a signature without inputs is an action (TF
                # Serving's counter model: incr_counter, reset_counter) a warm-up must not take
                continue
            try:
                servable.run(sig.name, runtimes.synthetic_inputs(sig, 1))
            except RuntimeFailure as exc:
                self._warmup_warning(slot, sig.name, str(exc))

    def _warmup_warning(self, slot: VersionSlot, signature: str, why: str) -> None:
        slot.warnings[signature] = why
        self.db.event("warmup_warning", f"{slot.model} version {slot.version}: the synthetic warm-up call of "
                      f"signature {signature!r} failed ({why}); the version serves all the same, as TF Serving "
                      "would, and a request to that signature gets the model's own answer", model=slot.model,
                      version=slot.version, signature=signature, error=why)

    @staticmethod
    def _replay_warmup_file(servable: Servable, requests: list[Any]) -> None:
        for kind, signature, inputs in requests:
            if kind != "predict":
                sig = servable.signatures.get(signature)
                if sig is None:
                    raise RuntimeFailure(f"warm-up request names signature {signature!r}, which the model lacks")
                inputs = {next(iter(sig.inputs)): inputs}  # serialized examples feed the only input
            servable.run(signature, inputs)  # type: ignore[arg-type]

    def _make_batcher(self, name: str, cfg: ModelConfig, version: int, servable: Servable) -> Batcher | None:
        params = self.config.batching_for(cfg)
        if not params.enable_batching:
            return None
        threads = params.num_batch_threads or self.device.get("cpu_count", 1)
        observe = self.metrics.batch_observer(name, servable.backend) if self.metrics is not None else None
        return Batcher(servable.run, params, f"{name}:{version}", threads, observe=observe)

    def _fail(self, entry: ModelEntry, slot: VersionSlot, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RuntimeFailure) else str(exc)
        cause = exc.__cause__
        if cause is not None and str(cause) and str(cause) not in reason:
            # a refused load names the library's own words too (LiteRT's "XNNPack delegate failed
            # to reshape ..."), which a request's answer leaves to the log (runtimes/tflite.py _refused)
            reason += f" ({type(cause).__name__}: {cause})"
        slot.error = reason
        if slot.servable is not None:
            slot.servable.close()
            slot.servable = None
        entry.quarantined[slot.version] = (_mtime(slot.path), reason)
        self._transition(slot, State.END, f"{slot.model} version {slot.version} failed to load: {reason}",
                         "load_failed", error=reason)

    # -- unloading ---------------------------------------------------------------------
    def _begin_unload(self, slot: VersionSlot, why: str, background: bool = True, timeout: float | None = None) -> None:
        """Stop new requests getting ``slot``; close it once its requests are done, or after
        ``timeout`` (``server.drain_timeout_s``, the bound a shutdown drain has too)."""
        timeout = self.config.server.drain_timeout_s if timeout is None else timeout
        with self._lock:
            if slot.state in (State.UNLOADING, State.END):
                return
        self._transition(slot, State.UNLOADING, f"unloading {slot.model} version {slot.version}: {why}", "unload_start")
        if background:
            threading.Thread(target=self._finish_unload, args=(slot, timeout), daemon=True,
                             name=f"drain-{slot.model}-{slot.version}").start()
        else:
            self._finish_unload(slot, timeout)

    def _finish_unload(self, slot: VersionSlot, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            while slot.refs > 0 and time.monotonic() < deadline:
                self._drained.wait(min(0.1, deadline - time.monotonic()))  # the count drops without the lock
            left = slot.refs
        if slot.batcher is not None:
            slot.batcher.close()
        if slot.servable is not None:
            slot.servable.close()
        slot.servable, slot.batcher = None, None
        release_freed_memory()  # else glibc keeps the old version's buffers: RSS grows per swap
        note = f" ({left} requests still in flight at the drain timeout)" if left else ""
        self._transition(slot, State.END, f"{slot.model} version {slot.version} unloaded{note}", "unloaded")

    # -- request side ------------------------------------------------------------------
    def handle(self, name: str, version: int | None = None, label: str | None = None,
               route_key: Callable[[str], str | None] | None = None, judged: bool = True) -> Handle:
        """A handle on the requested version (latest AVAILABLE when none is named), whose
        ``run`` batches and, for an unversioned request of a model in rollout, routes and
        tallies it (appliance/core/handle.py). ``route_key(header)``: the request's header
        or metadata value, for sticky canary routing; ``judged=False``: a request of the
        rollout machinery itself.

        The request path takes no lock while nothing changed since the same request was
        last answered: dozens of HTTP workers taking one lock twice per request queued on
        it under the GIL (a convoy: most of their time under overload). A request counts
        itself in first and checks the state after, so an unload that starts meanwhile
        (state first, then waiting for the count to reach zero) always waits for it."""
        route = self.rollouts.route(name, route_key) if judged and version is None and label is None \
            and self.rollouts is not None else None
        if route is not None:
            return self._routed(route)
        slot = self._picks.get((name, version, label))
        if slot is not None:
            slot.inflight.append(None)
            if slot.state == State.AVAILABLE:
                return Handle(self, slot)
            self.release_slot(slot)
        return self._handle_locked(name, version, label)

    def _routed(self, route: Any) -> Handle:
        """The handle of a request the rollout routed: on the version of its role, or on
        whatever serves unversioned requests once the rollout has just been decided."""
        rollout = route.rollout
        wanted = rollout.candidate if route.role == "candidate" else rollout.serving
        try:  # the inner handle's hold on the slot becomes the routed handle's (released once)
            return Handle(self, self.handle(rollout.model, wanted, judged=False).slot, route)
        except ApplianceError:  # swapped away under us: the model's current version, not judged
            return self.handle(rollout.model, judged=False)

    def _handle_locked(self, name: str, version: int | None, label: str | None) -> Handle:
        with self._lock:
            entry = self._models.get(name)
            if entry is None:
                raise NotFound(f"Servable not found for request: {_request_text(name, version, label)}")
            if label is not None:
                if label not in entry.config.labels:
                    raise InvalidArgument(f"Unrecognized servable version label: {label}")
                version = entry.config.labels[label]
            if version is None:
                ready = [s for s in entry.versions.values() if s.state == State.AVAILABLE]
                if not ready:
                    loading = any(s.state in (State.START, State.LOADING) for s in entry.versions.values())
                    if entry.quarantined and not loading:  # nothing will become ready by waiting
                        raise NotFound(f"Servable not found for request: {_request_text(name, version, label)}; "
                                       f"no version of {name} could be loaded ({self._why_not_ready(entry)})")
                    raise Unavailable(f"model {name} has no available version yet "
                                      f"({self._why_not_ready(entry)})")
                pinned = entry.versions.get(entry.serving) if entry.serving is not None else None
                slot = pinned if pinned is not None and pinned in ready else max(ready, key=lambda s: s.version)
            else:
                slot = entry.versions.get(version)
                if slot is None or slot.state != State.AVAILABLE:
                    if slot is not None and slot.state in (State.START, State.LOADING):
                        raise Unavailable(f"{name} version {version} is still loading")
                    raise NotFound(f"Servable not found for request: {_request_text(name, version, label)}")
            slot.inflight.append(None)
            self._picks[(name, version, label)] = slot
        return Handle(self, slot)

    def release_slot(self, slot: VersionSlot) -> None:
        """(a handle) The request holding ``slot`` is done with it."""
        slot.inflight.pop()
        if not slot.inflight and slot.state == State.UNLOADING:
            with self._lock:
                self._drained.notify_all()

    @staticmethod
    def _why_not_ready(entry: ModelEntry) -> str:
        if entry.quarantined:
            return "; ".join(f"version {v}: {why}" for v, (_, why) in sorted(entry.quarantined.items()))
        if any(s.state == State.LOADING for s in entry.versions.values()):
            return "loading"
        return f"no version directory under {entry.config.base_path}"

    # -- read side ---------------------------------------------------------------------
    def models(self) -> list[str]:
        with self._lock:
            return sorted(self._models)

    def entry(self, name: str) -> ModelEntry:
        with self._lock:
            entry = self._models.get(name)
        if entry is None:
            raise NotFound(f"Servable not found for request: Latest({name})")
        return entry

    def version_states(self, name: str, version: int | None = None, label: str | None = None) -> list[VersionSlot]:
        """Versions for the status endpoint: all known ones, newest first, or the one asked for."""
        with self._lock:
            entry = self._models.get(name)
        if entry is None:  # TF Serving's status text (model_servers/get_model_status_impl.cc)
            raise NotFound(f"Could not find any versions of model {name}")
        with self._lock:
            if label is not None:
                if label not in entry.config.labels:
                    raise InvalidArgument(f"Unrecognized servable version label: {label}")
                version = entry.config.labels[label]
            slots = sorted(entry.versions.values(), key=lambda s: -s.version)
        if version is not None:
            slots = [s for s in slots if s.version == version]
            if not slots:
                raise NotFound(f"Could not find version {version} of model {name}")
        return slots

    def ready(self) -> bool:
        """Every configured model has an AVAILABLE version."""
        with self._lock:
            return bool(self._models) and all(
                any(s.state == State.AVAILABLE for s in e.versions.values()) for e in self._models.values())

    def stalled(self, after_s: float) -> bool:
        with self._lock:
            batchers = [s.batcher for e in self._models.values() for s in e.versions.values() if s.batcher]
        return any(b.stalled(after_s) for b in batchers)

    def freeze_batchers(self, frozen: bool) -> None:
        with self._lock:
            batchers = [s.batcher for e in self._models.values() for s in e.versions.values() if s.batcher]
        for b in batchers:
            b.freeze(frozen)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            entries = list(self._models.items())
        out = {}
        for name, entry in entries:
            with self._lock:
                slots = sorted(entry.versions.values(), key=lambda s: -s.version)
            available = [s.version for s in slots if s.state == State.AVAILABLE]
            serving = entry.serving if entry.serving in available else max(available, default=None)
            out[name] = {
                "base_path": entry.config.base_path,
                "version_policy": entry.config.version_policy,
                "labels": dict(entry.config.labels),
                "serving_version": serving,
                "quarantined": {str(v): why for v, (_, why) in entry.quarantined.items()},
                "versions": [s.describe() for s in slots],
            }
            if entry.config.rollout.mode != "off":
                out[name]["candidate_version"] = entry.candidate
        return out


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def _request_text(name: str, version: int | None, label: str | None) -> str:
    if version is not None:
        return f"Specific({name}, {version})"
    if label is not None:
        return f"Label({name}, {label})"
    return f"Latest({name})"


def _without_rollout(cfg: ModelConfig) -> ModelConfig:
    """A model's settings apart from its rollout (which a channel may replace)."""
    return dataclasses.replace(cfg, rollout=RolloutConfig())
