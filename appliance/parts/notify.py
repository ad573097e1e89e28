"""systemd's notify protocol, spoken directly: no libsystemd, one datagram per message.

Under ``Type=notify`` systemd passes ``$NOTIFY_SOCKET`` (a path, or ``@name`` in the
abstract namespace) and, with ``WatchdogSec=``, ``$WATCHDOG_USEC``/``$WATCHDOG_PID``.
``attach(service)`` (called by ``service._add_optional_parts``) then runs one thread
that tells systemd the truth:

- ``READY=1`` only once the HTTP server listens *and* ``manager.ready()`` holds (every
  configured model has an AVAILABLE version); never before.
- ``STATUS=`` whenever the one-line summary changes: loading (which models, why not
  yet), serving N models, degraded (why: the parts that are down), reloading, stopping.
- ``WATCHDOG=1`` every half of ``$WATCHDOG_USEC`` (only when ``$WATCHDOG_PID`` is unset or
  this process), and only after a liveness check passed: no batcher has had work waiting
  without finishing a batch for that long (``manager.stalled``), and ``GET /healthz``
  through the real listening socket answers 200 in time, which proves the accept loop and
  a worker thread are alive; with front worker processes, also that their supervisor is
  running and no worker has stayed silent past its replacement (``Fronts.liveness_problem``:
  a worker being replaced is not a reason to restart the service, a supervisor that stopped
  replacing them is). A timer thread that pings unconditionally would keep a hung
  service alive forever; this one stops pinging and systemd restarts the service.
- ``RELOADING=1`` + ``MONOTONIC_USEC=`` when a SIGHUP reload starts, ``READY=1`` when it
  is applied and the models are ready again; ``STOPPING=1`` when the drain starts.

Without ``$NOTIFY_SOCKET`` ``attach`` does nothing and returns None. Sending never
raises: a notify failure must not take the service down. Thread-safety: ``send`` may be
called from any thread; hooks run in the service's main thread.
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import threading
import time
from typing import Mapping

from appliance.core.json_read import obj, objs
from appliance.core.json_types import ReadJSONObject
from appliance.parts.host import Host, Supervised

log = logging.getLogger("appliance.notify")

READY_AFTER_RELOAD_MAX_S = 60.0  # a reload whose models never come up still ends with READY=1


class Notifier:
    """A datagram socket aimed at ``$NOTIFY_SOCKET``."""

    def __init__(self, address: str):
        self.address: str | bytes = "\0" + address[1:] if address.startswith("@") else address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Notifier | None":
        """None when the variable is unset or names a transport other than AF_UNIX."""
        address = (env if env is not None else os.environ).get("NOTIFY_SOCKET", "")
        if not address.startswith(("/", "@")):
            if address:
                log.warning("NOTIFY_SOCKET=%s is not an AF_UNIX address; not notifying systemd", address)
            return None
        return cls(address)

    def send(self, *lines: str) -> bool:
        """Send ``lines`` as one message; False (and a log line) when it could not be sent."""
        message = "\n".join(lines).encode()
        try:
            with self._lock:
                self._sock.sendto(message, self.address)
            return True
        except OSError as exc:
            log.warning("sd_notify %r failed: %s", lines[0] if lines else "", exc)
            return False

    def close(self) -> None:
        self._sock.close()


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of $WATCHDOG_USEC), or None when not ours."""
    env = env if env is not None else os.environ
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
        pid = int(env.get("WATCHDOG_PID", "0") or 0)
    except ValueError:
        return None
    if usec <= 0 or (pid and pid != os.getpid()):
        return None
    return usec / 2e6


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in µs, the clock systemd compares RELOADING=1's timestamp with."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def probe_host(host: str) -> str:
    """Where to reach our own listener: a wildcard address means loopback."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


class Liveness:
    """The watchdog's question: is the service making progress, not merely running?"""

    def __init__(self, service: Host, stall_after_s: float, http_timeout_s: float):
        self.service = service
        self.stall_after_s = stall_after_s
        self.http_timeout_s = http_timeout_s

    def problem(self) -> str | None:
        """None when alive, else why not (checked batchers first: it costs no I/O)."""
        manager = self.service.core.manager
        if manager is not None and manager.stalled(self.stall_after_s):
            return f"a batcher has had work queued and finished no batch for {self.stall_after_s:g} s"
        server = self.service.server
        if server is None:
            return "the HTTP server is not running"
        workers = server.liveness_problem() if isinstance(server, Supervised) else None
        return workers or self._http_problem(probe_host(server.host), server.port)

    def _http_problem(self, host: str, port: int) -> str | None:
        conn = http.client.HTTPConnection(host, port, timeout=self.http_timeout_s)
        try:
            conn.request("GET", "/healthz", headers={"User-Agent": "edge-appliance-watchdog"})
            response = conn.getresponse()
            response.read()
            if response.status != 200:
                return f"GET /healthz answered {response.status}"
            return None
        except (OSError, http.client.HTTPException) as exc:
            return f"GET /healthz on {host}:{port} failed: {exc or type(exc).__name__}"
        finally:
            conn.close()


