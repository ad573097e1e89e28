"""Helpers shared by the sync tests: versioned models, load generators, store checks, and a
device's sync side without a service (``Device``: a store, a source, a follower).

``sync_models()`` builds TF Serving's half_plus_two three times with different ``b``
(version 1: y = x/2 + 2, version 2: + 3, version 3: + 4), cached across runs like the
``models_dir`` fixture, so a response tells which version answered it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any

import requests

from sync.follower import Follower, LocalModel, Options
from sync.open_source import open_source
from sync.store import Store
from tests.support.cache import built_once
from tests.support.servers import free_port, poll_until

ROOT = Path(__file__).resolve().parents[2]
CPU_TAGS = frozenset({"any", "x86_64", "tflite", "tf"})  # what an x86 device with both runtimes matches
OFFSETS = {1: 2.0, 2: 3.0, 3: 4.0}  # version -> b in y = 0.5 x + b


def sync_models() -> Path:
    """<cache>/hpt/<v>/ for v in OFFSETS (real SavedModels with warm-up requests)."""
    from tests.support import modelgen

    digest = hashlib.sha256((ROOT / "tests" / "support" / "modelgen.py").read_bytes() + json.dumps(OFFSETS).encode())

    def build(folder: Path) -> None:
        for version, b in OFFSETS.items():
            modelgen.build_half_plus_two(str(folder / "hpt" / str(version)), b=b, warmup=True)

    return built_once(f"sync-{digest.hexdigest()[:12]}", build)


def predict(url: str, model: str = "hpt", timeout: float = 10) -> float:
    """y for x = 2.0 (1 + b), from the real REST API."""
    r = requests.post(f"{url}/v1/models/{model}:predict", json={"instances": [2.0]}, timeout=timeout)
    r.raise_for_status()
    return float(r.json()["predictions"][0])


def version_of(y: float) -> int:
    for version, b in OFFSETS.items():
        if abs(y - (1.0 + b)) < 1e-5:
            return version
    raise AssertionError(f"answer {y} matches no published version")


def answer_of(body: Any) -> float:
    """y of a :predict answer, of a SavedModel's rows ([y]) or a LiteRT model's ([[y]] or {"y": [y]})."""
    row = body["predictions"][0]
    row = row["y"] if isinstance(row, dict) else row
    return float(row[0] if isinstance(row, list) else row)


class Load:
    """Steady concurrent predict load; counts failures and which versions answered. ``instance``
    is the one row each request sends ([[2.0]] for the LiteRT models of fleet_support)."""

    def __init__(self, url: str, threads: int = 4, instance: Any = 2.0):
        self.url, self.threads, self.instance = url, threads, instance
        self.ok = 0
        self.failures: list[str] = []
        self.versions: set[int] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers = [threading.Thread(target=self._run, name=f"load-{i}") for i in range(threads)]

    def __enter__(self) -> "Load":
        for w in self._workers:
            w.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for w in self._workers:
            w.join(30)

    def _run(self) -> None:
        session = requests.Session()
        while not self._stop.is_set():
            try:
                r = session.post(f"{self.url}/v1/models/hpt:predict", json={"instances": [self.instance]}, timeout=30)
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                version = version_of(answer_of(r.json()))
                with self._lock:
                    self.ok += 1
                    self.versions.add(version)
            except Exception as exc:  # every failure is a finding
                with self._lock:
                    self.failures.append(str(exc))
        session.close()


def serving_version(status: dict[str, Any], model: str = "hpt") -> int | None:
    return status.get("models", {}).get(model, {}).get("serving_version")


def events(status: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e for e in status.get("events", []) if e["kind"] == kind]


def store_is_complete(models_dir: Path) -> list[str]:
    """Problems in a device's model store: any version whose files disagree with its manifest."""
    problems = []
    for version_dir in sorted(models_dir.glob("*/*")):
        manifest = version_dir / "MANIFEST.json"
        if not manifest.exists():
            problems.append(f"{version_dir}: no manifest")
            continue
        for entry in json.loads(manifest.read_text())["files"]:
            path = version_dir / entry["path"]
            if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
                problems.append(f"{path}: missing or wrong content")
    return problems


def wait(predicate: Any, timeout: float = 60, what: str = "condition") -> Any:
    return poll_until(predicate, timeout, what)


