"""The device profile: what this box has, found without importing any ML framework.

Backends decide availability from this mapping, so it must be cheap (it runs at every
start) and honest: every entry is something looked at, not assumed.
"""

from __future__ import annotations

import ctypes.util
import glob
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Protocol

import psutil

from runtimes.tflite import EDGETPU_DELEGATE_LIBS, GPU_DELEGATE_LIBS

from appliance.core.cgroup import available_bytes, total_bytes
from appliance.core.json_types import JSONObject, ReadJSONObject


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tensorflow() -> JSONObject:
    if importlib.util.find_spec("tensorflow") is None:
        return {"tensorflow_version": None, "tensorflow_build": None}
    cpu = _dist_version("tensorflow-cpu") or _dist_version("tensorflow_cpu")
    version = cpu or _dist_version("tensorflow") or "unknown"
    return {"tensorflow_version": version, "tensorflow_build": "cpu" if cpu else "cuda"}


def _nvidia() -> JSONObject:
    present = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
    name = ""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=5, check=False)
            name = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
            present = present or bool(name)
        except (OSError, subprocess.TimeoutExpired):
            pass
    tensorrt = bool(ctypes.util.find_library("nvinfer") or importlib.util.find_spec("tensorrt"))
    return {"nvidia_gpu": present, "gpu_name": name, "tensorrt": tensorrt}


def _library_found(names: tuple[str, ...], configured: str = "") -> bool:
    if configured:
        return os.path.exists(configured)
    for name in names:
        stem = name.split(".so")[0].removeprefix("lib")
        if ctypes.util.find_library(stem):
            return True
        for folder in ("/usr/lib", "/usr/local/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"):
            if glob.glob(os.path.join(folder, name + "*")):
                return True
    return False


def device_id(state_dir: str) -> str:
    """A stable id: kept in the state directory, first made from the machine id."""
    path = os.path.join(state_dir, "device-id")
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        pass
    # Random, not derived from /etc/machine-id: devices cloned from one image share that id,
    # and their fleet reports and mDNS ids must not collide.
    ident = os.urandom(6).hex()
    try:
        os.makedirs(state_dir, exist_ok=True)
        with open(path, "w") as f:
            f.write(ident)
    except OSError:  # a read-only state directory: this id lasts until the next start
        pass
    return ident


def profile(tflite_options: Mapping[str, object] | None = None) -> JSONObject:
    """Everything the backends and the status page need to know about this device.
    ``tflite_options``: the ``[runtime.tflite]`` settings (their delegate paths are read)."""
    opts = tflite_options or {}
    memory = psutil.virtual_memory()
    info: JSONObject = {
        "hostname": socket.gethostname(),
        "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "cpu_count": os.cpu_count() or 1,
        "memory_mb": total_bytes(memory.total) // (1 << 20),  # a container's limit, when smaller
        "litert": "ai_edge_litert" if importlib.util.find_spec("ai_edge_litert") else (
            "tflite_runtime" if importlib.util.find_spec("tflite_runtime") else None),
        "delegates": {
            "gpu": _library_found(GPU_DELEGATE_LIBS, str(opts.get("gpu_delegate_path") or "")),
            "edgetpu": _library_found(EDGETPU_DELEGATE_LIBS, str(opts.get("edgetpu_delegate_path") or ""))
            and (os.path.exists("/dev/apex_0") or bool(glob.glob("/dev/bus/usb/*/*"))),
        },
    }
    info.update(_tensorflow())
    info.update(_nvidia())
    return info


def fingerprint(info: ReadJSONObject) -> str:
    """What must match for a cached backend decision to still hold on this device."""
    keys = ("machine", "cpu_count", "tensorflow_version", "litert", "nvidia_gpu", "gpu_name", "tensorrt")
    delegates = info.get("delegates", {})
    found = sorted((str(k), v) for k, v in delegates.items()) if isinstance(delegates, Mapping) else []
    text = "|".join(str(info.get(k)) for k in keys) + "|" + str(found)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_cpu_lock = threading.Lock()
class _CPUTimes(Protocol):
    """psutil's ``cpu_times()`` (a named tuple of seconds; psutil ships no types)."""

    idle: float

    def __iter__(self) -> Iterator[float]: ...


_cpu_last: list[_CPUTimes] = []  # the system CPU times at the previous live_figures call


def _cpu_percent() -> float | None:
    """System CPU use (%) since the previous call from any thread; None on the first.

    Not ``psutil.cpu_percent(None)``: psutil keeps its previous sample per thread, so a
    status request served on a worker thread that had not asked before always read 0.0."""
    now: _CPUTimes = psutil.cpu_times()
    with _cpu_lock:
        last = _cpu_last[0] if _cpu_last else None
        _cpu_last[:] = [now]
    if last is None:
        return None

    def busy_total(t: _CPUTimes) -> tuple[float, float]:
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)  # Linux counts guest in user
        return total - t.idle - getattr(t, "iowait", 0.0), total

    (busy1, total1), (busy0, total0) = busy_total(now), busy_total(last)
    if total1 <= total0:
        return None
    return round(min(100.0, max(0.0, 100 * (busy1 - busy0) / (total1 - total0))), 1)


def clock() -> JSONObject:
    """The device's time and time zone, so a page read elsewhere can say which zone its
    times are in: ``now`` (epoch s), ``timezone`` (IANA name where known, else the
    abbreviation) and ``utc_offset_s``."""
    now = time.time()
    local = time.localtime(now)
    return {"now": now, "timezone": _zone_name() or local.tm_zone, "utc_offset_s": local.tm_gmtoff}


def _zone_name() -> str:
    """The IANA zone: $TZ, /etc/timezone (Debian), or where /etc/localtime points."""
    tz = os.environ.get("TZ", "").lstrip(":")
    if tz and "/" in tz and not tz.startswith("/"):
        return tz
    try:
        with open("/etc/timezone") as f:
            name = f.read().strip()
        if name:
            return name
    except OSError:
        pass
    target = os.path.realpath("/etc/localtime")
    return target.split("zoneinfo/", 1)[1] if "zoneinfo/" in target else ""


def live_figures(state_dir: str) -> JSONObject:
    """Figures that change: load, memory, disk on the state directory, temperatures."""
    memory = psutil.virtual_memory()
    total, available = total_bytes(memory.total), available_bytes(memory.available)  # the cgroup's when smaller
    try:
        disk = psutil.disk_usage(state_dir)
        disk_free: JSONObject = {"disk_free_mb": disk.free // (1 << 20), "disk_total_mb": disk.total // (1 << 20)}
    except OSError:
        disk_free = {"disk_free_mb": None, "disk_total_mb": None}
    temps: dict[str, float] = {}
    try:
        for name, sensors in (psutil.sensors_temperatures() or {}).items():
            for s in sensors[:2]:
                temps[f"{name}{'/' + s.label if s.label else ''}"] = s.current
    except (AttributeError, OSError):
        pass
    load1, load5, _ = os.getloadavg()
    return {"load_1m": round(load1, 2), "load_5m": round(load5, 2), "cpu_percent": _cpu_percent(),
            "memory_used_mb": (total - available) // (1 << 20), "memory_available_mb":
            available // (1 << 20), "process_rss_mb": psutil.Process().memory_info().rss // (1 << 20),
            "boot_time": psutil.boot_time(), "temperatures_c": dict(temps), **disk_free}
