"""What a refused version costs across a restart and a hang (issue 47, item 11):

- a version refused at its load stays refused after a restart, with its reason, and is not
  tried again (no new ``load_start``) until its directory or the settings that judged it change;
- a trial's deadline grows with its version's size (``runtime.load_timeout_base_s`` plus
  ``load_timeout_s_per_mb``, at most ``load_timeout_s``), so a small version whose load hangs
  holds the next one up for a minute, not ten; a hanging trial is stopped at it;
- with TLS on, the start-up line says https://.

The real service with half_plus_two's LiteRT model (no TensorFlow in the serving process).
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from appliance.core.loader_trial import MB, Limits, load_deadline_s, run_in_child
from tests.support.servers import free_port
from tests.support.versions_support import SAMPLE, add_version, failed, model_status


def tflite_only(dst: Path) -> Path:
    dst.mkdir(parents=True)
    (dst / "model.tflite").write_bytes((SAMPLE / "model.tflite").read_bytes())
    return dst


def garbage(dst: Path) -> Path:
    dst.mkdir(parents=True)
    (dst / "model.tflite").write_bytes(b"not a flatbuffer " * 64)
    return dst


def loads_of(server: Any, version: int) -> int:
    events = server.status()["events"]
    return sum(1 for e in events if e["kind"] == "load_start" and e["model"] == "hpt" and e["version"] == version)


def config(tmp_path: Path, extra: str = "") -> str:
    path = tmp_path / "appliance.toml"
    path.write_text(f"poll_interval_s = 0.3\n[discovery]\nenabled = false\n[runtime]\nload_memory_mb = 256\n{extra}")
    return str(path)


def test_a_refused_version_stays_refused_across_a_restart(start_server: Any, tmp_path: Path) -> None:
    base = tmp_path / "models"
    add_version(tflite_only, base / "hpt", 1)
    add_version(garbage, base / "hpt", 2)
    port = free_port()
    args = ("--models", str(base), "--backend", "tflite")
    first = start_server(*args, "--config", config(tmp_path), port=port)
    refused = first.wait_for(lambda: failed(first, "hpt", 2), 120, "version 2 to be refused")
    assert loads_of(first, 2) == 1
    first.stop()

    again = start_server(*args, "--config", config(tmp_path), port=port)  # the same state folder
    record = again.wait_for(lambda: failed(again, "hpt", 2), 60, "version 2 shown refused")
    assert (record["error_code"], record["error"]) == (refused["error_code"], refused["error"])
    assert "2" in model_status(again, "hpt")["quarantine"] and model_status(again, "hpt")["serving_version"] == 1
    assert loads_of(again, 2) == 1  # not tried again
    again.stop()

    changed = start_server(*args, "--config", config(tmp_path, "load_timeout_s = 300\n"), port=port)
    changed.wait_for(lambda: loads_of(changed, 2) == 2, 60, "version 2 tried again under other settings")
    changed.wait_for(lambda: failed(changed, "hpt", 2), 120, "version 2 refused again")


def runtime(**kw: float) -> Any:
    return SimpleNamespace(**{"load_timeout_s": 600.0, "load_timeout_s_per_mb": 2.0, "load_timeout_base_s": 60.0,
                              **kw})


def test_the_deadline_grows_with_the_versions_size(tmp_path: Path) -> None:
    small = tflite_only(tmp_path / "small")
    assert 60 < load_deadline_s(str(small), runtime()) < 61  # ~1 KB: the base
    big = tmp_path / "big"
    (big / "variables").mkdir(parents=True)
    (big / "variables" / "variables.data").write_bytes(b"\0" * (50 * MB))
    assert load_deadline_s(str(big), runtime()) == 160.0  # 60 s + 2 s for each of 50 MB
    assert load_deadline_s(str(big), runtime(load_timeout_s=100)) == 100.0  # the cap
    assert load_deadline_s(str(small), runtime(load_timeout_s_per_mb=0)) == 600.0  # off: the whole cap


def test_a_hanging_trial_is_stopped_at_the_small_versions_deadline(tmp_path: Path) -> None:
    small = tflite_only(tmp_path / "small")
    deadline = load_deadline_s(str(small), runtime(load_timeout_base_s=2.0))
    hang = ["python3", "-c", "import json, os, time; print(json.dumps({'resident_bytes': 0}), flush=True); "
            "time.sleep(3600)"]
    verdict = run_in_child({}, Limits(256 * MB, deadline), threading.Event(), hang)
    assert verdict["code"] == "DEADLINE_EXCEEDED" and f"after {deadline:g} s" in verdict["reason"], verdict
    assert "load_timeout_s_per_mb" in verdict["reason"]


def test_the_start_up_line_says_https_with_tls(start_server: Any, tmp_path: Path) -> None:
    from tests.transport.test_tls import make_cert

    cert, key, _, _ = make_cert(tmp_path, "server")
    path = tmp_path / "tls.toml"
    path.write_text(f'[discovery]\nenabled = false\n[security]\ntls_cert_file = "{cert}"\ntls_key_file = "{key}"\n')
    server = start_server("--config", str(path), "--workers", "0", ready=False)
    line = server.wait_for(lambda: next((ln for ln in server.log_text().splitlines() if " listening on " in ln), None),
                           120, "the start-up line")
    assert f"listening on https://localhost:{server.port} " in line, line
