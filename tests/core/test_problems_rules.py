"""appliance/core/problems.py on its own: which states are problems, which are not yet, and
since when. The snapshots are the shapes the manager, the sync part and the front workers
write (the live service is tests/service/test_problems.py)."""

from __future__ import annotations

from typing import Any

from appliance.core.problems import (ERROR, LOADING_GRACE_S, STALE_WORKER_S, UNSEEN_GRACE_S, WARNING, Inputs, Problem,
                                     ProblemLog, find_problems)


def version(v: int, state: str = "AVAILABLE", **more: Any) -> dict[str, Any]:
    return {"version": v, "state": state, "error": None, "backend": "tflite", "decision": None, **more}


def model(serving: int | None, *versions: dict[str, Any], quarantined: dict[str, Any] | None = None,
          **more: Any) -> dict[str, Any]:
    return {"base_path": "/m", "serving_version": serving, "quarantined": quarantined or {}, "versions": list(versions),
            **more}


def kinds(found: list[Problem]) -> list[tuple[str, str | None, int | None]]:
    return [(p.kind, p.model, p.version) for p in found]


def sync(**more: Any) -> dict[str, Any]:
    return {"bucket": "file:///b", "channel": "stable", "last_error": "", "failures": 0, "targets": {}, **more}


def test_a_healthy_device_has_no_problem() -> None:
    inputs = Inputs(models={"m": model(2, version(2), version(1, "END"))}, sync=sync(targets={"m": 2}),
                    workers=[{"index": 0, "pid": 10, "up": True, "heard_s_ago": 0.5}])
    assert find_problems(inputs) == []


def test_the_target_quarantined_is_two_problems_named_with_their_reason() -> None:
    """The issue's case: v4 quarantined, v3 serves, the channel says v4."""
    m = model(3, version(4, "END", error="LoadFailure: bad"), version(3), quarantined={"4": "LoadFailure: bad"})
    found = find_problems(Inputs(models={"m": m}, sync=sync(targets={"m": 4})))
    assert kinds(found) == [("target_not_reached", "m", 4), ("version_quarantined", "m", 4)]
    target = found[0]
    assert "version 4" in target.message and "version 3 serves" in target.message
    # the reason is said once (issue 49: a ~600-character text three times filled a phone's screen)
    assert "LoadFailure: bad" not in target.message and "quarantined" in target.message
    assert [p.message.count("LoadFailure: bad") for p in found] == [0, 1]
    assert "channel 'stable'" in target.message and target.severity == WARNING and target.grace_s == 0


def test_a_target_still_loading_or_not_yet_loaded_waits_its_grace() -> None:
    loading = find_problems(Inputs(models={"m": model(1, version(2, "LOADING"), version(1))},
                                   sync=sync(targets={"m": 2})))
    assert kinds(loading) == [("target_not_reached", "m", 2)] and loading[0].grace_s == LOADING_GRACE_S
    unseen = find_problems(Inputs(models={"m": model(1, version(1))}, sync=sync(targets={"m": 2})))
    assert unseen[0].grace_s == UNSEEN_GRACE_S and "not loaded" in unseen[0].message


def test_a_candidate_under_judgment_or_a_pin_is_not_a_missed_target() -> None:
    judged = model(1, version(2), version(1), candidate_version=2)
    assert find_problems(Inputs(models={"m": judged}, sync=sync(targets={"m": 2}))) == []
    pinned = model(1, version(2, "END"), version(1))
    assert find_problems(Inputs(models={"m": pinned}, sync=sync(targets={"m": 2}, pins={"m": 1}))) == []


def test_a_model_with_nothing_serving_is_an_error() -> None:
    failed = model(None, version(1, "END", error="x"), quarantined={"1": "x"})
    found = find_problems(Inputs(models={"m": failed}))
    assert kinds(found)[0] == ("model_not_serving", "m", None) and found[0].severity == ERROR
    assert "every version failed" in found[0].message
    empty = find_problems(Inputs(models={"m": model(None)}))
    assert "no version found under /m" in empty[0].message and empty[0].grace_s == 0
    loading = find_problems(Inputs(models={"m": model(None, version(1, "LOADING"))}))
    assert loading[0].grace_s == LOADING_GRACE_S


