"""The fleet page (``appliance fleet --serve``) in a real browser (Debian's chromium driven by
Playwright) over 10,000 device reports in a real bucket folder: counts, a progress bar per
rollout with its halt and failing devices, a devices table that filters, sorts and pages, a
device's detail with its report, hostile strings shown as text, nothing fetched from
another origin, and the page's API read-only. A screenshot lands in test-artifacts/."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Iterator

import pytest
import requests
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sync.publisher import halt_channel, publish, set_channel
from sync.report import register_keys, sign_report
from sync.open_source import open_source
from tests.support.servers import ARTIFACTS, ROOT, free_port, poll_until, stop_process
from tests.support.fleet_support import device_ids, fleet_report
from tests.ui.test_ui import CHROMIUM_ARGS, CHROMIUM, _browser_missing

pytestmark = pytest.mark.skipif(bool(_browser_missing()), reason=_browser_missing() or "browser present")
DEVICES = 10_000
XSS = "<img src=x onerror=window.__xss=1>"
# how many devices of each kind (the rest are on the target and well)
KINDS = {"refused": 400, "failed": 300, "waiting": 200, "unhealthy": 50, "stale": 49}
UNREGISTERED = 500  # well devices whose key nobody registered: shown untrusted, never counted in the rollout


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fleet-page")
    folder = tmp / "bucket"
    source = open_source(f"file://{folder}")
    for version in (1, 2):
        d = tmp / f"v{version}"
        d.mkdir()
        (d / "model.tflite").write_bytes(b"v%d" % version * 100)
        publish(source, "hpt", str(d), version)
    set_channel(source, "hpt", "stable", 2, waves=[{"percent": 50, "hold_minutes": 0}, {"percent": 100}],
                failure_threshold={"percent": 5, "min_devices": 10})
    halt_channel(source, "hpt", "stable", reason="7.0% of the devices in the open waves failed version 2")
    ids = device_ids(DEVICES, seed=7)
    key = Ed25519PrivateKey.generate()
    kinds: dict[str, str] = {}
    start = 0
    for kind, count in KINDS.items():
        kinds.update({d: kind for d in ids[start:start + count]})
        start += count
    (folder / "_devices").mkdir(parents=True)
    old = time.time() - 3600 * 24
    for device in ids:
        kind = kinds.get(device, "ok")
        doc = fleet_report(device, 1 if kind in ("refused", "failed", "waiting") else 2, 2,
                           "ok" if kind == "stale" else kind)
        doc = sign_report({**doc, "hostname": XSS} if device == ids[-1] else doc, key)
        path = folder / "_devices" / f"{device}.json"
        path.write_text(json.dumps(doc))
        if kind == "stale":
            os.utime(path, (old, old))
    register_keys(source, {d: json.loads((folder / "_devices" / f"{d}.json").read_text())["device_key"]
                           for d in ids[:DEVICES - UNREGISTERED]})  # the last ones are all of the well kind
    return {"folder": folder, "ids": ids, "kinds": kinds}


@pytest.fixture(scope="module")
def served(fleet: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("fleet-serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", "fleet", "--bucket", f"file://{fleet['folder']}",
                                 "--serve", "--port", str(port), "--no-cache", "--refresh", "3600"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        poll_until(lambda: proc.poll() is None and requests.get(url + "/api/fleet", timeout=5).ok, 120,
                   "the fleet page to serve", lambda: log.read_text(errors="replace")[-2000:],
                   lambda: f"exited with {proc.returncode}" if proc.poll() is not None else None)
        yield url
    finally:
        stop_process(proc, signal.SIGTERM)


@pytest.fixture(scope="module")
def browser(served: str, module_server: Any) -> Iterator[Any]:
    """One chromium for the module. ``module_server`` (unused) marks the module's processes
    as the status page's tests do: chromium's renderers come and go with each page."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Any, served: str, module_server: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    urls: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("request", lambda req: urls.append(req.url))
    page.goto(served + "/")
    page.wait_for_selector("body[data-updated]")
    page.errors, page.urls = errors, urls
    yield page
    context.close()
    assert not errors, f"the page logged errors: {errors[:3]}"
    assert all(u.startswith(served) or u.startswith("data:") for u in urls), [u for u in urls if not u.startswith(served)]


def rows_shown(page: Any) -> list[str]:
    return page.eval_on_selector_all("#table tbody tr", "rows => rows.map(r => r.dataset.device)")


def test_ten_thousand_devices_counts_rollout_and_pages(page: Any, fleet: dict[str, Any]) -> None:
    assert page.inner_text("#count-devices") == "10,000 devices"
    for kind in ("stale", "unhealthy"):
        assert page.inner_text(f"#count-{kind}").startswith(str(KINDS[kind]))
    assert page.inner_text("#count-degraded").startswith(str(KINDS["refused"] + KINDS["failed"]))
    assert page.inner_text("#range") == "1–50 of 10,000" and len(rows_shown(page)) == 50
    assert rows_shown(page) == sorted(fleet["ids"])[:50]  # sorted by device id
    card = page.locator("article.rollout[data-model=hpt][data-channel=stable]")
    assert page.inner_text("#count-untrusted").startswith(str(UNREGISTERED))
    counted = DEVICES - UNREGISTERED
    on_target = counted - KINDS["refused"] - KINDS["failed"] - KINDS["waiting"] - KINDS["unhealthy"] - KINDS["stale"]
    assert card.locator("[role=progressbar]").get_attribute("aria-valuenow") == str(round(100 * on_target / counted, 1))
    assert "Halted: 7.0% of the devices" in card.locator(".halted").first.inner_text()
    assert "Failure threshold 5%" in card.inner_text() and "Waves: 2 of 2 open" in card.inner_text()
    assert card.locator("ul.failing li").count() == 5 and "and 695 more" in card.inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "fleet-10000.png"))
    page.click("#next")
    assert page.inner_text("#range") == "51–100 of 10,000" and rows_shown(page) == sorted(fleet["ids"])[50:100]
    page.select_option("#size", "1000")
    assert len(rows_shown(page)) == 1000 and page.inner_text("#range") == "1–1,000 of 10,000"


