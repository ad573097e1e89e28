"""No single point of failure besides the serving process (issue 47 item 8): kill -9 of the
zygote under load costs no request, its workers serve on, a new zygote is started, and a worker
killed afterwards is replaced by one the new zygote forked.

The real service as a user starts it, two keep-alive clients on loopback, SIGKILL sent by PID to
processes of the tree this test started (found with psutil from the service's own pid).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest

from tests.fronts.test_fronts import MLP, Clients, models

pytestmark = pytest.mark.timeout(600)  # the waits below add up to under 300 s


def tree(server: Any) -> dict[int, psutil.Process]:
    return {p.pid: p for p in psutil.Process(server.proc.pid).children(recursive=True)}


def parent(pid: int) -> int | None:
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return None


def workers(server: Any) -> list[dict[str, Any]]:
    return server.status()["workers"]  # type: ignore[no-any-return]


def zygote_of(server: Any) -> int:
    """The zygote that forked worker 0, as /api/status says and the process tree agrees."""
    forker = workers(server)[0]["zygote_pid"]
    assert forker == parent(workers(server)[0]["pid"]) and parent(forker) == server.proc.pid, workers(server)
    return forker  # type: ignore[no-any-return]


def fresh_zygote(server: Any, dead: int) -> int | None:
    """The serving process's child started as a zygote since ``dead`` died, if any."""
    for child in psutil.Process(server.proc.pid).children():
        try:
            if child.pid != dead and "appliance.fronts.zygote" in " ".join(child.cmdline()):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    return None


