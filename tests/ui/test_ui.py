"""The status page in a real browser (Debian's chromium driven by Playwright) on the real server.

Two servers and one browser serve the module.

* healthy: ``multisig_tflite`` (LiteRT: starts in seconds) and two copies of it whose
  directory names are HTML (they must show as text): no problem, a green header. A test
  adds version 2 of ``multisig_tflite`` while the page is open and waits for it to appear
  without reload.
* degraded: the same model from a signed folder bucket, with its gRPC port taken by
  another socket and discovery told to use an interface that does not exist: two configured
  parts down while the REST API serves; beside it ``multisig_broken`` from a local folder,
  whose version 2 is not a model (quarantined while version 1 serves). A test publishes an
  unsigned version, which the device refuses.

The problems scenario of issue 38 (a version target not reached, workers, the bucket) is
tests/service/test_problems.py.

Screenshots of both at 1280, 390 and 360 px land in ``$EDGE_TEST_ARTIFACTS/status-*.png``
(scripts/test.sh: the checkout's test-artifacts/).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests

from tests.support.servers import ARTIFACTS, Server, free_port, model_copy, poll_until

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
MODEL = "multisig_tflite"
BROKEN = "multisig_broken"  # version 1 serves, version 2 is not a model: quarantined
ADD = {"signature_name": "add", "inputs": {"a": [[1, 1, 1, 1]], "b": [[2, 2, 2, 2]]}}
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


def broken_model(models_dir: Path, base: Path) -> Path:
    """``base/multisig_broken``: version 1 serves, version 2 is not a model."""
    shutil.copytree(models_dir / MODEL / "1", base / BROKEN / "1")
    (base / BROKEN / "2").mkdir()
    (base / BROKEN / "2" / "model.tflite").write_bytes(b"not a flatbuffer " * 8)
    return base


@pytest.fixture(scope="module")
def server(module_server: Any, models: Path) -> Server:
    return module_server("--models", str(models), "--backend", "tflite", "--poll-interval", "0.5")


class Degraded:
    """A device with two configured parts down, following a signed folder bucket."""

    def __init__(self, server: Server, bucket: Path, version_dir: Path):
        self.server, self.bucket, self.version_dir = server, bucket, version_dir

    def publish_unsigned(self, version: int) -> None:
        from sync.publisher import publish
        from sync.open_source import open_source

        publish(open_source(f"file://{self.bucket}"), MODEL, str(self.version_dir), version)


@pytest.fixture(scope="module")
def taken_port() -> Iterator[int]:
    """A port another socket listens on (no SO_REUSEPORT): gRPC cannot bind it."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


@pytest.fixture(scope="module")
def degraded(module_server: Any, models_dir: Path, tmp_path_factory: pytest.TempPathFactory,
             taken_port: int) -> Degraded:
    from sync import manifest as mf
    from sync.publisher import publish
    from sync.open_source import open_source

    tmp = tmp_path_factory.mktemp("degraded")
    mf.keygen(str(tmp / "k.key"), str(tmp / "k.pub"))
    bucket = tmp / "bucket"
    publish(open_source(f"file://{bucket}"), MODEL, str(models_dir / MODEL / "1"), 1,
            sign_key=mf.load_private_key(str(tmp / "k.key")))
    port = free_port()
    config = tmp / "degraded.toml"
    config.write_text("\n".join([
        f'models_dir = "{broken_model(models_dir, tmp / "local")}"',
        "poll_interval_s = 0.5", "[discovery]", 'interfaces = ["no-such-if0"]', "recheck_interval_s = 60.0",
        "[grpc]", "bind_retry = true", "[sync]", f'bucket = "file://{bucket}"', f'public_key = "{tmp / "k.pub"}"', "poll_interval_s = 0.3",
        "jitter = 0.1"]) + "\n")
    server = module_server("--config", str(config), "--backend", "tflite", "--grpc-port", str(taken_port),
                           port=port, discovery=True, ready=False)  # not ready: its gRPC API is not listening
    server.wait_for(lambda: server.status()["models"][MODEL]["serving_version"] == 1, 60, "v1 synced and serving")
    return Degraded(server, bucket, models_dir / MODEL / "1")


@pytest.fixture(scope="module")
def browser(module_server: Any) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


