"""The service core: config, device profile, state database, model manager, metrics.

Constructors do no I/O and start no threads; ``start()`` opens the state database,
profiles the device and starts the model manager; ``close()`` drains and stops. Both are
idempotent. Parts (sync loop, discovery, notify, gRPC) contribute to ``/api/status``
through ``add_status(name, provider)`` and report trouble with ``report_problem``.

``/api/status`` ``problems`` is every state an operator must act on, each with its kind,
model and version, a sentence and since when (appliance/core/problems.py); the device
report carries the same list (``problem_list``). ``footprint`` is the memory (RSS, PSS) and
CPU of the whole service tree (appliance/core/footprint.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Callable, Collection

import runtimes

from appliance.version import __version__
from appliance.core import device as device_mod
from appliance.core.config import Config, ModelConfig
from appliance.core.footprint import TreeSampler
from appliance.core.local import LocalHandles, LocalStates
from appliance.core.manager import Manager
from appliance.core.metrics import Metrics
from appliance.core.json_read import objs
from appliance.core.json_types import JSONObject, JSONValue, ReadJSONObject, ReadJSONValue
from appliance.core.problems import Inputs, ProblemLog, find_problems
from appliance.core.rollout import Rollouts
from appliance.core.shared_memory import SharedMemory
from appliance.core.model_control import ModelControl
from appliance.core.sources import DirectorySource, scan_interval
from appliance.core.state import StateDB

# /api/status and the page never show a secret: a string under a key naming one is "***"
# (a *_file key is a path and stays visible, its content never is), and any URL in any
# string loses its password and the values of signing/credential query parameters.
PUBLIC_STATUS_KEYS = ("token", "password", "passwd", "secret", "credential", "credentials", "private_key",
                      "api_key", "access_key", "secret_key", "authorization")  # key name endings
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^/@\s:]*):[^/@\s]*@")
_SECRET_QUERY = re.compile(r"(?i)([?&](?:x-amz-signature|x-amz-credential|x-amz-security-token|signature|sig|"
                           r"token|access_token|password|secret|key|api_key)=)[^&#\s\"']*")
# Heavy libraries a technician (and the small-device tests) want to know are loaded or not.
HEAVY_MODULES = ("tensorflow", "ai_edge_litert", "tflite_runtime", "boto3", "zeroconf", "cryptography")


class Appliance:
    """The service core: config, device profile, state db, model manager, metrics. The
    ``ServingCore`` of the serving process (appliance/core/seams.py).

    Thread-safety: ``add_status``/``report_problem`` and ``status`` may be called from any
    thread; ``start``/``close`` from the service's main thread."""

    def __init__(self, config: Config, backends: dict[str, runtimes.Backend] | None = None,
                 version_check: Callable[[str], None] | None = None):
        """``version_check``: the model sources' load-time artifact check (the service passes
        sync/store.py's ``check_version``; see ``Manager``)."""
        self.config = config
        self.version_check = version_check
        self.config_applier: Callable[[Config, str], None] | None = None  # the service's apply_config
        self.backends = backends
        self.metrics = Metrics()
        self.db = StateDB(os.path.join(config.state_dir, "state.db"))
        self.device: JSONObject = {}  # device.profile(): what this box has
        self.device_id = ""
        self.manager: Manager | None = None
        self.control: ModelControl | None = None  # between the sources and the manager (core/model_control.py)
        self.handles = LocalHandles(lambda: self.manager)  # the API families' seams (core/seams.py)
        self.states = LocalStates(lambda: self.manager)
        self.rollouts: Rollouts | None = None
        self._config_source: DirectorySource | None = None  # [[models]] and models_dir
        self._sources: list[DirectorySource] = []  # the parts' (the synced store)
        self.started_at = time.time()
        self._lock = threading.Lock()
        # /api/status sections of the parts (sync, discovery, grpc, http, rollouts, ...):
        # name -> a function returning the section, called at each status request.
        self._status: dict[str, Callable[[], ReadJSONValue]] = {}
        self._problems: dict[str, str] = {}  # part -> why it is down (readiness, page, notify)
        self._critical: set[str] = set()  # the parts among them without which the device is not ready
        self.problem_log = ProblemLog()  # since when each problem stands
        self.footprint = TreeSampler()
        self.db.subscribe(self.metrics.on_event)  # edge_appliance_events_total{kind}
        self.db.subscribe(self.problem_log.on_event)
        # Triton's system shared-memory regions (the KServe v2 API registers and reads them)
        self.shared_memory = SharedMemory(lambda: self.config.shared_memory)
        self.add_status("shared_memory", self.shared_memory.summary)

    def start(self) -> "Appliance":
        with self._lock:
            if self.manager is not None:
                return self
            self.db.open()
            self.device = device_mod.profile(vars(self.config.runtime.tflite))
            self.device_id = device_mod.device_id(self.config.state_dir)
            self.manager = Manager(self.config, self.db, self.device, self.backends, metrics=self.metrics,
                                   version_check=self.version_check)
            self.rollouts = self.manager.rollouts = Rollouts(self.manager, self.db, self.metrics.registry)
            kserve = self.config.kserve  # the mode is the start-up config's (as Triton's flag)
            self.control = ModelControl(self.manager, kserve.model_control, kserve.startup_models)
            self.add_status("rollouts", self.rollouts.status)
            self.metrics.bind(lambda: self.manager.snapshot() if self.manager else {}, self.config.state_dir)
            self.db.event("service_start", f"edge-appliance {__version__} starting on {self.device['hostname']}",
                          device_id=self.device_id)
            self.manager.start()
            self._config_source = self._directory_source(self.config).start(scan_interval(self.config.poll_interval_s))
        return self

    def _directory_source(self, config: Config) -> DirectorySource:
        """The configuration's own models: ``[[models]]`` (TF Serving's ``models.config``) and
        the models found under ``models_dir``."""
        configured = {m.name: m for m in config.models}
        assert self.manager is not None and self.control is not None
        models_dir = config.models_dir
        if config.sync.bucket and _same_dir(models_dir, os.path.join(config.state_dir, "models")):
            models_dir = ""  # the bucket's store <state>/models is the sync part's source (add_source)
        return DirectorySource("config", self.control, [m for m in config.models if m.base_path],
                               models_dir, config.model_name, settings=configured.get)

    def add_source(self, name: str, models_dir: str,
                   withheld: Callable[[str], Collection[int]] = lambda model: ()) -> DirectorySource:
        """Another folder of model versions (the bucket follower's store): its models get the
        configuration's ``[[models]]`` settings by name; the caller rescans it (``scan()``).
        ``withheld(model)``: versions in the folder not to push (the store's withdrawn ones)."""
        assert self.manager is not None and self.control is not None
        configured = {m.name: m for m in self.config.models}
        source = DirectorySource(name, self.control, [], models_dir, self.config.model_name,
                                 settings=lambda model: _based(configured.get(model), models_dir), withheld=withheld)
        self._sources.append(source)
        source.scan()
        return source

    def close(self) -> None:
        with self._lock:
            manager, self.manager = self.manager, None
        for source in [self._config_source, *self._sources]:
            if source is not None:
                source.close()
        if self.rollouts is not None:
            self.rollouts.close()
        if manager is not None:
            manager.close(self.config.server.drain_timeout_s)
            self.db.event("service_stop", "edge-appliance stopped")
        self.shared_memory.unregister()  # their descriptors
        self.db.close()

    def request_config(self, config: Config, why: str) -> None:
        """Ask for ``config`` to take effect (gRPC's HandleReloadConfigRequest): through the
        service's one reload path when a service runs this core, else applied here."""
        applier = self.config_applier or self.apply_config
        applier(config, why)

    def apply_config(self, config: Config, why: str) -> None:
        """Adopt ``config``: the manager loads, unloads and re-tunes models to match."""
        self.config = config
        if self.manager is not None:
            self.manager.reload(config)
            old, self._config_source = self._config_source, self._directory_source(config)
            if old is not None:
                old.close()
            self._config_source.start(scan_interval(config.poll_interval_s))
            for source in self._sources:
                source.scan()
        self.db.event("reloaded", why)

    def add_status(self, name: str, provider: Callable[[], ReadJSONValue]) -> None:
        """Show ``provider()`` as ``/api/status[name]`` (called per status request, any thread)."""
        self._status[name] = provider

    def report_problem(self, part: str, reason: str | None, critical: bool = True) -> None:
        """Mark ``part`` as down with ``reason`` (``None``: it works again). Every part that is
        down shows on the page and in the systemd status; a ``critical`` one (an API that is
        not listening) also makes the device not ready."""
        if reason:
            self._problems[part] = reason
            if critical:
                self._critical.add(part)
        else:
            self._problems.pop(part, None)
            self._critical.discard(part)

    def ready(self) -> bool:
        """Every configured model has an AVAILABLE version and no critical part is down."""
        return self.manager is not None and self.manager.ready() and not self._critical

    def status_of(self, name: str) -> ReadJSONValue:
        """One part's status section, or None."""
        provider = self._status.get(name)
        return provider() if provider else None

    def problems(self) -> list[str]:
        """The parts that are down and the state database's complaints, one line each (what
        /readyz and systemd's status line say); ``problem_list`` has every problem."""
        return [*self.db.problems, *(f"{part}: {why}" for part, why in self._problems.items())]

    def problem_list(self, models: ReadJSONObject | None = None,
                     sections: Mapping[str, ReadJSONValue] | None = None) -> list[JSONObject]:
        """Every state an operator must act on (appliance/core/problems.py), with since when;
        for ``/api/status``, the page and the device report. Any thread. ``models`` and
        ``sections`` (the parts' status): what the caller already has."""
        if models is None:
            models = self.manager.snapshot() if self.manager is not None else {}
        section = (lambda name: sections.get(name)) if sections is not None else self.status_of
        workers = section("workers")
        inputs = Inputs(models=models, sync=_object(section("sync")),
                        workers=objs(workers) if isinstance(workers, (list, tuple)) else None,
                        parts_down=self.parts_down(), critical=set(self._critical), database=list(self.db.problems),
                        grpc=_object(section("grpc")))
        return [p.to_dict() for p in self.problem_log.update(find_problems(inputs))]

    def parts_down(self) -> dict[str, str]:
        return dict(self._problems)

    def status(self) -> JSONObject:
        """The snapshot behind /api/status and the status page (no secrets)."""
        assert self.manager is not None
        models = self.manager.snapshot()
        parts = {name: provider() for name, provider in list(self._status.items())}
        problems = self.problem_list(models, parts)
        for name, model in models.items():
            model["requests"] = self.metrics.window.summary(name)
        snapshot = redact_object({
            "service": {"name": "edge-appliance", "version": __version__, "device_id": self.device_id,
                        "uptime_s": round(time.time() - self.started_at, 1), "started": self.started_at,
                        "ready": self.ready(), "last_poll": self.manager.last_poll,
                        "imported": [m for m in HEAVY_MODULES if m in sys.modules], "clock": device_mod.clock()},
            "problems": problems,
            "device": {**self.device, **device_mod.live_figures(self.config.state_dir)},
            "footprint": self.footprint.sample(_worker_roles(parts.get("workers"))),
            "config": _public_config(self.config),
            "models": models,
            "events": self.db.recent(50),
            **parts,
            "parts_down": self.parts_down(),
        })
        return snapshot


