"""The model manager: the mechanism that loads, serves, swaps and unloads model versions.

TF Serving's seams: sources say which versions exist (``set_aspired``: directories on disk,
filled by hand or by ``sync``, appliance/core/sources.py); ``policy`` says which to aspire to;
a ``Loader`` makes one version ready (appliance/core/loader.py: a trial in a child process,
whole and compatible, then the chosen backend in this process); this module carries it out.
All version transitions happen in ``_transition`` and each is an event in the state database.
Rollout state (a channel's candidate and policy, the serving pin) lives beside the rollout
judge (appliance/core/rollout_state.py).

GUARANTEES: a version that fails to load, or is not whole, or serves less than the version it
would replace, is quarantined with its reason and error code, and whatever served keeps
serving; the last AVAILABLE version is never unloaded for one that is not AVAILABLE yet
(policy.py); a version whose load ended the process twice is quarantined at the next start
(appliance/core/ledger.py).

Requests hold a version through a handle (``with manager.handle("det") as slot:``). A swap
replaces what new handles get; the old version moves to UNLOADING and is closed when its
last handle is released (drain), in a background thread. Loads run one at a time in the
poll thread, so two big versions are never being loaded at once on a small device.

Thread-safety: every public method may be called from any thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

import runtimes

from appliance.core import device as device_mod
from appliance.core.config import Config, ModelConfig, RolloutConfig
from appliance.core.errors import ApplianceError, InvalidArgument, NotFound, Unavailable
from appliance.core.json_types import JSONObject, ReadJSONObject
from appliance.core.handle import Handle
from appliance.core.ledger import Ledger, mtime
from appliance.core.loader import LoadEnv, LoadError, Loaded, Loader
from appliance.core.loader_api import Api
from appliance.core.memory import release_freed_memory
from appliance.core.policy import State, aspired_versions, plan
from appliance.core.rollout_state import ChannelRollouts, rollout_aspired, servable_versions
from appliance.core.slots import ModelEntry, Quarantine, VersionSlot
from appliance.core.sources import Aspired
from appliance.core.state import StateDB

if TYPE_CHECKING:
    from appliance.core.metrics import Metrics
    from appliance.core.rollout import Route, Rollouts

log = logging.getLogger("appliance.manager")


class Manager:
    def __init__(self, config: Config, db: StateDB, device: ReadJSONObject,
                 backends: Mapping[str, runtimes.Backend] | None = None, metrics: "Metrics | None" = None,
                 version_check: Callable[[str], None] | None = None):
        """``version_check(path)``: raises when a version directory must not load (links,
        bytes changed since the bucket's manifest was verified: sync/store.py check_version);
        run right before each load."""
        self.config = config
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
        self.ledger = Ledger(db.kv())
        self.channels = ChannelRollouts(db.event)
        self.loads = LoadEnv(config, self.device, self.backends, self.ledger, device_mod.fingerprint(self.device),
                             metrics, version_check, cancel=self._stop)
        self.last_poll = 0.0
        self.rollouts: Rollouts | None = None  # set by the core before start()

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
        self.config = self.loads.config = config
        self.poll_now()

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll_loop, name="model-manager", daemon=True)
            self._thread.start()

    def close(self, drain_timeout: float = 20.0) -> None:
        """Stop polling (a trial in progress is stopped), drain in-flight requests (bounded),
        unload everything. Idempotent."""
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
        self.channels.apply(entries, self._lock)
        for name, entry in entries:
            if self._stop.is_set():
                return
            self._reconcile_model(name, entry)

    def set_channel_rollout(self, name: str, record: JSONObject | None) -> None:
        """(sync) The channel of ``name`` names a candidate and/or a rollout policy
        (``{"candidate": N | None, "policy": {...} | None}``; None: neither). Applied at once."""
        self.channels.set(name, record)
        self.poll_now()

    def rollout_policy(self, name: str) -> RolloutConfig | None:
        """The rollout policy in force for ``name`` (lock-free: the request path reads it)."""
        entry = self._models.get(name)
        return entry.config.rollout if entry is not None else None

    def _reconcile_model(self, name: str, entry: ModelEntry) -> None:
        cfg = entry.config
        on_disk = dict(entry.on_disk)
        self._update_quarantine(entry, on_disk)
        aspired = aspired_versions(cfg.version_policy, servable_versions(entry, on_disk), cfg.latest, cfg.versions,
                                   entry.quarantined)
        with self._lock:
            self._changed()  # the serving pin may move
            aspired = rollout_aspired(entry, aspired)
            # an unloaded version whose directory is gone has nothing left to show, but a failed
            # one keeps its reason (retention deletes failed versions first)
            for version in [v for v, s in entry.versions.items()
                            if s.state == State.END and v not in on_disk and v not in entry.quarantined]:
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
        self._record_good(slot)
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
            path = slot.path if slot else entry.on_disk.get(version, "")
            entry.quarantined[version] = Quarantine(mtime(path), reason, "ABORTED")
        if slot is not None:
            self._begin_unload(slot, f"quarantined: {reason}")
        self.poll_now()

    def _update_quarantine(self, entry: ModelEntry, on_disk: Mapping[int, str]) -> None:
        """A quarantined version is retried only if its directory was replaced (one deleted keeps
        its reason until a new directory of that number appears); one the ledger quarantined in
        an earlier run (refused, or its load ended the process) stays quarantined while its
        directory and the settings that judged it are the same."""
        for version, q in list(entry.quarantined.items()):
            path = on_disk.get(version)  # gone (deleted, set aside): the reason stays until it is back
            if path is not None and mtime(path) != q.mtime:
                entry.quarantined.pop(version, None)
        for version, path in on_disk.items():
            if version not in entry.quarantined and version not in entry.versions:
                lasting = self.ledger.quarantined(entry.config.name, version, path, self._judged_by(entry))
                if lasting is not None:
                    entry.quarantined[version] = Quarantine(mtime(path), *lasting)
                    self._show_refused(entry, version, path, *lasting)

    def _show_refused(self, entry: ModelEntry, version: int, path: str, reason: str, code: str) -> None:
        """A version refused in an earlier run, shown as it was then (END with its reason), untried."""
        slot = VersionSlot(entry.config.name, version, path, State.END, reason, code)
        with self._lock:
            entry.versions.setdefault(version, slot)
            self._changed()

    def _judged_by(self, entry: ModelEntry) -> str:
        """A digest of the settings a load is judged under: ``[runtime]`` and the model's own."""
        settings = [dataclasses.asdict(self.config.runtime), dataclasses.asdict(entry.config)]
        return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def _changed(self) -> None:
        """Under the lock: ``handle``'s choices are void; tell the listeners."""
        self._picks = {}
        for listener in self.listeners:
            listener()

    def _transition(self, slot: VersionSlot, state: State, message: str, kind: str, **detail: object) -> None:
        with self._lock:
            slot.state = state
            self._changed()
        self.db.event(kind, message, model=slot.model, version=slot.version, state=state.value, **detail)
        if state == State.AVAILABLE and self.rollouts is not None:
            self.rollouts.candidate_ready(slot.model)  # a candidate beside the serving version starts its rollout

    # -- loading -----------------------------------------------------------------------
    def _load(self, name: str, entry: ModelEntry, version: int, path: str) -> None:
        slot = VersionSlot(name, version, path)
        with self._lock:
            entry.versions[version] = slot
        self._transition(slot, State.LOADING, f"loading {name} version {version} from {path}", "load_start")
        try:
            loaded = Loader(self.loads, entry.config, version, path).load(self._reference(entry, version))
        except LoadError as exc:  # refused: quarantined with its reason; others keep serving
            self._fail(entry, slot, str(exc), exc.code, exc.decision)
            return
        except Exception as exc:  # a library's surprise: this version fails, the others serve
            log.exception("loading %s version %s failed unexpectedly", name, version)
            self._fail(entry, slot, f"{type(exc).__name__}: {exc}", "INTERNAL", None)
            return
        self._available(entry, slot, loaded)

    def _reference(self, entry: ModelEntry, version: int) -> tuple[int, Api] | None:
        """What a new ``version`` must stay compatible with: the version answering unversioned
        requests now, else the last one that served here (a restart); None for a version that
        is not newer than it (a rollback, or an older one a policy also wants)."""
        with self._lock:
            live = {s.version: s for s in entry.versions.values()
                    if s.state == State.AVAILABLE and s.api is not None and s.version != version}
            current = live.get(entry.serving) if entry.serving is not None else None
            current = current or (live[max(live)] if live else None)
        reference: tuple[int, Api] | None = None
        if current is not None and current.api is not None:
            reference = (current.version, current.api)
        elif good := self.ledger.good(entry.config.name):
            reference = (max(good), good[max(good)]["api"])
        return reference if reference is not None and version > reference[0] else None

    def _available(self, entry: ModelEntry, slot: VersionSlot, loaded: Loaded) -> None:
        slot.servable, slot.batcher, slot.decision, slot.api = loaded.servable, loaded.batcher, loaded.decision, \
            loaded.api
        slot.load_ms, slot.warmup_ms, slot.trial_ms = loaded.load_ms, loaded.warmup_ms, loaded.trial_ms
        slot.degraded, slot.api_change = loaded.degraded, loaded.api_change
        for signature, why in loaded.warnings.items():
            self._warmup_warning(slot, signature, why)
        if self.metrics is not None:
            self.metrics.observe_warmup(slot.path, slot.warmup_ms / 1000)
        slot.available_since = time.time()
        if entry.candidate != slot.version:  # a rollout candidate is good once promoted
            self._record_good(slot)
        backend = loaded.servable.backend
        self._transition(slot, State.AVAILABLE, _available_text(slot, backend), "loaded", backend=backend,
                         load_ms=round(slot.load_ms, 1), trial_ms=round(slot.trial_ms, 1),
                         **_available_detail(slot))

    def _record_good(self, slot: VersionSlot) -> None:
        if slot.api is not None:
            self.ledger.record_good(slot.model, slot.version, slot.api, str((slot.decision or {}).get("chosen")))

    def _warmup_warning(self, slot: VersionSlot, signature: str, why: str) -> None:
        slot.warnings[signature] = why
        self.db.event("warmup_warning", f"{slot.model} version {slot.version}: the synthetic warm-up call of "
                      f"signature {signature!r} failed ({why}); the version serves all the same, as TF Serving "
                      "would, and a request to that signature gets the model's own answer", model=slot.model,
                      version=slot.version, signature=signature, error=why)

    def _fail(self, entry: ModelEntry, slot: VersionSlot, reason: str, code: str,
              decision: JSONObject | None) -> None:
        slot.error, slot.error_code = reason, code
        slot.decision = decision or slot.decision
        entry.quarantined[slot.version] = Quarantine(mtime(slot.path), reason, code)
        if code != "CANCELLED":  # remembered across a restart (a stop's cancel says nothing of the version)
            self.ledger.quarantine(slot.model, slot.version, slot.path, reason, code, self._judged_by(entry))
        self._transition(slot, State.END, f"{slot.model} version {slot.version} failed to load ({code}): {reason}",
                         "load_failed", error=reason, error_code=code)

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
        self._tensorflow_idle(slot)

    def _tensorflow_idle(self, unloaded: VersionSlot) -> None:
        """Say so when the last version on TensorFlow went: TensorFlow cannot be unloaded from
        a process, so its ~600 MB stay mapped until the service restarts (bench/RESULTS.md)."""
        if not str((unloaded.decision or {}).get("chosen") or "").startswith("tf-"):
            return
        with self._lock:
            busy = any(str((s.decision or {}).get("chosen") or "").startswith("tf-") and s.servable is not None
                       for e in self._models.values() for s in e.versions.values())
        if not busy and not self._stop.is_set():
            self.db.event("tensorflow_idle", "no version runs on TensorFlow any more; TensorFlow stays mapped in "
                          "the serving process (about 600 MB) until the service restarts", model=unloaded.model)

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

    def _routed(self, route: Route) -> Handle:
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
                slot: VersionSlot | None = pinned if pinned is not None and pinned in ready else max(ready, key=lambda s: s.version)
            else:
                slot = entry.versions.get(version)
                if slot is None or slot.state != State.AVAILABLE:
                    if slot is not None and slot.state in (State.START, State.LOADING):
                        raise Unavailable(f"{name} version {version} is still loading")
                    raise NotFound(f"Servable not found for request: {_request_text(name, version, label)}")
            assert slot is not None  # (both branches made sure: mypy does not join them)
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
            return "; ".join(f"version {v}: {q.reason}" for v, q in sorted(entry.quarantined.items()))
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
        """Per model: what serves, each version's state and record, and every quarantined
        version with its reason and error code (what /api/status, the page and the device
        report read); ``degraded``: the partial versions serving, with what they lack."""
        with self._lock:
            entries = list(self._models.items())
        out = {}
        for name, entry in entries:
            with self._lock:
                slots = sorted(entry.versions.values(), key=lambda s: -s.version)
                quarantined = dict(entry.quarantined)
            available = [s.version for s in slots if s.state == State.AVAILABLE]
            serving = entry.serving if entry.serving in available else max(available, default=None)
            out[name] = {
                "base_path": entry.config.base_path,
                "version_policy": entry.config.version_policy,
                "labels": dict(entry.config.labels),
                "serving_version": serving,
                "quarantined": {str(v): q.reason for v, q in quarantined.items()},
                "quarantine": {str(v): {"reason": q.reason, "error_code": q.code} for v, q in quarantined.items()},
                "degraded": {str(s.version): s.degraded for s in slots if s.degraded and s.state == State.AVAILABLE},
                "versions": [s.describe() for s in slots],
            }
            if entry.config.rollout.mode != "off":
                out[name]["candidate_version"] = entry.candidate
        return out


def _available_text(slot: VersionSlot, backend: str) -> str:
    generation = (slot.decision or {}).get("generation")  # what a generative version is (runtimes/select.py)
    said = (f"; generates ({generation.get('convention')}, decode batch {generation.get('decode_batch')}, "
            f"context {generation.get('context_length')}, vocabulary {generation.get('vocab_size')})"
            if isinstance(generation, dict) else "")
    notes = (f"; DEGRADED: {slot.degraded}" if slot.degraded else "") + (
        f"; API change let through: {slot.api_change}" if slot.api_change else "")
    return (f"{slot.model} version {slot.version} available on {backend} (trial {slot.trial_ms:.0f} ms, "
            f"load {slot.load_ms:.0f} ms, warm-up {slot.warmup_ms:.0f} ms){said}{notes}")


def _available_detail(slot: VersionSlot) -> dict[str, Any]:
    generation = (slot.decision or {}).get("generation")
    return {**({"generation": generation} if generation else {}),
            **({"degraded": slot.degraded} if slot.degraded else {}),
            **({"api_change": slot.api_change} if slot.api_change else {})}


def _request_text(name: str, version: int | None, label: str | None) -> str:
    if version is not None:
        return f"Specific({name}, {version})"
    if label is not None:
        return f"Label({name}, {label})"
    return f"Latest({name})"


def _without_rollout(cfg: ModelConfig) -> ModelConfig:
    """A model's settings apart from its rollout (which a channel may replace)."""
    return dataclasses.replace(cfg, rollout=RolloutConfig())


__all__ = ["Manager", "ModelEntry", "VersionSlot"]
