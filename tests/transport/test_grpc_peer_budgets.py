"""Attacks on the gRPC port that reconnect before a per-connection bound (issue 47, items 3, 4
and 6), each against a real ``appliance serve`` (two front workers, the MLP on LiteRT), from
127.0.0.2 while REST and gRPC probes run from 127.0.0.1 (bench/peer_attacks.py holds the
attack clients; it prints the same figures over longer runs):

- **abandoned calls**: connect, send 100 Predicts, close without reading, again. The
  attacker's address passes its budget of abandoned streams and is refused (its connections
  closed before a byte of them is read), and the calls it left are cancelled, not computed:
  the model answers far fewer Predicts than were sent;
- **PING, SETTINGS and WINDOW_UPDATE floods** of 190 frames a connection (under the per-connection 200),
  reconnecting: the address's control-frame budget refuses it;
- **slow TLS handshakes** (a ClientHello trickled 1 byte / 2 s, reconnecting when closed) on
  the gRPC TLS port filled past ``[grpc] max_connections``: the handshake under way longest
  makes room for a new client, so a TLS probe still gets in.

What must hold in each: other clients' probes (each with a deadline of PROBE_S, stretched by
the machine's load) fail at most once per API during the attack, the attacker is refused
(the service's own counters say so), and both APIs answer after the attack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

grpc = pytest.importorskip("grpc")

from bench.peer_attacks import Probes, attack_process, config_text, grpc_probe, rest_probe  # noqa: E402
from tests.support import load  # noqa: E402
from tests.support.servers import free_port  # noqa: E402

ATTACK_S = 8.0
PROBE_S = 5.0  # a probe's deadline on a quiet machine (stretched by the load)
ALLOWED_FAILURES = 1  # per API per attack (the bar)

pytestmark = pytest.mark.timeout(600)


def start(start_server: Any, tmp_path: Path, models_dir: Path, extra: str = "",
          tls: tuple[Path, Path] | None = None) -> Any:
    grpc_port = free_port()
    config = tmp_path / "appliance.toml"
    config.write_text(config_text(models_dir, grpc_port, extra, tls))
    srv = start_server("--config", str(config), "--grpc-port", str(grpc_port), ready=tls is None)
    srv.grpc_port = grpc_port
    return srv


@pytest.fixture()
def service(start_server: Any, models_dir: Path, tmp_path: Path) -> Iterator[Any]:
    srv = start(start_server, tmp_path, models_dir)
    srv.probes = (rest_probe(srv.url), grpc_probe(srv.grpc_port))
    warm(srv)
    yield srv


def warm(srv: Any) -> None:
    """Both APIs answer, a few times (each worker's first calls, the batcher's first batches)."""
    rest, rpc = srv.probes
    srv.wait_for(lambda: all(rest(10.0) and rpc(10.0) for _ in range(5)), 120, "REST and gRPC to answer")


class Attacked:
    """What an attack process did: connections made, and those the server closed (slow TLS)."""

    def __init__(self, out: str):
        words = out.split()
        assert len(words) == 4 and words[0] == "made", f"the attacker did not say what it did: {out!r}"
        self.made, self.closed = int(words[1]), int(words[3])


def under_attack(srv: Any, kind: str, clients: int = 300) -> tuple[Attacked, Probes]:
    """Probes run while the attack (its own process, from 127.0.0.2) runs ATTACK_S; both
    APIs must answer after it."""
    probes = Probes(*srv.probes, timeout=load.scaled(PROBE_S))
    attack = attack_process(kind, srv.grpc_port, ATTACK_S, clients)
    probes.start()
    try:
        out, _ = attack.communicate(timeout=load.scaled(120))
    finally:
        probes.stop()
        if attack.poll() is None:  # only on a failure above: ended here, by its PID
            attack.kill()
            attack.wait(30)
    rest, rpc = srv.probes
    srv.wait_for(lambda: rest(5.0) and rpc(5.0), 60, "REST and gRPC to answer after the attack")
    return Attacked(out), probes


def grpc_figures(srv: Any, verify: Any = True) -> dict[str, Any]:
    import requests

    return dict(requests.get(f"{srv.url}/api/status", timeout=30, verify=verify).json()["grpc"])


def assert_probes_held(probes: Probes, what: str) -> None:
    n, rest_failed, rpc_failed = probes.failed()
    print(f"{what}: probes failed REST {rest_failed}/{n}, gRPC {rpc_failed}/{n}")
    assert n >= 3, f"only {n} probes ran during {what}"
    assert rest_failed <= ALLOWED_FAILURES and rpc_failed <= ALLOWED_FAILURES, (
        f"{what} from another address failed REST {rest_failed} and gRPC {rpc_failed} of {n} probes")


def refused(figures: dict[str, Any]) -> int:
    """Connections refused for their address's budgets: at a frame, or at the accept."""
    return int(figures.get("peer_budget_refusals", 0)) + int(figures.get("peer_refused_connections", 0))


