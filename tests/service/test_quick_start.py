"""The README's quick start as a new user meets it: ``appliance serve`` with no config.

The "try:" line appears only once the API answers (a request copied from the terminal at
that moment succeeds), the banner names the bucket and a publish line that works as
printed, the local operator's ``appliance sync`` works without configuring a token (the
embedded default made one, readable by this user only), and a second service on the same
state directory is refused with the holder's pid instead of sharing its events.
"""

from __future__ import annotations

import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import requests

from tests.support.servers import ROOT, free_port, launch


def banner(server: Any) -> dict[str, str]:
    """The quick-start lines of the server's log, by their first word ("try:", "publish:")."""
    lines = {}
    for line in server.log_text().splitlines():
        word = line.split(" ", 1)[0]
        if word in ("try:", "publish:", "serving", "edge-appliance"):
            lines[word] = line
    return lines


def test_the_first_run_as_the_readme_tells_it(tmp_path: Path) -> None:
    server = launch([], tmp_path, ready=False)
    try:
        lines = server.wait_for(lambda: (b := banner(server)).get("try:") and b, 180, "the try: line")
        # The moment it is printed, the request it shows is answered.
        curl = shlex.split(lines["try:"].split(" ", 1)[1].strip())
        assert curl[0] == "curl" and curl[1] == "-d"
        answer = requests.post(curl[3], data=curl[2], timeout=10)
        assert answer.status_code == 200 and answer.json() == {"predictions": [2.5, 3.0, 4.5]}
        bucket = f"file://{server.state}/bucket"
        assert bucket in lines["serving"] and "half_plus_two v1" in lines["serving"]

        # The publish line works as printed, on a version folder of the user's.
        version = tmp_path / "my-model" / "7"
        sample = ROOT / "appliance" / "sample_models" / "half_plus_two" / "1"
        shutil.copytree(sample, version)
        publish = shlex.split(lines["publish:"].split(" ", 1)[1].split("  (")[0])
        assert publish[0].endswith("appliance") and publish[1:5] == ["publish", "--bucket", bucket, "--model"]
        cmd = [sys.executable, "-m", "appliance.cli", *publish[1:-1], str(version), "--version", "7"]
        subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=120)

        # The local operator's "poll now" needs no token set up: the embedded default made one.
        token = server.state / "admin-token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        sync = subprocess.run([sys.executable, "-m", "appliance.cli", "sync", "--url", server.url,
                               "--state", str(server.state)], cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert sync.returncode == 0, sync.stderr
        server.wait_for(lambda: server.status()["models"]["half_plus_two"]["serving_version"] == 7, 120,
                        "the published version 7 serving")
        # A remote caller without the token is still refused.
        assert server.post("/api/sync").status_code in (401, 403)

        # A second service on the same state directory is refused and names the holder.
        second = subprocess.run([sys.executable, "-m", "appliance.cli", "serve", "--host", "127.0.0.1",
                                 "--port", str(free_port()), "--state", str(server.state), "--no-discovery",
                                 "--grpc-port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert f"pid {server.proc.pid}" in second.stderr and str(server.state) in second.stderr
    finally:
        server.stop()
    # After a restart the banner says what really serves: the published version, not "the sample".
    again = launch([], tmp_path, ready=False, port=server.port)
    try:
        lines = again.wait_for(lambda: (b := banner(again)).get("try:") and b, 180, "the try: line after a restart")
        assert "half_plus_two v7" in lines["serving"]
    finally:
        again.stop()
