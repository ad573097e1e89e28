"""Where a new stream goes in a decode loop: the lanes of one model version and their rows.

A *lane* is one ``runtimes.generative.Slots`` (the KV cache of ``lane_size`` rows): one
decode call per step for all its streams. Placement decides how many calls a step costs:

* A driver whose rows each have their own position (genmodel's exports, ``generate_step``,
  a decode batch of 1) takes a stream into any free row.
* An **aligned** driver (a shared ``input_pos`` with the mask as an input,
  runtimes/generative.py) runs every row of a lane at the lane's one position. A new stream
  whose prompt is shorter than that position is placed at an *offset* (its prompt
  prefilled so that its last token lands on the lane's position, the mask hiding the keys
  before it), in the lane that wastes the fewest positions and still leaves room for its
  ``max_new_tokens``; a stream no lane can take opens a lane of its own.
* A shared position **without** the mask input cannot shift a stream: it joins a lane whose
  streams are at its own position when there is one (they share a call), else any free
  row (a call of its own that step).

Single-threaded: the loop thread of appliance/core/generation.py owns its lanes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtimes import generative

if TYPE_CHECKING:
    from appliance.core.streams import Stream


@dataclass
class Lane:
    """One decode call per step: ``slots`` (the cache rows) and the stream in each row."""

    slots: generative.Slots
    # a Stream or None (a free row); Any while generation.py reads the rows it knows are taken
    rows: list[Any] = field(default_factory=list)

    def active(self) -> list[int]:
        return [i for i, s in enumerate(self.rows) if s is not None]

    def free(self) -> int | None:
        return next((i for i, s in enumerate(self.rows) if s is None), None)

    def position(self) -> int | None:
        """The physical position of the next decode input of its streams (aligned: one)."""
        streams = [s for s in self.rows if s is not None]
        return streams[0].physical if streams else None


def place(lanes: list[Lane], driver: generative.Driver, stream: Stream, lane_size: int) -> tuple[Lane, int, int]:
    """(lane, row, offset) for a new stream (module docstring); a new lane is appended
    when no existing one fits. ``offset``: where its prompt's first token goes."""
    want = stream.position  # logical position of its first decode input
    if stream.leader is not None:  # a copy of another choice's prefilled row: its very position
        return _place_copy(lanes, driver, stream.leader, lane_size)
    if getattr(driver, "aligned", False):
        return _place_aligned(lanes, driver, stream, lane_size)
    if getattr(driver, "shared_position", False):
        same = [lane for lane in lanes if lane.free() is not None and lane.position() == want]
        if same:
            return same[0], same[0].free(), 0  # type: ignore[return-value]  # free() is not None: filtered above
    for lane in lanes:
        row = lane.free()
        if row is not None:
            return lane, row, 0
    return _new_lane(lanes, driver, lane_size), 0, 0


def _place_aligned(lanes: list[Lane], driver: generative.Driver, stream: Stream,
                   lane_size: int) -> tuple[Lane, int, int]:
    context = driver.context_length or 0
    need = stream.position + stream.params.max_new_tokens  # logical positions it may use
    best: tuple[int, Lane] | None = None
    for lane in lanes:
        at = lane.position()
        if lane.free() is None or at is None or at < stream.position:
            continue
        offset = at - stream.position
        if offset + need <= context and (best is None or offset < best[0]):
            best = (offset, lane)
    if best is not None:
        return best[1], best[1].free(), best[0]  # type: ignore[return-value]  # free() is not None: filtered above
    empty = next((lane for lane in lanes if not lane.active()), None)
    return (empty or _new_lane(lanes, driver, lane_size)), 0, 0


def _place_copy(lanes: list[Lane], driver: generative.Driver, leader: Stream, lane_size: int) -> tuple[Lane, int, int]:
    """A row at the leader's own physical position (or in a fresh lane): n choices of one
    prompt share its prefilled cache and run in one call."""
    for lane in lanes:
        row = lane.free()
        at = lane.position()
        if row is not None and (at is None or at == leader.physical or not _one_position(driver)):
            return lane, row, leader.offset
    return _new_lane(lanes, driver, lane_size), 0, leader.offset


def _one_position(driver: generative.Driver) -> bool:
    return bool(getattr(driver, "shared_position", False))


def _new_lane(lanes: list[Lane], driver: generative.Driver, lane_size: int) -> Lane:
    lane = Lane(driver.new_slots(lane_size), [None] * lane_size)
    lanes.append(lane)
    return lane


__all__ = ["Lane", "place"]