def predicts_answered(srv: Any) -> int:
    """Predicts the model answered (KServe v2's statistics, counted in the serving process)."""
    stats = srv.get("/v2/models/mlp/stats").json()["model_stats"]
    return sum(int(s["inference_stats"]["success"]["count"]) for s in stats)


def test_calls_abandoned_from_one_address_are_refused_and_cancelled(service: Any) -> None:
    before = predicts_answered(service)
    attack, probes = under_attack(service, "abandon")
    sent = attack.made * 100
    answered = predicts_answered(service) - before - len(probes.results)
    figures = grpc_figures(service)
    print(f"abandoned calls: {attack.made} connections of 100 Predicts, {answered} of them computed; {figures}")
    assert_probes_held(probes, "100 Predicts a connection, closed unread")
    assert refused(figures), f"the attacker's address was never refused: {figures}"
    assert attack.made >= 10, f"only {attack.made} attacking connections were made: the attack did not run"
    assert answered < sent // 2, (f"{answered} of the {sent} Predicts sent by a client that closed unread "
                                  "were computed: abandoned calls are not cancelled or refused")


@pytest.mark.parametrize("kind", ["ping", "settings", "window_update"])
def test_control_floods_that_reconnect_are_refused(service: Any, kind: str) -> None:
    attack, probes = under_attack(service, kind)
    figures = grpc_figures(service)
    print(f"{kind} flood: {attack.made} connections of 190 frames; {figures}")
    assert_probes_held(probes, f"190 {kind.upper()} frames a connection, reconnecting")
    assert attack.made >= 10, f"only {attack.made} attacking connections were made: the attack did not run"
    assert refused(figures), f"the flooding address was never refused: {figures}"


def test_slow_tls_handshakes_do_not_starve_the_grpc_tls_port(start_server: Any, models_dir: Path,
                                                             tmp_path: Path) -> None:
    import requests

    from tests.transport.test_tls import make_cert

    cert, key, _, _ = make_cert(tmp_path, "server")
    # 64 connections for the port (32 a worker): 200 slow clients fill it, as 2,000 fill the default
    srv = start(start_server, tmp_path, models_dir, "max_connections = 64", (cert, key))
    srv.url = srv.url.replace("http://", "https://")  # ready when its HTTPS /readyz says so
    srv.wait_for(lambda: requests.get(f"{srv.url}/readyz", verify=str(cert), timeout=2).status_code == 200, 120,
                 "the service to be ready over HTTPS")
    srv.probes = (rest_probe(srv.url, str(cert)), grpc_probe(srv.grpc_port, cert.read_bytes()))
    warm(srv)
    attack, probes = under_attack(srv, "tls", 200)
    figures = grpc_figures(srv, str(cert))
    print(f"slow TLS handshakes: {attack.made} connections, {attack.closed} closed by the server; {figures}")
    assert_probes_held(probes, "200 ClientHellos trickled 1 byte / 2 s")
    assert attack.made > 64, f"only {attack.made} slow connections were made: the port's cap was never reached"
    assert figures.get("evicted_handshakes", 0) > 0, f"no slow handshake made room for a client: {figures}"
