"""The device says what is wrong, first: a real service following a real folder bucket, its
``/api/status`` ``problems`` and the status page in chromium at 1280 and 390 px.

One device serves the module: TF Serving's half_plus_two (the bundled sample: a SavedModel
and a ``model.tflite``) from a ``file://`` bucket, two front workers, an admin token file.
The issue's scenario is played on it: a version whose SavedModel is cut short beside an
intact ``model.tflite``, then one with nothing loadable, published with ``appliance
publish`` and pulled with ``appliance sync``; then a front worker stopped, and the bucket
taken away. Each must show at the top of the page (on a phone without scrolling), the
header must never be green while any stands, and the device report must carry them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from tests.support.servers import ROOT, Server, free_port, poll_until
from tests.ui.test_ui import BADGE_RECORDER, CHROMIUM, CHROMIUM_ARGS, Page, _browser_missing

SAMPLE = ROOT / "appliance" / "sample_models" / "half_plus_two" / "1"
MODEL = "half_plus_two"
STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+")  # a date, a time and a zone
PHONE = (390, 844)


def publish(bucket: Path, tmp: Path, version: int, cut_savedmodel: bool = False, break_tflite: bool = False) -> None:
    """The sample as ``version``, its SavedModel cut short and/or its LiteRT model garbage."""
    folder = tmp / f"v{version}"
    shutil.copytree(SAMPLE, folder)
    if cut_savedmodel:
        pb = folder / "saved_model.pb"
        pb.write_bytes(pb.read_bytes()[:100])
    if break_tflite:
        (folder / "model.tflite").write_bytes(b"not a flatbuffer " * 4)
    cli("publish", "--bucket", f"file://{bucket}", "--model", MODEL, "--version", str(version), str(folder))


class Device:
    def __init__(self, server: Server, bucket: Path, tmp: Path):
        self.server, self.bucket, self.tmp = server, bucket, tmp

    def publish(self, version: int, **broken: bool) -> None:
        publish(self.bucket, self.tmp, version, **broken)

    def sync(self) -> None:
        """``appliance sync`` as an operator types it: the service found from its state directory."""
        done = cli("sync", "--state", str(self.server.state), check=False)
        assert "Traceback" not in done.stderr, done.stderr

    def problems(self) -> list[dict[str, Any]]:
        """``/api/status`` problems; a request the kernel gave a stopped worker times out: not yet."""
        return requests.get(self.server.url + "/api/status", timeout=3).json()["problems"]

    def wait_problem(self, what: str, kind: str, **match: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            return next((p for p in self.problems() if p["kind"] == kind
                         and all(p.get(k) == v for k, v in match.items())), None)
        return self.server.wait_for(found, 120, what)


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "appliance.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    if check:
        assert done.returncode == 0, done.stderr
    return done


@pytest.fixture(scope="module")
def device(module_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Device:
    tmp = tmp_path_factory.mktemp("troubled")
    bucket = tmp / "bucket"
    token = tmp / "admin-token"
    token.write_text("problems-admin-token-0123456789\n")
    port = free_port()
    config = tmp / "device.toml"
    config.write_text("\n".join([
        "[server]", "workers = 2", "worker_timeout_s = 120", "[sync]", f'bucket = "file://{bucket}"', "poll_interval_s = 0.5", "jitter = 0.1",
        "max_backoff_s = 2.0", "report_interval_s = 1.0", "[security]", f'admin_token_file = "{token}"']) + "\n")
    publish(bucket, tmp, 1)
    return Device(module_server("--config", str(config), port=port, timeout=240), bucket, tmp)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if _browser_missing():
        pytest.skip(_browser_missing())
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def open_page(browser: Any, device: Device, size: tuple[int, int] = (1280, 900)) -> Page:
    return Page(browser, device.server, width=size[0], height=size[1], init_script=BADGE_RECORDER)


def closed(page: Page) -> None:
    page.close()
    assert not page.errors, f"the page logged {len(page.errors)} errors, first: {page.errors[:3]}"


def problem_item(page: Page, kind: str, version: int | None = None) -> Any:
    selector = f"#problems li.problem[data-kind={kind}]"
    if version is not None:
        selector += f"[data-version='{version}']"
    return page.page.locator(selector)


def test_half_broken_then_broken_versions_are_said_first(device: Device, browser: Any) -> None:
    page = open_page(browser, device)
    try:
        page.page.locator("#ready[data-state=ready]").wait_for()
        device.publish(2, cut_savedmodel=True)  # the TF artifact is cut short; model.tflite is intact
        device.sync()
        # Served on LiteRT with TF's failure named, or refused whole: either way a problem says so.
        named = device.server.wait_for(lambda: next((p for p in device.problems() if p.get("version") == 2), None),
                                       120, "a problem naming version 2 (its SavedModel is broken)")
        assert named["kind"] in ("backend_failed", "version_quarantined", "version_degraded", "target_not_reached")

        device.publish(3, cut_savedmodel=True, break_tflite=True)  # nothing in it loads
        device.sync()
        target = device.wait_problem("version 3 named as the target not reached", "target_not_reached", version=3)
        device.wait_problem("version 3 quarantined", "version_quarantined", version=3)
        status = device.server.status()
        serving = status["models"][MODEL]["serving_version"]
        assert serving in (1, 2) and f"version {serving} serves" in target["message"]
        assert isinstance(target["since"], float) and target["since"] <= status["service"]["clock"]["now"]

        # The page: the problems first, each with what, which version and since when; never green.
        problem_item(page, "target_not_reached", 3).wait_for()
        problem_item(page, "version_quarantined", 3).wait_for()
        count = len(device.problems())
        page.page.locator("#ready[data-state=degraded]").wait_for()
        assert page.page.locator("#ready").get_attribute("class") == "badge warn"
        assert re.fullmatch(r"degraded · \d+ problems?", page.page.locator("#ready").inner_text())
        first = problem_item(page, "target_not_reached", 3)
        assert "half_plus_two v3" in first.inner_text() and STAMP.search(first.locator("time").inner_text())
        top = page.page.locator("#problems").bounding_box()
        assert top is not None and top["y"] < page.page.locator("#device").bounding_box()["y"]
        sync = page.page.locator("#sync")
        sync.locator(".part-state .badge", has_text="target not reached").wait_for()
        assert "in step with the bucket" not in sync.inner_text()
        assert page.page.locator("#problems li.problem").count() >= min(count, 2)
        page.page.evaluate("window.__badgeClasses.length = 0")  # green before v2 came; from now on never
        for _ in range(3):
            page.next_update()
        classes = page.page.evaluate("window.__badgeClasses")
        assert classes and all(c == "badge warn" for c in classes), classes
    finally:
        closed(page)

    # A fresh page never shows green while the problems stand, and on a phone they are on
    # the first screen without scrolling, nothing wider than the screen.
    phone = open_page(browser, device, PHONE)
    try:
        item = problem_item(phone, "target_not_reached", 3)
        item.wait_for()
        phone.next_update()
        box = item.bounding_box()
        assert box is not None and box["y"] + min(box["height"], 40) <= PHONE[1], box
        assert phone.page.evaluate("document.documentElement.scrollWidth") <= PHONE[0]
        assert all("ok" not in c.split() for c in phone.page.evaluate("window.__badgeClasses"))
        assert phone.page.title().startswith("(!) ")
    finally:
        closed(phone)


def test_a_backend_that_failed_is_not_called_usable(device: Device, browser: Any) -> None:
    """The tf-cpu load error of the cut SavedModel sits in the backend decision of the version
    that loaded it, labelled as a failure (never "usable")."""
    failed = [p for p in device.problems() if p["kind"] == "backend_failed"]
    if not failed:
        pytest.skip("version 2 did not serve on another backend (a partial version is refused whole)")
    page = open_page(browser, device)
    try:
        version = failed[0]["version"]
        card = page.card(MODEL)
        details = card.locator("details.decision", has_text=f"Backend decision v{version}:").first
        details.wait_for()
        if details.get_attribute("open") is None:  # the serving version's is open already
            details.locator("summary").click()
        row = details.locator(".considered li", has_text="tf-cpu").first
        row.locator(".badge.bad", has_text="failed to load").wait_for()
        assert "usable" not in row.locator(".badge").inner_text()
    finally:
        closed(page)


def test_the_device_report_carries_the_problems(device: Device) -> None:
    def report() -> dict[str, Any] | None:
        found = list((device.bucket / "_devices").glob("*.json"))
        doc = json.loads(found[0].read_text()) if found else {}
        kinds = {(p["kind"], p.get("version")) for p in doc.get("problems", [])}
        return doc if ("target_not_reached", 3) in kinds else None

    doc = device.server.wait_for(report, 60, "a device report naming the target not reached")
    assert all(isinstance(p["since"], float) and p["message"] for p in doc["problems"])


def test_a_stopped_front_worker_is_a_problem_until_it_runs_again(device: Device) -> None:
    workers = device.server.status()["workers"]
    assert len(workers) == 2 and all(w["up"] for w in workers)
    pid = workers[0]["pid"]
    os.kill(pid, signal.SIGSTOP)  # wedged: its channel open, silent, the kernel still gives it connections
    try:
        found = device.wait_problem("the stopped worker named", "workers_down", part="worker 0")
        assert f"pid {pid}" in found["message"]
    finally:
        os.kill(pid, signal.SIGCONT)
    poll_until(lambda: not [p for p in device.problems() if p["kind"] == "workers_down"], 60,
               "the worker problem gone once it runs again")


def test_a_bucket_that_cannot_be_polled_is_a_problem(device: Device, browser: Any) -> None:
    away = device.tmp / "bucket-away"
    device.bucket.rename(away)
    try:
        found = device.wait_problem("the sync failure", "sync_failing")
        assert "failed polls" in found["message"]
        phone = open_page(browser, device, PHONE)
        try:
            item = problem_item(phone, "sync_failing")
            item.wait_for()
            assert item.bounding_box()["y"] < PHONE[1]
            phone.page.locator("#sync .part-state .badge", has_text="bucket unreachable").wait_for()
        finally:
            closed(phone)
    finally:
        away.rename(device.bucket)
    poll_until(lambda: not [p for p in device.problems() if p["kind"] == "sync_failing"], 60,
               "the sync problem gone once the bucket is back")


def test_the_whole_service_tree_its_ports_workers_and_token(device: Device, browser: Any) -> None:
    status = device.server.status()
    tree = status["footprint"]
    pids = {p["pid"]: p for p in tree["per_process"]}
    assert device.server.proc.pid in pids and pids[device.server.proc.pid]["role"] == "serving"
    assert {w["pid"] for w in status["workers"]} <= set(pids)
    roles = sorted(p["role"] for p in pids.values() if p["role"] != "serving")
    assert roles[:2] == ["front worker 0", "front worker 1"] and "zygote" in roles, roles
    assert tree["rss_bytes"] == sum(p["rss_bytes"] for p in tree["per_process"])
    assert tree["pss_bytes"] == sum(p["pss_bytes"] for p in tree["per_process"]) < tree["rss_bytes"]
    listening = status["listening"]
    assert listening["rest"]["port"] == device.server.port and listening["workers"] == 2
    assert listening["admin_token"]["file"] == str(device.tmp / "admin-token")
    assert "token" not in json.dumps(listening["admin_token"]).replace("admin-token", "")  # the source, never a token
    page = open_page(browser, device)
    try:
        card = page.page.locator("#device")
        page.next_update()
        page.next_update()  # the second sample has a CPU figure
        memory = page.row(card, "Service memory").inner_text()
        assert re.search(r"MiB PSS · [\d.]+ [MG]iB RSS, 4 processes", memory), memory  # serving, zygote, 2 workers
        assert "front worker 0" in memory and "serving" in memory
        assert re.fullmatch(r"[\d.]+ % of one core \([\d.]+ % of the \d+-core machine\), since the last update",
                            page.row(card, "Service CPU").inner_text())
        assert f":{device.server.port}" in page.row(card, "REST").inner_text()
        assert page.row(card, "Front workers").inner_text().startswith("2 of 2 up")
        assert str(device.tmp / "admin-token") in page.row(card, "Admin token").inner_text()
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC[+−]\d\d:\d\d( \(.+\))?",
                            page.row(card, "Device clock").inner_text())
        times = page.page.locator("#events li.event time").all_inner_texts()
        assert times and all(STAMP.fullmatch(t) for t in times), times[:3]
    finally:
        closed(page)