def test_a_degraded_version_is_named_whichever_way_the_snapshot_says_it() -> None:
    """The manager may mark a partial version with a DEGRADED state or a ``degraded`` reason."""
    by_state = model(2, version(2, "DEGRADED", error="saved_model.pb failed: truncated", error_code="DATA_LOSS"))
    by_flag = model(2, version(2, degraded={"reason": "tf-cpu artifact failed"}))
    for m, text in ((by_state, "truncated"), (by_flag, "tf-cpu artifact failed")):
        found = [p for p in find_problems(Inputs(models={"m": m})) if p.kind == "version_degraded"]
        assert len(found) == 1 and text in found[0].message and found[0].version == 2
    assert [p.error_code for p in find_problems(Inputs(models={"m": by_state}))] == ["DATA_LOSS"]


def test_a_backend_that_failed_on_a_serving_version_is_not_hidden() -> None:
    decision = {"chosen": "tflite", "considered": [
        {"backend": "tf-cpu", "available": True, "load_error": "Cannot parse saved_model.pb"},
        {"backend": "tflite", "available": True, "load_error": None},
        {"backend": "tf-gpu", "available": False, "reason": "no GPU", "load_error": None}]}
    found = find_problems(Inputs(models={"m": model(2, version(2, decision=decision))}))
    assert kinds(found) == [("backend_failed", "m", 2)]
    assert "tf-cpu" in found[0].message and "Cannot parse" in found[0].message
    assert "serves on tflite" in found[0].message
    degraded = find_problems(Inputs(models={"m": model(2, version(2, "DEGRADED", decision=decision, error="tf-cpu"))}))
    assert kinds(degraded) == [("version_degraded", "m", 2)]  # one problem, not two, for one cause


def test_a_quarantine_with_an_error_code_carries_it() -> None:
    m = model(1, version(1), quarantined={"2": {"reason": "crashed while loading", "error_code": "INTERNAL"}})
    found = find_problems(Inputs(models={"m": m}))
    assert found[0].error_code == "INTERNAL" and "crashed while loading" in found[0].message


def test_fewer_workers_up_than_configured_and_a_silent_one() -> None:
    workers = [{"index": 0, "pid": 10, "up": False}, {"index": 1, "pid": 11, "up": True, "heard_s_ago": 0.4},
               {"index": 2, "pid": 12, "up": True, "heard_s_ago": STALE_WORKER_S + 1}]
    found = find_problems(Inputs(workers=workers))
    assert [p.kind for p in found] == ["workers_down", "workers_down"]
    assert "2 of 3 front workers are up" in found[0].message and "0 (pid 10)" in found[0].message
    assert "pid 12" in found[1].message and "not reported" in found[1].message


def test_sync_failing_refusing_and_the_store() -> None:
    failing = find_problems(Inputs(sync=sync(failures=3, last_error="connection refused")))
    assert kinds(failing) == [("sync_failing", None, None)] and "3 failed polls" in failing[0].message
    refusing = find_problems(Inputs(sync=sync(last_error="m: version 5 is not signed", problems=["m/7 is foreign"])))
    assert [p.kind for p in refusing] == ["sync_refused", "store"]


def test_parts_down_are_named_and_a_critical_one_is_an_error() -> None:
    parts = {"appliance.service.grpc_port": "cannot listen", "appliance.parts.discovery": "no multicast"}
    found = find_problems(Inputs(parts_down=parts, critical={"appliance.service.grpc_port"},
                                 database=["state database was damaged"]))
    assert [(p.kind, p.part, p.severity) for p in found] == [("part_down", "gRPC", ERROR),
                                                             ("part_down", "Discovery", WARNING),
                                                             ("state_database", None, WARNING)]


def test_errors_come_first() -> None:
    found = find_problems(Inputs(models={"a": model(1, version(1), quarantined={"2": "x"}), "b": model(None)}))
    assert [p.kind for p in found] == ["model_not_serving", "version_quarantined"]


