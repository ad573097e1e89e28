"""Issue 47's attack 2, rerun: two clients post the 16 KB gzip bomb (4,194,301 JSON strings under
"instances") for 20 s at a service with two front workers serving the bench MLP on LiteRT; a
REST probe every 0.5 s (5 s timeout). Prints the bomb's answers and their latency, failed probes,
worker restarts, and the tree's RSS idle and at its peak.

    PYTHONPATH=. .venv/bin/python bench/bomb_attack.py PORT MODELS_DIR STATE_DIR

MODELS_DIR holds ``keras_mlp_tflite/1/model.tflite`` (tests/support/modelgen.py builds it);
compare a tree before the change by running this script with ``PYTHONPATH`` at a ``git archive``
of it. Every process it starts is stopped by PID."""
import argparse
import gzip
import json
import subprocess
import sys
import threading
import time

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("port", type=int, help="a free loopback port for the service")
parser.add_argument("models", help="MODELS_DIR, holding keras_mlp_tflite/1/model.tflite")
parser.add_argument("state", help="STATE_DIR, the service's state directory (its log goes beside it)")
args = parser.parse_args()
port, models, state = args.port, args.models, args.state

import psutil  # noqa: E402  (after --help: the bench's imports are not paid to print it)
import requests  # noqa: E402
proc = subprocess.Popen([sys.executable, "-m", "appliance.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                         "--state", state, "--models", models, "--backend", "tflite", "--workers", "2",
                         "--no-discovery", "--grpc-port", "0"], stdout=open(state + ".log", "wb"), stderr=subprocess.STDOUT)
url = f"http://127.0.0.1:{port}"
try:
    for _ in range(600):
        try:
            if requests.get(url + "/readyz", timeout=2).status_code == 200: break
        except requests.RequestException: pass
        time.sleep(0.2)
    model = "keras_mlp_tflite"
    row = [0.01 * i for i in range(64)]
    bomb = gzip.compress(b'{"instances": [' + b",".join([b'"a"'] * 4194301) + b"]}", 9)
    def tree_rss():
        p = psutil.Process(proc.pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])
    idle = tree_rss()
    stop = time.monotonic() + 20
    answers, probes = [], []
    def attack():
        s = requests.Session()
        while time.monotonic() < stop:
            t = time.monotonic()
            try:
                r = s.post(f"{url}/v1/models/{model}:predict", data=bomb, headers={"Content-Encoding": "gzip"}, timeout=30)
                answers.append((r.status_code, time.monotonic() - t))
            except requests.RequestException as e:
                answers.append(("err", time.monotonic() - t))
    def probe():
        while time.monotonic() < stop + 2:
            try:
                ok = requests.post(f"{url}/v1/models/{model}:predict", json={"instances": [row]}, timeout=5).status_code == 200
            except requests.RequestException:
                ok = False
            probes.append(ok); time.sleep(0.5)
    peak = [idle]
    def watch():
        while time.monotonic() < stop + 2:
            peak[0] = max(peak[0], tree_rss()); time.sleep(0.2)
    ts = [threading.Thread(target=f) for f in (attack, attack, probe, watch)]
    [t.start() for t in ts]; [t.join() for t in ts]
    status = requests.get(url + "/api/status", timeout=10).json()
    lat = sorted(a[1] for a in answers)
    print(json.dumps({"bomb_bytes": len(bomb), "bomb_answers": len(answers),
                      "statuses": sorted({str(a[0]) for a in answers}),
                      "bomb_latency_median_s": round(lat[len(lat)//2], 3), "bomb_latency_max_s": round(lat[-1], 3),
                      "probes": len(probes), "failed_probes": probes.count(False),
                      "worker_restarts": [w["restarts"] for w in status["workers"]],
                      "tree_rss_idle_mb": idle >> 20, "tree_rss_peak_mb": peak[0] >> 20}))
finally:
    proc.terminate(); proc.wait(60)
