"""What TensorFlow costs a device: whole-tree PSS with LiteRT only, with TensorFlow installed but
LiteRT serving, with a version on TensorFlow, and after the last TensorFlow version goes.

    .venv/bin/python bench/tf_footprint.py [--out bench/RESULTS.md]

Every figure is PSS from ``/proc/<pid>/smaps_rollup``, summed over the service's process tree
(the serving process and its front workers), measured idle once the model is AVAILABLE, with
``--workers 1`` (one process) and the default workers. Rows:

1. LiteRT-only venv (bench/footprint.py's), the bench MLP's ``model.tflite``;
2. the full venv (TensorFlow installed), the bench MLP with ``saved_model.pb`` and
   ``model.tflite``: the trial measures both in a child and LiteRT wins;
3. the full venv, the embedded default (TF Serving's half_plus_two, served on tf-cpu: only it has
   classify and regress), beside a bare ``import tensorflow`` and a bare ``import numpy``;
4. the full venv, a TensorFlow version replaced by a LiteRT one (the MLP, SavedModel only, then
   ``model.tflite`` only): what stays of TensorFlow once nothing runs on it;
5. the cost of the alternative for TensorFlow versions, a child process that serves them: the
   round trip of a request's tensors to another process (a socketpair, the bytes and a header).

Each row also says whether any process of the tree maps TensorFlow's shared objects.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.footprint import lite_venv  # noqa: E402
from bench.run_bench import bench_models, stop  # noqa: E402

FULL = ROOT / ".venv"


def memory_kb(pid: int) -> dict[str, int]:
    """Rss, Pss and Uss (private pages) from smaps_rollup. PSS splits a shared page among every
    process mapping it, on this shared machine other services of the same venv files too, so
    USS and RSS are shown beside it."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[-1:] == ["kB"]}
    return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": fields["Private_Clean"] + fields["Private_Dirty"]}


def maps_tensorflow(pid: int) -> bool:
    """Whether the process maps TensorFlow's own shared objects (not LiteRT's)."""
    with open(f"/proc/{pid}/maps") as f:
        return any("/site-packages/tensorflow/" in line or "libtensorflow" in line for line in f)


def tree(pid: int) -> list[psutil.Process]:
    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def figures(pid: int) -> dict[str, Any]:
    procs = tree(pid)
    per = [memory_kb(p.pid) for p in procs]
    out: dict[str, Any] = {"processes": len(procs), "tensorflow_mapped": [p.pid for p in procs if maps_tensorflow(p.pid)]}
    for kind in ("rss", "pss", "uss"):
        out[f"tree_{kind}_mb"] = round(sum(m[kind] for m in per) / 1024, 1)
        out[f"serving_{kind}_mb"] = round(per[0][kind] / 1024, 1)
    return out


def get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.loads(r.read())


def serve(python: Path, args: list[str], state: Path, port: int, checkout: Path) -> tuple[subprocess.Popen, float]:
    """The service started from ``checkout`` (its code: the working directory comes first on the
    path) and the seconds it took to answer /readyz 200."""
    cmd = [str(python), "-m", "appliance.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--state", str(state), "--no-discovery", "--grpc-port", "0", "--poll-interval", "0.5", *args]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=checkout, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
                if r.status == 200:
                    return proc, round(time.perf_counter() - started, 2)
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd} exited with {proc.returncode}")
        time.sleep(0.02)
    stop(proc)
    raise RuntimeError("the service did not become ready")


def settled(port: int, model: str, version: int) -> dict[str, Any]:
    """The version's record once it serves and nothing else of the model is still loaded."""
    while True:
        status = get(port, "/api/status")["models"][model]
        versions = status["versions"]
        if status["serving_version"] == version and all(v["state"] == "END" for v in versions if v["version"] != version):
            return next(v for v in versions if v["version"] == version)
        time.sleep(0.2)


def measured(python: Path, args: list[str], port: int, model: str, version: int, checkout: Path,
             then: Any = None) -> dict[str, Any]:
    """Figures of one service: started fresh (its trial runs), measured idle, stopped; then, for a
    plain row, started again on the same state (the cached verdict: no trial) for the time to ready."""
    state = Path(tempfile.mkdtemp(prefix="edge-tf-footprint-"))
    proc, first_s = serve(python, args, state, port, checkout)
    try:
        record = settled(port, model, version)
        if then is not None:
            model, version = then()
            record = settled(port, model, version)
        time.sleep(3)  # idle: the trial child has exited, the unloaded version is freed
        out = figures(proc.pid)
        out.update(backend=record["backend"], trial_ms=record.get("trial_ms"), load_ms=record["load_ms"],
                   imported=get(port, "/api/status")["service"]["imported"], first_start_s=first_s)
    finally:
        stop(proc)
    if then is None:
        proc, out["restart_s"] = serve(python, args, state, port, checkout)
        stop(proc)
    shutil.rmtree(state, ignore_errors=True)
    return out


