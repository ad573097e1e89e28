"""What both generation conventions share (runtimes/generative.py): the cache rows a decode loop
owns (``Slots``), the driver's face (``Driver``) and the helpers on a call's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .base import Servable

Shapes = Mapping[str, Mapping[str, tuple[int, ...] | None]]


@dataclass
class Slots:
    """The cache of up to ``capacity`` sequences: ``arrays`` (name -> [capacity, ...]) for
    models with a cache, ``history`` (token ids per row) for a generate_step without one."""

    capacity: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    history: list[list[int]] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # rows of each model call of the last decode
    # Rows whose cache a batch-1 decode returned, held as it came ([1, ...] per name) instead of
    # copied back into ``arrays`` (that copy cost a lone stream ~1.7x a batch-1 conversion's token
    # on a 4 MB cache); ``settle`` puts them back before anything reads ``arrays`` whole.
    own: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    # Rows of ``arrays`` allocated but never written (``np.empty``): zeroed when first used.
    # Zeroing a whole lane up front cost a batch-4 conversion's lone stream ~2 ms of its time to
    # first token on a 4 MB row (12 MB of rows it never uses; bench/RESULTS.md, issue 45); left
    # uninitialized they could hold NaN, which the mask (an addition) does not hide.
    blank: set[int] = field(default_factory=set)

    def clean(self, *rows: int) -> None:
        """Zero the given rows (default: every blank one) if they were never written."""
        for row in rows or sorted(self.blank):
            if row in self.blank:
                self.blank.discard(row)
                for array in self.arrays.values():
                    array[row] = 0

    def row(self, name: str, row: int) -> np.ndarray:
        """Row ``row`` of cache ``name`` as [1, ...]: where it is held."""
        held = self.own.get(row)
        return held[name] if held is not None else self.arrays[name][row:row + 1]

    def settle(self, *rows: int) -> None:
        """Copy the given rows (default: all) held apart back into ``arrays``."""
        for row in rows or list(self.own):
            for name, array in self.own.pop(row, {}).items():
                self.arrays[name][row] = array[0]


class Driver:
    """Common part of both conventions (see module docstring)."""

    kind = ""
    batch_size: int | None = None  # fixed decode batch; None: any number of rows
    context_length: int | None = None  # positions the cache holds; None: unknown
    vocab_size = 0

    def __init__(self, servable: Servable):
        self.servable = servable

    def new_slots(self, capacity: int) -> Slots:
        raise NotImplementedError

    aligned = False  # rows at different positions may share a call (module docstring)

    def prefill(self, slots: Slots, row: int, prompt: Sequence[int], start: int = 0) -> None:
        """Make ``row`` hold ``prompt[:-1]`` from position ``start`` (0 unless ``aligned``);
        ``prompt[-1]`` is the row's first decode token, at ``start + len(prompt) - 1``."""
        raise NotImplementedError

    def decode(self, slots: Slots, rows: Sequence[int], tokens: Sequence[int], positions: Sequence[int],
               starts: Sequence[int] | None = None) -> np.ndarray:
        """One step of the given rows: next-token logits [len(rows), vocab]. ``starts``: each
        row's first position (``aligned`` drivers; else all 0). Sets ``slots.calls``."""
        raise NotImplementedError

    def copy_row(self, src: Slots, src_row: int, dst: Slots, dst_row: int) -> None:
        """Copy one sequence's cache into another row (of the same or another ``Slots``):
        n choices of one prompt share its prefill."""
        src.settle(src_row)
        dst.own.pop(dst_row, None)
        dst.blank.discard(dst_row)  # every array of the row is written below
        for name, array in src.arrays.items():
            dst.arrays[name][dst_row] = array[src_row]
        if src.history:
            dst.history[dst_row] = list(src.history[src_row])

    def move(self, slots: Slots, src: int, dst: int) -> None:
        """Copy one sequence's cache to another row (keeps a dynamic batch packed)."""
        slots.settle(src)
        slots.own.pop(dst, None)
        slots.blank.discard(dst)
        for array in slots.arrays.values():
            array[dst] = array[src]
        if slots.history:
            slots.history[dst] = slots.history[src]

    def warm_up(self) -> None:
        """One short prompt and one step: allocates what the first request would."""
        slots = self.new_slots(self.batch_size or 1)
        self.prefill(slots, 0, [0, 0])
        self.decode(slots, [0], [0], [1])

    def _rows(self, n: int) -> int:
        """Rows one call feeds: the fixed batch, else exactly ``n``."""
        return self.batch_size or n

    def _run(self, signature: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.servable.run(signature, feeds)

    def describe(self) -> dict[str, Any]:
        return {"convention": self.kind, "decode_batch": self.batch_size or "dynamic",
                "context_length": self.context_length, "vocab_size": self.vocab_size, **self._details()}

    def _details(self) -> dict[str, Any]:
        return {}


def batch_of(shape: tuple[int, ...] | None) -> int | None:
    return shape[0] if shape and shape[0] > 0 else None


def owned(array: np.ndarray) -> np.ndarray:
    """A backend's output kept as the next step's cache: used as is when writable."""
    return array if array.flags.writeable else array.copy()


def last_logits(logits: np.ndarray, rows: int) -> np.ndarray:
    return logits.reshape(rows, -1, logits.shape[-1])[:, -1]


__all__ = ["Driver", "Shapes", "Slots", "batch_of", "last_logits", "owned"]
