"""LAN discovery with real packets: the real service advertises, separate processes browse.

Topology: where network namespaces can be made (root), three namespaced hosts ``a``,
``b`` (advertisers) and ``c`` (browser) hang off a bridge in a fourth "switch"
namespace, with link-local addresses inside the namespaces only; mDNS packets really
cross veth interfaces and a bridge. Elsewhere (or with EDGE_TEST_DISCOVERY_LOOPBACK=1) every
host is the loopback interface: services bound to 127.0.0.1 announce there and the
browser listens on 127.0.0.1.

The browsers are ``appliance discover --json`` and a python-zeroconf ``ServiceBrowser``
watcher (``WATCHER`` below) that prints one JSON line per add/update/remove.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import appliance
from appliance.parts import discovery
from tests.support.servers import ROOT, free_port, poll_until, stop_process

SERVICE_TYPE = "_edge-appliance._tcp.local."
HTTP_TYPE = "_http._tcp.local."
MODEL = "multisig_tflite"  # a LiteRT model: a tflite-only server starts in about a second

WATCHER = r"""
import json, sys
from zeroconf import IPVersion, ServiceBrowser, ServiceStateChange, Zeroconf
interfaces = sys.argv[1:] or None
zc = Zeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only) if interfaces else Zeroconf(ip_version=IPVersion.V4Only)
def on_change(zeroconf, service_type, name, state_change):
    row = {"event": state_change.name.lower(), "type": service_type, "name": name}
    if state_change is not ServiceStateChange.Removed:
        info = zeroconf.get_service_info(service_type, name, 3000)
        if info is not None:
            row.update(port=info.port, addresses=info.parsed_addresses(), server=info.server,
                       txt_keys=[k.decode() for k in info.properties],
                       txt={k.decode(): (v or b"").decode() for k, v in info.properties.items()})
    print(json.dumps(row), flush=True)
browser = ServiceBrowser(zc, ["_edge-appliance._tcp.local.", "_http._tcp.local."], handlers=[on_change])
print(json.dumps({"event": "ready"}), flush=True)
import threading
threading.Event().wait()
"""


# -- the network -------------------------------------------------------------------------------
@dataclass
class Host:
    """One host of the test LAN: commands run there through ``prefix``."""

    name: str
    prefix: list[str]
    address: str  # what an appliance on this host announces
    serve_host: str  # what ``serve --host`` gets there
    browse_args: list[str]
    netns: str = ""


class Net:
    def __init__(self, mode: str, hosts: dict[str, Host]):
        self.mode, self.hosts = mode, hosts

    def add_address(self, host: Host, address: str) -> None:
        subprocess.run(["ip", "-n", host.netns, "addr", "add", f"{address}/16", "dev", "eth0"], check=True)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _make_namespaces(tag: str) -> dict[str, Host]:
    switch = f"{tag}-sw"
    _ip("netns", "add", switch)
    _ip("-n", switch, "link", "add", "br0", "type", "bridge")
    _ip("-n", switch, "link", "set", "br0", "up")
    hosts = {}
    for i, name in enumerate("abc", start=1):
        ns, peer, address = f"{tag}-{name}", f"p{name}", f"169.254.{(os.getpid() % 200) + 20}.{i}"
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", peer, "netns", switch)
        _ip("-n", switch, "link", "set", peer, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{address}/16", "dev", "eth0")
        for dev in ("lo", "eth0"):
            _ip("-n", ns, "link", "set", dev, "up")
        _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
        hosts[name] = Host(name, ["ip", "netns", "exec", ns], address, "0.0.0.0", [], ns)
    return hosts


def _delete_namespaces(tag: str) -> None:
    for suffix in ("a", "b", "c", "sw"):
        subprocess.run(["ip", "netns", "del", f"{tag}-{suffix}"], check=False, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    """Namespaced hosts when the kernel lets us make them, else loopback."""
    tag = f"eat{os.getpid()}"
    try:
        if os.environ.get("EDGE_TEST_DISCOVERY_LOOPBACK"):
            raise OSError("EDGE_TEST_DISCOVERY_LOOPBACK is set")
        hosts = _make_namespaces(tag)
    except (OSError, subprocess.SubprocessError) as exc:
        _delete_namespaces(tag)
        print(f"network namespaces unavailable ({exc}); using loopback multicast")
        loop = {n: Host(n, [], "127.0.0.1", "127.0.0.1", ["--interface", "127.0.0.1"]) for n in "abc"}
        yield Net("loopback", loop)
        return
    try:
        yield Net("netns", hosts)
    finally:
        _delete_namespaces(tag)


# -- processes --------------------------------------------------------------------------------
class Proc:
    """A child process started on a host, with its output in a file; stopped by PID."""

    def __init__(self, cmd: list[str], log: Path):
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        return stop_process(self.proc, sig, timeout)


class Appliance(Proc):
    def __init__(self, host: Host, tmp_path: Path, models: Path, name: str, extra_config: str = ""):
        self.port = free_port()
        self.state = tmp_path / f"state-{host.name}-{self.port}"
        config = tmp_path / f"config-{host.name}-{self.port}.toml"
        config.write_text(f'[discovery]\nname = "{name}"\n{extra_config}')
        cmd = [*host.prefix, sys.executable, "-m", "appliance.cli", "serve", "--config", str(config),
               "--models", str(models), "--host", host.serve_host, "--port", str(self.port),
               "--state", str(self.state), "--backend", "tflite", "--poll-interval", "0.5"]
        super().__init__(cmd, tmp_path / f"server-{host.name}-{self.port}.log")

    @property
    def device_id(self) -> str:
        return (self.state / "device-id").read_text().strip()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Factory for child processes, each stopped by PID at teardown."""
    started: list[Proc] = []

    def start(kind: type, *args: Any, **kw: Any) -> Any:
        proc = kind(*args, **kw)
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        proc.stop()


