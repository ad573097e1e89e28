"""The device side of fleet sync: decide each model's target version and make the store match.

``Follower.sync_once()`` runs one poll. Per model: read the channel pointer (or the
version index when no channel is configured) with a conditional request; check it
(signature, expiry, replay, rollback); if the target version is not in the store, fetch
and verify it into staging and commit it with one rename; set newer versions aside when
the target is older (a channel move back or a pin: withdrawn from the manager at once, moved
out of ``models/`` only once the manager has unloaded them, so a servable that still answers
never loses its files); record the trust; apply retention.
An idle poll with nothing new is one conditional request per followed model and no writes:
the list of models (``_models.json``, or a folder listing) is read again only every
``models_refresh_s`` and on a forced poll (``appliance sync``).

Errors: ``SourceError`` (bucket down) aborts the poll and propagates (the caller retries);
``Refused`` is per model: an event when it is new (another version or reason), kept with its
original reason in ``refused`` (what the device report carries), and a refused version is
not fetched again until an object it was judged on changes (sync/refusals.py). Every step
calls ``event(kind, message, model=, version=, **detail)``.
Not thread-safe: one thread runs ``sync_once``; other threads may read ``targets``,
``refused`` and ``waves`` (whole values are replaced, never mutated in place).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from . import faults
from .errors import Refused
from .fetcher import fetch
from .json_types import JSONObject, JSONValue
from .manifest import MANIFEST, MAX_VERSION, check_version_number, is_version_name, verify, verify_channel
from .refusals import Refusals, objects_judged
from .source import MISSING, NOT_MODIFIED, Fetched, Source
from .store import Store, set_rollout_policy
from .waves import admission, check_rollout_policy

if TYPE_CHECKING:  # the key types, for annotations: cryptography is imported where keys are used
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
Event = Callable[..., None]


@dataclass
class Options:
    models: list[str] = field(default_factory=list)  # empty: every model the bucket lists
    channel: str = ""  # empty: the newest committed version
    public_key: Ed25519PublicKey | None = None  # None: signatures not required
    device_tags: frozenset[str] = frozenset()
    retain: int = 2
    device_id: str = ""  # decides wave membership (sync/waves.py)
    models_refresh_s: float = 300.0  # how often the list of models is read again (models empty)
    # Called with (model, {"candidate": N | None, "policy": {...} | None} | None) whenever the
    # channel's rollout entry changes: the source pushes it to the model manager.
    on_rollout: Callable[[str, JSONObject | None], None] | None = None


@dataclass
class LocalModel:
    """What the model manager says about a model (empty for a sync-only client)."""

    serving: int | None = None
    quarantined: frozenset[int] = frozenset()
    # Versions the manager holds (loading, serving, draining): their directories must stay where
    # their servables read them. None: not known (no manager), a version is parked at once.
    loaded: frozenset[int] | None = None


@dataclass
class PollResult:
    changed: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    requests: int = 0


class Follower:
    def __init__(self, source: Source, store: Store, options: Options, event: Event,
                 local: Callable[[], Mapping[str, LocalModel]] | None = None):
        self.source, self.store, self.options, self.event = source, store, options, event
        self.local = local or (lambda: {})
        self._cache: dict[str, tuple[str, Any]] = {}  # key -> (etag, parsed doc or Refused)
        self._refusals = Refusals()  # refused versions and the objects they were judged on
        self._pin_noted: dict[str, int] = {}
        self._wave_noted: dict[str, str] = {}
        self._models_listed: tuple[float, list[str]] | None = None  # (when, names)
        self.targets: dict[str, int] = {}
        self.refused: dict[str, JSONObject] = {}  # model -> its standing refusal {version, reason, since}
        self.waves: dict[str, JSONObject] = {}  # model -> this device's place in the channel's waves

    def sync_once(self, force: bool = False) -> PollResult:
        """One poll of every followed model; ``force`` also reads the list of models again."""
        result = PollResult()
        before = self.source.requests
        local = self.local()
        try:
            models = self._models(force)
        except Refused as exc:  # the bucket's list of models itself (_models.json) is malformed
            result.refused.append(str(exc))
            self._note_refusal("", exc)
            return result
        self._clear_refusal("")
        for model in models:
            try:
                self._follow(model, local.get(model, LocalModel()), result)
            except Refused as exc:
                result.refused.append(f"{model}: {exc}")
                self._note_refusal(model, exc)
            else:
                self._clear_refusal(model)
        result.requests = self.source.requests - before
        return result

    def _note_refusal(self, model: str, exc: Refused) -> None:
        """Keep the model's refusal with its original reason; an event only when it is new."""
        standing = self.refused.get(model)
        if standing is not None and standing["reason"] == str(exc) and standing["version"] == exc.version \
                and not exc.fresh:
            return
        self.refused = {**self.refused, model: {"version": exc.version, "reason": str(exc), "since": time.time()}}
        what = f"{model} version {exc.version}" if exc.version is not None else model or "the list of models"
        self.event("sync_refused", f"refused {what}: {exc}", model=model, version=exc.version, reason=str(exc))

    def _clear_refusal(self, model: str) -> None:
        if model in self.refused:
            self.refused = {k: v for k, v in self.refused.items() if k != model}

    # -- which models, which version ---------------------------------------------------
    def _models(self, force: bool = False) -> list[str]:
        if self.options.models:
            return list(self.options.models)
        now = time.monotonic()
        if not force and self._models_listed is not None and now - self._models_listed[0] < self.options.models_refresh_s:
            return self._models_listed[1]
        doc = self._read_cached("_models.json", lambda data: json.loads(data).get("models", []))
        names = doc if doc is not None else self.source.list_dirs("")
        models = [n for n in names if isinstance(n, str) and MODEL_NAME.match(n)]
        self._models_listed = (now, models)
        return models

    def _read_cached(self, key: str, parse: Callable[[bytes], Any]) -> Any:
        """A conditional read; the parsed document (cached on 304), or None when missing.
        A document that failed to parse, or that the source refused to read (over its cap),
        raises the same ``Refused`` until its ETag changes: it is not read again till then."""
        etag, cached = self._cache.get(key, ("", None))
        try:
            fetched: Fetched = self.source.read(key, etag)
        except Refused as exc:
            if exc.etag:
                self._cache[key] = (exc.etag, exc)
            exc.fresh = True
            raise
        if fetched.status == NOT_MODIFIED and key in self._cache:
            if isinstance(cached, Refused):
                raise Refused(str(cached))
            return cached
        if fetched.status == MISSING:
            self._cache.pop(key, None)
            return None
        try:
            doc = parse(fetched.data)
        except Refused as exc:
            self._cache[key] = (fetched.etag, exc)
            exc.fresh = True
            raise
        except (ValueError, AttributeError, TypeError) as exc:
            refusal = Refused(f"{key} is malformed: {exc}")
            self._cache[key] = (fetched.etag, refusal)
            refusal.fresh = True
            raise refusal from exc
        self._cache[key] = (fetched.etag, doc)
        return doc

    def _target(self, model: str) -> tuple[int | None, JSONObject | None]:
        """(target version, the channel pointer when a channel decides), from the bucket."""
        channel = self.options.channel
        if channel:
            pointer = self._read_cached(f"{model}/channels/{channel}.json",
                                        lambda d: verify_channel(d, model, channel, self.options.public_key))
            if pointer is None:
                raise Refused(f"{model} has no channel {channel!r} in the bucket")
            return int(pointer["version"]), pointer
        index = self._read_cached(f"{model}/versions.json", lambda d: check_version_number(
            json.loads(d)["latest"], f"{model}/versions.json latest"))
        if index is not None:
            return int(index), None
        listed = sorted((int(v) for v in self.source.list_dirs(model) if is_version_name(v)), reverse=True)
        for version in listed:  # no index (hand-made bucket): the newest version with a manifest
            if version in self.store.versions(model) or self.source.head(f"{model}/{version}/{MANIFEST}").status != MISSING:
                return version, None
        return None, None

    # -- one model ---------------------------------------------------------------------
    def _follow(self, model: str, local: LocalModel, result: PollResult) -> None:
        pin = self.store.pins().get(model)
        if pin is not None:
            self._apply_pin(model, pin, local, result)
            return
        self._pin_noted.pop(model, None)
        target, pointer = self._target(model)
        if target is None:
            return
        self._check_rollback(model, target, pointer)
        if pointer is not None and not self._admitted(model, target, pointer):
            return
        self.targets = {**self.targets, model: target}
        candidate = self._candidate(model, target, pointer)
        self._rollout_policy(model, pointer, candidate)
        if self._restore(model, target, candidate):
            result.changed.append(f"{model}:{target}")
        if target not in self.store.versions(model):
            if target in self.store.parked(model):
                self.store.unpark(model, target)
                self.event("sync_restored", f"{model} version {target} moved back into the store",
                           model=model, version=target)
            else:
                self._install(model, target, pointer)
            result.changed.append(f"{model}:{target}")
        if candidate is not None and candidate not in self.store.versions(model):
            self._install(model, candidate, pointer)  # judged on the device when its rollout mode is on
            result.changed.append(f"{model}:{candidate} (candidate)")
        if self._park_newer(model, target, local.loaded, keep=candidate):
            result.changed.append(f"{model}:{target} (newer versions set aside)")
        self._record_trust(model, target, pointer)
        self._retain(model, target, local, candidate)

    def _admitted(self, model: str, target: int, pointer: JSONObject) -> bool:
        """Waves and halt (sync/waves.py): a device outside the open waves keeps what it
        has. One with nothing of this model yet, or already on the target, is never held."""
        have = self.store.versions(model)
        if target in have or not have:
            self._set_wave(model, None)
            return True
        verdict = admission(self.options.device_id, pointer, f"{model} channel {self.options.channel}")
        self._set_wave(model, {"version": target, "wave": verdict.wave + 1 if verdict.wave >= 0 else None,
                               "admitted": verdict.admitted, "opens_at": verdict.opens_at or None,
                               "reason": verdict.reason})
        if verdict.admitted:
            self._wave_noted.pop(model, None)
            return True
        if self._wave_noted.get(model) != f"{target}:{verdict.wave}":
            self._wave_noted[model] = f"{target}:{verdict.wave}"
            self.event("sync_wave_wait", f"{model} stays on version {max(have)}: version {target} not yet for this "
                       f"device ({verdict.reason})", model=model, version=target, wave=verdict.wave,
                       opens_at=verdict.opens_at)
        return False

    def _set_wave(self, model: str, state: JSONObject | None) -> None:
        if self.waves.get(model) != state:
            self.waves = {k: v for k, v in {**self.waves, model: state}.items() if v is not None}

    def _rollout_policy(self, model: str, pointer: JSONObject | None, candidate: int | None) -> None:
        """The channel's candidate and rollout policy (the central team's, for the whole
        fleet) go where the manager reads them: the candidate is only ever judged, never
        served as the newest version, and the channel's policy replaces the device's own
        [models.rollout] (which applies when the channel has none)."""
        policy = (pointer or {}).get("rollout")
        if policy is not None:
            policy = check_rollout_policy(policy, f"{model} channel {self.options.channel}")
        doc: JSONObject | None = ({"candidate": candidate, "policy": policy}
                                  if candidate is not None or policy is not None else None)
        if set_rollout_policy(self.store.state_dir, model, doc):  # kept for the next start
            if self.options.on_rollout is not None:
                self.options.on_rollout(model, doc)
            self.event("sync_rollout_policy", f"{model}: rollout from the channel: candidate {candidate}, "
                       f"policy {policy or 'the device own'}", model=model, candidate=candidate, policy=policy)

    @staticmethod
    def _candidate(model: str, target: int, pointer: JSONObject | None) -> int | None:
        value = (pointer or {}).get("candidate")
        if value is None:
            return None
        if type(value) is not int or not target < value <= MAX_VERSION:
            raise Refused(f"{model} channel pointer: candidate must be a version above {target}, got {value!r}")
        return value

    def _check_rollback(self, model: str, target: int, pointer: JSONObject | None) -> None:
        trust = self.store.trust(model)
        if pointer is not None and _seconds(pointer.get("created")) < float(trust.get("pointer_created", 0)):
            raise _about(Refused(f"{model} channel pointer is older than one already seen (a replayed pointer?)"), target)
        highest = int(trust.get("version", -1))
        if target < highest and pointer is None:
            raise _about(Refused(f"{model}: the newest listed version {target} is below the highest trusted version "
                                 f"{highest}; going back needs a channel move or `appliance rollback`"), target)

    def _record_trust(self, model: str, target: int, pointer: JSONObject | None) -> None:
        """The highest version trusted, the newest pointer seen, and the target with the one
        before it (retention keeps that one: the channel can send the device back to it)."""
        trust = self.store.trust(model)
        last = trust.get("target")
        record = {"version": max(int(trust.get("version", -1)), target),
                  "pointer_created": max(float(trust.get("pointer_created", 0)),
                                         _seconds((pointer or {}).get("created"))),
                  "target": target, "previous_target": trust.get("previous_target") if last in (None, target) else last}
        if record["previous_target"] is None:
            del record["previous_target"]
        if record != trust:
            self.store.set_trust(model, record)

    def _install(self, model: str, version: int, pointer: JSONObject | None = None) -> None:
        """Fetch, verify and commit ``version``; ``Refused`` (with ``version`` set) when it
        fails verification, or while an earlier refusal of it stands (nothing fetched then)."""
        given = pointer.get("created") if pointer is not None else None
        created = None if given is None else _seconds(given)
        standing = self._refusals.standing(self.source, model, version, created)
        if standing is not None:
            raise _about(Refused(standing.reason), version)
        key = f"{model}/{version}/{MANIFEST}"
        etag: str | None = None
        try:
            fetched = self.source.read(key)
            etag = fetched.etag if fetched.status != MISSING else ""
            if fetched.status == MISSING:
                raise Refused(f"{model} version {version} is not committed (no {MANIFEST})", key=key, etag="")
            manifest = verify(fetched.data, model, version, self.options.public_key, self.options.device_tags)
            self.event("sync_fetch", f"fetching {model} version {version} ({manifest.total_bytes} bytes, "
                       f"{len(manifest.files)} files)", model=model, version=version)
            stats = fetch(self.source, manifest, fetched.data, self.store.stage_dir(model, version),
                          self.store.reuse_index(model))
        except Refused as exc:
            self._refusals.record(model, version, str(exc), objects_judged(key, exc.etag if exc.key == key else etag, exc),
                                  created)
            exc.fresh = True
            raise _about(exc, version)
        self._refusals.clear(model, version)
        faults.point("before_commit")
        self.store.commit(self.store.stage_dir(model, version), model, version)
        self.event("sync_committed", f"{model} version {version} verified and committed "
                   f"({stats.downloaded_bytes} bytes downloaded, {stats.reused_files} files reused)",
                   model=model, version=version, downloaded_bytes=stats.downloaded_bytes,
                   downloaded_files=stats.downloaded_files, reused_files=stats.reused_files)
        faults.point("after_commit")

    def _restore(self, model: str, *versions: int | None) -> bool:
        """Serve again the withdrawn ``versions`` (a move forward before they were parked)."""
        back = sorted(v for v in versions if v is not None and v in self.store.withdrawn(model))
        for version in back:
            self.store.restore(model, version)
            self.event("sync_restored", f"{model} version {version} is served again", model=model, version=version)
        return bool(back)

    def _park_newer(self, model: str, target: int, loaded: frozenset[int] | None, keep: int | None = None) -> bool:
        """Set aside the versions above ``target``: first withdrawn (no longer pushed to the
        manager, their directories left where the servables read them), then parked at a
        later poll once the manager has unloaded them. True when the pushed set changed."""
        withdrawn = self.store.withdrawn(model)
        newer = sorted(v for v in self.store.versions(model) if v > target and v != keep)
        for version in newer:
            if version not in withdrawn:
                self.event("sync_parked", f"{model} version {version} set aside: the target is version {target}",
                           model=model, version=version)
            if loaded is None or (version in withdrawn and version not in loaded):
                self.store.park(model, version)
            else:
                self.store.withdraw(model, version)  # parked once the manager has let it go
        return any(v not in withdrawn for v in newer)

    def _apply_pin(self, model: str, pin: int, local: LocalModel, result: PollResult) -> None:
        if pin not in self.store.versions(model):
            if pin not in self.store.parked(model):
                if self._pin_noted.get(model) != -pin - 1:
                    self._pin_noted[model] = -pin - 1
                    self.event("sync_pin_missing", f"{model} is pinned to version {pin}, which is not on disk",
                               model=model, version=pin)
                return
            self.store.unpark(model, pin)
            result.changed.append(f"{model}:{pin} (pinned)")
        if self._restore(model, pin) | self._park_newer(model, pin, local.loaded):
            result.changed.append(f"{model}:{pin} (pinned)")
        if self._pin_noted.get(model) != pin:
            self._pin_noted[model] = pin
            self.event("sync_pinned", f"{model} pinned to version {pin} (appliance rollback)", model=model, version=pin)

    def _retain(self, model: str, target: int, local: LocalModel, candidate: int | None = None) -> None:
        protect = {target} | ({local.serving} if local.serving is not None else set()) | set(local.loaded or ())
        protect |= {candidate} if candidate is not None else set()
        previous = self.store.trust(model).get("previous_target")
        # The channel's previous target is kept for a move back, unless it failed here: a move
        # back to it would fail again (its reason outlives its directory, core/manager.py).
        protect |= {previous} if isinstance(previous, int) and previous not in local.quarantined else set()
        deleted = self.store.retain(model, self.options.retain, protect, local.quarantined, target, local.serving)
        if deleted:
            self.event("sync_retention", f"{model}: deleted old versions {deleted} (keeping {self.options.retain})",
                       model=model, deleted=deleted)


def _about(exc: Refused, version: int) -> Refused:
    """``exc`` marked as the refusal of ``version`` (the report and the event name it)."""
    exc.version = version
    return exc


def _seconds(value: JSONValue) -> float:
    """A pointer's ``created`` (epoch seconds); 0 when it has none."""
    return float(value) if isinstance(value, (int, float, str)) and value else 0.0
