"""Give freed native memory back to the operating system after a version unloads.

glibc's malloc raises its mmap threshold after the first large free (up to 32 MiB), so
the multi-megabyte buffers a backend allocates for weights (XNNPACK's packed copies,
TensorFlow's tensors) then come from the heap arenas; freed there, they stay in the
process and a device grows by about a model per hot swap. ``malloc_trim(0)`` returns the
free pages of every arena. A no-op where the C library has no ``malloc_trim`` (musl,
macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

log = logging.getLogger("appliance.memory")
_trim: Any = False  # False: not looked up yet; None: no malloc_trim here


def release_freed_memory() -> bool:
    """Return freed heap memory to the OS; True when the C library did it. Thread-safe."""
    global _trim
    if _trim is False:
        try:
            _trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _trim = None
    if _trim is None:
        return False
    try:
        return bool(_trim(0))
    except OSError as exc:  # never let housekeeping break an unload
        log.debug("malloc_trim failed: %s", exc)
        return False
