"""Version sources: who tells the manager which versions of which models exist.

TF Serving's ``Source`` -> ``AspiredVersionsManager`` seam. A source pushes, the manager
never scans:

    manager.set_aspired(source_name, {model: (ModelConfig, {version: directory})})

CONTRACT (the manager's ``set_aspired``):

- Each call carries the source's WHOLE set: a model the source named before and leaves
  out now is removed (its versions drain and unload); a version left out of a model's
  set is unloaded once the version policy no longer wants it.
- Models belong to the source that first named them; another source naming the same
  model is refused with an event (two folders never fight over one model).
- A call may come from any thread, at any time, as often as the source likes; it only
  records the set and wakes the manager, which loads and unloads in its own thread.
- The directories must hold complete versions (the store commits them by one rename);
  the source's load-time artifact check runs right before each load (``version_check``).

Sources here: ``DirectorySource`` for plain TF Serving base directories (``--models
DIR``, ``[[models]] base_path``) and, in appliance/parts/sync_loop.py, the same class over
the bucket follower's store, rescanned after every sync that changed it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Collection, Mapping, Protocol

from appliance.core.config import ModelConfig

log = logging.getLogger("appliance.sources")

Aspired = Mapping[str, tuple[ModelConfig, Mapping[int, str]]]


class VersionTarget(Protocol):
    """What a source pushes to (the manager)."""

    def set_aspired(self, source: str, models: Aspired) -> None: ...


MAX_VERSION = (1 << 63) - 1  # TF Serving's versions are int64


def version_number(name: str) -> int | None:
    """The version a directory name stands for, or None: as TF Serving's source reads names
    (``safe_strto64``), a name that is no int64 is not a version and is ignored, so a folder
    named 9223372036854775808 never reaches the manager or the state database. Only ASCII
    digits count (``str.isdigit`` takes '²'); leading zeros are TF Serving's ``00000123``."""
    if not (name.isascii() and name.isdigit()):
        return None
    number = int(name)
    return number if number <= MAX_VERSION else None


def versions_on_disk(base: str) -> dict[int, str]:
    """Integer-named version directories of one model base path (of two names for one number,
    such as 7 and 007, the one listed last wins, as in TF Serving)."""
    try:
        names = os.listdir(base)
    except OSError:
        return {}
    out = {}
    for name in names:
        number = version_number(name)
        if number is not None and os.path.isdir(os.path.join(base, name)):
            out[number] = os.path.join(base, name)
    return out


def discover_models(models_dir: str, single_name: str) -> list[ModelConfig]:
    """Models of a TF Serving base directory: DIR/<model>/<version>/, or DIR/<version>/ alone."""
    if not os.path.isdir(models_dir):
        return []
    if versions_on_disk(models_dir):
        return [ModelConfig(name=single_name, base_path=models_dir)]
    found = []
    for name in sorted(os.listdir(models_dir)):
        path = os.path.join(models_dir, name)
        if os.path.isdir(path) and not name.startswith((".", "_")):
            found.append(ModelConfig(name=name, base_path=path))
    return found


class DirectorySource:
    """Models in folders: the ``configured`` ones (each with its own base path) and every
    model found under ``models_dir``, pushed as one set on each ``scan()``.

    ``start(every_s)`` rescans every ``every_s`` seconds in a thread of its own (new
    version folders appear while serving); ``scan()`` may also be called at any time."""

    def __init__(self, name: str, target: VersionTarget, configured: list[ModelConfig] | None = None,
                 models_dir: str = "", single_name: str = "default",
                 settings: Callable[[str], ModelConfig | None] = lambda name: None,
                 withheld: Callable[[str], Collection[int]] = lambda name: ()):
        self.name, self.target = name, target
        self.withheld = withheld  # versions of a model on disk that must not be pushed (still open elsewhere)
        self.configured = list(configured or [])
        self.models_dir, self.single_name = models_dir, single_name
        self.settings = settings  # a discovered model's [[models]] settings, when the config has them
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one scan at a time: the pushes stay in order

    def models(self) -> list[ModelConfig]:
        models = list(self.configured)
        if self.models_dir:
            names = {m.name for m in models}
            for found in discover_models(self.models_dir, self.single_name):
                if found.name not in names:
                    own = self.settings(found.name)
                    models.append(own if own is not None else found)
        return models

    def scan(self) -> None:
        with self._lock:
            self.target.set_aspired(self.name, {m.name: (m, self._versions(m)) for m in self.models()})

    def _versions(self, model: ModelConfig) -> dict[int, str]:
        hidden = self.withheld(model.name)
        return {v: p for v, p in versions_on_disk(model.base_path).items() if v not in hidden}

    def start(self, every_s: float) -> "DirectorySource":
        self.scan()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, args=(every_s,), name=f"source-{self.name}",
                                            daemon=True)
            self._thread.start()
        return self

    def _loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.scan()
            except Exception:  # a disk error must not end the source: the next scan tries again
                log.exception("scanning %s failed", self.models_dir or self.name)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def scan_interval(poll_interval_s: float) -> float:
    """How often a directory is rescanned: ``poll_interval_s``, and hourly when it is 0."""
    return poll_interval_s or 3600.0


__all__ = ["MAX_VERSION", "Aspired", "DirectorySource", "VersionTarget", "discover_models", "scan_interval",
           "version_number", "versions_on_disk"]
