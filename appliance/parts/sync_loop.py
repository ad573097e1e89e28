"""The device-side sync loop: follow the bucket, hand new versions to the model manager.

``attach(service)`` (called by the service after start-up) registers the admin endpoints
(``POST /api/reload`` always; the sync ones need ``sync.bucket``). Without a bucket that is
all it does. Otherwise it points the manager at ``<state>/models``, empties
``<state>/staging``, starts one daemon thread that polls the bucket every
``sync.poll_interval_s`` (+- ``sync.jitter``), registers ``POST /api/sync`` and starts the
device report's writer (appliance/parts/device_report.py: ``_devices/<device-id>.json``
after each change, coalesced, plus a heartbeat). It stops on the "stopping" hook.

Retries, split as AWS's SDKs split them (sync/errors.py): a bucket that cannot be reached,
that fails a request, or that answers it cannot serve now (503 ServiceUnavailable, a bare
503 from a gateway whose backend is down, 500/502/504: ``Unavailable``) is tried again at
the poll interval (+- jitter): an unreachable bucket costs it nothing, and a device is back
within an interval of the bucket's return (measured in bench/RESULTS.md; an exponential
backoff to 600 s kept devices minutes behind a 30 s outage, and a 2-minute 503 cost 8.4
intervals). A Retry-After is honoured up to two intervals. A bucket that asks for less
(429, 503 SlowDown: ``Throttled``) gets exponential backoff from the poll interval, capped
at two intervals so a device is back within two intervals of the throttling's end; only a
Retry-After the bucket sends makes it wait longer (up to ``sync.max_backoff_s``).

Nothing here can stop serving: every failure is caught, recorded as an event and shown
in ``/api/status`` under ``sync``.

Admin endpoints (a POST under ``/api/``: appliance/api/auth.py lets them through only with the
admin token, and answers 403 while none is configured):

* ``POST /api/sync``: poll the bucket now and wait for that poll; the sync status.
* ``POST /api/models/<m>/rollback``: pin ``m`` to a version kept on disk, as ``appliance
  rollback`` does (body ``{"version": N}``, default the one below the newest; ``{"clear":
  true}`` removes the pin), then poll; the pin and the sync status.
* ``POST /api/reload``: what SIGHUP does (re-read the config file and apply it), waiting for
  the result: 200 when applied, 409 with the reason when the file was refused.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any
from urllib.parse import urlparse, urlunparse

from flask import Blueprint, Response, jsonify, request


from sync import faults
from sync.errors import SourceError, Throttled, Unavailable
from sync.follower import Follower, LocalModel, Options
from sync.manifest import load_public_key
from sync.source import Limits
from sync.open_source import open_source
from sync.store import Store, rollout_policies, set_pin

from appliance.api.errors import flask_error
from appliance.core.config import SyncConfig
from appliance.core.json_read import obj
from appliance.core.json_types import JSONObject, ReadJSONObject
from appliance.core.sources import DirectorySource
from appliance.api.routes import ADMIN
from appliance.parts.device_report import Reporter
from appliance.parts.host import Host

log = logging.getLogger("appliance.sync")
RELOAD_WAIT_S = 120.0
BACKOFF_CAP_INTERVALS = 2  # no failure keeps a device more than two poll intervals from a recovered bucket


def attach(service: Host) -> "SyncLoop | None":
    reloads = Reloads(service)
    service.hooks.append(reloads.on_hook)
    if not service.config.sync.bucket:
        _register_routes(service, None, reloads)
        return None
    loop = SyncLoop(service)
    loop.start()
    service.hooks.append(loop.on_hook)
    _register_routes(service, loop, reloads)
    return loop


class Reloads:
    """``POST /api/reload``: ask the service's main loop for a SIGHUP reload and wait for it."""

    def __init__(self, service: Host):
        self.service = service
        self._done = threading.Condition()
        self._count = 0
        self._last: tuple[bool, str] = (True, "")

    def on_hook(self, what: str, service: Host) -> None:
        if what in ("reloaded", "reload_failed"):
            with self._done:
                self._count += 1
                self._last = (what == "reloaded", str(getattr(service, "reload_error", "")))
                self._done.notify_all()

    def reload(self, timeout: float = RELOAD_WAIT_S) -> tuple[bool, str] | None:
        """(applied, reason) of the reload this call asked for; None if it did not finish in time."""
        with self._done:
            wanted = self._count + 1
        self.service.request_reload()
        with self._done:
            if not self._done.wait_for(lambda: self._count >= wanted, timeout):
                return None
            return self._last


