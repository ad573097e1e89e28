"""Fleet sync at the device's limits: a full disk during sync, and memory across hot swaps.

Disk full: the service's state directory is a small tmpfs (real ENOSPC, real statvfs).
Version 2 is refused by the free-space check first (a filler file leaves too little room),
then the disk fills *during* the download (a paced loopback HTTP mirror holds the big file
half sent while the test fills the disk). Each time: staging is cleaned, version 1 keeps
answering every request, the error names the disk space; once the filler is gone the
device converges to version 2 on its own (backoff retry). The folder source's own write
path is covered in-process the same way (the real FileSource into a full tmpfs).

Memory: a LiteRT model of ~12 MB is swapped v1 -> v7 under the real service; the
process RSS after the last swap must be back near the one-version level (a memory
bound, not a timing assertion).

The disk tests need root (``mount -t tmpfs``) and skip, saying why, where mounting fails.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import requests

from sync.fetcher import FREE_MARGIN_BYTES, DiskFull, fetch
from sync.manifest import MANIFEST, verify
from sync.publisher import publish
from sync.open_source import open_source
from sync.source_file import FileSource
from sync.store import Store
from tests.support.cache import built_once
from tests.support.mirror import Mirror
from tests.support.servers import ROOT, free_port
from tests.support.sync_scenario import hpt, start_device  # noqa: F401 (fixture)
from tests.support.sync_support import Load, events, serving_version, store_is_complete, wait

MiB = 1 << 20


# -- a small disk ---------------------------------------------------------------------------
@pytest.fixture
def tmpfs() -> Iterator[Callable[[Path, int], Path]]:
    """``mount(path, size_mib)``: a fresh tmpfs there; every mount is undone at teardown
    (lazily when a process still holds it, so a failed test never leaves one behind)."""
    mounted: list[Path] = []

    def mount(path: Path, size_mib: int) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0755", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], check=True)


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def fill(path: Path, leave: int = 0) -> Path:
    """A filler file under ``path`` that leaves ``leave`` bytes free (0: fills to ENOSPC)."""
    filler = path / "filler.bin"
    block = b"\xa5" * MiB
    with open(filler, "wb", buffering=0) as f:  # unbuffered: ENOSPC surfaces in write(), not close()
        try:
            while free_bytes(path) - leave >= len(block):
                f.write(block)
            if not leave:  # the last pages, down to ENOSPC
                while True:
                    f.write(block[:4096])
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler


def staged_files(state: Path) -> list[Path]:
    return [p for p in (state / "staging").rglob("*") if not p.is_dir()]


def big_version(hpt_dir: Path, dest: Path, extra_bytes: int) -> Path:
    """A servable version: the half_plus_two files plus ``extra.bin`` of random bytes."""
    shutil.copytree(hpt_dir, dest)
    with open(dest / "extra.bin", "wb") as f:
        f.write(os.urandom(extra_bytes))
    return dest


def last_error(server: Any) -> str:
    return str(server.status()["sync"]["last_error"])


def sync_errors(server: Any) -> list[str]:
    return [e["message"] for e in events(server.status(), "sync_error")]


# -- disk full, free-space check (folder bucket) -------------------------------------------
def test_version_too_big_for_the_disk_is_deferred_then_installed(start_server: Any, tmpfs: Any, tmp_path: Path,
                                                                 hpt: Path) -> None:
    folder = tmp_path / "bucket"
    bucket = open_source(f"file://{folder}")
    publish(bucket, "hpt", str(hpt / "1"), 1, channel="stable")
    port = free_port()
    state = tmpfs(tmp_path / f"state-{port}", 96)  # the path start_server gives --state
    server = start_device(start_server, tmp_path, f"file://{folder}", port=port)
    try:
        v2 = big_version(hpt / "2", tmp_path / "v2", 30 * MiB)
        filler = fill(state, leave=36 * MiB)  # 30 MiB + the margin do not fit in 36 MiB
        with Load(server.url) as load:
            publish(bucket, "hpt", str(v2), 2, channel="stable")
            server.wait_for(lambda: "MiB free" in last_error(server), 60, "the free-space refusal")
            status = server.status()
            assert any("hpt version 2 needs" in m and "MiB free" in m for m in sync_errors(server)), status["events"]
            assert serving_version(status) == 1 and not (state / "models/hpt/2").exists()
            assert staged_files(state) == []
            polled = server.status()["sync"]["polls"]  # a few backed-off retries: still refused, nothing staged
            server.wait_for(lambda: server.status()["sync"]["polls"] >= polled + 2, 60, "two more polls")
            assert staged_files(state) == [] and serving_version(server.status()) == 1
            filler.unlink()  # room again: the device installs version 2 on its own
            server.wait_for(lambda: serving_version(server.status()) == 2, 90, "version 2 after the disk freed up")
            wait(lambda: 2 in load.versions, 30, "answers from version 2")
        assert load.failures == [], load.failures[:5]
        assert load.versions == {1, 2} and load.ok > 0
        assert staged_files(state) == [] and store_is_complete(state / "models") == []
        assert events(server.status(), "sync_recovered")
    finally:
        server.stop()


# -- disk full while writing (paced loopback HTTP mirror) ----------------------------------
class PacedMirror(Mirror):
    """The loopback mirror of a bucket folder. The first GET of ``gated`` sends
    ``gate_bytes`` and then waits for ``go`` before the rest: the device is mid-download,
    past its free-space check, for as long as the test needs."""

    def __init__(self, root: Path, gated: str, gate_bytes: int):
        super().__init__(root, "paced-mirror")
        self.gated, self.gate_bytes = gated, gate_bytes
        self.halfway, self.go = threading.Event(), threading.Event()
        self._gate_used = False

    def serve(self, h: Any) -> None:
        found = self.found(h)
        if found is None:
            return
        key, data, start = found
        self.head(h, data, start)
        body = data[start:]
        if key == self.gated and not self._gate_used:
            self._gate_used = True
            h.wfile.write(body[:self.gate_bytes])
            h.wfile.flush()
            self.halfway.set()
            self.go.wait(60)
            body = body[self.gate_bytes:]
        h.wfile.write(body)

    def stop(self) -> None:
        self.go.set()  # the gated answer ends first
        super().stop()


def test_disk_filling_up_during_the_download_is_cleaned_and_retried(start_server: Any, tmpfs: Any,
                                                                    tmp_path: Path, hpt: Path) -> None:
    folder = tmp_path / "bucket"
    bucket = open_source(f"file://{folder}")
    publish(bucket, "hpt", str(hpt / "1"), 1, channel="stable")
    mirror = PacedMirror(folder, "hpt/2/extra.bin", 8 * MiB).start()
    port = free_port()
    state = tmpfs(tmp_path / f"state-{port}", 96)
    server = start_device(start_server, tmp_path, mirror.url, port=port)
    try:
        v2 = big_version(hpt / "2", tmp_path / "v2", 40 * MiB)
        assert free_bytes(state) > 40 * MiB + FREE_MARGIN_BYTES  # the free-space check will pass
        with Load(server.url) as load:
            publish(bucket, "hpt", str(v2), 2, channel="stable")
            assert mirror.halfway.wait(60), "the device never started downloading version 2"
            part = state / "staging/hpt/2/extra.bin.part"
            wait(lambda: part.exists() and part.stat().st_size == 8 * MiB, 30, "8 MiB written to staging")
            filler = fill(state)  # another writer takes every byte left
            mirror.go.set()  # the rest of extra.bin arrives: the device's write hits ENOSPC
            server.wait_for(lambda: any("disk full while staging hpt version 2" in m for m in sync_errors(server)),
                            60, "the disk-full event")
            status = server.status()
            assert serving_version(status) == 1 and not (state / "models/hpt/2").exists()
            assert "MiB free" in status["sync"]["last_error"] or "disk full" in status["sync"]["last_error"]
            assert staged_files(state) == []
            filler.unlink()
            server.wait_for(lambda: serving_version(server.status()) == 2, 90, "version 2 after the disk freed up")
            wait(lambda: 2 in load.versions, 30, "answers from version 2")
        assert load.failures == [], load.failures[:5]
        assert load.versions == {1, 2}
        assert staged_files(state) == [] and store_is_complete(state / "models") == []
    finally:
        server.stop()
        mirror.stop()


class FillingFileSource(FileSource):
    """The real folder source, with another writer filling the disk just as a download
    begins (after the fetcher's free-space check passed)."""

    def __init__(self, url: str, root: str, disk: Path):
        super().__init__(url, root)
        self.disk = disk
        self.armed = True  # fill once, at the first download

    def download(self, key: str, path: str, offset: int = 0) -> None:
        if self.armed:
            self.armed = False
            fill(self.disk)
        super().download(key, path, offset)


def test_folder_source_write_hitting_enospc_is_disk_full(tmpfs: Any, tmp_path: Path) -> None:
    folder = tmp_path / "bucket"
    version = tmp_path / "v1"
    version.mkdir()
    (version / "model.bin").write_bytes(os.urandom(8 * MiB))
    publish(open_source(f"file://{folder}"), "m", str(version), 1)
    disk = tmpfs(tmp_path / "state", 40)
    store = Store(str(disk)).open()
    raw = (folder / "m/1" / MANIFEST).read_bytes()
    manifest = verify(raw, "m", 1, None, frozenset())
    stage = store.stage_dir("m", 1)
    source = FillingFileSource(f"file://{folder}", str(folder), disk)
    with pytest.raises(DiskFull):
        fetch(source, manifest, raw, stage, {})
    assert staged_files(disk) == [], "a full disk must not leave partial files in staging"
    (disk / "filler.bin").unlink()
    fetch(source, manifest, raw, stage, {})  # the same call succeeds once there is room
    store.commit(stage, "m", 1)
    assert store_is_complete(disk / "models") == [] and staged_files(disk) == []


# -- memory after hot swaps ----------------------------------------------------------------
DENSE = {"in_dim": 512, "hidden": 1536, "out": 10}  # ~12 MB of float32 weights
SWAPS = 6  # enough that a model's worth kept per swap cannot hide under the bound


def dense_models() -> Path:
    """<cache>/dense/<v>/model.tflite, v = 1..SWAPS+1: the same MLP with different weights."""
    from tests.support import modelgen

    digest = hashlib.sha256((ROOT / "tests" / "support" / "modelgen.py").read_bytes() + repr((DENSE, SWAPS)).encode()).hexdigest()

    def build(folder: Path) -> None:
        for v in range(1, SWAPS + 2):
            modelgen.build_keras_mlp_tflite(str(folder / "dense" / str(v)), seed=v, **DENSE)

    return built_once(f"dense-{digest[:12]}", build) / "dense"


def exercise(url: str, threads: int = 4, each: int = 25) -> None:
    """Concurrent predicts (every interpreter of the pool gets used); all must answer 200."""
    body = {"instances": [[0.01 * (i % 7) for i in range(DENSE["in_dim"])]]}
    failures: list[str] = []

    def run() -> None:
        with requests.Session() as s:
            for _ in range(each):
                r = s.post(f"{url}/v1/models/dense:predict", json=body, timeout=30)
                if r.status_code != 200:
                    failures.append(f"HTTP {r.status_code}: {r.text[:200]}")

    workers = [threading.Thread(target=run, name=f"exercise-{i}") for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert failures == [], failures[:5]


def version_states(server: Any) -> dict[int, str]:
    model = server.status().get("models", {}).get("dense", {})
    return {int(v["version"]): v["state"] for v in model.get("versions", [])}


def swapped(server: Any, new: int) -> bool:
    states = version_states(server)
    return states.get(new) == "AVAILABLE" and all(s == "END" for v, s in states.items() if v != new)


def test_memory_after_hot_swaps_returns_to_the_one_version_level(start_server: Any, tmp_path: Path) -> None:
    import psutil

    dense = dense_models()
    model_bytes = (dense / "1" / "model.tflite").stat().st_size
    folder = tmp_path / "bucket"
    bucket = open_source(f"file://{folder}")
    publish(bucket, "dense", str(dense / "1"), 1)
    server = start_server("--bucket", f"file://{folder}", "--poll-interval", "0.5", "--backend", "tflite")
    proc = psutil.Process(server.proc.pid)

    def settled_rss() -> int:
        exercise(server.url)
        time.sleep(0.5)  # let the drain threads and the allocator settle
        return proc.memory_info().rss

    server.wait_for(lambda: swapped(server, 1), 60, "version 1 available")
    settled_rss()  # first requests: interpreter pool, batchers, HTTP threads
    levels = {1: settled_rss()}
    for v in range(2, SWAPS + 2):
        publish(bucket, "dense", str(dense / str(v)), v)
        server.wait_for(lambda: swapped(server, v), 90, f"version {v} available and the rest unloaded")
        levels[v] = settled_rss()
    figures = ", ".join(f"v{v}: {rss / MiB:.1f} MiB" for v, rss in levels.items())
    print(f"\nmodel {model_bytes / MiB:.1f} MiB; server RSS after warm-up and requests: {figures}")
    bound = levels[1] + model_bytes // 2 + 30 * MiB
    last = levels[SWAPS + 1]
    assert last < bound, f"RSS after {SWAPS} swaps {last / MiB:.1f} MiB >= bound {bound / MiB:.1f} MiB ({figures})"