def _object(section: ReadJSONValue) -> ReadJSONObject | None:
    """A part's status section as ``find_problems`` reads it: an object, else none."""
    return section if isinstance(section, Mapping) else None


def _worker_roles(workers: ReadJSONValue) -> dict[int, str]:
    """pid -> "front worker N", from the workers' status section."""
    return {pid: f"front worker {w.get('index')}" for w in objs(workers)
            if isinstance(pid := w.get("pid"), int) and pid}


def _public_config(config: Config) -> JSONObject:
    return redact_object(dataclasses.asdict(config))  # the config's fields: strings, numbers, lists, tables


def _secret_key(key: str) -> bool:
    return key.lower().endswith(PUBLIC_STATUS_KEYS)  # admin_token, not max_new_tokens or tls_key_file


def redact_object(doc: ReadJSONObject) -> JSONObject:
    """``redact`` of a JSON object."""
    return {k: ("***" if isinstance(k, str) and _secret_key(k) and isinstance(v, str) and v else redact(v))
            for k, v in doc.items()}


def redact(value: ReadJSONValue) -> JSONValue:
    """``value`` (status, config) with secrets masked: see PUBLIC_STATUS_KEYS."""
    if isinstance(value, Mapping):
        return redact_object(value)
    if isinstance(value, str):
        if "=" in value or "@" in value:
            return _SECRET_QUERY.sub(r"\1***", _URL_PASSWORD.sub(r"\1:***@", value))
        return value
    if isinstance(value, Sequence):  # a list or a tuple (a string is handled above)
        return [redact(v) for v in value]
    return value


def _based(cfg: ModelConfig | None, models_dir: str) -> ModelConfig | None:
    """A ``[[models]]`` entry's settings for the copy of that model under ``models_dir``."""
    return dataclasses.replace(cfg, base_path=os.path.join(models_dir, cfg.name)) if cfg is not None else None


def _same_dir(a: str, b: str) -> bool:
    return bool(a) and os.path.realpath(a) == os.path.realpath(b)