def source_limits(cfg: SyncConfig) -> Limits:
    """The sources' transfer limits from ``[sync]``."""
    return Limits(max_document_bytes=cfg.max_manifest_bytes, stall_timeout_s=cfg.stall_timeout_s)


def public_bucket_url(url: str) -> str:
    """The bucket URL without any user:password part (status pages and reports)."""
    parsed = urlparse(url)
    if parsed.username or parsed.password:
        parsed = parsed._replace(netloc=(parsed.hostname or "") + (f":{parsed.port}" if parsed.port else ""))
    return urlunparse(parsed)


def device_tags(device: ReadJSONObject) -> frozenset[str]:
    """Compatibility tags this device satisfies (a manifest's ``compat`` must be a subset)."""
    tags = {"any", str(device.get("machine", ""))}
    if device.get("litert"):
        tags.add("tflite")
    if device.get("tensorflow_version"):
        tags.add("tf")
        if device.get("tensorflow_build") == "cuda" and device.get("nvidia_gpu"):
            tags.add("cuda")
    if device.get("tensorrt"):
        tags.add("tensorrt")
    tags.update(name for name, present in obj(device.get("delegates")).items() if present)
    return frozenset(t for t in tags if t)


class SyncLoop:
    def __init__(self, service: Host):
        self.service = service
        self.core = service.core
        cfg = service.config.sync
        self.cfg = cfg
        self.store = Store(service.config.state_dir)
        self.source = open_source(cfg.bucket, cfg.s3_endpoint_url, cfg.s3_region, source_limits(cfg))
        options = Options(models=list(cfg.models), channel=cfg.channel, device_id=self.core.device_id,
                          public_key=load_public_key(cfg.public_key) if cfg.public_key else None,
                          device_tags=device_tags(self.core.device), retain=max(1, cfg.retain),
                          on_rollout=self._push_rollout, models_refresh_s=cfg.models_refresh_s)
        self.follower = Follower(self.source, self.store, options, self.event, self._local)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._force = False  # the next poll reads the list of models again (appliance sync)
        self._polled = threading.Condition()
        self._started = self._finished = 0
        self._failures = 0
        self._throttled: Throttled | None = None
        self._unavailable: Unavailable | None = None
        self.polls_done = 0
        self.polling = False  # a poll is running (read by the report writer, any thread)
        self._thread: threading.Thread | None = None
        self.versions: DirectorySource | None = None  # the store's, from start()
        self.reporter: Reporter | None = None  # from start(), when the bucket takes writes
        self.status: dict[str, Any] = {"bucket": public_bucket_url(cfg.bucket), "channel": cfg.channel,
                                       "last_poll": None, "last_success": None, "last_change": None,
                                       "next_poll": None, "last_error": "", "failures": 0, "targets": {},
                                       "refused": {}, "requests": {"polls": 0, "reports": 0}}
        self.core.add_status("sync", self._status)

    def _push_rollout(self, model: str, record: JSONObject | None) -> None:
        """The channel's candidate and rollout policy, pushed to the model manager."""
        if self.core.manager is not None:
            self.core.manager.set_channel_rollout(model, record)

    def start(self) -> None:
        # the store is this part's version source: it pushes what sync commits to the manager.
        # First, so what is on disk serves even when the store cannot be written (read-only state).
        self.versions = self.core.add_source("bucket", self.store.models_dir, withheld=self.store.withdrawn)
        self.store.open()
        faults.configure(self.store.state_dir)
        for model, record in rollout_policies(self.store.state_dir).items():  # what the last run was told
            self._push_rollout(model, record)
        self.event("sync_config", f"serving the synced store {self.store.models_dir}")
        if self.source.writable:
            self.reporter = Reporter(self)
            self.reporter.start()
        self._thread = threading.Thread(target=self._run, name="sync-loop", daemon=True)
        self._thread.start()

    def _status(self) -> JSONObject:
        """``/api/status`` ``sync``: the loop's figures, each model's standing refusal, and the
        bucket requests made by the polls and by the report writer."""
        reports = self.reporter.source.requests if self.reporter is not None else 0
        return {**self.status, "refused": dict(self.follower.refused), "waves": dict(self.follower.waves),
                "polls": self.polls_done, "requests": {"polls": self.source.requests, "reports": reports},
                "report_error": self.reporter.last_error if self.reporter is not None else ""}

    def on_hook(self, what: str, service: Host) -> None:
        if what == "stopping":
            self.close()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.reporter is not None:
            self.reporter.close()
        self.source.close()

    def sync_now(self, timeout: float = 120) -> JSONObject:
        """Run a poll now (reading the list of models again too) and wait for it (one that
        started after this call)."""
        with self._polled:
            wanted = self._started + 1
            self._force = True
        self._wake.set()
        with self._polled:
            self._polled.wait_for(lambda: self._finished >= wanted or self._stop.is_set(), timeout)
        return self._status()

    # -- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            with self._polled:
                self._started += 1
                force, self._force = self._force, False
            delay = self._poll(force)
            with self._polled:
                self._finished += 1
                self._polled.notify_all()
            self.status["next_poll"] = time.time() + delay
            self._wake.wait(delay)
            self._wake.clear()

    def _poll(self, force: bool = False) -> float:
        self.status["last_poll"] = time.time()
        started, outcome = time.monotonic(), "error"
        self.polling = True  # the report waits: what this poll commits is about to load
        try:
            result = self.follower.sync_once(force)
        except Exception as exc:  # the bucket (SourceError) or a local fault: never fatal
            if not isinstance(exc, SourceError):
                log.exception("sync poll failed")
            self._failed(exc)
        else:
            outcome = "updated" if result.changed else ("refused" if result.refused else "unchanged")
            self._succeeded(result.refused)
            if result.changed:
                self.status["last_change"] = time.time()
                if self.versions is not None:  # set by start(), before the first poll
                    self.versions.scan()  # push the store's new set of versions
        self.polling = False
        self.core.metrics.observe_sync(outcome, time.monotonic() - started)
        self.status["targets"] = dict(self.follower.targets)
        self.status["pins"] = dict(self.store.pins())  # a pin replaces the channel's target (appliance rollback)
        self.status["problems"] = list(self.store.problems)
        self.polls_done += 1
        if self.reporter is not None:
            self.reporter.poll_done()
        return self._next_delay()

    def _failed(self, exc: Exception) -> None:
        message = str(exc) if isinstance(exc, SourceError) else f"{type(exc).__name__}: {exc}"
        self._failures += 1
        self._throttled = exc if isinstance(exc, Throttled) else None
        self._unavailable = exc if isinstance(exc, Unavailable) else None
        if message != self.status["last_error"]:
            self.event("sync_error", f"bucket poll failed (attempt {self._failures}, {self._what_next()}): {message}")
        self.status.update(last_error=message, failures=self._failures)

    def _succeeded(self, refused: list[str]) -> None:
        if self._failures:
            self.event("sync_recovered", f"bucket reachable again after {self._failures} failed polls")
        self._failures, self._throttled, self._unavailable = 0, None, None
        self.status.update(last_error="; ".join(refused), failures=0, last_success=time.time())

    def _next_delay(self) -> float:
        """The next poll's delay (+- jitter); see the module docstring."""
        jitter = max(0.0, min(self.cfg.jitter, 0.9))
        return self._base_delay() * random.uniform(1 - jitter, 1 + jitter)

    def _base_delay(self) -> float:
        """The poll interval; after "slow down", doubling to two intervals (a Retry-After up to
        ``max_backoff_s``); after "unavailable", a Retry-After up to two intervals."""
        base = max(0.05, self.cfg.poll_interval_s)
        cap = BACKOFF_CAP_INTERVALS * base
        if self._throttled is not None:
            backoff = min(cap, base * 2 ** min(self._failures, 30))
            return max(base, backoff, min(self._throttled.retry_after, self.cfg.max_backoff_s))
        if self._unavailable is not None:
            return max(base, min(self._unavailable.retry_after, cap))
        return base

    def _what_next(self) -> str:
        """What the loop does after a failed poll, in the words of the problem text."""
        delay = self._base_delay()
        if self._throttled is not None:
            return f"the bucket asks for fewer requests: backing off, next poll in about {delay:.3g} s"
        if self._unavailable is not None:
            return f"the bucket is unavailable: retrying at the poll interval, next poll in about {delay:.3g} s"
        return f"retrying at the poll interval, next poll in about {delay:.3g} s"

    # -- what the manager says -----------------------------------------------------------
    def _local(self) -> dict[str, LocalModel]:
        manager = self.core.manager
        if manager is None:
            return {}
        return {name: LocalModel(m.get("serving_version"), frozenset(int(v) for v in m.get("quarantined", {})),
                                 frozenset(int(v["version"]) for v in m.get("versions", []) if v.get("state") != "END"))
                for name, m in manager.snapshot().items()}

    def event(self, kind: str, message: str, model: str = "", version: int | None = None, **detail: object) -> None:
        """Record a sync event (state.db, logs, the page); never raises (any thread)."""
        try:
            self.core.db.event(kind, message, model=model, version=version, **detail)
        except Exception:  # the database closing under us at shutdown
            log.warning("%s: %s", kind, message)


