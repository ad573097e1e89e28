"""Faults: kill -9 at random moments under load and during sync; a bad state database.

Kill -9: the real service (LiteRT backend, so a restart takes about a second) follows a
loopback HTTP mirror that sends model files at a throttled rate while a publisher thread
keeps publishing signed versions and a load thread keeps predicting. Each of N rounds kills
the service either at a random moment or the moment a download is in flight, then checks
what a power cut would leave: the state database passes ``PRAGMA integrity_check`` and is
in WAL mode, every committed version matches its manifest. The restart must become ready
and serve a complete, verified version.

State database: corrupt, read-only (the whole state folder, by a read-only bind mount)
or missing at start-up: the service starts, serves what is on disk, and says what is wrong
in ``/readyz``'s body and ``/api/status`` instead of crash-looping.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from sync import manifest as mf
from sync.publisher import publish
from sync.open_source import open_source
from sync.store import verify_version
from tests.support.cache import built_once
from tests.support.mirror import Mirror
from tests.support.servers import ROOT, free_port, launch
from tests.support.sync_support import store_is_complete

SMALL = {"in_dim": 8, "hidden": 16, "out": 2}
ROUNDS = 10
PAD_BYTES = 768 << 10  # each version carries this much extra, sent at RATE: downloads take ~0.4 s
RATE = 2 << 20


def small_models() -> Path:
    """<cache>/small/<v>/model.tflite for v = 1..3 (a tiny MLP, different weights each)."""
    from tests.support import modelgen

    digest = hashlib.sha256((ROOT / "tests" / "support" / "modelgen.py").read_bytes() + repr(SMALL).encode()).hexdigest()[:12]

    def build(folder: Path) -> None:
        for v in (1, 2, 3):
            modelgen.build_keras_mlp_tflite(str(folder / "small" / str(v)), seed=v, **SMALL)

    return built_once(f"small-{digest}", build) / "small"


class ThrottledMirror(Mirror):
    """A read-only loopback HTTP mirror of a bucket folder that sends at ``RATE`` bytes/s
    (Range supported), so the device spends real time mid-download."""

    def serve(self, h: Any) -> None:
        found = self.found(h)
        if found is None:
            return
        _, data, start = found
        if start >= len(data) > 0:
            h.send_response(416)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        self.head(h, data, start)
        body = data[start:]
        step = 32 << 10
        for i in range(0, len(body), step):
            h.wfile.write(body[i:i + step])
            if len(body) > step:
                time.sleep(step / RATE)


class Publisher(threading.Thread):
    """Publishes a new signed version every ~0.8 s until stopped (the fleet moving on)."""

    def __init__(self, folder: Path, models: Path, key: Any, work: Path):
        super().__init__(name="publisher", daemon=True)
        self.folder, self.models, self.key, self.work = folder, models, key, work
        self.stop = threading.Event()
        self.version = 1
        self.errors: list[str] = []

    def publish_next(self) -> None:
        v = self.version
        src = self.work / f"v{v}"
        shutil.copytree(self.models / str((v - 1) % 3 + 1), src)
        (src / "pad.bin").write_bytes(os.urandom(PAD_BYTES))
        publish(open_source(f"file://{self.folder}"), "small", str(src), v, sign_key=self.key)
        shutil.rmtree(src)
        self.version += 1

    def run(self) -> None:
        while not self.stop.wait(0.8):
            try:
                self.publish_next()
            except Exception as exc:  # a finding, reported by the test
                self.errors.append(repr(exc))


class Load(threading.Thread):
    """Light predict load against whatever server is current; errors while it is down are expected."""

    def __init__(self) -> None:
        super().__init__(name="load", daemon=True)
        self.url = ""
        self.stop = threading.Event()
        self.ok = 0

    def run(self) -> None:
        body = {"instances": [[0.1] * SMALL["in_dim"]]}
        with requests.Session() as s:
            while not self.stop.is_set():
                try:
                    if self.url and s.post(f"{self.url}/v1/models/small:predict", json=body, timeout=5).ok:
                        self.ok += 1
                except requests.RequestException:
                    time.sleep(0.02)


def device_config(tmp: Path, port: int, bucket: str, public_key: str) -> Path:
    path = tmp / f"device-{port}.toml"
    path.write_text("\n".join([
        f'models_dir = "{tmp}/state-{port}/models"', "poll_interval_s = 0.3", "[sync]", f'bucket = "{bucket}"',
        f'public_key = "{public_key}"', "poll_interval_s = 0.2", "jitter = 0.1", "max_backoff_s = 1.0",
        "report_interval_s = 3600", "retain = 2"]) + "\n")
    return path


def db_check(state: Path) -> tuple[str, str]:
    """(integrity_check, journal_mode) of the state database a dead process left."""
    conn = sqlite3.connect(f"file:{state / 'state.db'}?mode=ro", uri=True)
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0], conn.execute("PRAGMA journal_mode").fetchone()[0]
    finally:
        conn.close()


def served_version_is_verified(server: Any, public_key: Any) -> int:
    """The serving version; asserts it answers and its directory matches a manifest signed by the fleet key."""
    status = server.get("/api/status").json()
    version = status["models"]["small"]["serving_version"]
    r = server.post("/v1/models/small:predict", {"instances": [[0.1] * SMALL["in_dim"]]})
    assert r.status_code == 200, r.text
    directory = server.state / "models/small" / str(version)
    assert verify_version(str(directory)) == []
    mf.verify((directory / "MANIFEST.json").read_bytes(), "small", version, public_key, frozenset({"any"}))
    return int(version)


def partials(state: Path) -> list[Path]:
    return [p for p in (state / "staging").rglob("*.part") if p.is_file() and p.stat().st_size > 0]


@pytest.mark.timeout(240)
def test_kill_9_at_random_moments_under_load_and_during_sync(tmp_path: Path) -> None:
    models = small_models()
    mf.keygen(str(tmp_path / "k.key"), str(tmp_path / "k.pub"))
    key, public = mf.load_private_key(str(tmp_path / "k.key")), mf.load_public_key(str(tmp_path / "k.pub"))
    folder = tmp_path / "bucket"
    publisher = Publisher(folder, models, key, tmp_path)
    publisher.publish_next()
    mirror = ThrottledMirror(folder).start()
    port = free_port()
    config = device_config(tmp_path, port, mirror.url, str(tmp_path / "k.pub"))
    args = ["--config", str(config), "--backend", "tflite"]
    rng = random.Random(int(os.environ.get("EDGE_FAULT_SEED", "9")))
    load, server = Load(), None
    mid_transfer, served = 0, []
    load.start()
    publisher.start()
    try:
        for round_ in range(ROUNDS):
            server = launch(args, tmp_path, port=port, timeout=60)
            load.url = server.url
            served.append(served_version_is_verified(server, public))
            assert not [p for p in (server.state / "staging").rglob("*") if p.is_file() and p.name.endswith(".part")
                        and p.stat().st_mtime < server_started(server)], "staging was not emptied at start-up"
            if round_ % 2:  # the moment a download is in flight
                server.wait_for(lambda: partials(server.state), 30, "a download in flight")
            else:  # any moment
                time.sleep(rng.uniform(0.05, 1.2))
            mid_transfer += bool(partials(server.state))
            server.stop(signal.SIGKILL)
            integrity, mode = db_check(server.state)
            assert (integrity, mode) == ("ok", "wal"), f"round {round_}: {integrity}, {mode}"
            assert store_is_complete(server.state / "models") == [], f"round {round_}"
        server = launch(args, tmp_path, port=port, timeout=60)  # the last restart must serve too
        served.append(served_version_is_verified(server, public))
        server.stop()
    finally:
        publisher.stop.set()
        load.stop.set()
        publisher.join(30)
        load.join(30)
        if server is not None:
            server.stop(signal.SIGKILL)
        mirror.stop()
    print(f"\n{ROUNDS} kills, {mid_transfer} mid-transfer; versions served after each restart: {served}; "
          f"{load.ok} requests answered")
    assert mid_transfer >= ROUNDS // 2 and publisher.errors == []
    assert served == sorted(served) and served[-1] > served[0]  # it kept converging forward


def server_started(server: Any) -> float:
    import psutil

    return psutil.Process(server.proc.pid).create_time()


# -- the state database at start-up -----------------------------------------------------------
@pytest.fixture(scope="module")
def small_v1() -> Path:
    return small_models() / "1"


def start_plain(tmp: Path, port: int, bucket: Path) -> Any:
    config = tmp / f"plain-{port}.toml"
    config.write_text("\n".join([f'models_dir = "{tmp}/state-{port}/models"', "[sync]", f'bucket = "file://{bucket}"',
                                 "poll_interval_s = 0.2"]) + "\n")
    return launch(["--config", str(config), "--backend", "tflite"], tmp, port=port, timeout=60)


def readyz(server: Any) -> tuple[int, dict[str, Any]]:
    r = server.get("/readyz")
    return r.status_code, r.json()


@pytest.fixture
def first_run(tmp_path: Path, small_v1: Path) -> Iterator[tuple[Path, int, Path]]:
    """A device that ran once (version 1 synced, a state database written) and stopped."""
    bucket = tmp_path / "bucket"
    publish(open_source(f"file://{bucket}"), "small", str(small_v1), 1)
    port = free_port()
    server = start_plain(tmp_path, port, bucket)
    assert server.stop() == 0
    yield bucket, port, server.state


def test_a_corrupt_state_database_is_moved_aside_and_reported(tmp_path: Path, first_run: Any) -> None:
    bucket, port, state = first_run
    (state / "state.db").write_bytes(b"this is not a database " * 200)
    for suffix in ("-wal", "-shm"):
        (state / f"state.db{suffix}").unlink(missing_ok=True)
    server = start_plain(tmp_path, port, bucket)
    try:
        code, body = readyz(server)
        assert code == 200 and any("was damaged" in p for p in body.get("problems", [])), body
        status = server.get("/api/status").json()
        assert any(p["kind"] == "state_database" and "was damaged" in p["message"] for p in status["problems"])
        assert status["models"]["small"]["serving_version"] == 1
        assert list(state.glob("state.db.corrupt-*")) and db_check(state) == ("ok", "wal")
        page_shows(server.url, "was damaged")
    finally:
        server.stop()


def page_shows(url: str, text: str) -> None:
    """The status page, in a real browser, shows ``text`` (skipped where no browser is installed)."""
    from tests.ui.test_ui import CHROMIUM, CHROMIUM_ARGS, _browser_missing

    if _browser_missing():
        return
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url + "/")
            page.get_by_text(text, exact=False).first.wait_for(state="visible", timeout=30_000)
        finally:
            browser.close()


def test_a_damaged_page_inside_the_database_is_caught_too(tmp_path: Path, first_run: Any) -> None:
    bucket, port, state = first_run
    db = state / "state.db"
    data = bytearray(db.read_bytes())
    assert len(data) >= 3 * 4096
    data[4096:8192] = b"\xff" * 4096  # the header is fine; a table page is garbage
    db.write_bytes(bytes(data))
    server = start_plain(tmp_path, port, bucket)
    try:
        code, body = readyz(server)
        assert code == 200 and body.get("problems"), body
        assert db_check(state)[0] == "ok"
    finally:
        server.stop()


@pytest.mark.skipif(os.getuid() != 0, reason="a read-only bind mount needs root (chmod does not stop root)")
def test_a_read_only_state_folder_still_serves_and_says_why(tmp_path: Path, first_run: Any) -> None:
    bucket, port, state = first_run
    subprocess.run(["mount", "--bind", str(state), str(state)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(state)], check=True)
        server = start_plain(tmp_path, port, bucket)
        try:
            code, body = readyz(server)
            assert code == 200, body
            problems = " | ".join(body.get("problems", []))
            assert "cannot be opened for writing" in problems and "appliance.parts.sync_loop" in problems, problems
            r = server.post("/v1/models/small:predict", {"instances": [[0.1] * SMALL["in_dim"]]})
            assert r.status_code == 200, r.text
            status = server.get("/api/status").json()
            assert status["problems"] and status["models"]["small"]["serving_version"] == 1
        finally:
            server.stop()
    finally:
        subprocess.run(["umount", str(state)], check=True)


def test_a_missing_state_database_or_folder_starts_clean(tmp_path: Path, first_run: Any) -> None:
    bucket, port, state = first_run
    for name in ("state.db", "state.db-wal", "state.db-shm"):
        (state / name).unlink(missing_ok=True)
    server = start_plain(tmp_path, port, bucket)
    try:
        code, body = readyz(server)
        assert code == 200 and "problems" not in body, body
    finally:
        server.stop()
    shutil.rmtree(state)  # the whole state folder gone: a fresh device, synced again
    server = start_plain(tmp_path, port, bucket)
    try:
        assert readyz(server)[0] == 200 and db_check(state) == ("ok", "wal")
        assert json.loads((state / "models/small/1/MANIFEST.json").read_text())["version"] == 1
    finally:
        server.stop()
