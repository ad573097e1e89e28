"""``appliance fleet``'s table in words (issue 49: ``half_plus_two:1 (failed)`` meant "serving 1,
target 2 failed", and the columns had no header). The model states come from sync/fleet_view.py's
``model_state`` over a device report's model entry, as the command builds them."""

from __future__ import annotations

from typing import Any

from appliance.commands.fleet_text import device_line, header_line
from sync.fleet_view import model_state


def row(**models: dict[str, Any]) -> dict[str, Any]:
    return {"device_id": "cam-7", "status": "degraded", "channel": "stable", "age_s": 12.0, "error": "",
            "problems": [], "trust": "signed", "models": {name: model_state(m) for name, m in models.items()}}


def test_a_failed_target_reads_as_words() -> None:
    failed = {"serving_version": 1, "target_version": 2,
              "versions": [{"version": 2, "state": "END", "reason": "LoadFailure: truncated saved_model.pb"}]}
    line = device_line(row(half_plus_two=failed))
    assert "half_plus_two: target v2 failed; serving v1" in line and "LoadFailure: truncated" in line
    assert "(failed)" not in line and "half_plus_two:1" not in line


def test_each_state_has_its_words() -> None:
    line = device_line(row(a={"serving_version": 3, "target_version": 3},
                           b={"serving_version": 1, "target_version": 2},
                           c={"serving_version": None, "target_version": 1, "refused": {"version": 1, "reason": "unsigned"}},
                           d={"serving_version": 1, "target_version": 2, "wave": {"version": 2, "admitted": False}}))
    assert "a: serving v3; b: serving v1, moving to v2; c: target v1 refused; serving nothing; " \
           "d: serving v1; target v2 waits for its wave" in line


def test_the_header_names_the_columns_above_them() -> None:
    header, line = header_line(), device_line(row(a={"serving_version": 3, "target_version": 3}))
    for column, value in (("STATUS", "DEGRADED"), ("CHANNEL", "stable"), ("MODELS", "a: serving v3")):
        assert header.index(column) == line.index(value), (column, header, line)
    assert header.startswith("DEVICE") and line.startswith("cam-7")
