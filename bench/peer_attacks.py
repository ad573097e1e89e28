"""Issue 47's attacks 3, 4 and 6 on the gRPC port, rerun on loopback against a real service
with two front workers serving the MLP on LiteRT, while a REST and a gRPC probe run every
0.5 s from another loopback address (5 s deadline each):

- ``abandon`` (item 3): connect, send 100 gRPC Predicts, close without reading, again;
- ``ping`` / ``settings`` / ``window_update`` (item 4): 190 PINGs (or SETTINGS, or
  WINDOW_UPDATEs) a connection, just under the per-connection burst, then a new connection;
- ``zero_window`` (issue 37's zero-window stalls): connections that set
  SETTINGS_INITIAL_WINDOW_SIZE 0, send 100 Predicts of 8 rows and never read or grant credit,
  all kept open until the attack ends (then closed at once);
- ``tls`` (item 6): slow TLS clients, each trickling its ClientHello 1 byte every 2 s and
  reconnecting when closed, on the gRPC TLS port (``[grpc] max_connections`` lowered so a few
  hundred fill it, as 2,000 fill the default; ``--clients 2000 --tls-cap 0`` is the issue's
  own figure on the default cap).

The attacker connects from 127.0.0.2, the probes from 127.0.0.1 (a per-address budget must
limit the one and not the other). Prints per attack: connections made, probes failed per API,
seconds from the attack's end until both APIs answer, the tree's RSS idle / at its peak / 30 s
after, and what the service says it refused (``/api/status`` ``grpc``).

    PYTHONPATH=. .venv/bin/python -m bench.peer_attacks [--attack abandon,ping,settings,tls] [--seconds 20]

tests/transport/test_grpc_peer_budgets.py runs the same attacks, shorter, and asserts on them.
Compare a tree before the change by running this with ``PYTHONPATH`` at a ``git worktree`` of it.
Targets are loopback only; every process it starts is stopped by PID.
"""

from __future__ import annotations

import argparse
import resource
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ATTACKER = "127.0.0.2"  # the attacker's source address; the probes come from 127.0.0.1
PREDICT = "/tensorflow.serving.PredictionService/Predict"
PROBE_EVERY_S, PROBE_TIMEOUT_S = 0.5, 5.0


def predict_request(rows: int = 1) -> bytes:
    from appliance.protos.tfserving import pb

    request = pb.PredictRequest()
    request.model_spec.name = "mlp"
    tensor = request.inputs["x"]
    tensor.dtype = 1  # DT_FLOAT
    tensor.tensor_shape.dim.add(size=rows)
    tensor.tensor_shape.dim.add(size=64)
    tensor.float_val.extend([0.25] * (64 * rows))
    return bytes(request.SerializeToString())


def dial(port: int, timeout: float = 5) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(ATTACKER, 0))


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except OSError:  # the server closed it (GOAWAY, or refused at once): what a limit looks like
        return False


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", stream) + payload


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, PING, WINDOW_UPDATE = 0x4, 0x6, 0x8


def abandon_burst(port: int, calls: int = 100) -> bytes:
    """The preface, then ``calls`` whole Predicts on streams 1, 3, 5..."""
    from bench.h2load import build_request

    request, offsets = build_request("127.0.0.1", port, PREDICT, predict_request())
    out = [PREFACE, frame(SETTINGS, 0, 0)]
    for i in range(calls):
        for off in offsets:
            struct.pack_into(">I", request, off, 2 * i + 1)
        out.append(bytes(request))
    return b"".join(out)


def control_burst(kind: str, frames: int = 190) -> bytes:
    """The preface, then ``frames`` PINGs (or empty SETTINGS, or connection WINDOW_UPDATEs of 1
    with nothing to send them for): just under the per-connection 200."""
    one = {"ping": frame(PING, 0, 0, b"\0" * 8), "settings": frame(SETTINGS, 0, 0),
           "window_update": frame(WINDOW_UPDATE, 0, 0, (1).to_bytes(4, "big"))}[kind]
    return PREFACE + frame(SETTINGS, 0, 0) + one * frames


def one_shot(port: int, burst: bytes) -> Callable[[], None]:
    """A connection that sends ``burst`` and closes without reading a byte."""
    def connection() -> None:
        with dial(port) as sock:
            send_quietly(sock, burst)
    return connection


