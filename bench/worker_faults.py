"""A hung, a killed and a crash-looping front worker, under load (issue 34's done-when).

    PYTHONPATH=. .venv/bin/python -m bench.worker_faults [--clients 8] [--out bench/RESULTS.md]

The service (this tree, LiteRT, the bench MLP, 2 workers, the default ``worker_timeout_s``)
answers ``--clients`` keep-alive clients throughout. Then:

- **SIGSTOP** one worker: a prober opens a fresh connection every 0.1 s (2 s timeout each);
  reported: how long after the stop new connections kept failing (the last failure), how many
  failed, and when the supervisor replaced the worker.
- **kill -9** one worker: the keep-alive clients' failed requests, against the connections the
  worker held (at most one request each may fail).
- **kill -9 of the zygote** (``--only zygote``; issue 47 item 8): ``--zygote-clients``
  keep-alive clients (2, as the issue's attack); reported: failed requests in the ``SETTLE_S``
  after the kill, whether the workers kept their pids, and the new zygote's pid (none: not
  replaced).
- **a crash loop**: the TLS key is moved away and a worker killed, so every new worker fails at
  start-up; over 20 s: how many starts, and the whole tree's CPU (it must not spin a core).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.run_bench import bench_models, body, start_service, stop  # noqa: E402

PORT = 18960
BODY = body("mlp")


class Load:
    """Keep-alive clients posting MLP predicts until stopped; outcomes with their times."""

    def __init__(self, port: int, clients: int, context: ssl.SSLContext | None = None):
        self.port, self.context = port, context
        self.stop = threading.Event()
        self.ok, self.failed = 0, []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _conn(self) -> http.client.HTTPConnection:
        if self.context is not None:
            return http.client.HTTPSConnection("127.0.0.1", self.port, timeout=30, context=self.context)
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def _run(self) -> None:
        conn = self._conn()
        while not self.stop.is_set():
            try:
                conn.request("POST", "/v1/models/mlp:predict", BODY, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                with self._lock:
                    self.ok += response.status == 200
            except (OSError, http.client.HTTPException) as exc:
                with self._lock:
                    self.failed.append((time.monotonic(), type(exc).__name__))
                conn.close()
                conn = self._conn()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def status(port: int, context: ssl.SSLContext | None = None) -> dict[str, Any]:
    """``/api/status``, asked again on a fresh connection while the one asked hangs or fails (it
    may land on the stopped worker)."""
    for _ in range(30):
        conn = (http.client.HTTPSConnection("127.0.0.1", port, timeout=2, context=context) if context
                else http.client.HTTPConnection("127.0.0.1", port, timeout=2))
        try:
            conn.request("GET", "/api/status")
            return json.loads(conn.getresponse().read())  # type: ignore[no-any-return]
        except (OSError, http.client.HTTPException):
            time.sleep(0.1)
        finally:
            conn.close()
    raise RuntimeError("no /api/status answer in 30 tries")


def fresh_ok(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("POST", "/v1/models/mlp:predict", BODY, {"Content-Type": "application/json"})
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def stopped_worker(port: int) -> dict[str, Any]:
    victim = status(port)["workers"][0]["pid"]
    load = Load(port, 8)
    time.sleep(2)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGSTOP)
    failures, replaced = [], None
    while time.monotonic() - t0 < 40:
        if not fresh_ok(port):
            failures.append(time.monotonic() - t0)
        if replaced is None and status(port)["workers"][0]["pid"] != victim:
            replaced = time.monotonic() - t0
        if replaced is not None and time.monotonic() - t0 > replaced + 5:
            break
        time.sleep(0.1)
    load.finish()
    if psutil.pid_exists(victim):
        os.kill(victim, signal.SIGKILL)
    return {"replaced_s": round(replaced or -1, 1), "last_failure_s": round(max(failures, default=0.0), 1),
            "failed_fresh": len(failures), "cut_keepalive": len(load.failed)}


def killed_worker(port: int, clients: int) -> dict[str, Any]:
    load = Load(port, clients)
    time.sleep(3)
    pid = status(port)["workers"][0]["pid"]
    held = sum(1 for c in psutil.Process(pid).net_connections("tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port)
    os.kill(pid, signal.SIGKILL)
    time.sleep(5)
    ok_before = load.ok
    time.sleep(3)
    load.finish()
    return {"held": held, "failed": len(load.failed), "ok_after": load.ok - ok_before}


SETTLE_S = 6.0  # the window: 581 of 2,576 failed in the 6 s after the kill


def zygote_of(root: int, workers: list[int]) -> int | None:
    """The zygote: the serving process's child that is the workers' parent, else (once it was
    replaced) the serving process's child started as ``appliance.fronts.zygote``."""
    children = psutil.Process(root).children()
    for child in children:
        if any(psutil.Process(w).ppid() == child.pid for w in workers if psutil.pid_exists(w)):
            return child.pid
    for child in children:
        if "appliance.fronts.zygote" in " ".join(child.cmdline()):
            return child.pid
    return None