class Page:
    """A page on the status page that records errors and every URL it asked for."""

    def __init__(self, browser: Any, server: Server, width: int = 1024, height: int = 800, init_script: str = ""):
        self.server = server
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        if init_script:
            self.page.add_init_script(init_script)
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

    def row(self, within: Any, label: str) -> Any:
        """The <dd> of the key/value row labelled exactly ``label``."""
        return within.locator("dl.kv > dt", has_text=re.compile("^" + re.escape(label) + "$")).locator("xpath=following-sibling::dd[1]")

    def next_update(self) -> None:
        """Until the page has drawn a newer /api/status than the one on screen now."""
        seen = self.page.get_attribute("body", "data-updated")
        self.page.wait_for_function("seen => document.body.dataset.updated !== seen", arg=seen)

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser: Any, server: Server) -> Iterator[Page]:
    p = Page(browser, server)
    yield p
    p.close()
    assert not p.errors, f"the page logged {len(p.errors)} errors, first: {p.errors[:3]}"


@pytest.fixture
def degraded_page(browser: Any, degraded: Degraded) -> Iterator[Page]:
    p = Page(browser, degraded.server, width=1280, init_script=BADGE_RECORDER)
    yield p
    p.close()
    assert not p.errors, f"the page logged {len(p.errors)} errors, first: {p.errors[:3]}"


# Records every class the header badge ever had, from the first paint on.
BADGE_RECORDER = """
window.__badgeClasses = [];
document.addEventListener("DOMContentLoaded", () => {
  const badge = document.getElementById("ready");
  const note = () => window.__badgeClasses.push(badge.className);
  note();
  new MutationObserver(note).observe(badge, { attributes: true, attributeFilter: ["class"] });
});
"""


def test_shows_model_backend_state_and_events(page: Page) -> None:
    page.page.locator("#ready.ok", has_text=re.compile("^ready$")).wait_for()
    assert page.page.locator("#problems").is_hidden() and page.page.locator("#problems li").count() == 0
    card = page.card(MODEL)
    card.locator(".badge", has_text="serving v1 on tflite").wait_for()
    assert card.locator("tr[data-version='1'] .badge").inner_text() == "AVAILABLE"
    decision = card.locator("details.decision").first
    assert "tflite" in decision.locator("summary").inner_text()
    considered = decision.locator(".considered li")
    assert sorted(considered.locator("b").all_inner_texts()) == ["litertlm", "tf-cpu", "tf-gpu", "tflite"]
    assert all(t.strip() for t in considered.locator(".why").all_inner_texts())  # every backend's reason shown
    event = page.page.locator("#events li.event", has_text=f"{MODEL} version 1 available on tflite")
    assert event.count() >= 1
    assert event.first.locator(".badge").inner_text() == "loaded"
    hostname = page.server.status()["device"]["hostname"]
    assert hostname in page.page.locator("#device").inner_text()
    assert "sync not configured" in page.page.locator("#sync").inner_text()


def test_page_is_self_contained_and_read_only(page: Page) -> None:
    """Works offline (every request goes to the device) and offers no admin action yet."""
    page.next_update()  # at least one poll after the first
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


def texts(locator: Any) -> list[str]:
    """textContent of every match (SVG elements have no innerText)."""
    return locator.evaluate_all("els => els.map(e => e.textContent)")


def test_device_card_says_what_the_data_says(page: Page) -> None:
    device = page.server.status()["device"]
    card = page.page.locator("#device")
    runtimes = page.row(card, "Runtimes").inner_text()
    if device["tensorflow_version"] and device["tensorflow_build"] == "cuda" and not device["nvidia_gpu"]:
        assert "built with CUDA, no GPU found" in runtimes, runtimes
    assert "(cuda)" not in runtimes.lower()
    if not device["nvidia_gpu"] and not device["gpu_name"]:
        assert page.row(card, "GPU").inner_text().startswith("none found")
    assert re.fullmatch(r"\d+(\.\d)? % of all cores \(every process\)|—", page.row(card, "Machine CPU").inner_text())
    assert re.fullmatch(r"[\d.]+ \(1 min\) · [\d.]+ \(5 min\)", page.row(card, "Load average").inner_text())
    assert page.row(card, "CPU").inner_text() == f"{device['cpu_count']} cores"


