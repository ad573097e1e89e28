"""The status page in a real browser (Debian's chromium driven by Playwright) on the real server.

One server and one browser serve the module. Models: ``multisig_tflite`` (LiteRT: starts
in seconds) and two copies of it whose directory names are HTML, which must show as text.
A test adds version 2 while the page is open and waits for it to appear without reload.
The phone-width screenshot lands in ``test-artifacts/status-phone.png``.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.conftest import ARTIFACTS, Server, model_copy

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
MODEL = "multisig_tflite"
HTML_NAMES = ("<script>", "<img src=x onerror=window.__xss=1>")
WAIT_MS = 30_000  # the page polls every 2 s; loads take well under a second


def _browser_missing() -> str:
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} not installed (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright Python package is not installed (pip install playwright; no browser download)"
    return ""


pytestmark = pytest.mark.skipif(bool(_browser_missing()), reason=_browser_missing() or "browser present")


@pytest.fixture(scope="module")
def models(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = model_copy(models_dir, tmp_path_factory.mktemp("ui-models"), MODEL)
    for name in HTML_NAMES:
        shutil.copytree(base / MODEL, base / name)  # raises if the filesystem refused the name
    return base


@pytest.fixture(scope="module")
def server(module_server: Any, models: Path) -> Server:
    return module_server("--models", str(models), "--backend", "tflite", "--poll-interval", "0.5")


@pytest.fixture(scope="module")
def browser(module_server: Any) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Page:
    """A page on the status page that records errors and every URL it asked for."""

    def __init__(self, browser: Any, server: Server, width: int = 1024, height: int = 800):
        self.server = server
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.page.set_default_timeout(WAIT_MS)
        self.errors: list[str] = []
        self.urls: list[str] = []
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("console", lambda msg: self.errors.append(msg.text) if msg.type == "error" else None)
        self.page.on("request", lambda req: self.urls.append(req.url))
        self.page.goto(server.url + "/")
        self.page.wait_for_selector("body[data-updated]")

    def card(self, name: str) -> Any:
        """The model card whose title is exactly ``name``."""
        title = self.page.locator("h3.model-name", has_text=re.compile("^" + re.escape(name) + "$"))
        return self.page.locator("article.model").filter(has=title)

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser: Any, server: Server) -> Iterator[Page]:
    p = Page(browser, server)
    yield p
    p.close()
    assert not p.errors, f"the page logged {len(p.errors)} errors, first: {p.errors[:3]}"


def test_shows_model_backend_state_and_events(page: Page) -> None:
    card = page.card(MODEL)
    card.locator(".badge", has_text="serving v1 on tflite").wait_for()
    assert card.locator("tr[data-version='1'] .badge").inner_text() == "AVAILABLE"
    decision = card.locator("details.decision").first
    assert "tflite" in decision.locator("summary").inner_text()
    considered = decision.locator(".considered li")
    assert sorted(considered.locator("b").all_inner_texts()) == ["tf-cpu", "tf-gpu", "tflite"]
    assert all(t.strip() for t in considered.locator(".why").all_inner_texts())  # every backend's reason shown
    event = page.page.locator("#events li.event", has_text=f"{MODEL} version 1 available on tflite")
    assert event.count() >= 1
    assert event.first.locator(".badge").inner_text() == "loaded"
    hostname = page.server.status()["device"]["hostname"]
    assert hostname in page.page.locator("#device").inner_text()
    assert "sync not configured" in page.page.locator("#sync").inner_text()


def test_page_is_self_contained_and_read_only(page: Page) -> None:
    """Works offline (every request goes to the device) and offers no admin action yet."""
    page.page.wait_for_timeout(2500)  # let at least one poll happen
    foreign = [u for u in page.urls if not u.startswith(page.server.url) and not u.startswith("data:")]
    assert not foreign, f"the page fetched from elsewhere: {foreign}"
    assert any(u.endswith("/api/status") for u in page.urls)
    assert page.page.locator("button, form, input, select, textarea").count() == 0
    assert page.page.locator("#admin").is_hidden()


def test_html_in_model_names_renders_as_text(page: Page) -> None:
    for name in HTML_NAMES:
        title = page.card(name).locator("h3.model-name")
        title.wait_for()
        assert title.inner_text() == name
        assert "&lt;" in title.inner_html()  # stored as text, escaped when serialised
        assert page.page.locator("#events .ev-model", has_text=name).count() >= 1
    assert page.page.locator("main script, main img").count() == 0
    assert page.page.evaluate("window.__xss") is None


def test_new_version_appears_without_reload(page: Page, models: Path) -> None:
    card = page.card(MODEL)
    card.locator(".badge", has_text="serving v1").wait_for()
    page.page.evaluate("window.__sameDocument = true")
    staging = models / MODEL / ".incoming-2"  # built aside, then renamed in: how versions arrive
    shutil.copytree(models / MODEL / "1", staging)
    os.rename(staging, models / MODEL / "2")
    card.locator("tr[data-version='2'] .badge", has_text="AVAILABLE").wait_for()
    card.locator(".badge", has_text="serving v2 on tflite").wait_for()
    assert page.page.evaluate("window.__sameDocument") is True  # no reload happened
    page.page.locator("#events li.event", has_text=f"{MODEL} version 2 available").first.wait_for()


def test_phone_width_screenshot(browser: Any, server: Server) -> None:
    phone = Page(browser, server, width=360, height=800)
    try:
        phone.card(MODEL).locator(".badge", has_text="serving v").wait_for()
        assert phone.page.evaluate("document.documentElement.scrollWidth") <= 360  # nothing wider than the phone
        ARTIFACTS.mkdir(exist_ok=True)
        phone.page.screenshot(path=str(ARTIFACTS / "status-phone.png"), full_page=True)
        assert (ARTIFACTS / "status-phone.png").stat().st_size > 10_000
    finally:
        phone.close()
    assert not phone.errors, f"the page logged {len(phone.errors)} errors, first: {phone.errors[:3]}"
