"""Version policy: pure functions of what is on disk and the current version states.

TF Serving's split: the source says which versions exist, this module says which ones to
aspire to and what to do next, and the manager carries it out. The one rule above the
rest: **never unload the last ready version** — a newer version only replaces an older
one once it is AVAILABLE itself.
"""

from __future__ import annotations

import enum
from typing import Iterable, Mapping


class State(str, enum.Enum):
    """A model version's state, with TF Serving's names."""

    START = "START"
    LOADING = "LOADING"
    AVAILABLE = "AVAILABLE"
    UNLOADING = "UNLOADING"
    END = "END"


def aspired_versions(policy: str, on_disk: Iterable[int], latest: int = 1,
                     specific: Iterable[int] = (), quarantined: Iterable[int] = ()) -> list[int]:
    """Versions to serve. Quarantined (failed) versions never count, so with ``latest``
    a broken newest version leaves the newest good one aspired."""
    bad = set(quarantined)
    usable = sorted(v for v in set(on_disk) if v not in bad)
    if policy == "all":
        return usable
    if policy == "specific":
        wanted = set(specific)
        return [v for v in usable if v in wanted]
    return usable[-max(1, latest):] if usable else []


def plan(states: Mapping[int, State], aspired: Iterable[int]) -> tuple[list[int], list[int]]:
    """(versions to load, versions to unload) for one model.

    Loads: aspired versions not yet loading or loaded. Unloads: versions no longer
    aspired, but an AVAILABLE one only when some aspired version is AVAILABLE, so the
    model is never left with nothing to serve.
    """
    aspired = sorted(set(aspired))
    live = {v: s for v, s in states.items() if s in (State.START, State.LOADING, State.AVAILABLE)}
    to_load = [v for v in aspired if v not in live]
    aspired_ready = any(live.get(v) == State.AVAILABLE for v in aspired)
    to_unload = [v for v, s in sorted(live.items())
                 if v not in aspired and (s != State.AVAILABLE or aspired_ready)]
    return to_load, to_unload