def test_quarantined_version_says_so(degraded_page: Page) -> None:
    page = degraded_page
    card = page.card(BROKEN)
    card.locator(".badge", has_text="serving v1 on tflite").wait_for()
    card.locator(".model-head .badge.bad", has_text="v2 quarantined").wait_for()
    assert card.locator("tr[data-version='2'] .badge").inner_text() == "quarantined"
    assert card.locator("tr[data-version='1'] .badge").inner_text() == "AVAILABLE"
    # The reason is said once, in its problem at the top (issue 49: a ~600-character text three
    # times); the card points there.
    problem = page.page.locator(f"#problems li.problem[data-kind=version_quarantined][data-model={BROKEN}]")
    problem.wait_for()
    assert "tflite failed to load" in problem.inner_text()
    assert page.row(card, "Quarantined").inner_text() == "v2: why: under Problems, at the top"
    said = page.page.locator("#problems").inner_text() + card.inner_text()
    assert said.count("tflite failed to load") == 1, said


def test_latency_and_batch_charts_have_axes_and_units(page: Page) -> None:
    session = requests.Session()
    for _ in range(30):
        assert session.post(f"{page.server.url}/v1/models/{MODEL}:predict", json=ADD, timeout=30).status_code == 200
    card = page.card(MODEL)
    latency = card.locator("[data-chart=latency]")
    latency.locator("circle.pt.p50").first.wait_for()
    # Each figure in its own element, with its name and unit: no "0.05 p50 ms 1.50 p99 ms".
    stats = latency.locator("figcaption .stat").all_inner_texts()
    assert [re.sub(r"\s+", " ", t).strip().split(" ")[0] for t in stats] == ["p50", "p99"], stats
    assert all(re.fullmatch(r"p(50|99) \d+(\.\d+)? ms", re.sub(r"\s+", " ", t).strip()) for t in stats), stats
    y_ticks = texts(latency.locator(".axis-y text"))
    assert len(y_ticks) == 3 and all(t.endswith(" ms") for t in y_ticks) and y_ticks[0] == "0 ms", y_ticks
    assert texts(latency.locator(".axis-x text")) == ["−60 s", "−30 s", "now"]
    for series in ("p50", "p99"):  # every value a visible mark, not a 1-px dash
        box = latency.locator(f"circle.pt.{series}").first.bounding_box()
        assert box and box["width"] >= 3 and box["height"] >= 3, (series, box)
    rate_ticks = texts(card.locator("[data-chart=rate] .axis-y text"))
    assert all(t.endswith(" /s") for t in rate_ticks), rate_ticks

    idle = page.card(HTML_NAMES[0]).locator("[data-chart=latency]")  # no traffic: the same axes, and says so
    assert texts(idle.locator(".axis-x text")) == ["−60 s", "−30 s", "now"]
    assert texts(idle.locator("text.empty")) == ["no requests in the last minute"]

    hist = card.locator("[data-chart=batch-sizes]")
    hist.locator("rect.bar").first.wait_for()
    labels = texts(hist.locator("svg text"))
    assert "rows per batch" in labels and "batches" in labels, labels
    sizes = hist.locator("rect.bar").evaluate_all("bars => bars.map(b => b.dataset.size)")
    assert sizes and all(hist.locator("text.bar-label", has_text=re.compile(f"^{s}$")).count() == 1 for s in sizes[:12])
    assert texts(hist.locator(".axis-y text"))[0] == "0"


def test_a_part_that_is_down_makes_the_device_amber_and_is_named(degraded_page: Page) -> None:
    page = degraded_page
    ready = page.page.locator("#ready")
    page.page.locator("#ready[data-state=degraded]").wait_for()
    grpc = page.page.locator("#problems li.problem[data-kind=part_down][data-part=gRPC]")
    discovery = page.page.locator("#problems li.problem[data-kind=part_down][data-part=Discovery]")
    discovery.wait_for()  # discovery attaches last
    page.next_update()
    page.next_update()
    assert ready.get_attribute("class") == "badge warn"
    count = page.page.locator("#problems li.problem").count()
    assert count >= 3 and ready.inner_text() == f"degraded · {count} problems", ready.inner_text()  # + v2 quarantined
    assert "gRPC down" in grpc.locator(".badge").inner_text() and "cannot listen for gRPC" in grpc.inner_text()
    assert "sev-error" in grpc.get_attribute("class")  # a configured API not listening: the device is not ready
    assert "Discovery down" in discovery.locator(".badge").inner_text() and "no-such-if0" in discovery.inner_text()
    assert page.page.locator("#discovery .part-state .badge.warn").inner_text().startswith("down")
    classes = page.page.evaluate("window.__badgeClasses")
    assert "badge warn" in classes and not [c for c in classes if "ok" in c.split()], classes  # never green
    # The REST API serves all along, but the device is not ready while a configured API is down.
    assert page.server.get(f"/v1/models/{MODEL}").json()["model_version_status"][0]["state"] == "AVAILABLE"
    readyz = page.server.get("/readyz")
    assert readyz.status_code == 503 and any("grpc" in p for p in readyz.json()["problems"])
    assert page.page.title().startswith("(!) ")


