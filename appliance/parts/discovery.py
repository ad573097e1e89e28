"""LAN discovery: the appliance announces itself with mDNS/DNS-SD; apps find it with one call.

Advertising (``attach(service)``, called by the service once its HTTP server listens):
the REST port is registered as ``_edge-appliance._tcp.local.`` and as
``_http._tcp.local.`` (the status page, ``path=/``) under one instance name, the
configured friendly name or the hostname. The TXT record (RFC 6763: ``txtvers`` first,
short keys, well under 400 bytes, never a secret) is built by :func:`txt_record`; it is
re-announced whenever the models or their serving versions change (state-db events,
plus a poll of the manager snapshot every ``recheck_interval_s``), and the announced
addresses are re-checked on that interval too. On the service's "stopping" hook the
records are withdrawn with goodbye packets, so browsers drop the device at once.

A name already held on the LAN by another device (a different ``id`` in its TXT) is
avoided with an RFC 6763 suffix: ``name (2)``, ``name (3)``, ... Discovery never stops
the API: a failure (no multicast route, no address on the chosen interfaces) is logged,
shown under ``discovery`` in ``/api/status``, and retried on the recheck interval.

Browsing: :func:`browse` (blocking) and :func:`async_browse` return one dict per
appliance found; ``appliance discover [--timeout S] [--json]`` (appliance/commands/discover.py)
prints them.

Threading: all zeroconf work runs on one asyncio loop in the "discovery" thread; the
callbacks that other threads call (``_Advertiser.notify``, hooks) only set flags and
wake that loop. zeroconf is imported inside functions: it costs start-up time on
small devices and the service must run without it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import socket
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, TypedDict

from appliance.core.config import Config
from appliance.core.json_read import obj, objs
from appliance.core.json_types import JSONValue, ReadJSONObject
from appliance.version import __version__
from appliance.parts.host import Host

if TYPE_CHECKING:  # zeroconf is imported when discovery starts (module docstring)
    from zeroconf import ServiceInfo, ServiceStateChange, Zeroconf
    from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger("appliance.discovery")

SERVICE_TYPE = "_edge-appliance._tcp.local."
HTTP_TYPE = "_http._tcp.local."
TXT_VERSION = "1"
MODELS_BUDGET = 200  # bytes of the ``models`` value; the whole record stays well under 400
PROBE_MS = 1000  # how long to wait for a current holder of a name to answer
DEBOUNCE_S = 0.3  # events come in bursts (unload + load); announce the settled state once
WILDCARD_HOSTS = ("", "0.0.0.0", "::")


# -- settings -----------------------------------------------------------------------------
@dataclasses.dataclass
class Settings:
    """The ``[discovery]`` config section, read defensively (the section may be absent)."""

    enabled: bool = True
    name: str = ""  # empty: the hostname
    interfaces: list[str] = dataclasses.field(default_factory=list)  # names or IPv4 addresses; empty: all
    recheck_interval_s: float = 30.0


def settings_from(config: Config) -> Settings:
    section = getattr(config, "discovery", None)
    defaults = Settings()
    interfaces = getattr(section, "interfaces", defaults.interfaces)
    if isinstance(interfaces, str):
        interfaces = [] if interfaces in ("", "all") else [interfaces]
    return Settings(
        enabled=bool(getattr(section, "enabled", defaults.enabled)),
        name=str(getattr(section, "name", "") or ""),
        interfaces=[i for i in interfaces if i != "all"],
        recheck_interval_s=max(0.5, float(getattr(section, "recheck_interval_s", defaults.recheck_interval_s))),
    )


# -- what is announced --------------------------------------------------------------------
def model_summary(snapshot: ReadJSONObject, budget: int = MODELS_BUDGET) -> str:
    """``name@serving_version`` per model (just ``name`` while none serves), sorted,
    comma-separated; past ``budget`` bytes the rest is counted as ``+N``."""
    entries = []
    for name in sorted(snapshot):
        serving = obj(snapshot[name]).get("serving_version")
        entries.append(f"{name}@{serving}" if serving is not None else name)
    full = ",".join(entries)
    if len(full.encode()) <= budget:
        return full
    kept: list[str] = []
    for entry in entries:  # keep room for the ",+N" tail
        if len(",".join([*kept, entry]).encode()) > budget - 6:
            break
        kept.append(entry)
    return ",".join([*kept, f"+{len(entries) - len(kept)}"])

def chosen_backends(snapshot: ReadJSONObject) -> str:
    """The backends that serve an AVAILABLE version, sorted, comma-separated."""
    names = {str(v.get("backend")) for m in snapshot.values() for v in objs(obj(m).get("versions"))
             if v.get("state") == "AVAILABLE" and v.get("backend")}
    return ",".join(sorted(names))


def txt_record(device_id: str, snapshot: ReadJSONObject) -> dict[str, str]:
    """The TXT key/value pairs in announcement order (``txtvers`` first). Public facts only."""
    return {"txtvers": TXT_VERSION, "id": device_id, "ver": __version__, "api": "/v1", "path": "/",
            "backend": chosen_backends(snapshot), "models": model_summary(snapshot)}


def instance_name(base: str, n: int) -> str:
    """The n-th candidate instance name (``base``, ``base (2)``...), within DNS's 63 bytes."""
    suffix = "" if n == 1 else f" ({n})"
    room = 63 - len(suffix.encode())
    trimmed = base.encode()[:room].decode(errors="ignore").strip() or "edge-appliance"
    return trimmed + suffix