def _error(status: int, message: str) -> Response:
    return flask_error(status, message)  # the REST app's one error renderer


def _register_routes(service: Host, loop: SyncLoop | None, reloads: Reloads) -> None:
    """Admin endpoints, into the app's route table with the admin scope (appliance/api/routes.py;
    the token check is appliance/api/auth.py's)."""
    bp = Blueprint("admin", __name__)
    no_sync = "fleet sync is off on this device (sync.bucket is empty)"

    @bp.post("/api/reload", scope=ADMIN)
    def reload() -> Response:
        result = reloads.reload()
        if result is None:
            return _error(504, f"the reload did not finish within {RELOAD_WAIT_S:g} s")
        applied, reason = result
        if not applied:
            return _error(409, f"config reload refused, the running config is kept: {reason}")
        return jsonify({"reloaded": True})

    @bp.post("/api/sync", scope=ADMIN)
    def sync_now() -> Response:
        if loop is None:
            return _error(409, f"nothing to sync: {no_sync}")
        return jsonify(loop.sync_now())

    @bp.post("/api/models/<model>/rollback", scope=ADMIN)
    def rollback(model: str) -> Response:
        if loop is None:
            return _error(409, f"rollback pins a synced version: {no_sync}")
        body = request.get_json(force=True, silent=True) if request.content_length else {}  # any Content-Type
        if not isinstance(body, dict):
            return _error(400, 'the body must be a JSON object: {"version": N} or {"clear": true} (or empty)')
        return rollback_to(loop, model, body)

    service.app.register_blueprint(bp)  # attach() runs before the HTTP server serves


def rollback_to(loop: SyncLoop, model: str, body: ReadJSONObject) -> Response:
    """Pin (or unpin) ``model`` as ``appliance rollback`` does, then poll so it takes effect now."""
    state_dir = loop.store.state_dir
    version = body.get("version")
    if body.get("clear") is True:
        set_pin(state_dir, model, None)
        return jsonify({"model": model, "pinned": None, "sync": loop.sync_now()})
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        return _error(400, f'"version" must be an integer, got {version!r}')
    on_disk = sorted(set(loop.store.versions(model)) | set(loop.store.parked(model)))
    if version is None:
        version = loop.store.previous_version(model)
    if version not in on_disk:
        return _error(409, f"{model} version {version} is not on disk (have: {on_disk or 'none'})")
    set_pin(state_dir, model, version)
    loop.event("rollback", f"{model} pinned to version {version} (POST /api/models/{model}/rollback)",
                model=model, version=version)
    return jsonify({"model": model, "pinned": version, "sync": loop.sync_now()})
