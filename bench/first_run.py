"""The README's first command as a new user meets it: ``scripts/run.sh`` from nothing to its
``try:`` line, in a throwaway virtualenv.

    PYTHONPATH=. .venv/bin/python -m bench.first_run [--idle-seconds 20] [--out bench/RESULTS.md]

Runs ``VENV=<tmp>/venv scripts/run.sh`` on a private state folder and a free loopback port (the
user's ``~/.local/state`` and port 8501 stay untouched), times every step the script announces
(venv, pip, the service's start) and the ``try:`` line, checks that the line's request is
answered, measures the venv's size on disk and, after ``--idle-seconds``, the whole process
tree's PSS and RSS (bench/footprint.py's ``tree``), then stops the service with SIGINT, as
Ctrl-C does, and removes the folder. pip and uv read their wheels wherever this machine's pip
configuration says (a warm cache or a local index makes the install a local one: say so when
quoting the figure); uv's cache is run.sh's own throwaway folder, empty as on a fresh machine,
unless UV_CACHE_DIR is set. ``--installer pip`` runs run.sh's pip-only
path (INSTALLER=pip), the one before uv, for a side-by-side figure. The load average is printed beside the figures: on a busy machine every
step stretches, so the CPU time of all of it (every process run.sh started, until it stopped)
is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.footprint import du_kb, tree  # noqa: E402
from tests.support.servers import free_port  # noqa: E402

STEP = re.compile(r"^run\.sh \[[\d:]+\] (\w+)")
UV = re.compile(r"^(Using Python|Resolved \d+ packages)")  # uv's first line: pip has fetched uv


def first_run(work: Path, port: int, timeout_s: float, installer: str) -> tuple[subprocess.Popen[str], dict[str, float]]:
    """run.sh started in ``work``: (the process, seconds from the start to each step and the try: line)."""
    env = {**os.environ, "VENV": str(work / "venv"), "INSTALLER": installer}
    cmd = [str(ROOT / "scripts" / "run.sh"), "--host", "127.0.0.1", "--port", str(port), "--grpc-port", "0",
           "--no-discovery", "--state", str(work / "state")]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    marks: dict[str, float] = {}
    assert proc.stdout is not None
    for line in proc.stdout:
        step = STEP.match(line)
        if step:
            marks.setdefault(step.group(1), time.perf_counter() - t0)
        elif UV.match(line):
            marks.setdefault("uv", time.perf_counter() - t0)
        if line.startswith("try:"):
            marks["try-line"] = time.perf_counter() - t0
            marks["curl"] = _answered(line)
            return proc, marks
        if time.perf_counter() - t0 > timeout_s:
            break
    proc.kill()
    raise RuntimeError(f"no try: line within {timeout_s} s (exit {proc.poll()})")


def _answered(line: str) -> float:
    """The try: line's request, as printed: 1.0 when it answers the sample's predictions."""
    body, url = re.search(r"-d '(.*)' (\S+)", line).groups()  # type: ignore[union-attr]
    with urllib.request.urlopen(urllib.request.Request(url, body.encode()), timeout=10) as r:
        return 1.0 if json.load(r) == {"predictions": [2.5, 3.0, 4.5]} else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle-seconds", type=float, default=20)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    ap.add_argument("--installer", choices=("uv", "pip"), default="uv")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edge-first-run-"))
    load_before = os.getloadavg()[0]
    proc, marks = first_run(work, free_port(), args.timeout, args.installer)
    threading.Thread(target=proc.communicate, daemon=True).start()  # the service's log must never fill the pipe
    try:
        size_mb = du_kb(work / "venv") / 1024
        time.sleep(args.idle_seconds)
        procs = tree(proc.pid)
    finally:
        proc.send_signal(signal.SIGINT)
        stopped = proc.wait(60)
        shutil.rmtree(work, ignore_errors=True)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # run.sh, venv, pip, the service: all waited for
    cpu = usage.ru_utime + usage.ru_stime
    pss, rss = sum(p["pss"] for p in procs), sum(p["rss"] for p in procs)
    steps = ", ".join(f"{k} at {v:.1f} s" for k, v in marks.items() if k not in ("try-line", "curl"))
    text = (f"\n## The first run (scripts/run.sh from nothing), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n"
            f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {load_before:.1f} before, "
            f"{os.getloadavg()[0]:.1f} after. Command: `{' '.join(sys.argv)}`. pip's configuration: "
            f"{os.environ.get('PIP_FIND_LINKS') or 'its defaults'} (find-links). Installer: {args.installer}"
            f"{'' if args.installer == 'pip' else ', its cache ' + os.environ.get('UV_CACHE_DIR', 'empty')}.\n\n"
            f"- try: line after **{marks['try-line']:.1f} s** ({steps}); its request answered: "
            f"{'yes' if marks['curl'] else 'NO'}\n"
            f"- CPU time of it all (venv, pip, the service until stopped, every process): **{cpu:.1f} s**: what "
            "a quiet machine's wall time approaches where one core does the work\n"
            f"- venv: **{size_mb:.0f} MiB** on disk (pip included, and uv where it installed)\n"
            f"- idle after {args.idle_seconds:.0f} s, the whole tree ({len(procs)} processes): **{pss:.1f} MiB PSS**, "
            f"{rss:.1f} MiB RSS (serving process {procs[0]['pss']:.1f} MiB PSS)\n"
            f"- Ctrl-C (SIGINT): exit status {stopped}\n")
    with open(args.out, "a") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
