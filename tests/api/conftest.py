"""Fixtures of the API tests."""

from __future__ import annotations

from typing import Any, Iterator

import pytest


@pytest.fixture(scope="module")
def channel(server: Any) -> Iterator[Any]:
    """A gRPC channel to the module's ``server`` (one with a ``grpc_port``), ready."""
    grpc = pytest.importorskip("grpc")
    ch = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}")
    grpc.channel_ready_future(ch).result(timeout=30)
    yield ch
    ch.close()
