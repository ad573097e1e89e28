"""appliance/core/policy.py, the pure rule the manager follows: properties over every state.

The promise: the last AVAILABLE version is never unloaded for one that is not AVAILABLE yet,
whatever the versions' states and whatever the sources aspire to; and over a whole run of
passes where loads succeed or fail at random, a model that once served keeps an AVAILABLE
version for good."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.core.policy import State, aspired_versions, plan

VERSIONS = st.integers(min_value=1, max_value=12)
STATES = st.dictionaries(VERSIONS, st.sampled_from(list(State)), max_size=8)
ASPIRED = st.lists(VERSIONS, max_size=6)
LIVE = (State.START, State.LOADING, State.AVAILABLE)


@given(STATES, ASPIRED)
def test_plan_never_unloads_the_last_available_version(states: dict[int, State], aspired: list[int]) -> None:
    to_load, to_unload = plan(states, aspired)
    available = {v for v, s in states.items() if s == State.AVAILABLE}
    if available:
        assert available - set(to_unload), (states, aspired, to_unload)
    assert set(to_load) <= set(aspired) and not set(to_unload) & set(aspired)
    assert not any(states.get(v) in LIVE for v in to_load)  # nothing loads twice
    assert all(states[v] in LIVE for v in to_unload)  # only what holds something unloads


@given(STATES, ASPIRED)
def test_an_available_version_goes_only_once_an_aspired_one_is_available(states: dict[int, State],
                                                                         aspired: list[int]) -> None:
    _, to_unload = plan(states, aspired)
    if any(states[v] == State.AVAILABLE for v in to_unload):
        assert any(states.get(v) == State.AVAILABLE for v in aspired)


@given(st.sampled_from(["latest", "all", "specific"]), st.sets(VERSIONS, max_size=8),
       st.integers(min_value=1, max_value=4), st.sets(VERSIONS, max_size=4), st.sets(VERSIONS, max_size=4))
def test_aspired_versions_skip_quarantined_and_follow_the_policy(policy: str, on_disk: set[int], latest: int,
                                                                specific: set[int], quarantined: set[int]) -> None:
    got = aspired_versions(policy, on_disk, latest, specific, quarantined)
    usable = sorted(on_disk - quarantined)
    assert got == sorted(got) and not set(got) & quarantined and set(got) <= set(usable)
    if policy == "latest":
        assert got == usable[-latest:]  # a broken newest version leaves the newest good ones aspired
    elif policy == "all":
        assert got == usable
    else:
        assert set(got) == set(usable) & specific


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sets(VERSIONS, min_size=1, max_size=5), st.lists(st.booleans(), min_size=12,
                                                                                max_size=12)), max_size=8))
def test_a_model_that_served_always_keeps_an_available_version(passes: list[tuple[set[int], list[bool]]]) -> None:
    """Each pass: the source offers some versions (latest policy), every load the plan asks for
    succeeds or fails (quarantined), then the unloads the plan asks for happen, as the manager does."""
    states: dict[int, State] = {}
    quarantined: set[int] = set()
    served = False
    for on_disk, outcomes in passes:
        aspired = aspired_versions("latest", on_disk, 1, (), quarantined)
        to_load, _ = plan(states, aspired)
        for version in to_load:
            ok = outcomes[version - 1]
            states[version] = State.AVAILABLE if ok else State.END
            quarantined |= set() if ok else {version}
        _, to_unload = plan(states, aspired)
        for version in to_unload:
            states[version] = State.END
        served = served or State.AVAILABLE in states.values()
        if served:
            assert State.AVAILABLE in states.values(), (passes, states)
