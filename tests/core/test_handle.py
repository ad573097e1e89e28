"""The handle's rollout duties on a real core (appliance/core/handle.py): a canary candidate's
failure answered again by the serving version, tallied for the judge only when the serving
version does answer; a shadow copy run on the candidate after the serving version answered.

Real LiteRT models: version 1 is the signature-less model (``serving_default``: y = 2x + 1);
the canary candidate is the multi-signature model, which has no ``serving_default`` (its API
change declared with ``accept_api_change``), so every unversioned request fails on it."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from appliance.core.appliance import Appliance
from appliance.core.config import ModelConfig, RolloutConfig
from appliance.core.config_file import load as load_config
from appliance.core.errors import ApplianceError
from tests.support.servers import poll_until

X = {"x": np.array([[3.0]], np.float32)}  # y = 7


@pytest.fixture
def core(request: pytest.FixtureRequest, models_dir: Path, tmp_path: Path) -> Iterator[Appliance]:
    """A core serving model ``m`` version 1, with version 2 (``request.param``: (mode, model))
    loaded beside it as the rollout's candidate."""
    mode, candidate = request.param
    base = tmp_path / "models" / "m"
    shutil.copytree(models_dir / "nosig_tflite" / "1", base / "1")
    config = load_config(None, {"state_dir": str(tmp_path / "state"), "poll_interval_s": 0.2,
                                "discovery.enabled": False})
    rollout = RolloutConfig(mode=mode, canary_percent=100.0, shadow_percent=100.0, min_requests=10**6,
                            max_error_rate=1.0, max_duration_s=3600.0, shadow_busy_share=1.0)
    config.models = [ModelConfig(name="m", base_path=str(base), rollout=rollout, accept_api_change=[2])]
    appliance = Appliance(config).start()
    try:
        manager = appliance.manager
        assert manager is not None and appliance.rollouts is not None
        poll_until(manager.ready, 120, "version 1 to serve")
        stage = tmp_path / "stage"
        shutil.copytree(models_dir / candidate / "1", stage)
        stage.rename(base / "2")
        poll_until(lambda: appliance.rollouts.route("m", None), 120, "version 2 to be the candidate")
        yield appliance
    finally:
        appliance.close()


def figures(core: Appliance) -> dict[str, Any]:
    assert core.rollouts is not None
    route = core.rollouts.route("m", None)
    assert route is not None
    return route.rollout.figures()


@pytest.mark.parametrize("core", [("canary", "multisig_tflite")], indirect=True)
def test_a_failing_canary_is_answered_by_the_serving_version(core: Appliance) -> None:
    assert core.manager is not None
    with core.manager.handle("m") as handle:
        assert handle.version == 2  # routed to the candidate (canary_percent 100)
        out = asyncio.run(handle.run("serving_default", X))
    np.testing.assert_allclose(out["y"], [[7.0]])  # version 1's answer
    f = figures(core)
    assert (f["candidate_requests"], f["candidate_errors"], f["serving_requests"]) == (1, 1, 1)


@pytest.mark.parametrize("core", [("canary", "multisig_tflite")], indirect=True)
def test_a_request_that_fails_on_both_counts_against_neither_version(core: Appliance) -> None:
    assert core.manager is not None
    with pytest.raises(ApplianceError):
        with core.manager.handle("m") as handle:
            asyncio.run(handle.run("serving_default", {"nope": np.zeros((1, 1), np.float32)}))
    f = figures(core)
    assert f["candidate_errors"] == 0 and f["candidate_requests"] == 0 and f["serving_requests"] == 1


@pytest.mark.parametrize("core", [("shadow", "nosig_tflite")], indirect=True)
def test_a_shadow_copy_runs_on_the_candidate_after_the_serving_version_answered(core: Appliance) -> None:
    assert core.manager is not None
    with core.manager.handle("m") as handle:
        assert handle.version == 1
        out = asyncio.run(handle.run("serving_default", X))
    np.testing.assert_allclose(out["y"], [[7.0]])
    f = poll_until(lambda: (f := figures(core))["compared"] >= 1 and f, 30, "the shadow copy to be compared")
    assert f["serving_requests"] == 1 and f["candidate_requests"] == 1 and f["candidate_errors"] == 0
    assert f["output_drift"] == 0.0  # the same model answered the copy


def test_a_rollout_candidate_that_serves_less_is_refused_before_it_is_judged(models_dir: Path,
                                                                             tmp_path: Path) -> None:
    """The API check applies to rollouts alike: without ``accept_api_change`` the candidate
    that lacks ``serving_default`` never loads, and no rollout starts."""
    base = tmp_path / "models" / "m"
    shutil.copytree(models_dir / "nosig_tflite" / "1", base / "1")
    config = load_config(None, {"state_dir": str(tmp_path / "state"), "poll_interval_s": 0.2,
                                "discovery.enabled": False})
    config.models = [ModelConfig(name="m", base_path=str(base), rollout=RolloutConfig(mode="canary"))]
    appliance = Appliance(config).start()
    try:
        manager = appliance.manager
        assert manager is not None and appliance.rollouts is not None
        poll_until(manager.ready, 120, "version 1 to serve")
        shutil.copytree(models_dir / "multisig_tflite" / "1", tmp_path / "stage")
        (tmp_path / "stage").rename(base / "2")
        slot = poll_until(lambda: next((s for s in manager.version_states("m") if s.version == 2 and s.error), None),
                          120, "version 2 refused")
        assert slot.error_code == "FAILED_PRECONDITION" and "signature 'serving_default' is gone" in slot.error
        assert appliance.rollouts.route("m", None) is None
        assert manager.snapshot()["m"]["serving_version"] == 1
    finally:
        appliance.close()
