"""The loader's parts on their own: the trial process's limits and verdicts (real child
processes that grow, hang, crash or answer), what a new version's API breaks, the ledger's
crash markers, the bounds on version numbers and on what an event may hold."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from appliance.core.ledger import MAX_INTERRUPTED, Ledger
from appliance.core.loader_api import api_of, differences
from appliance.core.loader_trial import Limits, run_in_child
from appliance.core.sources import versions_on_disk
from appliance.core.state import StateDB
from runtimes import SignatureInfo, TensorSpec

MB = 1 << 20
BASELINE = "import json,os,sys; print(json.dumps({'resident_bytes': 0}), flush=True); "


def child(code: str) -> list[str]:
    """A stand-in for the trial: reports its baseline as the trial does, then runs ``code``."""
    return [sys.executable, "-c", BASELINE + code]


def trial(code: str, memory_mb: int = 64, timeout_s: float = 60, cancel: threading.Event | None = None) -> Any:
    return run_in_child({}, Limits(memory_mb * MB, timeout_s), cancel or threading.Event(), child(code))


def test_a_child_that_grows_past_the_limit_is_stopped() -> None:
    """Touches 16 MB blocks up to 1 GB at most: the watchdog stops it past 64 MB (+ its start)."""
    verdict = trial("import time\nblocks = []\nfor _ in range(64):\n"
                    "    blocks.append(bytearray(os.urandom(1)) * (16 << 20)); time.sleep(0.01)\ntime.sleep(60)")
    assert verdict["ok"] is False and verdict["code"] == "RESOURCE_EXHAUSTED", verdict
    assert "past the load memory limit of 64 MB" in verdict["reason"]


def test_a_child_that_hangs_is_stopped_at_the_timeout() -> None:
    verdict = trial("import time; time.sleep(120)", timeout_s=1)
    assert verdict["code"] == "DEADLINE_EXCEEDED" and "load_timeout_s" in verdict["reason"], verdict


def test_a_child_is_stopped_when_the_service_stops() -> None:
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    verdict = trial("import time; time.sleep(120)", cancel=cancel)
    assert verdict["code"] == "CANCELLED", verdict


@pytest.mark.parametrize("code, signal_name", [("os.abort()", "SIGABRT"),
                                               ("import ctypes; ctypes.string_at(0)", "SIGSEGV")])
def test_a_crash_is_a_failed_verdict_naming_the_signal(code: str, signal_name: str) -> None:
    verdict = trial("import faulthandler; faulthandler.disable(); " + code)
    assert verdict["code"] == "INTERNAL" and f"crashed with {signal_name}" in verdict["reason"], verdict


def test_an_exception_is_a_failed_verdict_with_the_childs_last_words() -> None:
    verdict = trial("raise RuntimeError('the library said no')")
    assert verdict["code"] == "INTERNAL" and "exit status 1" in verdict["reason"], verdict
    assert "RuntimeError: the library said no" in verdict["reason"]


def test_the_childs_verdict_is_returned() -> None:
    verdict = trial("print(json.dumps({'ok': True, 'backend': 'tflite'}))")
    assert verdict == {"ok": True, "backend": "tflite"}


def sig(name: str, inputs: dict[str, tuple[Any, Any]], outputs: dict[str, tuple[Any, Any]]) -> SignatureInfo:
    spec = lambda n, d, s: TensorSpec(n, np.dtype(d), s)  # noqa: E731
    return SignatureInfo(name, {n: spec(n, d, s) for n, (d, s) in inputs.items()},
                         {n: spec(n, d, s) for n, (d, s) in outputs.items()})


def test_differences_name_every_break_and_accept_what_serves_more() -> None:
    old = api_of({"serving_default": sig("serving_default", {"x": ("float32", (-1, 64))}, {"y": ("float32", (-1, 10))}),
                  "classify": sig("classify", {"e": (object, (-1,))}, {"s": ("float32", (-1, 2))})})
    wider = api_of({"serving_default": sig("serving_default", {"x": ("float32", (-1, -1))}, {"y": ("float32", (-1, 10))}),
                    "classify": sig("classify", {"e": (object, None)}, {"s": ("float32", (-1, 2))}),
                    "extra": sig("extra", {"z": ("int32", (1,))}, {"w": ("int32", (1,))})})
    assert differences(old, wider) == []  # open dimensions, unknown rank and a new signature serve more
    narrower = api_of({"serving_default": sig("serving_default", {"x": ("int8", (-1, 64)), "k": ("float32", (1,))},
                                              {"y": ("float32", (-1, 12))})})
    assert differences(old, narrower) == [
        "signature 'classify' is gone",
        "signature 'serving_default': input 'x' is int8 now, was float32",
        "signature 'serving_default': output 'y' is [-1,12] now, was [-1,10]",
        "signature 'serving_default': requires input 'k' that clients of the old version do not send"]
    assert json.loads(json.dumps(old)) == old  # crosses from the trial process and into the state database


def test_ledger_counts_interrupted_loads_of_the_same_directory(tmp_path: Path) -> None:
    version = tmp_path / "2"
    version.mkdir()
    ledger = Ledger({})
    assert ledger.loading("m", 2, str(version)) == 0  # a process begins it ... and dies: no loaded()
    assert ledger.interrupted("m", 2, str(version)) == 1
    assert ledger.loading("m", 2, str(version)) == 1  # the next start begins it again ... and dies
    assert ledger.interrupted("m", 2, str(version)) == MAX_INTERRUPTED
    os.utime(version, (1, 1))  # the directory was replaced: a fresh start
    assert ledger.interrupted("m", 2, str(version)) == 0
    ledger.loading("m", 2, str(version))
    ledger.loaded("m", 2)
    assert ledger.interrupted("m", 2, str(version)) == 0
    ledger.quarantine("m", 2, str(version), "it ended the service", "ABORTED")
    assert ledger.quarantined("m", 2, str(version)) == ("it ended the service", "ABORTED")
    os.utime(version, (2, 2))
    assert ledger.quarantined("m", 2, str(version)) is None


def test_version_folders_past_int64_or_not_ascii_digits_are_not_versions(tmp_path: Path) -> None:
    for name in ("1", "007", "9223372036854775807", "9223372036854775808", "²", "-1", "1e3", ".2"):
        (tmp_path / name).mkdir()
    assert sorted(versions_on_disk(str(tmp_path))) == [1, 7, 9223372036854775807]


def test_an_event_never_overflows_the_state_database(tmp_path: Path) -> None:
    db = StateDB(str(tmp_path / "state.db")).open()
    try:
        db.event("load_start", "a huge version", model="m", version=1 << 63)
        db.event("load_start", "a fine one", model="m", version=(1 << 63) - 1)
        rows = db.recent(2)
        assert db.problems == []
        assert rows[1]["version"] is None and rows[1]["detail"]["version_number"] == str(1 << 63)
        assert rows[0]["version"] == (1 << 63) - 1
    finally:
        db.close()


def test_litert_batch_slots_share_the_cores_and_a_lone_batch_gets_them_all() -> None:
    """LiteRT's options: each batch slot's interpreter its share of the cores (``num_threads``),
    a batch alone all of them (``wide_threads``, runtimes/tflite.py run_wide); a ``num_threads``
    the config sets is every interpreter's, with no wider one; one slot has nothing to widen."""
    from appliance.core.config import Config
    from appliance.core.loader import LoadEnv, backend_options

    def options(cpus: int, slots: int = 0, num_threads: int = 0) -> dict:
        config = Config()
        config.batching.num_batch_threads = slots
        config.runtime.tflite.num_threads = num_threads
        env = LoadEnv(config, {"cpu_count": cpus}, {}, None, "")  # type: ignore[arg-type]
        tflite = backend_options(env, "m", 1)["tflite"]
        return {k: tflite[k] for k in ("num_threads", "wide_threads")}

    assert options(4) == {"num_threads": 1, "wide_threads": 4}  # a slot per CPU by default
    assert options(8, slots=2) == {"num_threads": 4, "wide_threads": 8}
    assert options(4, num_threads=2) == {"num_threads": 2, "wide_threads": 0}
    assert options(4, slots=1) == {"num_threads": 4, "wide_threads": 0}
    assert options(1) == {"num_threads": 1, "wide_threads": 0}