def client_hello() -> bytes:
    """A real TLS ClientHello (ALPN h2), as the ssl module writes it."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


class Attack(threading.Thread):
    """``clients`` threads running ``connection()`` back to back until ``stop()``."""

    def __init__(self, connection: Callable[[], None], clients: int = 4):
        super().__init__(name="attack", daemon=True)
        self.connection, self.clients, self.made = connection, clients, 0
        self.halt = threading.Event()

    def run(self) -> None:
        def client() -> None:
            while not self.halt.is_set():
                try:
                    self.connection()
                    self.made += 1
                except OSError:  # refused or reset: a limit, or the backlog full
                    self.halt.wait(0.01)
        threads = [threading.Thread(target=client, daemon=True) for _ in range(self.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def stop(self) -> None:
        self.halt.set()
        self.join(60)


class ZeroWindow(Attack):
    """Connections that grant no flow-control window and never read, each kept open until
    ``stop()`` closes them all at once (the answers of 100 calls each stay with the server)."""

    def __init__(self, port: int, clients: int = 4):
        from bench.h2load import build_request

        request, offsets = build_request("127.0.0.1", port, PREDICT, predict_request(8))
        calls = []
        for i in range(100):
            for off in offsets:
                struct.pack_into(">I", request, off, 2 * i + 1)
            calls.append(bytes(request))
        self.burst = PREFACE + frame(SETTINGS, 0, 0, struct.pack(">HI", 0x4, 0)) + b"".join(calls)
        self.held: list[socket.socket] = []
        self.lock = threading.Lock()
        self.port = port
        super().__init__(self.stall, clients)

    def stall(self) -> None:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5, source_address=(ATTACKER, 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # never read: the answers stay with the server
        with self.lock:
            self.held.append(sock)
        send_quietly(sock, self.burst)
        self.halt.wait(0.05)

    def stop(self) -> None:
        super().stop()
        with self.lock:
            for sock in self.held:
                sock.close()
            self.held.clear()


class SlowTLS(threading.Thread):
    """``clients`` connections each trickling a ClientHello 1 byte every ``interval`` s; one
    the server closes is replaced at once. ``made``: connections made in all."""

    def __init__(self, port: int, clients: int, interval: float = 2.0):
        super().__init__(name="slow-tls", daemon=True)
        self.port, self.clients, self.interval = port, clients, interval
        self.hello, self.made, self.closed = client_hello(), 0, 0
        self.halt = threading.Event()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < clients + 256:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, clients + 256), hard))

    def _open(self) -> tuple[socket.socket, int] | None:
        try:
            sock = dial(self.port, timeout=2)
        except OSError:
            return None
        sock.setblocking(False)
        self.made += 1
        return sock, 0

    def run(self) -> None:
        socks: list[tuple[socket.socket, int]] = []
        try:
            while not self.halt.is_set():
                while len(socks) < self.clients and not self.halt.is_set():
                    opened = self._open()
                    if opened is None:
                        break
                    socks.append(opened)
                kept = []
                for sock, sent in socks:
                    if self._alive(sock) and sent < len(self.hello) and self._send(sock, self.hello[sent:sent + 1]):
                        kept.append((sock, sent + 1))
                    else:
                        self.closed += 1
                        sock.close()
                socks = kept
                self.halt.wait(self.interval)
        finally:
            for sock, _ in socks:
                sock.close()

    @staticmethod
    def _alive(sock: socket.socket) -> bool:
        # A non-blocking read, not select(): select() refuses descriptors past FD_SETSIZE (1024),
        # which 2,000 clients reach.
        try:
            return bool(sock.recv(4096))  # b"": the server closed it
        except BlockingIOError:
            return True  # nothing to read: still open
        except OSError:
            return False

    @staticmethod
    def _send(sock: socket.socket, byte: bytes) -> bool:
        try:
            return sock.send(byte) == 1
        except OSError:
            return False

    def stop(self) -> None:
        self.halt.set()
        self.join(60)


class Probes(threading.Thread):
    """A REST predict and a gRPC Predict every PROBE_EVERY_S, each with a PROBE_TIMEOUT_S
    deadline, from 127.0.0.1. ``results``: (when, REST answered, gRPC answered)."""

    def __init__(self, rest: Callable[[float], bool], rpc: Callable[[float], bool], timeout: float = PROBE_TIMEOUT_S):
        super().__init__(name="probes", daemon=True)
        self.rest, self.rpc, self.timeout = rest, rpc, timeout
        self.results: list[tuple[float, bool, bool]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            started = time.monotonic()
            self.results.append((started, self.rest(self.timeout), self.rpc(self.timeout)))
            self.halt.wait(max(0.0, PROBE_EVERY_S - (time.monotonic() - started)))

    def stop(self) -> None:
        self.halt.set()
        self.join(self.timeout * 2 + 30)

    def failed(self) -> tuple[int, int, int]:
        """(probes, REST failed, gRPC failed)."""
        return (len(self.results), sum(not r for _, r, _ in self.results), sum(not g for _, _, g in self.results))


def rest_probe(base: str, verify: Any = True) -> Callable[[float], bool]:
    import requests

    def probe(timeout: float) -> bool:
        try:
            reply = requests.post(f"{base}/v1/models/mlp:predict", json={"instances": [[0.25] * 64]},
                                  timeout=timeout, verify=verify)
            return reply.status_code == 200
        except (requests.RequestException, OSError):
            return False
    return probe


def grpc_probe(port: int, root_cert: bytes | None = None) -> Callable[[float], bool]:
    import grpc

    def probe(timeout: float) -> bool:
        target = f"127.0.0.1:{port}"
        channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials(root_cert),
                                       options=[("grpc.ssl_target_name_override", "localhost")])
                   if root_cert is not None else grpc.insecure_channel(target))
        try:
            with channel:
                return b"probs" in channel.unary_unary(PREDICT)(predict_request(), timeout=timeout)
        except grpc.RpcError:
            return False
    return probe


def recovery(rest: Callable[[float], bool], rpc: Callable[[float], bool], limit: float = 60.0,
             timeline: list[str] | None = None) -> float:
    """Seconds from now until REST and gRPC both answer (``limit`` + 1 when they do not);
    ``timeline`` gets one entry a try (when, which answered)."""
    started = time.monotonic()
    while time.monotonic() - started < limit:
        at = time.monotonic() - started
        ok_rest = rest(2.0)
        ok_rpc = ok_rest and rpc(2.0)
        if timeline is not None:
            timeline.append(f"{at:.1f}s:{'R' if ok_rest else 'r'}{'G' if ok_rpc else 'g'}")
        if ok_rest and ok_rpc:
            return time.monotonic() - started
        time.sleep(0.1)
    return limit + 1


def breakdown(pid: int) -> str:
    """The tree's PSS per process (MiB): serving, zygote, workers (bench/footprint.py's roles)."""
    from bench.footprint import tree

    return " ".join(f"{p['role']} {p['pss']:.0f}" for p in tree(pid))


def tree_rss(pid: int) -> int:
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in (root, *root.children(recursive=True)))


def config_text(models: Path, grpc_port: int, extra: str = "", tls: tuple[Path, Path] | None = None) -> str:
    security = f'[security]\ntls_cert_file = "{tls[0]}"\ntls_key_file = "{tls[1]}"\n' if tls else ""
    return (f"[discovery]\nenabled = false\n[grpc]\nport = {grpc_port}\n{'tls = true' if tls else ''}\n{extra}\n"
            f"{security}[[models]]\nname = \"mlp\"\nbase_path = \"{models / 'keras_mlp_tflite'}\"\nbackend = \"tflite\"\n")


def run(kind: str, seconds: float, work: Path, models: Path, clients: int = 300, tls_cap: int = 64) -> None:
    """One attack against a fresh service; prints its figures."""
    import requests

    from tests.support.servers import free_port, launch

    port, grpc_port = free_port(), free_port()
    tls, verify, root = None, True, None
    if kind == "tls":
        from tests.transport.test_tls import make_cert

        cert, key, _, _ = make_cert(work, f"server-{port}")
        tls, verify, root = (cert, key), str(cert), cert.read_bytes()
    config = work / f"{kind}.toml"
    config.write_text(config_text(models, grpc_port, f"max_connections = {tls_cap}" if kind == "tls" and tls_cap else "", tls))
    srv = launch(["--config", str(config), "--grpc-port", str(grpc_port)], work, port=port, ready=tls is None)
    scheme = "https" if tls else "http"
    srv.wait_for(lambda: requests.get(f"{scheme}://127.0.0.1:{port}/readyz", verify=verify, timeout=2).ok, 120,
                 "the service to be ready")
    rest, rpc = rest_probe(f"{scheme}://127.0.0.1:{port}", verify), grpc_probe(grpc_port, root)
    try:
        for _ in range(10):
            rest(10.0), rpc(10.0)
        idle, peak = tree_rss(srv.proc.pid), 0
        idle_parts = breakdown(srv.proc.pid)
        probes = Probes(rest, rpc)
        attack = attack_process(kind, grpc_port, seconds, clients)
        probes.start()
        try:
            while attack.poll() is None:
                peak = max(peak, tree_rss(srv.proc.pid))
                time.sleep(0.2)
        finally:
            probes.stop()
            if attack.poll() is None:
                attack.kill()
        made = (attack.communicate(timeout=60)[0] or "").strip()
        timeline: list[str] = []
        took = recovery(rest, rpc, timeline=timeline)
        time.sleep(30)
        after = tree_rss(srv.proc.pid)
        after_parts = breakdown(srv.proc.pid)
        n, rest_failed, rpc_failed = probes.failed()
        grpc_status = requests.get(f"{scheme}://127.0.0.1:{port}/api/status", verify=verify,
                                   timeout=30).json().get("grpc", {})
        refused = {k: v for k, v in grpc_status.items() if "refus" in k or "evicted" in k or "tls_handshake" in k}
        print(f"{kind}: {made} (attacking connections) in {seconds:g} s; probes failed REST {rest_failed}/{n}, "
              f"gRPC {rpc_failed}/{n}; both answered {took:.1f} s after the attack; tree RSS idle {idle >> 20} MiB, "
              f"peak {peak >> 20} MiB, 30 s after {after >> 20} MiB; refused: {refused}\n"
              f"  PSS MiB idle: {idle_parts}; 30 s after: {after_parts}\n  after the attack: {' '.join(timeline)}",
              flush=True)
    finally:
        srv.stop()


def attacker(kind: str, port: int, clients: int) -> Any:
    """The attack ``kind`` on ``port`` (not started)."""
    if kind == "tls":
        return SlowTLS(port, clients)
    if kind == "zero_window":
        return ZeroWindow(port)
    return Attack(one_shot(port, abandon_burst(port) if kind == "abandon" else control_burst(kind)))


def attack_process(kind: str, port: int, seconds: float, clients: int = 300) -> "subprocess.Popen[str]":
    """The attack in a process of its own (as the issue's attacker was: its threads never
    take the probes' interpreter lock). It prints ``made N closed M`` when it ends."""
    return subprocess.Popen([sys.executable, "-m", "bench.peer_attacks", "--client", kind, "--port", str(port),
                             "--seconds", str(seconds), "--clients", str(clients)],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)


def client_main(kind: str, port: int, seconds: float, clients: int) -> None:
    attack = attacker(kind, port, clients)
    attack.start()
    time.sleep(seconds)  # the attack's length
    attack.stop()
    print(f"made {attack.made} closed {getattr(attack, 'closed', 0)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attack", default="abandon,ping,settings,tls", help="which, comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each attack runs")
    parser.add_argument("--client", help="be the attacker only (abandon, ping, settings, window_update, zero_window or tls) against --port")
    parser.add_argument("--port", type=int, help="the gRPC port on 127.0.0.1 the --client attacks")
    parser.add_argument("--clients", type=int, default=300, help="slow TLS clients (the tls attack)")
    parser.add_argument("--tls-cap", type=int, default=64,
                        help="the gRPC port's max_connections for the tls attack (0: the service's default, "
                             "1024; the issue's 2,000 clients: --clients 2000 --tls-cap 0)")
    args = parser.parse_args()
    if args.client:
        client_main(args.client, args.port, args.seconds, args.clients)
        return
    from tests.conftest import every_model

    models = every_model()
    with tempfile.TemporaryDirectory(prefix="peer-attacks-") as tmp:
        for kind in args.attack.split(","):
            run(kind, args.seconds, Path(tmp), models, args.clients, args.tls_cap)


if __name__ == "__main__":
    main()