# -- since when -------------------------------------------------------------------------------
def quarantined(v: int = 4) -> Problem:
    return Problem("version_quarantined", "m v4 is quarantined", model="m", version=v)


def test_since_is_the_failure_event_when_the_log_saw_it() -> None:
    log = ProblemLog()
    log.on_event({"kind": "load_failed", "ts": 1000.0, "model": "m", "version": 4})
    log.on_event({"kind": "loaded", "ts": 1001.0, "model": "m", "version": 3})  # not a failure: ignored
    assert [p.since for p in log.update([quarantined()], now=1002.0)] == [1000.0]
    assert [p.since for p in log.update([quarantined()], now=1500.0)] == [1000.0]  # it stands: unchanged


def test_since_is_the_first_sight_without_an_event_and_restarts_after_an_end() -> None:
    log = ProblemLog()
    assert log.update([quarantined()], now=50.0)[0].since == 50.0
    assert log.update([], now=60.0) == []
    assert log.update([quarantined()], now=70.0)[0].since == 70.0  # a new problem, not the old one


def test_an_old_event_does_not_date_a_later_problem() -> None:
    log = ProblemLog()
    log.on_event({"kind": "load_failed", "ts": 10.0, "model": "m", "version": 4})
    assert log.update([quarantined()], now=11.0)[0].since == 10.0
    log.update([], now=100.0)  # fixed (the folder was replaced and loaded)
    assert log.update([quarantined()], now=200.0)[0].since == 200.0


def test_a_problem_within_its_grace_is_held_back() -> None:
    log = ProblemLog()
    slow = Problem("target_not_reached", "v2 still loading", model="m", version=2, grace_s=LOADING_GRACE_S)
    assert log.update([slow], now=0.0) == []
    assert log.update([slow], now=LOADING_GRACE_S - 1) == []
    shown = log.update([slow], now=LOADING_GRACE_S)
    assert [p.since for p in shown] == [0.0]


def test_sync_and_worker_events_date_their_problems() -> None:
    log = ProblemLog()
    log.on_event({"kind": "sync_error", "ts": 5.0, "model": "", "version": None})
    log.on_event({"kind": "worker_exited", "ts": 6.0, "model": "", "version": None})
    found = log.update([Problem("sync_failing", "x"), Problem("workers_down", "y", part="workers")], now=9.0)
    assert [p.since for p in found] == [5.0, 6.0]


def test_the_dict_form_has_no_empty_keys_and_no_grace() -> None:
    out = Problem("store", "x", since=3.0).to_dict()
    assert out == {"kind": "store", "message": "x", "severity": WARNING, "since": 3.0}


def test_grpc_on_its_slower_fallback_is_a_warning_naming_why() -> None:
    why = "libnghttp2.so.14 was not found (looked for /nowhere): install libnghttp2"
    found = find_problems(Inputs(grpc={"transport": "grpcio", "lean_unavailable": why}))
    assert [(p.kind, p.severity, p.part) for p in found] == [("fallback", WARNING, "gRPC")]
    assert why in found[0].message and "grpcio" in found[0].message
    assert find_problems(Inputs(grpc={"transport": "lean", "http2": "libnghttp2 1.52.0"})) == []
    assert find_problems(Inputs(grpc={"transport": "grpcio"})) == []  # chosen in the config: no fallback


def test_a_quarantined_version_older_than_the_one_serving_is_no_longer_a_problem() -> None:
    """Issue 49: the header stayed amber after a newer good version served; the old version's
    quarantine is history, not something to act on."""
    m = model(5, version(5), version(4, "END", error="LoadFailure: bad"), quarantined={"4": "LoadFailure: bad"})
    assert find_problems(Inputs(models={"m": m}, sync=sync(targets={"m": 5}))) == []
    newer = model(3, version(3), quarantined={"4": "LoadFailure: bad"})  # v3 serves, v4 failed: still a problem
    assert kinds(find_problems(Inputs(models={"m": newer}))) == [("version_quarantined", "m", 4)]
