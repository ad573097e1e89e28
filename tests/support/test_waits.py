"""The suite's wait helper: "not yet" errors are retried, the timeout says what it waited for."""

from __future__ import annotations

from typing import Any

import pytest
import requests

from tests.support.servers import free_port, poll_until


def test_a_missing_key_is_retried_until_it_appears() -> None:
    status: dict[str, Any] = {}
    calls = []

    def predicate() -> Any:
        calls.append(1)
        if len(calls) == 3:
            status["discovery"] = {"error": "no such interface"}
        return status["discovery"]["error"]  # KeyError until a part writes the key

    assert poll_until(predicate, 30, "the discovery error") == "no such interface"
    assert len(calls) == 3


def test_a_timeout_names_what_it_waited_for_and_the_last_error() -> None:
    port = free_port()  # nothing listens there: every poll is a connection error
    with pytest.raises(AssertionError) as failure:
        poll_until(lambda: requests.get(f"http://127.0.0.1:{port}/", timeout=2), 0.5, "the server to answer",
                   lambda: "context line")
    text = str(failure.value)
    assert "waiting for the server to answer" in text and "ConnectionError" in text and "context line" in text


def test_other_errors_fail_at_once() -> None:
    calls = []

    def predicate() -> Any:
        calls.append(1)
        return 1 / 0

    with pytest.raises(ZeroDivisionError):
        poll_until(predicate, 30, "never")
    assert len(calls) == 1


def test_a_dead_process_stops_the_wait() -> None:
    with pytest.raises(AssertionError, match="gave up waiting for x: server exited with 3"):
        poll_until(lambda: False, 30, "x", alive=lambda: "server exited with 3")
