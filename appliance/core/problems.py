"""What an operator must act on, found in the service's own status: ``/api/status``
``problems``, the top of the status page, the header colour, the device report.

``find_problems(inputs)`` is pure: it reads a snapshot of the service (the manager's
models, the sync part's section, the front workers, the parts that are down, the state
database's complaints) and returns one :class:`Problem` per state that needs a person:

======================  ========================================================================
kind                    when
======================  ========================================================================
``model_not_serving``   a configured model has no AVAILABLE version
``target_not_reached``  the bucket's target (channel or newest version) is not the serving one
``version_quarantined`` a version failed (load, warm-up, a rollout judge) and is kept out
``version_degraded``    a version serves only part of what it ships (``state`` DEGRADED, or a
                        ``degraded`` reason in its snapshot)
``backend_failed``      a backend failed to load a version that another backend now serves
``workers_down``        fewer front workers up than configured, or one that stopped reporting
``sync_failing``        the bucket cannot be polled
``sync_refused``        the bucket offers something this device refuses
``store``               the synced model store has a problem (a damaged or foreign entry)
``part_down``           a configured part is down (gRPC port, discovery, notify, ...)
``fallback``            a part serves on its slower fallback because what its fast path needs
                        is missing (gRPC on grpcio: no usable libnghttp2 for the lean server)
``state_database``      the state database was damaged or cannot be written
======================  ========================================================================

A state that is still in progress (a target version loading, a model's first load, a
committed version the manager has not picked up yet) is a problem only once it has lasted
``grace_s`` (``LOADING_GRACE_S``, ``UNSEEN_GRACE_S``): ``ProblemLog`` holds it back until then.

``ProblemLog`` adds ``since`` (when each problem began: the time of the state event that
started it when the log saw one, else the first evaluation that found it) and drops
problems that ended. Thread-safe; one per service core.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Union

from appliance.core.json_read import int_or_none, obj, objs, str_or_none
from appliance.core.json_types import JSONObject, JSONScalar, ReadJSONObject, ReadJSONValue

# A problem's identity, and the key of the event that starts one: (kind, model, version, part) or a prefix.
Key = tuple[Union[str, int, None], ...]

ERROR, WARNING = "error", "warning"  # error: something configured does not serve; warning: it does, look anyway
LOADING_GRACE_S = 600.0  # a version loading (TF-TRT conversions take minutes) is not yet a problem
UNSEEN_GRACE_S = 120.0  # a committed target the manager has not picked up yet is not yet a problem
STALE_WORKER_S = 5.0  # a front worker reports every second: this long silent, it is stopped or wedged
LOADING_STATES = ("START", "LOADING", "NEW")
# The order problems are listed in (errors first): what is not served, then why.
KIND_ORDER = ("model_not_serving", "part_down", "target_not_reached", "version_quarantined", "version_degraded",
              "backend_failed", "workers_down", "fallback", "sync_failing", "sync_refused", "store", "state_database")
# Event kinds that start a problem of a model version, a sync failure or a worker's death:
# the event's time becomes the problem's ``since``.
FAILURE_WORDS = ("fail", "quarantin", "refus", "degrad", "abort", "crash", "error")
# Parts as the page names them (the service reports a part by its module or a short name).
PART_NAMES = (("grpc", "gRPC"), ("sync", "Sync"), ("discovery", "Discovery"), ("notify", "systemd notify"),
              ("config_poller", "Config file"), ("tfs_config", "Model config file"), ("workers", "Front workers"),
              ("generat", "Generation"), ("auth", "Security"), ("security", "Security"))


@dataclass(frozen=True)
class Problem:
    """One state an operator must act on. ``message`` is a whole sentence for a person."""

    kind: str
    message: str
    severity: str = WARNING
    model: str | None = None
    version: int | None = None
    part: str | None = None
    error_code: str | None = None
    grace_s: float = 0.0  # still in progress: shown only once it has lasted this long (module docstring)
    since: float | None = None

    @property
    def key(self) -> Key:
        return (self.kind, self.model, self.version, self.part)

    def to_dict(self) -> JSONObject:
        fields: dict[str, JSONScalar] = dataclasses.asdict(self)
        fields.pop("grace_s")
        return {k: v for k, v in fields.items() if v is not None}


@dataclass
class Inputs:
    """What ``find_problems`` reads: sections of ``/api/status`` as the service has them."""

    models: ReadJSONObject = field(default_factory=dict)  # Manager.snapshot()
    sync: ReadJSONObject | None = None  # the sync part's section (None: no bucket)
    workers: list[ReadJSONObject] | None = None  # the front workers' section (None: one process)
    parts_down: Mapping[str, str] = field(default_factory=dict)  # part -> why
    critical: Iterable[str] = ()  # the parts among them without which the device is not ready
    database: Iterable[str] = ()  # the state database's problems
    grpc: ReadJSONObject | None = None  # the gRPC port's section (None: no gRPC port)


def find_problems(inputs: Inputs) -> list[Problem]:
    """Every problem in ``inputs``, errors first (pure)."""
    found: list[Problem] = []
    for name, model in sorted(inputs.models.items()):
        found += model_problems(name, obj(model))
    if inputs.sync is not None:
        found += target_problems(inputs.sync, inputs.models)
        found += sync_problems(inputs.sync)
    found += worker_problems(inputs.workers or [])
    found += part_problems(inputs.parts_down, set(inputs.critical))
    found += fallback_problems(inputs.grpc)
    found += [Problem("state_database", str(text)) for text in inputs.database]
    return sorted(found, key=lambda p: (p.severity != ERROR, KIND_ORDER.index(p.kind)))  # stable within a kind


# -- models ---------------------------------------------------------------------------------
def model_problems(name: str, model: ReadJSONObject) -> list[Problem]:
    """Not serving, quarantined and degraded versions, and backends that failed a version."""
    versions = objs(model.get("versions"))
    found = [*_quarantined(name, model), *_degraded(name, versions), *_backend_failures(name, versions)]
    if model.get("serving_version") is None:
        loading = [v for v in versions if str(v.get("state")) in LOADING_STATES]
        why = (f"version {loading[0]['version']} is still loading" if loading else
               "every version failed" if model.get("quarantined") else
               f"no version found under {model.get('base_path') or 'its base path'}")
        found.insert(0, Problem("model_not_serving", f"{name} is not serving: {why}.", ERROR, name,
                                grace_s=LOADING_GRACE_S if loading else 0.0))
    return found


def _quarantined(name: str, model: ReadJSONObject) -> list[Problem]:
    """Each quarantined version with its reason, but one older than the version serving: a newer
    good version took its place, so nothing is left to act on (the page turned amber for as long
    as the old version's folder stayed on disk)."""
    out = []
    serving = _int(model.get("serving_version"))
    for version, entry in sorted(obj(model.get("quarantined")).items(), key=lambda kv: _int(kv[0]) or 0):
        if serving is not None and (_int(version) or 0) < serving:
            continue
        reason, code = _reason(entry)
        out.append(Problem("version_quarantined", f"{name} version {version} is quarantined and will not be "
                           f"loaded again until its folder changes: {reason}", WARNING, name, _int(version),
                           error_code=code or _version_code(model, version)))
    return out


def _degraded(name: str, versions: list[ReadJSONObject]) -> list[Problem]:
    out = []
    for v in versions:
        flag = v.get("degraded")
        if str(v.get("state", "")).upper() != "DEGRADED" and not flag:
            continue
        reason = flag if isinstance(flag, str) else _reason(flag)[0] if isinstance(flag, Mapping) else (
            v.get("error") or "part of what it ships failed to load")
        out.append(Problem("version_degraded", f"{name} version {v.get('version')} serves only in part: {reason}",
                           WARNING, name, _int(v.get("version")), error_code=str_or_none(v.get("error_code"))))
    return out


def _backend_failures(name: str, versions: list[ReadJSONObject]) -> list[Problem]:
    """A backend that failed on a version that serves anyway (on another backend): the
    artifact it failed on is broken or this device cannot run it, and what serves may lack
    signatures the failed one had."""
    out = []
    for v in versions:
        decision = obj(v.get("decision"))
        if str(v.get("state")) != "AVAILABLE" or v.get("degraded"):  # a degraded one says so itself
            continue
        for c in objs(decision.get("considered")):
            if c.get("load_error"):
                out.append(Problem("backend_failed", f"{name} version {v.get('version')}: {c.get('backend')} failed "
                                   f"to load it ({c['load_error']}); it serves on {decision.get('chosen') or '?'}.",
                                   WARNING, name, _int(v.get("version")), part=str(c.get("backend"))))
    return out


# -- the bucket -----------------------------------------------------------------------------
def target_problems(sync: ReadJSONObject, models: ReadJSONObject) -> list[Problem]:
    """A model whose bucket target (``sync.targets``; a pin replaces it) is not what serves."""
    out = []
    pins = obj(sync.get("pins"))
    for name, target in sorted(obj(sync.get("targets")).items()):
        target = pins.get(name, target)
        model = obj(models.get(name))
        serving = model.get("serving_version")
        if serving == target or model.get("candidate_version") == target:  # reached, or being judged
            continue
        why, grace = _why_not(model, target)
        where = f"channel {sync['channel']!r}" if sync.get("channel") else "the newest version in the bucket"
        on = f"version {serving} serves" if serving is not None else "nothing serves"
        out.append(Problem("target_not_reached", f"{name}: the bucket's target is version {target} ({where}) but "
                           f"{on}: {why}.", WARNING if serving is not None else ERROR, name, _int(target),
                           grace_s=grace))
    return out


def _why_not(model: ReadJSONObject, target: ReadJSONValue) -> tuple[str, float]:
    """Why ``target`` does not serve, and how long that may last by itself (0: it will not)."""
    quarantined = obj(model.get("quarantined"))
    if str(target) in quarantined:  # its reason is said once, in its version_quarantined problem
        return f"version {target} failed and is quarantined (the reason is in its own problem)", 0.0
    slot = next((v for v in objs(model.get("versions")) if v.get("version") == target), None)
    if slot is None:
        return f"version {target} is not loaded (not on disk, refused, or not picked up yet)", UNSEEN_GRACE_S
    state = str(slot.get("state"))
    if state in LOADING_STATES:
        return f"version {target} is still loading", LOADING_GRACE_S
    if slot.get("error"):
        return f"version {target} failed ({slot['error']})", 0.0
    return f"version {target} is {state}", 0.0


def sync_problems(sync: ReadJSONObject) -> list[Problem]:
    out = []
    failures = _int(sync.get("failures") or 0) or 0
    if failures:
        out.append(Problem("sync_failing", f"The bucket {sync.get('bucket', '')} could not be polled "
                           f"({failures} failed polls in a row, backing off): {sync.get('last_error', '')}"))
    elif sync.get("last_error"):
        out.append(Problem("sync_refused", f"The bucket offers what this device refuses (what serves keeps "
                           f"serving): {sync['last_error']}"))
    out += [Problem("store", f"Model store: {text}") for text in _seq(sync.get("problems"))]
    return out


# -- the process ----------------------------------------------------------------------------
def worker_problems(workers: list[ReadJSONObject]) -> list[Problem]:
    """Fewer front workers up than configured (one entry per configured worker), and any
    that stopped reporting while its channel is open (stopped, or wedged)."""
    down = [w for w in workers if not w.get("up")]
    out = []
    if down:
        which = ", ".join(f"{w.get('index')}" + (f" (pid {w['pid']})" if w.get("pid") else "") for w in down)
        out.append(Problem("workers_down", f"{len(workers) - len(down)} of {len(workers)} front workers are up: "
                           f"worker {which} is down or restarting; its share of connections goes to the others.",
                           WARNING, part="workers"))
    for w in workers:
        silent = w.get("heard_s_ago")
        if w.get("up") and isinstance(silent, (int, float)) and silent >= STALE_WORKER_S:
            out.append(Problem("workers_down", f"Front worker {w.get('index')} (pid {w.get('pid')}) has not reported "
                               f"for {silent:.0f} s: stopped or wedged, and the connections the kernel gives it wait.",
                               WARNING, part=f"worker {w.get('index')}"))
    return out


def part_problems(parts: Mapping[str, str], critical: set[str]) -> list[Problem]:
    return [Problem("part_down", f"{part_name(part)} is down: {why}", ERROR if part in critical else WARNING,
                    part=part_name(part)) for part, why in parts.items()]


def fallback_problems(grpc: ReadJSONObject | None) -> list[Problem]:
    """gRPC answers, but on grpcio in the serving process instead of the lean server (in the
    front workers where there are some): slower, and only a log line said so before."""
    why = (grpc or {}).get("lean_unavailable")
    if not why:
        return []
    return [Problem("fallback", f"gRPC runs on its slower fallback (grpcio, in the serving process), not the lean "
                                f"server: {why}", WARNING, part="gRPC")]


def part_name(part: str) -> str:
    """A part as a person calls it ("appliance.service.grpc_port" -> "gRPC")."""
    return next((name for needle, name in PART_NAMES if needle in part), part.rsplit(".", 1)[-1])


# -- helpers --------------------------------------------------------------------------------
def _reason(entry: ReadJSONValue) -> tuple[str, str | None]:
    """(reason, error code) of a quarantine entry: a string, or a mapping that says more."""
    if isinstance(entry, Mapping):
        text = entry.get("reason") or entry.get("error") or entry.get("message") or ""
        return str(text), str_or_none(entry.get("error_code"))
    return str(entry), None


def _version_code(model: ReadJSONObject, version: str) -> str | None:
    slot = next((v for v in objs(model.get("versions")) if str(v.get("version")) == str(version)), None)
    return str_or_none((slot or {}).get("error_code"))


_int = int_or_none


def _seq(value: ReadJSONValue) -> list[ReadJSONValue]:
    return list(value) if isinstance(value, (list, tuple)) else []


# -- since when -----------------------------------------------------------------------------
class ProblemLog:
    """When each standing problem began (module docstring). Thread-safe.

    ``since`` is the time of the state event that started a problem (a load failure, a
    failed poll, a worker's exit: ``on_event``) when there is one, else the first
    ``update`` that found it. A problem that ends is forgotten, and so is the event
    behind it: the next one starts afresh."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: dict[Key, float] = {}
        self._hints: dict[Key, float] = {}  # hint key -> time of the earliest event not yet used up

    def on_event(self, row: Mapping[str, object]) -> None:
        """``StateDB.subscribe`` callback (any thread): remember a failure event's time."""
        kind, ts = str(row.get("kind", "")), row.get("ts")
        if not isinstance(ts, (int, float)) or not any(word in kind for word in FAILURE_WORDS + ("exited",)):
            return
        key = _event_key(kind, str_or_none(row.get("model")) or None, row.get("version"))
        with self._lock:
            self._hints.setdefault(key, float(ts))
            if len(self._hints) > MAX_HINTS:  # bounded: a flood of failures drops the oldest
                self._hints.pop(next(iter(self._hints)))

    def update(self, problems: list[Problem], now: float | None = None) -> list[Problem]:
        """``problems`` with ``since`` set; those still within their ``grace_s`` held back."""
        now = time.time() if now is None else now
        with self._lock:
            self._forget(problems, now)
            out = []
            for problem in problems:
                since = self._since.setdefault(problem.key, self._start_of(problem, now))
                if now - since >= problem.grace_s:
                    out.append(dataclasses.replace(problem, since=since))
            return out

    def _forget(self, problems: list[Problem], now: float) -> None:
        """Drop what ended: the problems not found now, and the events behind them (an
        event a moment old may still be ahead of the state it describes: kept)."""
        current = {p.key for p in problems}
        self._since = {k: t for k, t in self._since.items() if k in current}
        wanted = {_problem_key(p) for p in problems}
        self._hints = {k: t for k, t in self._hints.items() if k in wanted or t > now - EVENT_AHEAD_S}

    def _start_of(self, problem: Problem, now: float) -> float:
        hint = self._hints.get(_problem_key(problem))
        return hint if hint is not None and hint <= now else now


MAX_HINTS = 1000
EVENT_AHEAD_S = 10.0  # an event written just before the state it reports changed (sync_error before failures)


def _problem_key(problem: Problem) -> Key:
    """The event key whose time starts ``problem``."""
    if problem.kind == "sync_failing":
        return ("sync_error",)
    if problem.kind == "workers_down":
        return ("worker_exited",)
    return ("version", problem.model, problem.version)


def _event_key(kind: str, model: str | None, version: object) -> Key:
    if kind in ("sync_error", "worker_exited"):
        return (kind,)
    return ("version", model, _int(version))