def watcher(procs: Callable[..., Any], host: Host, tmp_path: Path) -> Proc:
    interfaces = host.browse_args[1::2]
    proc = procs(Proc, [*host.prefix, sys.executable, "-c", WATCHER, *interfaces],
                 tmp_path / f"watch-{uuid.uuid4().hex[:6]}.log")
    wait_until(lambda: '"ready"' in proc.text(), 30, "the watcher to start", proc)
    return proc


def events(proc: Proc) -> list[dict[str, Any]]:
    rows = []
    for line in proc.text().splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, *logs: Proc) -> Any:
    return poll_until(predicate, timeout, what,
                      lambda: "\n".join(f"--- {p.log.name}\n{p.text()[-3000:]}" for p in logs))


def discover(host: Host, *args: str) -> list[dict[str, Any]]:
    """``appliance discover --json`` run as its own process on ``host``."""
    out = subprocess.run([*host.prefix, sys.executable, "-m", "appliance.cli", "discover", "--json",
                          "--timeout", "1.5", *host.browse_args, *args],
                         check=False, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def seen(watch: Proc, server: Appliance, predicate: Callable[[dict[str, Any]], bool] = lambda r: True,
         kind: str = SERVICE_TYPE) -> list[dict[str, Any]]:
    """The watcher's resolved rows for ``server`` (matched by port) that satisfy ``predicate``."""
    return [r for r in events(watch) if r.get("type") == kind and r.get("port") == server.port
            and r.get("txt") and predicate(r)]


@pytest.fixture
def models(models_dir: Path, tmp_path: Path) -> Path:
    base = tmp_path / "models"
    shutil.copytree(models_dir / MODEL, base / MODEL)
    return base


def unique_name() -> str:
    return f"line-3 camera {uuid.uuid4().hex[:6]}"


# -- tests ------------------------------------------------------------------------------------
def test_browser_finds_the_service_with_its_txt_record(net: Net, models: Path, tmp_path: Path, procs: Any) -> None:
    a, c = net.hosts["a"], net.hosts["c"]
    name = unique_name()
    watch = watcher(procs, c, tmp_path)  # python-zeroconf directly, both service types
    server = procs(Appliance, a, tmp_path, models, name)
    wait_until(lambda: seen(watch, server, lambda r: r["txt"]["models"] == f"{MODEL}@1"), 60,
               "the announcement with the model serving", watch, server)
    (http,) = wait_until(lambda: seen(watch, server, kind=HTTP_TYPE)[-1:], 30, "the _http._tcp record", watch)
    assert http["name"] == f"{name}.{HTTP_TYPE}" and http["txt"]["path"] == "/"

    (found,) = [r for r in discover(c) if r["port"] == server.port]  # the CLI, as its own process
    assert found["name"] == name
    assert found["addresses"] == [a.address]
    assert found["url"] == f"http://{a.address}:{server.port}/"
    assert found["id"] == server.device_id and found["id"]
    assert found["version"] == appliance.__version__
    assert found["api"] == "/v1" and found["txt"]["path"] == "/"
    assert found["backend"] == "tflite"
    assert found["models"] == [MODEL] and found["versions"] == {MODEL: 1}
    assert next(iter(found["txt"])) == "txtvers" and found["txt"]["txtvers"] == "1"
    assert seen(watch, server)[-1]["txt_keys"][0] == "txtvers"  # the order on the wire


def test_txt_record_follows_a_new_model_version(net: Net, models: Path, tmp_path: Path, procs: Any) -> None:
    a, c = net.hosts["a"], net.hosts["c"]
    watch = watcher(procs, c, tmp_path)
    server = procs(Appliance, a, tmp_path, models, unique_name())
    wait_until(lambda: seen(watch, server, lambda r: r["txt"]["models"] == f"{MODEL}@1"), 60,
               "the first announcement with version 1", watch, server)

    staging = tmp_path / "staging-2"
    shutil.copytree(models / MODEL / "1", staging)
    os.rename(staging, models / MODEL / "2")  # a version appears atomically, as sync commits it

    wait_until(lambda: seen(watch, server, lambda r: r["event"] == "updated" and r["txt"]["models"] == f"{MODEL}@2"),
               60, "a TXT update with version 2", watch, server)
    assert [r["versions"] for r in discover(c) if r["port"] == server.port] == [{MODEL: 2}]


def test_goodbye_on_shutdown_removes_the_service(net: Net, models: Path, tmp_path: Path, procs: Any) -> None:
    a, c = net.hosts["a"], net.hosts["c"]
    name = unique_name()
    watch = watcher(procs, c, tmp_path)
    server = procs(Appliance, a, tmp_path, models, name)
    wait_until(lambda: seen(watch, server, kind=HTTP_TYPE) and seen(watch, server), 60,
               "the service to be seen", watch, server)

    assert server.stop() == 0
    # Records live for minutes in caches: only goodbye packets make the browser drop it now.
    wait_until(lambda: {(r["type"], r["event"]) for r in events(watch) if name in r.get("name", "")}
               >= {(SERVICE_TYPE, "removed"), (HTTP_TYPE, "removed")}, 15, "the goodbye", watch, server)
    assert not [r for r in discover(c) if r["name"] == name]


def test_two_services_with_one_name_get_distinct_names(net: Net, models: Path, tmp_path: Path, procs: Any) -> None:
    a, b, c = net.hosts["a"], net.hosts["b"], net.hosts["c"]
    name = unique_name()
    watch = watcher(procs, c, tmp_path)
    first = procs(Appliance, a, tmp_path, models, name)
    wait_until(lambda: seen(watch, first), 60, "the first service", watch, first)
    second = procs(Appliance, b, tmp_path, models, name)
    wait_until(lambda: seen(watch, second), 60, "the second service", watch, second)

    names = {r["port"]: r["name"] for r in discover(c) if r["port"] in (first.port, second.port)}
    assert names == {first.port: name, second.port: f"{name} (2)"}
    assert {r["name"] for r in seen(watch, second, kind=HTTP_TYPE)} == {f"{name} (2).{HTTP_TYPE}"}


def test_announced_addresses_follow_interface_changes(net: Net, models: Path, tmp_path: Path, procs: Any) -> None:
    if net.mode != "netns":
        pytest.skip("needs network namespaces to change an interface's addresses")
    a, c = net.hosts["a"], net.hosts["c"]
    watch = watcher(procs, c, tmp_path)
    server = procs(Appliance, a, tmp_path, models, unique_name(), "recheck_interval_s = 1.0\n")
    wait_until(lambda: seen(watch, server, lambda r: r["addresses"] == [a.address]), 60, "the service", watch, server)

    extra = a.address.rsplit(".", 1)[0] + ".99"
    net.add_address(a, extra)
    wait_until(lambda: seen(watch, server, lambda r: set(r["addresses"]) == {a.address, extra}), 30,
               "the new address to be announced", watch, server)


def test_discovery_failure_is_shown_and_the_api_keeps_serving(models: Path, tmp_path: Path,
                                                              start_server: Any) -> None:
    config = tmp_path / "broken.toml"
    config.write_text('[discovery]\ninterfaces = ["no-such-if0"]\nrecheck_interval_s = 60.0\n')
    server = start_server("--config", str(config), "--models", str(models), "--backend", "tflite", discovery=True)
    # Discovery attaches after the HTTP server is ready: /api/status may lack the key at first.
    status = server.wait_for(lambda: (s := server.status())["discovery"]["error"] and s, 30,
                             "the discovery error in /api/status")
    assert "no-such-if0" in status["discovery"]["error"] and status["discovery"]["announcing"] is False
    assert server.get("/readyz").status_code == 200

    config.write_text("[discovery]\nenabled = false\n")
    off = start_server("--config", str(config), "--models", str(models), "--backend", "tflite")
    assert off.wait_for(lambda: off.status()["discovery"], 30, "the discovery section in /api/status") == {
        "enabled": False, "error": None, "name": None}


def test_txt_record_is_small_and_ordered() -> None:
    snapshot = {f"model_{i:03d}": {"serving_version": i, "versions": [{"state": "AVAILABLE", "backend": "tflite"}]}
                for i in range(60)}
    txt = discovery.txt_record("0123456789ab", snapshot)
    assert list(txt)[:2] == ["txtvers", "id"]
    assert sum(len(k) + len(v) + 2 for k, v in txt.items()) < 400
    names, versions = discovery.parse_models(txt["models"])
    assert txt["models"].endswith(f",+{60 - len(names)}") and versions["model_000"] == 0
    assert discovery.instance_name("x" * 80, 2).endswith(" (2)")
    assert len(discovery.instance_name("x" * 80, 2).encode()) == 63