def _not_ready_reason(model: ReadJSONObject) -> str:
    if model.get("quarantined"):
        return "; ".join(f"v{v} failed: {why}" for v, why in obj(model["quarantined"]).items())
    if any(v["state"] in ("START", "LOADING") for v in objs(model.get("versions", []))):
        return "loading"
    return f"no version under {model.get('base_path')}"


def status_line(service: Host, announced_ready: bool, liveness_problem: str | None = None) -> str:
    """One line for ``systemctl status``: what the service is doing now, and why not more."""
    manager = service.core.manager
    if manager is None:
        return "starting"
    models = manager.snapshot()
    serving = {n: m["serving_version"] for n, m in models.items() if m["serving_version"] is not None}
    waiting = {n: _not_ready_reason(m) for n, m in models.items() if m["serving_version"] is None}
    problems = service.core.problems()
    if getattr(service, "reload_error", ""):
        problems.append(f"last reload refused: {service.reload_error}")
    if liveness_problem:
        problems.insert(0, f"not alive: {liveness_problem}")
    prefix = "loading" if not announced_ready else "degraded"
    if liveness_problem:
        prefix = "degraded"
    if waiting or problems or not models:
        why = [f"{n}: {r}" for n, r in sorted(waiting.items())] + problems
        head = f"{prefix}: {len(serving)} of {len(models)} models available"
        line = f"{head} ({'; '.join(why)})" if why else f"{head} (no models configured)"
    else:
        names = ", ".join(f"{n} v{v}" for n, v in sorted(serving.items()))
        line = f"serving {len(serving)} model{'s' if len(serving) != 1 else ''}: {names}"
        listed = service.core.problem_list(models)  # a version refused, a target not reached... (/api/status)
        if listed:
            first = str(listed[0]["message"])
            line += f"; {len(listed)} problem{'s' if len(listed) != 1 else ''}: {first[:160]}"
    return line


class SystemdNotify:
    """The thread and hooks that keep systemd informed about one ``Service``."""

    def __init__(self, service: Host, notifier: Notifier, interval: float | None):
        self.service = service
        self.notifier = notifier
        self.interval = interval
        self.liveness = Liveness(service, stall_after_s=interval or 30.0,
                                 http_timeout_s=min(5.0, max(0.5, (interval or 2.0) / 2)))
        self.ready_sent = False
        self._phase = "running"  # running | reloading | stopping
        self._reload_deadline = 0.0
        self._last_status = ""
        self._last_problem: str | None = None
        self._next_ping = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="sd-notify", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the thread and the socket. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.notifier.close()

    # -- hooks (the service's main thread) -----------------------------------------------
    def on_hook(self, what: str, service: Host) -> None:
        if what == "reloading" and self.ready_sent:  # before the first READY=1 systemd is still starting us
            self._phase = "reloading"
            self._status("reloading the configuration", extra=("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}"))
        elif what == "reloaded" and self._phase == "reloading":
            self._reload_deadline = time.monotonic() + READY_AFTER_RELOAD_MAX_S
        elif what == "stopping":
            self._phase = "stopping"
            self._status("stopping: finishing requests in flight", extra=("STOPPING=1",))
        elif what == "stopped":
            self.close()

    def _status(self, line: str, extra: tuple[str, ...] = ()) -> None:
        self._last_status = line
        self.notifier.send(*extra, f"STATUS={line}")

    # -- the thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        tick = min(0.5, self.interval / 4) if self.interval else 0.5
        while not self._stop.wait(tick):
            try:
                self._tick()
            except Exception:  # a bug here must not end the notifications for good
                log.exception("sd_notify tick failed")

    def _tick(self) -> None:
        ready = self.service.server is not None and self.service.core.ready()
        if self._phase == "running" and not self.ready_sent and ready:
            self.ready_sent = True
            self._status(status_line(self.service, True), extra=("READY=1",))
        elif self._phase == "reloading" and self._reload_deadline and (ready or time.monotonic() > self._reload_deadline):
            self._phase, self._reload_deadline = "running", 0.0
            self._status(status_line(self.service, True), extra=("READY=1",))
        elif self._phase == "running":
            line = status_line(self.service, self.ready_sent, self._last_problem)
            if line != self._last_status:
                self._status(line)
        self._watchdog()

    def _watchdog(self) -> None:
        now = time.monotonic()
        if self.interval is None or now < self._next_ping:
            return
        # While draining the listener is closed on purpose: the drain is bounded by
        # server.drain_timeout_s and TimeoutStopSec, so keep systemd from aborting it.
        problem = None if self._phase == "stopping" else self.liveness.problem()
        if problem is None:
            self.notifier.send("WATCHDOG=1")
            self._next_ping = now + self.interval
        elif problem != self._last_problem:
            log.error("watchdog: not pinging systemd: %s", problem)
        self._last_problem = problem


def attach(service: Host) -> SystemdNotify | None:
    """Start notifying systemd about ``service`` when ``$NOTIFY_SOCKET`` is set; else None."""
    notifier = Notifier.from_env()
    if notifier is None:
        return None
    part = SystemdNotify(service, notifier, watchdog_interval())
    service.hooks.append(part.on_hook)
    part.start()
    return part
