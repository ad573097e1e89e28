"""The service main: config -> Appliance -> HTTP server, and the process lifecycle.

SIGTERM/SIGINT: stop accepting, finish requests in flight (``server.drain_timeout_s``),
unload models, flush the state database, exit 0. SIGHUP: re-read the config file and
apply model changes without dropping requests (a file that fails to load or validate is
refused and the running config kept). Signal handlers only set flags; the main thread
does the work, so nothing heavy runs inside a handler.

Hooks: optional parts append ``hook(what, service)`` to ``service.hooks``; ``what`` is
one of "started", "reloading", "reloaded", "reload_failed" (``service.reload_error``
says why), "stopping" (the drain begins) and "stopped" (drained, models unloaded, state
database closed: the process exits next). A part attached after ``start()`` checks
``service.server`` itself instead of waiting for "started".

Test-only hook, off by default: with ``EDGE_APPLIANCE_TEST_HOOKS=1`` in the environment,
SIGUSR1 toggles ``manager.freeze_batchers`` and the decode loops' steps (a wedged backend, for the
watchdog tests; a stream held running for as long as a test needs).
Never set it on a device.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from appliance.version import __version__
from appliance.core import logs
from appliance.core import memory
from appliance.api.app import create_app
from appliance.core.appliance import Appliance
from appliance.core.config import Config
from appliance.core.config_file import load as load_config
from appliance.core.errors import ConfigError
from appliance.fronts.app import facing, serving_front
from appliance.fronts.pool import Fronts
from appliance.fronts.shares import workers_for
from appliance.service import listening
from appliance.service.models_wait import wait_for_models
from appliance.service.state_lock import StateDirBusy, lock_state_dir
from appliance.core.tls import tls_context
from sync.store import check_version
from appliance.transport.http.server import HTTPServer

if TYPE_CHECKING:  # the backends are the core's to import
    import runtimes

log = logging.getLogger("appliance.service")

TEST_HOOKS_ENV = "EDGE_APPLIANCE_TEST_HOOKS"
# Keys read once at start-up: a reload logs that they need a restart instead of ignoring them silently.
RESTART_ONLY = ("state_dir", "server", "runtime", "log_level")


class Service:
    """One running appliance: the core, its HTTP server and the signal-driven main loop."""

    def __init__(self, config: Config, config_path: str | None = None, overrides: dict[str, Any] | None = None,
                 backends: dict[str, runtimes.Backend] | None = None):
        self.config = config
        self.config_path = config_path
        self.overrides = overrides or {}
        self.core = Appliance(config, backends, version_check=check_version)
        self.core.config_applier = self.apply_config  # gRPC's reload goes the same way as SIGHUP
        self.app = create_app(config, self.core)
        self.server: HTTPServer | Fronts | None = None
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._toggle_freeze = threading.Event()
        self._frozen = False
        self.reload_error = ""
        self.hooks: list[Callable[[str, "Service"], None]] = []  # see the module docstring

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        """Start the core and bind the port; requests are served from ``serve_http()`` on.
        StateDirBusy when another live service holds the state directory."""
        self.start_core()
        self.bind_http()

    def start_core(self) -> None:
        """Lock the state directory and start the core (models begin to load); no port yet."""
        self._state_lock = lock_state_dir(self.config.state_dir)
        self.core.start()

    def bind_http(self) -> None:
        """Bind the REST port (and start the front workers); OSError when it cannot."""
        c, security = self.config.server, self.config.security
        context = tls_context(security) if security.tls_cert_file else None  # before binding: fail early
        workers = workers_for(self.config)
        if workers:  # HTTP and JSON in front worker processes, batches here (appliance/fronts/pool.py)
            fronts = self.server = Fronts(self.core, self.app, self.config, workers)
            self.core.add_status("workers", fronts.workers_status)
        else:
            # one process: the same front path as a worker's, on the core's own seams (appliance/fronts/app.py)
            front = serving_front(self.core, self.app)
            self.server = HTTPServer(front, c.host, c.port, c.threads, c.max_body_bytes, self.config.limits, context,
                                     fast=front, facing=facing(batches=True))
        server = self.server
        self.core.add_status("http", lambda: server.stats)  # live connection and shedding figures

    def serve_http(self) -> None:
        assert self.server is not None
        threading.Thread(target=self.server.serve_forever, name="http", daemon=True).start()
        self._emit("started")

    def _emit(self, what: str) -> None:
        for hook in self.hooks:
            try:
                hook(what, self)
            except Exception:  # an optional part (discovery, notify) must never stop the service
                log.exception("%s hook failed", what)

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
        signal.signal(signal.SIGINT, lambda *_: self._stop.set())
        signal.signal(signal.SIGHUP, lambda *_: self.request_reload())
        if os.environ.get(TEST_HOOKS_ENV) == "1":
            log.warning("%s=1: test hooks on (SIGUSR1 freezes the batchers); never on a device", TEST_HOOKS_ENV)
            signal.signal(signal.SIGUSR1, lambda *_: self._toggle_freeze.set())
            # A thread of its own, so the hook works during a drain too (the main loop has ended then).
            threading.Thread(target=self._test_hooks, name="test-hooks", daemon=True).start()

    def _test_hooks(self) -> None:
        while True:
            self._toggle_freeze.wait()
            self._toggle_freeze.clear()
            self._freeze(not self._frozen)

    def run(self) -> int:
        """Block until SIGTERM/SIGINT, handling SIGHUP reloads; then drain and exit 0."""
        while not self._stop.is_set():
            self._stop.wait(0.2)
            if self._reload.is_set() and not self._stop.is_set():
                self._reload.clear()
                self.reload()
        return self.shutdown()

    def _freeze(self, frozen: bool) -> None:
        """Test hook: stop (or resume) every batcher taking batches and every decode loop stepping."""
        from appliance.core.generation import freeze_steps

        self._frozen = frozen
        if self.core.manager is not None:
            self.core.manager.freeze_batchers(frozen)
        freeze_steps(frozen)
        log.warning("test hook: batchers %s", "frozen" if frozen else "running again")

    def reload(self) -> None:
        """Re-read the config file; apply it, or refuse it and keep the running one."""
        try:
            config = load_config(self.config_path, self.overrides)
        except ConfigError as exc:
            self.reload_error = str(exc)
            self.core.db.event("reload_failed", f"config reload refused, keeping the running config: {exc}")
            self._emit("reload_failed")
            return
        if not config.models and not config.models_dir and not config.sync.bucket:
            config.sync = self.config.sync  # start-up served the embedded default's bucket: keep it
        self.apply_config(config, "configuration reloaded")

    def apply_config(self, config: Config, why: str) -> None:
        """The one way a new configuration takes effect: SIGHUP and ``POST /api/reload``
        (through ``reload``) and gRPC's HandleReloadConfigRequest (through the core). The
        parts hear "reloading" (systemd's RELOADING=1) and "reloaded" (re-announce)."""
        self._emit("reloading")
        self._warn_restart_only(config)
        self.config, self.reload_error = config, ""
        self.core.apply_config(config, why)
        if isinstance(self.server, Fronts):
            self.server.apply_config(config)
        self._emit("reloaded")

    def _warn_restart_only(self, new: Config) -> None:
        changed = [key for key in RESTART_ONLY if getattr(new, key) != getattr(self.config, key)]
        if changed:
            log.warning("reload: %s changed; these take effect at the next restart", ", ".join(changed))

    def shutdown(self) -> int:
        """Drain HTTP (bounded by server.drain_timeout_s), unload, close the state db; 0."""
        self._emit("stopping")
        started = time.monotonic()
        log.info("stopping: draining requests in flight (at most %g s)", self.config.server.drain_timeout_s)
        if self.server is not None:
            clean = self.server.drain(self.config.server.drain_timeout_s)
            log.info("HTTP drained in %.1f s%s", time.monotonic() - started, "" if clean else " (timed out)")
        self.core.close()
        log.info("stopped after %.1f s", time.monotonic() - started)
        self._emit("stopped")
        return 0

    def request_reload(self) -> None:
        """What SIGHUP does: the main loop re-reads the config (never a request thread)."""
        self._reload.set()


def url_for(config: Config, port: int) -> str:
    """The URL the start-up lines show: https:// when the REST port speaks TLS."""
    host = config.server.host
    shown = "localhost" if host in ("0.0.0.0", "::", "127.0.0.1", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"{'https' if config.security.tls_cert_file else 'http'}://{shown}:{port}"


def main(config: Config, config_path: str | None = None, overrides: dict[str, Any] | None = None,
         banner: Callable[[str, dict[str, Any]], list[str]] | None = None) -> int:
    """Run the service until SIGTERM. ``banner(url, status)``: lines printed once the API
    listens and every model is AVAILABLE (the quick start's "try: curl ..."), never before."""
    logs.setup(config.log_level)
    memory.limit_arenas()  # before any thread: see appliance/core/memory.py
    memory.tune_gc()  # after the imports of start-up: see appliance/core/memory.py
    service = Service(config, config_path, overrides)
    service.install_signals()
    try:
        service.start_core()
    except StateDirBusy as exc:
        print(f"edge-appliance: {exc}", file=sys.stderr)
        return 1
    if config.tfs.wait_for_models:
        if not _models_available(service):
            return 1
        if service.stopping:  # SIGTERM while the models loaded: nothing was ever listening
            service.core.close()
            return 0
    try:
        service.bind_http()
    except OSError as exc:
        print(f"edge-appliance: cannot listen on {config.server.host}:{config.server.port}: {exc.strerror}",
              file=sys.stderr)
        service.core.close()
        return 1
    # sync adds routes and gRPC binds its port: both before the first request
    _add_optional_parts(service, ("appliance.parts.sync_loop",))
    try:
        _add_optional_parts(service, API_PARTS)
    except OSError as exc:  # a configured port that cannot be bound: TF Serving exits, so do we
        print(f"edge-appliance: Failed to start server. Error: {exc}", file=sys.stderr, flush=True)
        _abandon(service)
        return 1
    except ConfigError as exc:  # a bad value of a configured API (its TLS files): as a bad REST certificate
        print(f"edge-appliance: {exc}", file=sys.stderr, flush=True)
        _abandon(service)
        return 2
    _add_optional_parts(service, ("appliance.parts.config_poller",))
    listening.attach(service)  # <state>/service.json: how the CLI finds this service
    service.serve_http()
    _add_optional_parts(service, ("appliance.parts.notify", "appliance.parts.discovery"))
    assert service.server is not None
    url = url_for(config, service.server.port)
    print(f"edge-appliance {__version__} listening on {url} (state: {config.state_dir}, pid {os.getpid()})",
          file=sys.stderr, flush=True)
    threading.Thread(target=_announce_when_ready, args=(service, url, banner), name="announce", daemon=True).start()
    return service.run()


def _models_available(service: Service) -> bool:
    """``[tfs] wait_for_models``: block until the configured models are AVAILABLE before any
    port opens (appliance/service/models_wait.py); False (said, core closed) when they fail."""
    timeout = service.config.tfs.wait_for_models_timeout_s
    print(f"edge-appliance: waiting for the configured models before opening the ports (at most {timeout:g} s)",
          file=sys.stderr, flush=True)
    failure = wait_for_models(service.core.manager, timeout, lambda: service.stopping)
    if failure is None:
        return True
    print(f"edge-appliance: Failed to start server. Error: UNKNOWN: {failure}", file=sys.stderr, flush=True)
    service.core.db.event("start_failed", failure)
    service.core.close()
    return False


def _abandon(service: Service) -> None:
    """Undo a start-up that cannot go on: close the bound HTTP port and the core (no drain:
    nothing was served yet)."""
    service._emit("stopping")
    if service.server is not None:
        service.server.close()
    service.core.close()


def _announce_when_ready(service: Service, url: str, banner: Callable[[str, dict[str, Any]], list[str]] | None) -> None:
    """Say "ready" (and the banner) once every model is AVAILABLE, so a request copied from
    the terminal the moment it appears is answered. Checked every 0.2 s, for a day at most."""
    for _ in range(5 * 86400):
        if service.stopping:
            return
        if service.core.ready():
            lines = [f"edge-appliance ready: {url}"] + (banner(url, service.core.status()) if banner else [])
            print("\n".join(lines), file=sys.stderr, flush=True)
            return
        time.sleep(0.2)


# Parts whose failure leaves a configured API not listening: the device is not ready then.
API_PARTS = ("appliance.service.grpc_port", "appliance.service.rest_socket")


def _add_optional_parts(service: Service, modules: tuple[str, ...]) -> None:
    """Parts that may be missing on a device or fail without harming serving. A failure is
    shown (/api/status, the page, systemd's status line); an API part's also makes the
    device not ready. An API part that cannot bind its port raises OSError (start-up fails,
    as TF Serving's does), unless it retries by itself ([grpc] bind_retry); one with a bad
    configuration value (its TLS files) raises ConfigError: start-up stops, naming the key."""
    for module in modules:
        try:
            part = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # the part exists but something it needs is missing: say so
                log.warning("%s is not available: %s", module, exc)
                service.core.report_problem(module, str(exc), critical=module in API_PARTS)
            continue
        try:
            part.attach(service)
        except ConfigError as exc:
            if module in API_PARTS:  # a configured API with a bad value (a TLS file): start-up stops, naming it
                raise
            log.warning("%s failed to start: %s", module, exc)
            service.core.report_problem(module, str(exc), critical=False)
        except OSError as exc:
            if module in API_PARTS:  # a configured API that cannot listen (and is not retried): fatal
                raise
            log.exception("%s failed to start", module)
            service.core.report_problem(module, str(exc), critical=False)
        except Exception as exc:  # logged and shown in status; the API keeps running
            log.exception("%s failed to start", module)
            service.core.report_problem(module, str(exc), critical=module in API_PARTS)
