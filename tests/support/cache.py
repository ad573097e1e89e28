"""Test models built once, on this machine, for every test worker and every later session.

``built_once(name, build)`` returns ``<cache>/<name>`` (``$EDGE_TEST_MODEL_CACHE``, else
``/tmp/edge-appliance-test-models``), calling ``build(folder)`` only when no complete copy is
there. Builders take seconds to minutes (TensorFlow, litert-torch), and pytest-xdist runs
several test processes at once: an exclusive ``flock`` on ``.<name>.lock`` makes the others
wait for the one that builds, instead of building the same thing beside it. The build goes to
a staging folder renamed into place, so a session killed mid-build leaves no half cache that
looks complete (``.complete`` is written last).

``ahead_of_tests(fixture)`` registers a cache's builder under the fixture that returns it:
tests/conftest.py builds every registered cache the collected tests use before the first
test starts. A cold build (litert-torch converting a dozen models, TensorFlow writing
SavedModels) belongs to no test: on a busy machine it takes longer than one test's timeout,
and it ran inside whichever test came first. A rerun finds every cache complete and builds
nothing; each cache's name carries a hash of its builder's source, so a changed builder
builds afresh.

Two workers building ahead would otherwise build the caches one after the other, the second
worker waiting on each lock in turn: ``skip_busy()`` makes an outermost ``built_once`` whose
lock another process holds raise ``Busy`` at once instead, so the conftest lets each worker
build what nobody else is building, then waits for the rest (issue 49: a cold CI run's
builds side by side, not in a row).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, TypeVar

Built = TypeVar("Built")
AHEAD: dict[str, Callable[[], object]] = {}  # fixture name -> what builds (and returns) its cache
_skip_busy = False  # inside skip_busy(): an outermost built_once refuses to wait for another's build
_depth = 0  # built_once calls in progress in this process (a builder may use other caches)


class Busy(Exception):
    """Another process holds this cache's lock: it is building it now (``skip_busy``)."""


@contextlib.contextmanager
def skip_busy() -> Iterator[None]:
    """Inside, a ``built_once`` not called from another one raises ``Busy`` instead of waiting
    for a build another process has under way (the caches it builds inside still wait)."""
    global _skip_busy
    _skip_busy = True
    try:
        yield
    finally:
        _skip_busy = False


def ahead_of_tests(fixture: str) -> Callable[[Callable[[], Built]], Callable[[], Built]]:
    """Register ``build`` (no arguments, returns the cache) as what ``fixture`` needs built."""
    def register(build: Callable[[], Built]) -> Callable[[], Built]:
        AHEAD[fixture] = build
        return build
    return register


def cache_root() -> Path:
    return Path(os.environ.get("EDGE_TEST_MODEL_CACHE", "/tmp/edge-appliance-test-models"))


def built_once(name: str, build: Callable[[Path], None]) -> Path:
    """``<cache>/<name>``, built by ``build(folder)`` if no complete copy exists (module docstring)."""
    root = cache_root()
    cache = root / name
    if (cache / ".complete").exists():
        return cache
    root.mkdir(parents=True, exist_ok=True)
    global _depth
    with open(root / f".{name}.lock", "w") as lock:
        try:  # released when the file closes, or the process dies
            fcntl.flock(lock, fcntl.LOCK_EX | (fcntl.LOCK_NB if _skip_busy and _depth == 0 else 0))
        except BlockingIOError:
            raise Busy(name) from None
        if (cache / ".complete").exists():  # built by the worker we waited for
            return cache
        staged = root / f".{name}.build-{os.getpid()}"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir()
        _depth += 1
        try:
            build(staged)
        finally:
            _depth -= 1
        (staged / ".complete").write_text("ok")
        shutil.rmtree(cache, ignore_errors=True)  # what a killed session left, incomplete
        os.rename(staged, cache)
    return cache


__all__ = ["AHEAD", "Busy", "ahead_of_tests", "built_once", "cache_root", "skip_busy"]