def host_label(hostname: str, device_id: str) -> str:
    """A per-device mDNS host name: fleets cloned from one image share a hostname."""
    label = re.sub(r"[^a-z0-9-]+", "-", hostname.split(".")[0].lower()).strip("-") or "edge"
    return f"{label[:40]}-{device_id or 'x'}.local."


# -- interfaces and addresses ---------------------------------------------------------------
def interface_addresses(wanted: list[str]) -> list[str]:
    """IPv4 addresses of the wanted interfaces (by name or address; empty: every interface)."""
    import ifaddr  # a dependency of zeroconf

    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if not isinstance(ip.ip, str):  # IPv6 comes as a tuple; announced over IPv4 only
                continue
            if not wanted or adapter.nice_name in wanted or adapter.name in wanted or ip.ip in wanted:
                found.append(ip.ip)
    return sorted(set(found))


def plan_addresses(wanted: list[str], host: str) -> tuple[list[str], list[str]]:
    """(addresses zeroconf listens on, addresses announced) for these settings.

    A server bound to one address is announced on that address only; otherwise the
    interfaces' non-loopback addresses (loopback only when nothing else exists)."""
    if host not in WILDCARD_HOSTS:
        return (interface_addresses(wanted) if wanted else [host]), [host]
    listen = interface_addresses(wanted)
    announced = [a for a in listen if not a.startswith("127.")] or listen
    return listen, announced