def test_sync_card_shows_a_refused_version_and_no_empty_rows(degraded_page: Page, degraded: Degraded) -> None:
    page = degraded_page
    sync = page.page.locator("#sync")
    sync.locator(".part-state .badge", has_text="in step with the bucket").wait_for()
    assert sync.locator("dt", has_text=re.compile("^(Refused|Store problems|Last error)$")).count() == 0
    assert "problems" not in sync.inner_text().lower()

    degraded.publish_unsigned(2)
    sync.locator(".part-state .badge.warn", has_text="refusing a published version").wait_for()
    refused = page.row(sync, "Refused").inner_text()
    assert f"{MODEL} v2" in refused and "not signed" in refused, refused
    assert "problems" not in sync.inner_text().lower() and "—" not in page.row(sync, "Refused").inner_text()
    assert page.card(MODEL).locator(".badge", has_text="serving v1").count() == 1  # the trusted version stays


@pytest.mark.parametrize("width", [1280, 390, 360])
def test_screenshots(browser: Any, server: Server, degraded: Degraded, width: int) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    for name, srv, state in (("healthy", server, "ready"), ("degraded", degraded.server, "degraded")):
        shot = Page(browser, srv, width=width, height=900)
        try:
            shot.page.locator(f"#ready[data-state={state}]").wait_for()
            shot.card(MODEL).locator(".badge", has_text="serving v").wait_for()
            if name == "degraded":
                shot.page.locator("#problems li[data-part=Discovery]").wait_for()
            width_used = shot.page.evaluate("document.documentElement.scrollWidth")
            assert width_used <= width, f"{name} page is {width_used} px wide at {width} px"  # nothing wider
            path = ARTIFACTS / f"status-{name}-{width}.png"
            shot.page.screenshot(path=str(path), full_page=True)
            assert path.stat().st_size > 10_000
        finally:
            shot.close()
        assert not shot.errors, f"the page logged {len(shot.errors)} errors, first: {shot.errors[:3]}"


def test_a_clients_bad_requests_are_not_the_servers_errors(page: Page) -> None:
    """Issue 49: clients' 400s were counted as "Errors"; they are counted apart."""
    session = requests.Session()
    for _ in range(5):
        assert session.post(f"{page.server.url}/v1/models/{MODEL}:predict", json=ADD, timeout=30).status_code == 200
        bad = session.post(f"{page.server.url}/v1/models/{MODEL}:predict", json={"signature_name": "add"}, timeout=30)
        assert bad.status_code == 400, bad.text
    errors = page.card(MODEL).locator("[data-chart=errors]")

    def stats() -> dict[str, float] | None:
        page.next_update()
        found = {label: float(value) for label, value, _ in (re.sub(r"\s+", " ", t).strip().rsplit(" ", 2)
                                                           for t in errors.locator("figcaption .stat").all_inner_texts())}
        return found if found.get("client (4xx)") else None

    shown = poll_until(stats, 60, "the page to show the client errors")
    assert shown["server (5xx)"] == 0 and shown["client (4xx)"] > 0, shown
    summary = page.server.status()["models"][MODEL]["requests"]
    assert summary["error_rate"] == 0 and summary["client_error_rate"] > 0, summary


def test_discovery_on_loopback_only_is_not_called_announcing(browser: Any, start_server: Any, models: Path) -> None:
    """Issue 49: a service listening on 127.0.0.1 showed a green "announcing"; no other machine
    can find it, and the page says so."""
    server = start_server("--models", str(models), "--backend", "tflite", discovery=True)
    disc = server.wait_for(lambda: (lambda d: d if d.get("announcing") else None)(server.status()["discovery"]), 120,
                           "discovery to announce")
    assert disc["loopback_only"] is True and disc["addresses"] == ["127.0.0.1"], disc
    p = Page(browser, server)
    try:
        badge = p.page.locator("#discovery .part-state .badge")
        badge.filter(has_text="loopback only").wait_for()
        assert "ok" not in badge.get_attribute("class").split() and "announcing" not in badge.inner_text()
    finally:
        p.close()
    assert not p.errors, p.errors