class TCPProxy:
    """A loopback TCP forwarder: ``down()`` closes the port (the bucket is unreachable),
    ``up()`` listens again on the same port. Real sockets, so clients see real errors."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self._listener: Any = None
        self._threads: list[threading.Thread] = []
        self._conns: list[Any] = []
        self._pipes: list[threading.Thread] = []
        self._lock = threading.Lock()

    def up(self) -> "TCPProxy":
        import socket

        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._spawn(self._accept, listener)
        return self

    def down(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(2)  # wakes the accept() thread (close() alone would not)
            except OSError:
                pass
            listener.close()
        for t in self._threads:  # first the acceptor, so no connection is added after this
            t.join(10)
        with self._lock:
            conns, pipes, self._conns, self._pipes, self._threads = self._conns, self._pipes, [], [], []
        for c in conns:
            try:
                c.shutdown(2)  # wakes the pipe threads and sends the peers a FIN/RST now
                c.close()
            except OSError:
                pass
        for t in pipes:
            t.join(10)

    def _spawn(self, fn: Any, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, name="tcp-proxy", daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self, listener: Any) -> None:
        import socket

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            pipes = [threading.Thread(target=self._pipe, args=pair, daemon=True, name="tcp-proxy")
                     for pair in ((client, upstream), (upstream, client))]
            with self._lock:
                self._conns += [client, upstream]
                self._pipes += pipes
            for t in pipes:
                t.start()

    @staticmethod
    def _pipe(a: Any, b: Any) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):  # shutdown first: it wakes the opposite pipe blocked in recv()
                try:
                    s.shutdown(2)
                except OSError:
                    pass
                try:
                    s.close()
                except OSError:
                    pass


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 (and its key), made with ``cryptography``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class StaticHTTPS:
    """A static HTTPS file server over a folder: ETag + If-None-Match (304), Range (206)."""

    def __init__(self, root: Path, cert: Path, key: Path):
        import http.server
        import ssl

        outer = self
        self.root = root
        self.requests = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.requests += 1
                from urllib.parse import unquote

                rel = unquote(self.path.split("?")[0]).lstrip("/")
                path = (outer.root / rel).resolve()
                if not str(path).startswith(str(outer.root.resolve())) or not path.is_file():
                    self._send(404, b"not found")
                    return
                st = path.stat()
                etag = f'"{st.st_mtime_ns:x}-{st.st_size:x}"'
                if self.headers.get("If-None-Match") == etag:
                    self._send(304, b"", etag)
                    return
                data = path.read_bytes()
                rng = self.headers.get("Range", "")
                if rng.startswith("bytes=") and rng.endswith("-"):
                    start = int(rng[6:-1])
                    if start >= len(data):
                        self._send(416, b"")
                        return
                    self._send(206, data[start:], etag, f"bytes {start}-{len(data) - 1}/{len(data)}")
                    return
                self._send(200, data, etag)

            def _send(self, code: int, body: bytes, etag: str = "", content_range: str = "") -> None:
                self.send_response(code)
                if etag:
                    self.send_header("ETag", etag)
                if content_range:
                    self.send_header("Content-Range", content_range)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="static-https", daemon=True)

    def start(self) -> "StaticHTTPS":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def make_version(base: Path, name: str, files: dict[str, bytes]) -> Path:
    """A version folder ``base/name`` holding ``files`` (relative path -> bytes)."""
    d = base / name
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return d


class Device:
    """One device's sync side, no service: a store under ``tmp``, a source over the bucket (a
    folder, or a source's URL; ``source``: one made already), a follower of ``models`` with
    ``opts`` as its Options, and the events it reported."""

    def __init__(self, tmp: Path, bucket: Path | str, source: Any = None, models: tuple[str, ...] = ("m",),
                 **opts: Any):
        self.events: list[tuple[str, str, Any]] = []
        self.store = Store(str(tmp / "device")).open()
        self.source = source or open_source(bucket if isinstance(bucket, str) else f"file://{bucket}")
        options = Options(**{"models": list(models), "device_tags": CPU_TAGS, **opts})
        self.follower = Follower(self.source, self.store, options,
                                 lambda kind, msg, model="", version=None, **d: self.events.append((kind, msg, version)),
                                 lambda: {m: LocalModel(self.serving(m)) for m in models})

    def serving(self, model: str = "m") -> int | None:
        versions = self.store.served_versions(model)  # what the store pushes: the manager serves the newest
        return max(versions) if versions else None

    def kinds(self) -> list[str]:
        return [k for k, _, _ in self.events]

    def refusals(self) -> list[str]:
        return [msg for kind, msg, _ in self.events if kind == "sync_refused"]
