"""runtimes/litertlm.py's EnginePool: one caller per engine, a given-back engine goes to the
longest waiter (first come first served). Plain objects stand in for LiteRT-LM's engines: the
pool only hands them around (and closes them)."""

from __future__ import annotations

import threading
from typing import Callable

from runtimes.litertlm import EnginePool

WAIT_S = 30.0


class _Engine:
    bos_token_id = None

    def __init__(self, name: str) -> None:
        self.name, self.closed = name, False

    def tokenize(self, text: str) -> list[int]:
        return []

    def detokenize(self, ids: list[int]) -> str:
        return ""

    def create_session(self, **_: object) -> object:
        raise AssertionError("not used here")

    def close(self) -> None:
        self.closed = True


def _wait_until(check: Callable[[], bool], what: str) -> None:
    pause = threading.Event()
    for _ in range(int(WAIT_S / 0.01)):
        if check():
            return
        pause.wait(0.01)
    raise AssertionError(f"timed out after {WAIT_S:g} s waiting for {what}")


def test_a_given_back_engine_goes_to_the_waiters_in_arrival_order() -> None:
    engine = _Engine("only")
    pool = EnginePool([engine])
    got: list[str] = []
    threads = []
    with pool.lend() as held:
        assert held is engine
        for name in ("first", "second"):
            def borrow(name: str = name) -> None:
                with pool.lend() as e:
                    got.append(f"{name}:{getattr(e, 'name')}")  # the stand-in's name
            t = threading.Thread(target=borrow)
            t.start()
            threads.append(t)
            _wait_until(lambda n=len(threads): len(pool._waiting) == n, f"{name} to queue for the engine")
        assert got == []  # both wait while the engine is lent
    for t in threads:
        t.join(WAIT_S)
        assert not t.is_alive(), "a waiter never got the engine back"
    assert got == ["first:only", "second:only"]
    assert pool._free == [engine] and not pool._waiting  # back in the pool once nobody waits
    pool.close()
    assert engine.closed and pool.engines == []