def killed_zygote(proc: subprocess.Popen, port: int, clients: int) -> dict[str, Any]:
    workers = [w["pid"] for w in status(port)["workers"]]
    zygote = zygote_of(proc.pid, workers)
    if zygote is None:
        raise RuntimeError("no zygote in the service's process tree")
    from appliance.fronts.health import process_memory

    memory_before = process_memory(zygote)
    load = Load(port, clients)
    time.sleep(3)
    ok0, failed0 = load.ok, len(load.failed)
    t0 = time.monotonic()
    os.kill(zygote, signal.SIGKILL)
    time.sleep(SETTLE_S)
    ok, failed = load.ok - ok0, len(load.failed) - failed0
    last = max((t for t, _ in load.failed[failed0:]), default=t0)
    load.finish()
    after = [w["pid"] for w in status(port)["workers"]]
    new = zygote_of(proc.pid, after)
    mb = {f"zygote_{k}_mb": round(v / 2**20, 1) for k, v in memory_before.items()}
    if new is not None and new != zygote:
        mb.update({f"new_zygote_{k}_mb": round(v / 2**20, 1) for k, v in process_memory(new).items()})
    return {**mb, "failed": failed, "answered": ok + failed, "last_failure_s": round(last - t0, 1),
            "workers_kept": after == workers,
            "new_zygote": new if new != zygote else None}


def start_tls(models: Path, port: int, state: Path, extra: str, context: ssl.SSLContext) -> subprocess.Popen:
    """The service on HTTPS (start_service's config), ready once ``/readyz`` answers 200."""
    state.mkdir(parents=True, exist_ok=True)
    config = state / "bench.toml"
    config.write_text(f'models_dir = "{models}"\nstate_dir = "{state}"\n[runtime]\nbackend = "tflite"\n' + extra)
    proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve", "--config", str(config), "--host",
                             "127.0.0.1", "--port", str(port), "--grpc-port", "0", "--no-discovery"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(state / "server.log", "wb"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=2, context=context)
            conn.request("GET", "/readyz")
            if conn.getresponse().status == 200:
                return proc
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError("the HTTPS service did not become ready")


def crash_loop(models: Path, state: Path) -> dict[str, Any]:
    from tests.transport.test_tls import make_cert

    cert, key, _, _ = make_cert(state, "server")
    extra = f'[server]\nworkers = 2\n[security]\ntls_cert_file = "{cert}"\ntls_key_file = "{key}"\n'
    context = ssl.create_default_context(cafile=str(cert))
    proc = start_tls(models, PORT + 1, state / "tls", extra, context)
    try:
        key.rename(key.with_suffix(".gone"))
        os.kill(status(PORT + 1, context)["workers"][0]["pid"], signal.SIGKILL)
        time.sleep(2)
        root = psutil.Process(proc.pid)
        before = status(PORT + 1, context)["workers"][0]["restarts"]
        cpu0 = sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)])
        time.sleep(20)
        cpu = sum(sum(p.cpu_times()[:2]) for p in [root, *root.children(recursive=True)]) - cpu0
        after = status(PORT + 1, context)
        return {"starts_in_20s": after["workers"][0]["restarts"] - before, "tree_cpu_pct": round(5 * cpu, 1),
                "pause_s": after["workers"][0]["pause_s"],
                "problems": [p for p in after.get("problems", []) if "worker" in p]}
    finally:
        stop(proc)


