"""appliance/core/model_control.py: Triton's explicit model control between the sources and
the manager, with a recording target in the manager's place (the filter is all there is)."""

from __future__ import annotations

from typing import Any, Mapping

import pytest

from appliance.core.config import ModelConfig
from appliance.core.errors import FailedPrecondition, InvalidArgument
from appliance.core.inference_stats import InferenceStats
from appliance.core.model_control import NOT_EXPLICIT, ModelControl


class Target:
    def __init__(self) -> None:
        self.pushes: list[tuple[str, dict[str, Any]]] = []

    def set_aspired(self, source: str, models: Mapping[str, Any]) -> None:
        self.pushes.append((source, dict(models)))

    def last(self) -> dict[str, Any]:
        return self.pushes[-1][1]


def models(*names: str) -> dict[str, Any]:
    return {n: (ModelConfig(name=n, base_path=f"/m/{n}"), {1: f"/m/{n}/1"}) for n in names}


def test_none_mode_passes_everything_and_refuses_control() -> None:
    target = Target()
    control = ModelControl(target, "none")
    control.set_aspired("config", models("a", "b"))
    assert set(target.last()) == {"a", "b"}
    assert control.index() == [("a", True), ("b", True)]
    with pytest.raises(FailedPrecondition, match=NOT_EXPLICIT):
        control.load("a")


def test_explicit_mode_loads_and_unloads_by_request() -> None:
    target = Target()
    control = ModelControl(target, "explicit", ["a"])
    control.set_aspired("config", models("a", "b"))
    assert set(target.last()) == {"a"}
    assert control.index() == [("a", True), ("b", False)]
    control.load("b")
    assert set(target.last()) == {"a", "b"}
    control.unload("a")
    assert set(target.last()) == {"b"}
    control.set_aspired("config", models("a", "b", "c"))  # a rescan keeps the choice; "c" is not loaded
    assert set(target.last()) == {"b"}
    with pytest.raises(InvalidArgument, match="failed to load 'zz', failed to poll from model repository"):
        control.load("zz")


def test_star_loads_a_sources_first_set_only() -> None:
    target = Target()
    control = ModelControl(target, "explicit", ["*"])
    control.set_aspired("config", models("a", "b"))
    control.set_aspired("config", models("a", "b", "new"))
    assert set(target.last()) == {"a", "b"}


def test_reload_with_a_config_override_unloads_first_then_loads_with_it() -> None:
    target = Target()
    control = ModelControl(target, "explicit")
    control.set_aspired("config", models("a"))
    before = len(target.pushes)
    control.load("a", {"max_batch_size": 16})
    first, second = target.pushes[before][1], target.pushes[before + 1][1]
    assert "a" not in first  # the manager drops the old versions (and their batcher) ...
    assert second["a"][0].batching == {"max_batch_size": 16}  # ... and loads them with the override
    cfg = control.config_of("a")
    assert cfg is not None and cfg.batching == {"max_batch_size": 16}


def test_statistics_add_up_per_version() -> None:
    stats = InferenceStats()
    stats.request("m", 1, True, 0.002)
    stats.request("m", 1, False, 0.001)
    stats.execution("m", 1, rows=3, requests=2, queued=0.0005, ran=0.004)
    got = stats.of("m", 1)
    inference = got["inference_stats"]
    assert isinstance(inference, dict)
    assert inference["success"] == {"count": 1, "ns": 2_000_000}
    assert inference["fail"] == {"count": 1, "ns": 1_000_000}
    assert inference["queue"] == {"count": 2, "ns": 1_000_000}
    assert inference["compute_infer"] == {"count": 2, "ns": 8_000_000}
    assert got["inference_count"] == 3 and got["execution_count"] == 1 and got["last_inference"] > 0
    assert got["batch_stats"] == [{"batch_size": 3, "compute_input": {"count": 1, "ns": 0},
                                   "compute_infer": {"count": 1, "ns": 4_000_000},
                                   "compute_output": {"count": 1, "ns": 0}}]
    assert stats.of("m", 2)["execution_count"] == 0