def test_the_zygote_killed_under_load_costs_no_request(start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    server = start_server("--models", str(models(models_dir, tmp_path, MLP)), "--backend", "tflite", "--workers", "2")
    before = workers(server)
    assert all(w["forked"] for w in before), before
    zygote = zygote_of(server)
    assert zygote in tree(server)  # ours, by PID
    clients = Clients(f"{server.url}/v1/models/{MLP}:predict", threads=2)
    try:
        server.wait_for(lambda: clients.count() >= 50, 60, "50 answered requests")
        os.kill(zygote, signal.SIGKILL)
        server.wait_for(lambda: fresh_zygote(server, zygote) is not None, 60, "a new zygote")
        answered = clients.count()
        server.wait_for(lambda: clients.count() >= answered + 100, 60, "100 more answered requests")
        # the zygote held no request: none failed, and the same workers serve
        assert clients.failures() == [], clients.failures()[:5]
        assert [w["pid"] for w in workers(server)] == [w["pid"] for w in before]
        assert all(w["up"] and w["restarts"] == 0 for w in workers(server)), workers(server)
        new = fresh_zygote(server, zygote)
        assert new is not None

        victim = before[0]["pid"]  # a worker of the dead zygote, handed to the serving process
        assert parent(victim) == server.proc.pid
        os.kill(victim, signal.SIGKILL)
        server.wait_for(lambda: workers(server)[0]["pid"] != victim and workers(server)[0]["up"], 60,
                        "a new worker in the killed one's place")
        replaced = workers(server)[0]
        assert replaced["forked"] and parent(replaced["pid"]) == new == replaced["zygote_pid"], (replaced, new)
        exit_ = replaced["exits"][-1]
        assert exit_["pid"] == victim and exit_["reason"] == "signal" and exit_["code"] == -signal.SIGKILL, exit_
        answered = clients.count()
        server.wait_for(lambda: clients.count() >= answered + 50, 60, "50 answered requests after the worker's kill")
    finally:
        clients.finish()
    # the killed worker's keep-alive connections end: at most one request per client
    failures = clients.failures()
    assert len(failures) <= 2 and all(kind == "cut" for _, kind, _ in failures), failures
    assert not [e for e in server.status()["events"] if e["kind"] == "worker_exited" and "heartbeat" in e["message"]]


def test_connections_queued_for_a_stopped_worker_are_answered_by_its_replacement(
        start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    """A worker's death drains what it can: the connections the kernel queued for it (accepted by
    no one: it was stopped) wait in its listener, which the serving process keeps, and its
    replacement answers them; before, they were reset when the stopped worker was killed."""
    import json
    import http.client

    from tests.fronts.test_fronts import ROW
    from tests.fronts.test_worker_supervision import serve_config

    server = start_server("--config", str(serve_config(tmp_path)), "--models", str(models(models_dir, tmp_path, MLP)),
                          "--backend", "tflite", "--workers", "2")
    victim = workers(server)[0]["pid"]
    assert victim in tree(server)  # ours, by PID
    body = json.dumps({"instances": [ROW]})

    def ask() -> str:  # a fresh connection each: the kernel hashes about half to the stopped worker
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=240)
        try:
            conn.request("POST", f"/v1/models/{MLP}:predict", body, {"Content-Type": "application/json"})
            return str(conn.getresponse().status)
        except (OSError, http.client.HTTPException) as exc:
            return repr(exc)
        finally:
            conn.close()

    assert asked_while_stopped(server, victim, ask) == ["200"] * 20


def asked_while_stopped(server: Any, victim: int, ask: Callable[[], str]) -> list[str]:
    """What 20 ``ask()``s, each on a thread of its own, got while worker 0 (``victim``) was
    stopped (SIGSTOP) until a new worker stood in its place; the stopped one is killed after."""
    import threading

    from tests.fronts.test_worker_supervision import kill_if_left

    outcomes: list[str] = []
    os.kill(victim, signal.SIGSTOP)
    askers = [threading.Thread(target=lambda: outcomes.append(ask())) for _ in range(20)]
    try:
        for t in askers:
            t.start()
        server.wait_for(lambda: workers(server)[0]["pid"] != victim and workers(server)[0]["up"], 120,
                        "a new worker in the stopped one's place")
    finally:
        kill_if_left(victim, server)
        for t in askers:
            t.join(300)
    return outcomes


def grpc_server_live(port: int, timeout: float) -> str:
    """KServe v2's ServerLive on a fresh TCP connection to ``port`` (HTTP/2 by hand, h2: one
    connection, no retry, so a reset shows): "live" when answered OK and live, else what happened."""
    import socket
    import struct

    import h2.config
    import h2.connection
    import h2.events

    from appliance.protos.kserve import pb

    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":authority", f"127.0.0.1:{port}"),
                              (":path", "/inference.GRPCInferenceService/ServerLive"),
                              ("content-type", "application/grpc"), ("te", "trailers")])
        body = pb.ServerLiveRequest().SerializeToString()
        conn.send_data(1, struct.pack(">BI", 0, len(body)) + body, end_stream=True)
        sock.sendall(conn.data_to_send())
        data, status = b"", None
        while status is None:
            chunk = sock.recv(65536)
            if not chunk:
                return "closed"
            for event in conn.receive_data(chunk):
                if isinstance(event, h2.events.DataReceived):
                    data += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                elif isinstance(event, (h2.events.TrailersReceived, h2.events.ResponseReceived)):
                    status = dict(event.headers).get("grpc-status", status)
                elif isinstance(event, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                    return repr(event)
            sock.sendall(conn.data_to_send())
        if status != "0":
            return f"grpc-status {status}"
        return "live" if pb.ServerLiveResponse.FromString(data[5:]).live else "not live"
    except OSError as exc:
        return repr(exc)
    finally:
        sock.close()


def test_grpc_connections_queued_for_a_stopped_worker_are_answered_by_its_replacement(
        start_server: Any, models_dir: Path, tmp_path: Path) -> None:
    """As the REST test above, on the gRPC port the workers serve: each worker's gRPC listener is
    the serving process's too, kept across its death, so gRPC connections queued for a stopped
    worker are answered by its replacement; before, the worker bound its own and they were reset."""
    from tests.fronts.test_worker_supervision import serve_config
    from tests.support.servers import free_port

    grpc_port = free_port()
    server = start_server("--config", str(serve_config(tmp_path)), "--models", str(models(models_dir, tmp_path, MLP)),
                          "--backend", "tflite", "--workers", "2", "--grpc-port", str(grpc_port))
    assert server.status()["grpc"]["served_by"] == "front workers"
    assert grpc_server_live(grpc_port, 60) == "live"
    victim = workers(server)[0]["pid"]
    assert victim in tree(server)  # ours, by PID
    # a fresh connection each: the kernel hashes about half to the stopped worker
    assert asked_while_stopped(server, victim, lambda: grpc_server_live(grpc_port, 240)) == ["live"] * 20