def bare_import(module: str) -> dict[str, float]:
    """RSS, PSS and USS (MB) of a Python process that imported ``module`` and nothing else."""
    code = (f"import os; os.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'; import {module}; "
            "print(open('/proc/self/smaps_rollup').read())")
    out = subprocess.run([str(FULL / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    fields = {line.split(":")[0]: int(line.split()[1]) for line in out.stdout.splitlines()
              if line.split()[-1:] == ["kB"]}
    kb = {"rss": fields["Rss"], "pss": fields["Pss"], "uss": fields["Private_Clean"] + fields["Private_Dirty"]}
    return {k: round(v / 1024, 1) for k, v in kb.items()}


def ipc_round_trip_us(nbytes: int, rounds: int = 2000) -> float:
    """Median microseconds to send ``nbytes`` to another process and get as many back."""
    a, b = socket.socketpair()
    code = ("import socket,sys\ns=socket.socket(fileno=int(sys.argv[1]))\nwhile True:\n"
            " h=s.recv(8,socket.MSG_WAITALL)\n if not h: break\n n=int.from_bytes(h,'little')\n"
            " d=bytearray(n); v=memoryview(d); got=0\n while got<n: got+=s.recv_into(v[got:])\n s.sendall(h+d)\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(b.fileno())], pass_fds=(b.fileno(),))
    b.close()
    payload = os.urandom(nbytes)
    head = nbytes.to_bytes(8, "little")
    samples = []
    buf = bytearray(nbytes + 8)
    for _ in range(rounds):
        t0 = time.perf_counter()
        a.sendall(head + payload)
        view, got = memoryview(buf), 0
        while got < nbytes + 8:
            got += a.recv_into(view[got:])
        samples.append((time.perf_counter() - t0) * 1e6)
    a.close()
    child.wait(10)
    return round(statistics.median(samples), 1)


def swap_to_litert(base: Path, mlp: Path) -> Any:
    def then() -> tuple[str, int]:
        stage = base / ".stage"
        stage.mkdir()
        shutil.copy(mlp / "model.tflite", stage / "model.tflite")
        stage.rename(base / "mlp" / "2")
        return "mlp", 2
    return then


def run(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    mlp = bench_models() / "mlp" / "1"
    work = Path(tempfile.mkdtemp(prefix="edge-tf-footprint-models-"))
    lite, both, tf_only = work / "lite", work / "both", work / "tf_only"
    (lite / "mlp" / "1").mkdir(parents=True)
    shutil.copy(mlp / "model.tflite", lite / "mlp" / "1")
    shutil.copytree(mlp, both / "mlp" / "1")
    shutil.copytree(mlp, tf_only / "mlp" / "1", ignore=shutil.ignore_patterns("model.tflite"))
    rows = []
    port, checkout = args.port, Path(args.checkout)
    for workers in ("1", "default"):
        extra = ["--workers", "1"] if workers == "1" else []
        rows.append(("LiteRT-only venv, MLP .tflite", workers,
                     measured(lite_venv() / "bin" / "python", ["--models", str(lite), *extra], port, "mlp", 1,
                              checkout)))
        rows.append(("TF venv, MLP saved_model.pb + .tflite (LiteRT wins)", workers,
                     measured(FULL / "bin" / "python", ["--models", str(both), *extra], port, "mlp", 1, checkout)))
        rows.append(("TF venv, embedded default (half_plus_two on tf-cpu)", workers,
                     measured(FULL / "bin" / "python", extra, port, "half_plus_two", 1, checkout)))
        shutil.rmtree(tf_only / "mlp" / "2", ignore_errors=True)
        rows.append(("TF venv, MLP on tf-cpu, then replaced by a .tflite-only version", workers,
                     measured(FULL / "bin" / "python", ["--models", str(tf_only), *extra], port, "mlp", 1, checkout,
                              then=swap_to_litert(tf_only, mlp))))
    shutil.rmtree(work, ignore_errors=True)
    return rows


def report(rows: list[tuple[str, str, dict[str, Any]]], extra: dict[str, Any], argv: list[str],
           checkout: str) -> str:
    load = os.getloadavg()
    lines = [f"\n## What TensorFlow costs a device (issue 34), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} at the "
             f"end. Command: `{' '.join(argv)}` (code of {checkout}). From /proc/<pid>/smaps_rollup, idle, the model "
             "AVAILABLE; tree = the serving process and its front workers. 'TF mapped': processes of the tree mapping "
             "TensorFlow's shared objects. PSS splits shared pages with every process mapping them, other services "
             "on this shared machine too: USS (private) and RSS say what a process holds alone.\n",
             "| install, models | workers | processes | tree PSS MB | tree USS MB | tree RSS MB | serving PSS / USS / "
             "RSS MB | backend | TF mapped | trial ms | load ms | first start to ready s | restart s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, workers, r in rows:
        lines.append(f"| {name} | {workers} | {r['processes']} | {r['tree_pss_mb']} | {r['tree_uss_mb']} | "
                     f"{r['tree_rss_mb']} | {r['serving_pss_mb']} / {r['serving_uss_mb']} / {r['serving_rss_mb']} | "
                     f"{r['backend']} | {len(r['tensorflow_mapped']) or 'none'} | {r['trial_ms']} | {r['load_ms']} | "
                     f"{r['first_start_s']} | {r.get('restart_s', '-')} |")
    bare = lambda m: " / ".join(str(extra[m][k]) for k in ("pss", "uss", "rss"))  # noqa: E731
    lines += ["", f"Beside them, bare imports in the TF venv (PSS / USS / RSS MB): `import numpy` {bare('numpy')}, "
              f"`import tensorflow` {bare('tensorflow')}. A request's tensors to another process and back "
              "(socketpair, median): " + ", ".join(f"{k} {v} µs" for k, v in extra["ipc_us"].items()) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    ap.add_argument("--port", type=int, default=18961)
    ap.add_argument("--checkout", default=str(ROOT), help="run this checkout's code (a 'before' worktree, say)")
    args = ap.parse_args()
    rows = run(args)
    extra = {"numpy": bare_import("numpy"), "tensorflow": bare_import("tensorflow"),
             "ipc_us": {f"{n} B" if n < 1024 else f"{n >> 10} KiB": ipc_round_trip_us(n)
                        for n in (256, 110 << 10, 4 << 20)}}
    text = report(rows, extra, sys.argv, args.checkout)
    with open(args.out, "a") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
