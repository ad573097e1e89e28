"""The tests never touch the user's home or the checkout.

``private_home`` (tests/conftest.py) gives the whole session a home and state folders of its
own; the model generators print their help instead of building into a folder named
``--help``, and write only where they are told; and the suite passes beside a service the
README's first command started on the same machine, in that user's home, whose admin
token the tests must not pick up.
"""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.load import scaled
from tests.support.servers import ROOT, Server, free_port

REAL_HOME = pwd.getpwuid(os.getuid()).pw_dir


def test_the_session_has_a_home_of_its_own(private_home: Path) -> None:
    assert os.environ["HOME"] == str(private_home) != REAL_HOME
    assert Path.home() == private_home
    for name in ("STATE_DIRECTORY", "XDG_STATE_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME"):
        assert Path(os.environ[name]).is_relative_to(private_home), name
    code = "from appliance.core.config import default_state_dir as d; print(d())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert Path(child.stdout.strip()).is_relative_to(private_home)  # a service started without --state


@pytest.mark.parametrize("command", [["-m", "tests.support.genmodel"], ["-m", "tests.support.litert_llm"], ["-m", "tests.support.modelgen"],
                                     [str(ROOT / "scripts" / "make_sample_model.py")]])
def test_generators_print_their_help_and_write_nothing(command: list[str], tmp_path: Path) -> None:
    sample = ROOT / "appliance" / "sample_models" / "half_plus_two" / "1"
    before = {p: p.stat().st_mtime_ns for p in sample.rglob("*")}
    done = subprocess.run([sys.executable, *command, "--help"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0 and done.stdout.startswith("usage:"), done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == [] and not (ROOT / "--help").exists()
    assert {p: p.stat().st_mtime_ns for p in sample.rglob("*")} == before


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# The tests that meet what the README's service holds: the CLI finding a service from a state
# directory and its token (all of test_cli_service), TF Serving's flags and ports 8500/8501
# (all of test_tfs_files_and_flags), and `appliance sync` refused without the admin token and
# accepted with the unit's credential (the folder bucket's full scenario). The rest of
# test_sync_file (kill -9 at three points, unsigned versions) runs on free ports and a state
# folder of its own, as in the outer run: nested, it was half of this test's time (230 of 442 s).
NESTED = ["tests/service/test_cli_service.py", "tests/core/test_tfs_files_and_flags.py",
          "tests/sync/test_sync_file.py::test_folder_bucket_full_scenario"]


@pytest.mark.timeout(1800)  # 240 s for the service, 1200 for the nested suite, 300 for sync: all stretch alike
def test_the_suite_passes_beside_a_service_started_as_the_readme_says(tmp_path: Path) -> None:
    """``scripts/run.sh`` runs ``appliance serve`` on its embedded default: the user's home
    holds its state and admin token, REST on 8501, gRPC on 8500. Tests run beside it (their
    own ``appliance sync`` calls included), leave it alone and never need its ports. On a
    shared machine those may be another's: then this service takes others, and the tests
    still run beside whoever holds them. The nested tests are ``NESTED``."""
    home = tmp_path / "home-of-the-user"
    home.mkdir()
    user = {k: v for k, v in os.environ.items() if k not in ("STATE_DIRECTORY", "XDG_STATE_HOME", "XDG_CACHE_HOME",
                                                             "XDG_CONFIG_HOME", "XDG_DATA_HOME",
                                                             "EDGE_TEST_ARTIFACTS")}  # the outer run's record
    user["HOME"] = str(home)
    port = 8501 if _free(8501) else free_port()
    grpc = "8500" if _free(8500) else "0"  # TF Serving's gRPC port, as the README's service holds it
    state = home / ".local" / "state" / "edge-appliance"
    log = tmp_path / "readme-service.log"
    with open(log, "wb") as out:  # the user's environment exactly: no STATE_DIRECTORY of the test session
        serve = [sys.executable, "-m", "appliance.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--grpc-port", grpc, "--no-discovery"]
        proc = subprocess.Popen(serve, stdout=out, stderr=subprocess.STDOUT, env=user, cwd=ROOT)
    readme = Server(proc, port, state, log)
    try:
        readme.wait_for(lambda: readme.get("/readyz", timeout=2).status_code == 200, 240, "the README's service")
        token = (state / "admin-token").read_text()
        nested = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "nested"), *NESTED],
            cwd=ROOT, env=user, capture_output=True, text=True, timeout=scaled(1200))
        assert nested.returncode == 0, nested.stdout[-4000:] + nested.stderr[-2000:]
        assert (state / "admin-token").read_text() == token  # left alone
        sync = subprocess.run([sys.executable, "-m", "appliance.cli", "sync"], cwd=ROOT, env=user,
                              capture_output=True, text=True, timeout=scaled(300))
        assert sync.returncode == 0, sync.stderr  # the user's own `appliance sync` still finds it, as the README says
        assert readme.proc.poll() is None
    finally:
        readme.stop()
