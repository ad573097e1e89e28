"""What a front worker holds for gRPC calls is accounted in one place and bounded, under legal
big calls too (issue 47, item 5): requests being received count from the moment they are
given credit, through the method that decodes and runs them, and answers until written.

A real service (two front workers, the MLP on LiteRT, batching off so a call may carry many
rows) with ``[grpc] max_buffer_bytes`` at 48 MiB (24 MiB a worker; 16 MiB a connection, messages
up to 8 MiB) takes KServe v2 ModelInfer
calls of 4 MiB from 12 clients at once, each on its own connection (bench/big_calls.py runs
the issue's 16 MiB from 8-16). Before, a request still arriving was held by no account: the
worker took every connection's requests in at once (up to 80 MiB a connection) while
``held_bytes`` read 0. Now a request waits for credit while the worker holds its share, so:
every call is answered (none refused), ``held_bytes`` shows the calls while they run, and never
passes the workers' shares by more than one request each (the one always let in when its
worker holds nothing).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from bench.big_calls import INFER, infer_request, worker_pids  # noqa: E402
from tests.support.servers import free_port  # noqa: E402

MIB = 1 << 20
CALL_MIB, CLIENTS, CALLS_EACH = 4, 12, 3
BUFFER = 48 * MIB  # [grpc] max_buffer_bytes: 24 MiB for each of the two workers

pytestmark = pytest.mark.timeout(600)


def test_big_calls_wait_for_the_workers_share_and_are_all_answered(start_server: Any, models_dir: Path,
                                                                  tmp_path: Path) -> None:
    grpc_port = free_port()
    config = tmp_path / "appliance.toml"
    config.write_text(f"[discovery]\nenabled = false\n[server]\nworkers = 2\n[batching]\nenable_batching = false\n"
                      f"[grpc]\nport = {grpc_port}\nmax_buffer_bytes = {BUFFER}\nmax_message_bytes = {8 * MIB}\n"
                      f"max_connection_buffer_bytes = {16 * MIB}\n"
                      f"[[models]]\nname = \"mlp\"\nbase_path = \"{models_dir / 'keras_mlp_tflite'}\"\n"
                      f"backend = \"tflite\"\n")
    srv = start_server("--config", str(config), "--grpc-port", str(grpc_port))
    srv.wait_for(lambda: len(worker_pids(srv.status())) == 2, 60, "two front workers")
    message = infer_request(CALL_MIB)
    outcomes: list[str] = []
    go = threading.Barrier(CLIENTS)

    def client() -> None:
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1),
                   ("grpc.use_local_subchannel_pool", 1)]  # a connection each
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options) as channel:
            call = channel.unary_unary(INFER)
            go.wait(120)
            for _ in range(CALLS_EACH):
                try:
                    call(message, timeout=300)
                    outcomes.append("OK")
                except grpc.RpcError as exc:
                    outcomes.append(f"{exc.code().name}: {exc.details()}")
    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    held: list[int] = []

    def sample() -> bool:  # the workers' figures, as they report them every second
        held.append(int(srv.status()["grpc"].get("held_bytes", 0)))
        return not any(thread.is_alive() for thread in threads)
    srv.wait_for(sample, 300, f"{CLIENTS} clients' {CALLS_EACH} calls of {CALL_MIB} MiB each")
    failed = [o for o in outcomes if o != "OK"]
    print(f"{len(outcomes)} calls, {len(failed)} not answered; held_bytes peak {max(held) / MIB:.1f} MiB "
          f"over {len(held)} samples")
    assert len(outcomes) == CLIENTS * CALLS_EACH and not failed, f"legal calls were not answered: {failed[:3]}"
    assert max(held) > 0, "held_bytes read 0 throughout: the calls being received and run are not accounted"
    call_bytes = len(message) + 5
    assert max(held) <= BUFFER + 2 * call_bytes, (
        f"the workers held {max(held)} bytes of calls, over their shares of max_buffer_bytes ({BUFFER}) "
        f"plus one {call_bytes}-byte call each")