# -- the advertiser -------------------------------------------------------------------------
class _Advertiser:
    """Owns the zeroconf instance, the two registrations and the "discovery" thread.

    ``start()`` and ``close()`` are idempotent; ``notify`` and ``on_hook`` may be called
    from any thread."""

    def __init__(self, service: Host):
        self.service = service
        self.status: dict[str, JSONValue] = {"enabled": True, "announcing": False, "error": None, "name": None}
        self.settings = settings_from(service.config)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stop = threading.Event()
        self._restart = False
        self._zc: AsyncZeroconf | None = None
        self._infos: list[AsyncServiceInfo] = []
        self._name = ""
        self._addresses: list[str] = []
        self._txt: dict[str, str] = {}

    @property
    def _live(self) -> AsyncZeroconf:
        """The zeroconf instance, while the discovery thread runs one."""
        assert self._zc is not None, "zeroconf is used only between its start and its close"
        return self._zc

    # thread-safe entry points
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="discovery", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._poke()
        if self._thread is not None:
            self._thread.join(timeout)

    def notify(self, event: Mapping[str, object]) -> None:
        """State-db listener: any model event may change the TXT record."""
        if event.get("model"):
            self._poke()

    def _port(self) -> int:
        server = self.service.server
        assert server is not None, "a part is attached once the service holds its port"
        return server.port

    def on_hook(self, what: str, service: Host) -> None:
        if what == "stopping":
            self.close()
        elif what == "reloaded" and settings_from(service.config) != self.settings:
            self.settings = settings_from(service.config)
            self._restart = True
            self._poke()

    def _poke(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop already closed
                pass

    # the discovery thread
    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:  # never let discovery take the service down
            log.exception("discovery stopped")

    async def _main(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        try:
            while not self._stop.is_set():
                if self._zc is None or self._restart:
                    await self._restart_now()
                else:
                    await self._refresh_or_restart()
                await self._sleep(self.settings.recheck_interval_s)
        finally:
            await self._withdraw()

    async def _sleep(self, seconds: float) -> None:
        assert self._wake is not None
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
            await asyncio.sleep(DEBOUNCE_S)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()

    async def _restart_now(self) -> None:
        self._restart = False
        await self._withdraw()
        try:
            await self._register()
        except Exception as exc:  # e.g. no multicast route: logged, shown, retried
            log.warning("discovery could not start (retrying every %.0f s): %s",
                        self.settings.recheck_interval_s, exc)
            self._publish_status(error=f"{type(exc).__name__}: {exc}")
            await self._withdraw()

    async def _register(self) -> None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncZeroconf

        port = self._port()
        listen, self._addresses = plan_addresses(self.settings.interfaces, self.service.config.server.host)
        if not listen:
            raise OSError(f"no IPv4 address on interfaces {self.settings.interfaces or 'all'}")
        self._zc = AsyncZeroconf(interfaces=listen, ip_version=IPVersion.V4Only)
        self._txt = self._current_txt()
        base = self.settings.name or socket.gethostname()
        for n in range(1, 100):
            self._name = instance_name(base, n)
            if await self._try_claim(self._name, port):
                break
        else:
            raise RuntimeError(f"no free instance name for {base!r}")
        log.info("announcing %r on %s port %d", self._name, ",".join(self._addresses), port)
        self._publish_status()

    async def _try_claim(self, name: str, port: int) -> bool:
        """Register both types under ``name`` unless another device holds it."""
        from zeroconf import NonUniqueNameException

        if await self._held_by_other(name, port):
            log.info("instance name %r is taken on the LAN; trying the next one", name)
            return False
        self._infos = [self._info(kind, name, port) for kind in (SERVICE_TYPE, HTTP_TYPE)]
        try:  # both types probe and announce side by side: start-up waits once, not twice
            await asyncio.gather(*(self._announce(info) for info in self._infos))
        except NonUniqueNameException:
            await self._unregister()
            return False
        return True

    async def _announce(self, info: AsyncServiceInfo) -> None:
        await (await self._live.async_register_service(info))

    async def _held_by_other(self, name: str, port: int) -> bool:
        """Ask the LAN whether anyone answers for ``name``. Only a record with our id, port
        and an address of ours is ourselves (devices cloned from one image share an id)."""
        own = self.service.core.device_id.encode()
        holders = await asyncio.gather(*(self._live.async_get_service_info(kind, f"{name}.{kind}", PROBE_MS)
                                         for kind in (SERVICE_TYPE, HTTP_TYPE)))
        for holder in filter(None, holders):
            ours = (holder.properties.get(b"id") == own and holder.port == port
                    and set(holder.parsed_addresses()) & set(self._addresses))
            if not ours:
                return True
        return False

    def _info(self, kind: str, name: str, port: int) -> AsyncServiceInfo:
        from zeroconf.asyncio import AsyncServiceInfo

        server = host_label(socket.gethostname(), self.service.core.device_id)
        return AsyncServiceInfo(kind, f"{name}.{kind}", port=port, properties=dict(self._txt),
                                server=server, parsed_addresses=list(self._addresses))

    async def _refresh_or_restart(self) -> None:
        try:
            await self._refresh()
        except Exception as exc:  # a socket error mid-update: start over on the next round
            log.warning("discovery update failed, restarting it: %s", exc)
            self._restart = True

    async def _refresh(self) -> None:
        """Re-announce when the TXT record or the addresses changed; else nothing."""
        listen, announced = plan_addresses(self.settings.interfaces, self.service.config.server.host)
        txt = self._current_txt()
        if txt == self._txt and announced == self._addresses:
            return
        if announced != self._addresses and not await self._follow_interfaces(listen):
            return
        self._txt, self._addresses = txt, announced
        port = self._port()
        self._infos = [self._info(kind, self._name, port) for kind in (SERVICE_TYPE, HTTP_TYPE)]
        await asyncio.gather(*(self._reannounce(info) for info in self._infos))
        log.info("re-announced %r: models=%s addresses=%s", self._name, txt["models"], ",".join(announced))
        self._publish_status()

    async def _follow_interfaces(self, listen: list[str]) -> bool:
        """Move zeroconf's sockets to the new interface set; False when it needed a restart."""
        if listen and hasattr(self._zc, "async_update_interfaces"):
            await self._live.async_update_interfaces(listen)
            return True
        self._restart = True  # older zeroconf, or no address left: start over (and retry)
        return False

    def _current_txt(self) -> dict[str, str]:
        manager = self.service.core.manager
        snapshot = manager.snapshot() if manager is not None else {}
        return txt_record(self.service.core.device_id, snapshot)

    async def _reannounce(self, info: AsyncServiceInfo) -> None:
        await (await self._live.async_update_service(info))

    async def _unregister(self) -> None:
        await asyncio.gather(*(self._goodbye(info) for info in self._infos))
        self._infos = []

    async def _goodbye(self, info: AsyncServiceInfo) -> None:
        try:
            await (await self._live.async_unregister_service(info))
        except Exception as exc:  # goodbyes are best effort (the interface may be gone)
            log.debug("goodbye for %s failed: %s", info.name, exc)

    async def _withdraw(self) -> None:
        """Goodbye packets for our records, then close the sockets."""
        if self._zc is None:
            return
        await self._unregister()
        zc, self._zc = self._zc, None
        try:
            await zc.async_close()
        except Exception as exc:
            log.debug("closing zeroconf failed: %s", exc)
        if self._stop.is_set():
            self._publish_status(stopped=True)

    def _publish_status(self, error: str | None = None, stopped: bool = False) -> None:
        """What ``/api/status`` shows under ``discovery``."""
        ok = error is None and not stopped
        # announcing is a convenience: its failure shows (page, notify) but never makes the device unready
        self.service.core.report_problem("appliance.parts.discovery", error, critical=False)
        self.status = {
            "enabled": True, "announcing": ok, "error": error,
            "name": self._name if ok else None, "types": [SERVICE_TYPE, HTTP_TYPE],
            "port": self._port(), "addresses": list(self._addresses),
            "interfaces": list(self.settings.interfaces) or "all", "txt": dict(self._txt) if ok else {},
            # announced on loopback only (the service listens on 127.0.0.1): no other machine finds it
            "loopback_only": bool(self._addresses) and all(a.startswith("127.") for a in self._addresses),
        }


def attach(service: Host) -> _Advertiser | None:
    """Start announcing ``service`` (its HTTP server is listening); withdraw on "stopping".

    Returns the advertiser, or None when discovery is turned off in the config."""
    settings = settings_from(service.config)
    if not settings.enabled:
        service.core.add_status("discovery", lambda: {"enabled": False, "error": None, "name": None})
        return None
    advertiser = _Advertiser(service)
    service.core.add_status("discovery", lambda: advertiser.status)
    service.core.db.subscribe(advertiser.notify)
    service.hooks.append(advertiser.on_hook)
    advertiser.start()
    return advertiser


# -- browsing --------------------------------------------------------------------------------
class Found(TypedDict):
    """One appliance that answered a browse (``describe``)."""

    name: str
    host: str
    addresses: list[str]
    port: int | None
    url: str
    id: str
    version: str
    api: str
    backend: str
    models: list[str]
    versions: dict[str, int | None]
    txt: dict[str, str]


def browse(timeout: float = 3.0, interfaces: list[str] | None = None) -> list[Found]:
    """Every appliance that answers within ``timeout`` seconds, sorted by name.

    Blocking; from inside a running event loop use :func:`async_browse`. ``interfaces``:
    interface names or IPv4 addresses to browse on (default: all). Each dict has
    name, host, addresses, port, url (the status page), id, version, api, backend,
    models (names), versions ({name: serving version}) and txt (every key, decoded)."""
    return asyncio.run(async_browse(timeout, interfaces))


async def async_browse(timeout: float = 3.0, interfaces: list[str] | None = None) -> list[Found]:
    from zeroconf import IPVersion, ServiceStateChange
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

    listen = interface_addresses(interfaces) if interfaces else None
    if interfaces and not listen:
        raise OSError(f"no IPv4 address on interfaces {interfaces}")
    aiozc = AsyncZeroconf(interfaces=listen, ip_version=IPVersion.V4Only) if listen else AsyncZeroconf(
        ip_version=IPVersion.V4Only)
    names: set[str] = set()

    def on_change(zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        (names.discard if state_change is ServiceStateChange.Removed else names.add)(name)

    browser = AsyncServiceBrowser(aiozc.zeroconf, [SERVICE_TYPE], handlers=[on_change])
    try:
        await asyncio.sleep(timeout)
        infos = [AsyncServiceInfo(SERVICE_TYPE, name) for name in sorted(names)]
        answered = await asyncio.gather(*(i.async_request(aiozc.zeroconf, PROBE_MS) for i in infos))
    finally:
        await browser.async_cancel()
        await aiozc.async_close()
    return [describe(info) for info, ok in zip(infos, answered) if ok]


def describe(info: ServiceInfo) -> Found:
    """One browse result from a resolved zeroconf ``ServiceInfo``."""
    txt = {k.decode(errors="replace"): (v or b"").decode(errors="replace") for k, v in info.properties.items()}
    addresses = info.parsed_addresses()
    host = addresses[0] if addresses else (info.server or "").rstrip(".")
    shown = f"[{host}]" if ":" in host else host
    models, versions = parse_models(txt.get("models", ""))
    return {
        "name": info.name[: -len(SERVICE_TYPE) - 1], "host": (info.server or "").rstrip("."),
        "addresses": addresses, "port": info.port, "url": f"http://{shown}:{info.port}{txt.get('path', '/')}",
        "id": txt.get("id", ""), "version": txt.get("ver", ""), "api": txt.get("api", ""),
        "backend": txt.get("backend", ""), "models": models, "versions": versions, "txt": txt,
    }


def parse_models(value: str) -> tuple[list[str], dict[str, int | None]]:
    """``a@2,b,+3`` -> (["a", "b"], {"a": 2, "b": None}); a ``+N`` tail counts unlisted models."""
    versions: dict[str, int | None] = {}
    for entry in filter(None, value.split(",")):
        if entry.startswith("+") and entry[1:].isdigit():
            continue
        name, at, version = entry.rpartition("@")
        if at and version.isdigit():
            versions[name] = int(version)
        else:
            versions[entry] = None
    return list(versions), versions
