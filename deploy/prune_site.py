"""Drop from the image's site-packages what a running service never reads.

- Test suites bundled inside third-party packages (numpy's, psutil's ...).
- pip: sqlite-utils declares it (for its own ``sqlite-utils install`` verb, which the service
  never runs), and the runtime image is meant to hold no package installer.
- Debug sections of shared objects (``strip --strip-debug``, 27 MB on the lite image) -- but only
  of files that auditwheel left alone: a library under ``*.libs/`` or one with an RPATH/RUNPATH
  was rewritten by patchelf, and binutils' strip breaks those ("ELF load command address/offset
  not page-aligned", seen on numpy's OpenBLAS). The strip of the file's own architecture is used
  (``aarch64-linux-gnu-strip`` for an arm64 image built on x86-64); without one nothing is
  stripped and the image is only larger.

Our own packages (appliance, runtimes, sync, ui) are never touched. Prints what it removed.

    python3 prune_site.py SITE_PACKAGES
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

OURS = {"appliance", "runtimes", "sync", "ui"}
# Only "tests": "testing" and "test" are often real modules (absl.testing, which TensorFlow imports
# at load time; numpy.testing).
TEST_DIRS = {"tests"}
NOT_AT_RUN_TIME = ("pip",)  # whole distributions (see the module docstring)
STRIP = {b"\x3e\x00": "x86_64-linux-gnu-strip", b"\xb7\x00": "aarch64-linux-gnu-strip"}  # ELF e_machine


def prune_tests(site: str) -> int:
    freed = 0
    for top in sorted(os.listdir(site)):
        if top in OURS or not os.path.isdir(os.path.join(site, top)):
            continue
        for root, dirs, _ in os.walk(os.path.join(site, top)):
            for d in list(dirs):
                if d in TEST_DIRS:
                    freed += _remove(os.path.join(root, d))
                    dirs.remove(d)
    return freed


def prune_distributions(site: str) -> int:
    freed = 0
    for name in sorted(os.listdir(site)):
        if name in NOT_AT_RUN_TIME or (name.endswith(".dist-info") and name.split("-")[0] in NOT_AT_RUN_TIME):
            freed += _remove(os.path.join(site, name))
    return freed


def strip_debug(site: str) -> int:
    freed = 0
    for root, _, files in os.walk(site):
        if root.endswith(".libs") or ".libs" + os.sep in root + os.sep:
            continue
        for f in files:
            path = os.path.join(root, f)
            if ".so" in f and not os.path.islink(path):
                freed += _strip(path)
    return freed


def _strip(path: str) -> int:
    with open(path, "rb") as f:
        head = f.read(20)
    tool = shutil.which(STRIP.get(head[18:20], "")) if head[:4] == b"\x7fELF" else None
    if tool is None or _patched(path):
        return 0
    before = os.path.getsize(path)
    subprocess.run([tool, "--strip-debug", path], check=True)
    return before - os.path.getsize(path)


def _patched(path: str) -> bool:
    """An RPATH or RUNPATH: auditwheel's patchelf touched this file (never strip it)."""
    readelf = shutil.which("readelf")
    if readelf is None:
        return True  # cannot tell: leave it
    out = subprocess.run([readelf, "-d", path], capture_output=True, text=True).stdout
    return "RPATH" in out or "RUNPATH" in out


def _remove(path: str) -> int:
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
    shutil.rmtree(path)
    return size


if __name__ == "__main__":
    site = sys.argv[1]
    for what, fn in (("bundled tests", prune_tests), ("pip", prune_distributions), ("debug sections", strip_debug)):
        print(f"prune_site: {fn(site) / 2**20:.1f} MiB of {what} removed")