def bench_tree() -> tuple[Path, Path]:
    models = Path(tempfile.mkdtemp(prefix="edge-faults-models-"))
    state = Path(tempfile.mkdtemp(prefix="edge-faults-"))
    (models / "mlp" / "1").mkdir(parents=True)
    shutil.copy(bench_models() / "mlp" / "1" / "model.tflite", models / "mlp" / "1" / "model.tflite")
    return models, state


def zygote_only(clients: int) -> dict[str, Any]:
    models, state = bench_tree()
    proc = start_service(models, "tflite", True, PORT, state / "plain", "[server]\nworkers = 2\n[grpc]\nport = 0\n")
    try:
        return {"clients": clients, "load": round(os.getloadavg()[0], 1), **killed_zygote(proc, PORT, clients)}
    finally:
        stop(proc)
        shutil.rmtree(models, ignore_errors=True)
        shutil.rmtree(state, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "bench" / "RESULTS.md"))
    ap.add_argument("--only", choices=("zygote",), help="run one fault only, print it, write nothing")
    ap.add_argument("--zygote-clients", type=int, default=2)
    args = ap.parse_args()
    if args.only == "zygote":
        print(json.dumps(zygote_only(args.zygote_clients)))
        return
    models = Path(tempfile.mkdtemp(prefix="edge-faults-models-"))
    state = Path(tempfile.mkdtemp(prefix="edge-faults-"))
    (models / "mlp" / "1").mkdir(parents=True)
    shutil.copy(bench_models() / "mlp" / "1" / "model.tflite", models / "mlp" / "1" / "model.tflite")
    proc = start_service(models, "tflite", True, PORT, state / "plain", "[server]\nworkers = 2\n[grpc]\nport = 0\n")
    try:
        hung = stopped_worker(PORT)
        time.sleep(2)
        killed = killed_worker(PORT, args.clients)
    finally:
        stop(proc)
    looping = crash_loop(models, state)
    text = "\n".join([
        f"\n## Front workers hung, killed and crash-looping under load, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end. "
        f"Command: `PYTHONPATH=. .venv/bin/python -m bench.worker_faults {' '.join(sys.argv[1:])}`. 2 workers, "
        "worker_timeout_s = 10 (the default), bench MLP on LiteRT.\n",
        "| fault | result |", "|---|---|",
        f"| SIGSTOP of a worker, 8 keep-alive clients + a fresh connection every 0.1 s | replaced after "
        f"{hung['replaced_s']} s; last failed fresh connection {hung['last_failure_s']} s after the stop "
        f"({hung['failed_fresh']} failed); {hung['cut_keepalive']} keep-alive requests cut |",
        f"| kill -9 of a worker, {args.clients} keep-alive clients | {killed['failed']} requests failed; the worker "
        f"held {killed['held']} connections; {killed['ok_after']} answered in the 3 s after |",
        f"| crash loop (TLS key gone, a worker killed) | {looping['starts_in_20s']} starts in 20 s, pause now "
        f"{looping['pause_s']} s; whole tree {looping['tree_cpu_pct']} % of a core; problems: {looping['problems']} |",
    ]) + "\n"
    with open(args.out, "a") as f:
        f.write(text)
    print(text)
    shutil.rmtree(models, ignore_errors=True)
    shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