def test_filters_and_sorting(page: Any, fleet: dict[str, Any]) -> None:
    page.select_option("#f-status", "stale")
    assert page.inner_text("#range") == f"1–{KINDS['stale']} of {KINDS['stale']}"
    assert set(rows_shown(page)) == {d for d, k in fleet["kinds"].items() if k == "stale"}
    page.select_option("#f-status", "attention")
    attention = sum(KINDS.values()) - KINDS["waiting"] + UNREGISTERED  # waiting for a wave is not a problem
    assert page.inner_text("#range").endswith(f"of {attention:,}")
    page.select_option("#f-status", "")
    page.fill("#f-version", "1")
    assert page.inner_text("#range").endswith(f"of {KINDS['refused'] + KINDS['failed'] + KINDS['waiting']:,}")
    page.fill("#f-version", "")
    page.select_option("#f-trust", "unregistered")
    assert page.inner_text("#range").endswith(f"of {UNREGISTERED:,}")
    page.select_option("#f-trust", "")
    page.fill("#f-text", fleet["ids"][1234][:9])
    assert fleet["ids"][1234] in rows_shown(page)
    page.fill("#f-text", "")
    page.click("th[data-key=status] button")  # worst first: unhealthy before degraded before stale
    first = rows_shown(page)[0]
    assert fleet["kinds"][first] == "unhealthy"
    assert page.get_attribute("th[data-key=status]", "aria-sort") == "ascending"
    page.click("th[data-key=age_s] button")
    page.click("th[data-key=age_s] button")  # oldest report first
    assert fleet["kinds"][rows_shown(page)[0]] == "stale"


def test_a_device_detail_shows_its_report_and_hostile_text_stays_text(page: Any, fleet: dict[str, Any]) -> None:
    refused = next(d for d, k in fleet["kinds"].items() if k == "refused")
    page.fill("#f-text", refused)
    page.click(f"tr[data-device='{refused}'] button")
    detail = page.locator("#detail")
    detail.wait_for(state="visible")
    page.wait_for_selector("#detail pre")
    text = detail.inner_text()
    assert "Refused version 2: hpt version 2: model.tflite does not match its sha256" in text
    assert "serving 1, aiming at 2" in text and '"device_key"' in text
    page.screenshot(path=str(ARTIFACTS / "fleet-device.png"))
    assert page.evaluate("location.hash") == f"#device={refused}"
    page.keyboard.press("Escape")
    assert detail.is_hidden()
    hostile = fleet["ids"][-1]
    page.fill("#f-text", hostile)
    assert page.inner_text(f"tr[data-device='{hostile}'] td:nth-child(2)") == XSS
    assert page.evaluate("window.__xss") is None and page.locator("#table img").count() == 0


def test_the_page_api_is_read_only(served: str) -> None:
    for method in ("POST", "PUT", "DELETE"):
        r = requests.request(method, served + "/api/fleet", timeout=10)
        assert r.status_code == 405 and "read-only" in r.json()["error"]
    assert requests.get(served + "/api/devices/nope", timeout=10).status_code == 404
    r = requests.get(served + "/api/fleet", headers={"Accept-Encoding": "gzip"}, timeout=30)
    assert r.headers["Content-Encoding"] == "gzip" and len(r.json()["devices"]) == DEVICES
    assert "reports" not in r.json()  # full reports only one at a time
    assert "script-src 'self'" in requests.get(served + "/", timeout=10).headers["Content-Security-Policy"]
    assert r.json()["counts"]["trust_signed"] == DEVICES - UNREGISTERED  # every registered device's report


def test_on_a_phone_serving_and_problem_stay_in_view_in_words(browser: Any, served: str, fleet: dict[str, Any]) -> None:
    """390 px wide (issue 49: Serving and Problem were scrolled off to the right): every visible
    column fits the screen, Serving and Problem among them, and a failed target reads as words."""
    context = browser.new_context(viewport={"width": 390, "height": 844})
    try:
        page = context.new_page()
        page.set_default_timeout(30_000)
        page.goto(served + "/")
        page.wait_for_selector("body[data-updated]")
        failed = next(d for d, k in fleet["kinds"].items() if k == "failed")
        page.fill("#f-text", failed)
        row = page.locator(f"tr[data-device='{failed}']")
        row.wait_for()
        width = page.evaluate("document.documentElement.clientWidth")
        for key in ("device_id", "status", "models", "problem"):
            box = page.locator(f"#table th[data-key={key}]").bounding_box()
            assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width, (key, box, width)
        assert page.evaluate("document.querySelector('.table-wrap').scrollWidth <= document.querySelector('.table-wrap').clientWidth")
        cells = row.locator("td:visible").all_inner_texts()
        assert any("hpt v1; target v2 failed" in c for c in cells), cells
        assert not any(":1 (failed)" in c for c in cells), cells
        page.screenshot(path=str(ARTIFACTS / "fleet-390.png"))
    finally:
        context.close()
