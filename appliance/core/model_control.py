"""Triton's explicit model control, as a filter between the version sources and the manager.

TF Serving's seam keeps this simple: a source says which models and versions it wants, the
manager loads and unloads to match (appliance/core/sources.py). ``ModelControl`` stands in
that seam as a ``VersionTarget``: every source pushes its whole set here, and the manager is
pushed what of it the API asked for.

* ``[kserve] model_control = "none"`` (the default): every set goes on unchanged; the
  repository API's load and unload are refused (Triton's NONE mode).
* ``"explicit"`` (Triton's ``--model-control-mode=explicit``): only the models in
  ``loaded`` go on. ``[kserve] startup_models`` names the ones loaded at start ("*": every
  model of a source's first push, as ``--load-model=*``); ``load(name, batching)`` adds one
  (a model already loaded is unloaded first and loaded again: Triton's reload, how a
  config override takes effect), ``unload(name)`` removes it and the manager drains and
  unloads its versions. ``batching`` overrides (Triton's load "config" parameter, e.g.
  ``{"max_batch_size": 16}``) are merged into the model's ``batching`` settings.

Which models exist is the sources' business: a name no source has cannot be loaded.
Thread-safety: every method may be called from any thread (one lock; pushes happen under it
so the manager sees them in order).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Mapping

from appliance.core.config import ModelConfig
from appliance.core.errors import FailedPrecondition, InvalidArgument
from appliance.core.sources import Aspired, VersionTarget

NOT_EXPLICIT = "explicit model load / unload is not allowed if polling is enabled"  # Triton's words (none mode)


class ModelControl:
    """The filter (module docstring)."""

    def __init__(self, target: VersionTarget, mode: str = "none", startup: list[str] | None = None):
        self.target, self.explicit = target, mode == "explicit"
        startup = list(startup if startup is not None else ["*"])
        self._all_at_start = "*" in startup
        self._loaded: set[str] = {m for m in startup if m != "*"}
        self._sets: dict[str, dict[str, tuple[ModelConfig, Mapping[int, str]]]] = {}
        self._overrides: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def set_aspired(self, source: str, models: Aspired) -> None:
        """(a source) Its whole set, as ``VersionTarget`` says."""
        with self._lock:
            if self.explicit and self._all_at_start and source not in self._sets:
                self._loaded |= set(models)
            self._sets[source] = dict(models)
            self._push(source)

    def _push(self, source: str) -> None:
        models = self._sets[source]
        if self.explicit:
            models = {n: (self._configured(cfg), v) for n, (cfg, v) in models.items() if n in self._loaded}
        self.target.set_aspired(source, models)

    def _configured(self, cfg: ModelConfig) -> ModelConfig:
        override = self._overrides.get(cfg.name)
        return dataclasses.replace(cfg, batching={**cfg.batching, **override}) if override else cfg

    # -- the repository API -------------------------------------------------------------------
    def index(self) -> list[tuple[str, bool]]:
        """Every model the sources have, by name, and whether it is loaded (asked for)."""
        with self._lock:
            names = sorted({n for models in self._sets.values() for n in models})
            return [(n, not self.explicit or n in self._loaded) for n in names]

    def config_of(self, name: str) -> ModelConfig | None:
        """The settings a model is (or would be) loaded with, overrides included."""
        with self._lock:
            for models in self._sets.values():
                if name in models:
                    return self._configured(models[name][0])
        return None

    def load(self, name: str, batching: dict[str, Any] | None = None) -> None:
        """Load ``name`` (again, when loaded: a reload applies a new ``batching`` override)."""
        self._check_explicit()
        with self._lock:
            source = self._source_of(name)
            if batching is not None:
                self._overrides[name] = dict(batching)
            if name in self._loaded:  # reload: the manager unloads it, then loads it afresh
                self._loaded.discard(name)
                self._push(source)
            self._loaded.add(name)
            self._push(source)

    def unload(self, name: str) -> None:
        self._check_explicit()
        with self._lock:
            source = self._source_of(name)
            self._loaded.discard(name)
            self._push(source)

    def _source_of(self, name: str) -> str:
        for source, models in self._sets.items():
            if name in models:
                return source
        raise InvalidArgument(f"failed to load '{name}', failed to poll from model repository")

    def _check_explicit(self) -> None:
        if not self.explicit:
            raise FailedPrecondition(f"{NOT_EXPLICIT}: this server runs with [kserve] model_control = \"none\"; "
                                     "set it to \"explicit\" to load and unload models through the repository API")


__all__ = ["ModelControl", "NOT_EXPLICIT"]
