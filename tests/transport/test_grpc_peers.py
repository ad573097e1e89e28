"""The per-address budgets' arithmetic (appliance/transport/grpc/peers.py), without a server:
an address past a budget is refused until it refills (its debt counted), other addresses are
not touched, a connection's preface costs nothing, and the table stays bounded.
tests/transport/test_grpc_peer_budgets.py runs the attacks against the real service."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from appliance.transport.grpc import limits
from appliance.transport.grpc import peers as p


def test_an_address_past_its_abandoned_budget_is_refused_and_others_are_not() -> None:
    table = p.Peers()
    attacker = table.guard(("127.0.0.2", 40000))
    assert not table.refuse(("127.0.0.2", 40001))
    assert attacker.abandoned(100) == "" and attacker.abandoned(100) == ""  # 200 of 256
    assert "abandoned" in attacker.abandoned(100)  # past the burst: the connection ends
    attacker.closed()
    assert "abandoned" in table.refuse(("127.0.0.2", 40002))  # a new connection: closed at the accept
    assert table.refuse(("127.0.0.1", 40003)) == ""  # another address is served
    assert table.of("127.0.0.2").refusals == 1


def test_debt_keeps_an_address_refused_for_as_long_as_its_burst_takes_to_refill(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]  # the buckets' clock, moved by hand: a loaded machine's pauses cannot refill it
    monkeypatch.setattr(limits, "time", SimpleNamespace(monotonic=lambda: now[0]))
    budget = p.Budget(10, 1000.0)
    assert budget.charge(10) and not budget.charge(30)
    assert budget.tokens == -10  # debt floors at minus the burst
    now[0] += 0.0105  # 10.5 tokens back: still short of one
    assert budget.short()
    now[0] += 0.001
    assert not budget.short(), "the debt and one token refilled, yet still short"


def test_control_frames_are_budgeted_per_address_and_answered_calls_earn_them_back() -> None:
    table = p.Peers()
    guard = table.guard(("10.0.0.9", 1))
    for _ in range(p.PEER_CONTROL_BURST - 1):
        assert guard.control_frame() == ""
        guard.answered()  # a PING that comes with calls (grpcio's BDP pings) costs nothing
    for _ in range(2 * p.PEER_CONTROL_BURST):  # a flood: far more than the burst, at once
        if guard.control_frame():
            break
    else:
        raise AssertionError("a flood of control frames from one address was never refused")
    assert "control frames" in table.refuse(("10.0.0.9", 2))


def test_the_table_forgets_idle_addresses_with_full_budgets_first() -> None:
    table = p.Peers(max_peers=3)
    debtor = table.guard(("10.0.0.1", 1))
    debtor.abandoned(p.PEER_ABANDON_BURST + 10)
    debtor.closed()
    for host in ("10.0.0.2", "10.0.0.3", "10.0.0.4"):
        table.of(host)
    assert len(table.table) == 3
    assert "10.0.0.1" in table.table, "an address in debt was forgotten before idle ones with full budgets"
    assert table.refuse(("10.0.0.1", 2))


def test_unix_socket_peers_share_one_budget() -> None:
    assert p.host_of("") == "" and p.host_of(("::1", 5, 0, 0)) == "::1"
