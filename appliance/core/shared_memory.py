"""Triton's system shared-memory extension, the registry: regions of POSIX shared-memory
objects that an app on the device registers by name, then names in inference requests instead
of sending its tensors (appliance/api/kserve/shared_memory.py speaks the protocol).

A region is (name, key, offset, byte_size): ``byte_size`` bytes at ``offset`` of the object
``shm_open(key)`` names, ``/dev/shm/<key>`` on Linux. Registration opens the object once
(``O_NOFOLLOW``, never a symbolic link; ``O_NONBLOCK``, never waiting on a FIFO), checks that
it is a regular file of shared memory large enough for the region, and keeps the descriptor.

Safety, the reason this module exists: the app owns the object and may shrink, unlink or
replace it at any time, and a mapping of a shrunk object is a SIGBUS, a crash. So nothing is
mapped: inputs are read with ``preadv`` straight into the request's array (one copy; the
batch itself when the request runs alone) and outputs written with ``pwrite`` straight into
the region, so a shrunk object is a short read or a refused write, never a fault. Every
access checks, and each failure is an ``InvalidArgument`` (400) naming the region:

- bounds: a tensor's offset and size inside its region, its size what shape and datatype need;
- the key still names the object registered (unlinked, or replaced by another: refused);
- the region still registered: unregistering while a request uses it ends that request with a
  400 (its outputs are not written), and the descriptor closes once no request uses it, so a
  descriptor number is never used after it was closed and reused;
- keys: one path component (no ``/`` but leading ones, not ``.`` or ``..``), not the service's
  own reserved prefix, naming a regular file in the shared-memory directory.

``[shared_memory]`` limits the number of regions and their total size; ``summary()`` shows
both in ``/api/status``; ``allowed_keys`` (prefixes) limits which objects a region may open
(403 otherwise). The inference token guards registration (the API's route table), and the API
layer lets only callers on this host use regions at all (appliance/api/kserve/shared_memory.py).

With front workers, requests that use shared memory are answered by the serving process,
where this registry lives (a worker forwards them: their bodies hold no tensor, and the
tensors go from the app's region straight into the batch). The registry holds no
process-global state; another process could open the same objects by key with
``SharedMemory.opened`` and read through the same checks.

Thread-safety: every method may be called from any thread; the table is guarded by a lock.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, TypedDict

from appliance.core.config import SharedMemoryConfig
from appliance.core.errors import InvalidArgument, NotFound, PermissionDenied
from appliance.core.json_types import JSONObject

SHM_DIR = "/dev/shm"  # where glibc's shm_open puts objects (Linux)
RESERVED_PREFIX = "edge-appliance"  # keys of the service's own objects: never an app's region
NAME_MAX = 255
_BAD_NAME = re.compile(r"[\x00-\x1f\x7f]")


class RegionInfo(TypedDict):
    """A region as Triton's status shows it."""

    name: str
    key: str
    offset: int
    byte_size: int


@dataclass
class Region:
    """One registration (its descriptor is the registry's to close)."""

    name: str
    key: str
    offset: int
    byte_size: int
    fd: int
    identity: tuple[int, int]  # (st_dev, st_ino) of the object when registered
    users: int = 0
    gone: bool = False  # unregistered: requests using it fail, the descriptor closes after the last

    def status(self) -> RegionInfo:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


@dataclass(frozen=True)
class Slice:
    """What a tensor names: ``byte_size`` bytes at ``offset`` of a region (checked against it)."""

    region: Region
    offset: int
    byte_size: int
    where: str  # "input 'x'", "output 'y'": how errors name the tensor


class SharedMemory:
    """The registered regions (module docstring)."""

    def __init__(self, settings: Callable[[], SharedMemoryConfig] = SharedMemoryConfig, directory: str = SHM_DIR):
        """``settings()``: the ``[shared_memory]`` section in force (read at each use, so a
        reload's limits apply at once; regions already registered stay)."""
        self.settings = settings
        self.directory = directory
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return bool(self.settings().enabled)

    @property
    def max_regions(self) -> int:
        return int(self.settings().max_regions)

    @property
    def max_bytes(self) -> int:
        return int(self.settings().max_bytes)

    # -- registration ------------------------------------------------------------------------
    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Open the object ``key`` names and register ``name`` for the bytes given."""
        self._check_enabled()
        _check_name(name)
        _check_numbers(name, offset, byte_size)
        self._check_allowed(name, key)
        fd, identity, size = self.opened(key, name)  # first: a key that opens nothing is said as Triton says it
        try:
            if byte_size == 0:
                raise InvalidArgument(f"failed to register shared memory region '{name}': 'byte_size' must be at "
                                      "least 1")
            if offset + byte_size > size:
                raise InvalidArgument(f"failed to register shared memory region '{name}': invalid args: offset "
                                      f"{offset} + byte_size {byte_size} is past the end of '{key}' ({size} bytes)")
            with self._lock:
                self._admit(name, byte_size)
                self._regions[name] = Region(name, key, offset, byte_size, fd, identity)
        except BaseException:
            os.close(fd)
            raise

    def _check_allowed(self, name: str, key: str) -> None:
        """``[shared_memory] allowed_keys``: the key starts with one of them (none set: any)."""
        prefixes = [p.lstrip("/") for p in getattr(self.settings(), "allowed_keys", ())]
        if prefixes and not any(key.lstrip("/").startswith(p) for p in prefixes):
            raise PermissionDenied(f"failed to register shared memory region '{name}': key '{key[:NAME_MAX]}' "
                                   "starts with none of [shared_memory] allowed_keys")

    def _admit(self, name: str, byte_size: int) -> None:
        """(lock held) The name is free and the limits leave room for ``byte_size`` more."""
        if name in self._regions:
            raise InvalidArgument(f"shared memory region '{name}' already in manager")
        if len(self._regions) >= self.max_regions:
            raise InvalidArgument(f"cannot register shared memory region '{name}': {len(self._regions)} regions "
                                  f"are registered, the most allowed ([shared_memory] max_regions = "
                                  f"{self.max_regions}); unregister some first")
        total = sum(r.byte_size for r in self._regions.values())
        if total + byte_size > self.max_bytes:
            raise InvalidArgument(f"cannot register shared memory region '{name}': {byte_size} bytes more than the "
                                  f"{total} registered would pass [shared_memory] max_bytes = {self.max_bytes}")

    def unregister(self, name: str | None = None) -> None:
        """Unregister ``name`` (every region for None). An unknown name is no error (Triton's)."""
        with self._lock:
            names = list(self._regions) if name is None else [name] if name in self._regions else []
            for each in names:
                region = self._regions.pop(each)
                region.gone = True
                if not region.users:
                    os.close(region.fd)

    def status(self, name: str | None = None) -> list[RegionInfo]:
        """Each region as Triton shows it: name, key, offset, byte_size; NotFound for an unknown name."""
        with self._lock:
            if name is None:
                return [r.status() for r in self._regions.values()]
            region = self._regions.get(name)
        if region is None:
            raise NotFound(f"Unable to find system shared memory region: '{name}'")
        return [region.status()]

    def summary(self) -> JSONObject:
        """``/api/status``'s ``shared_memory``: the limits and what is registered."""
        with self._lock:
            regions = len(self._regions)
            total = sum(r.byte_size for r in self._regions.values())
        return {"enabled": self.enabled, "regions": regions, "bytes": total, "max_regions": self.max_regions,
                "max_bytes": self.max_bytes, "cuda": "not available: no CUDA shared-memory support on this device"}

    # -- what requests name --------------------------------------------------------------------
    def slice(self, name: object, offset: object, byte_size: object, where: str) -> Slice:
        """The bytes a tensor's parameters name (as the request wrote them: checked here),
        checked against the region they name."""
        self._check_enabled()
        if not isinstance(name, str):
            raise InvalidArgument(f"{where}: 'shared_memory_region' must be a string")
        numbers = []
        for label, value in (("shared_memory_offset", offset), ("shared_memory_byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise InvalidArgument(f"{where}: '{label}' must be a non-negative integer, got {value!r}")
            numbers.append(value)
        start, size = numbers
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise InvalidArgument(f"{where}: Unable to find shared memory region: '{name}'")
        if start >= region.byte_size or start + size > region.byte_size:
            raise InvalidArgument(f"{where}: Invalid offset + byte size for shared memory region: '{name}' (offset "
                                  f"{start} + {size} bytes, the region has {region.byte_size})")
        return Slice(region, start, size, where)

    def read_into(self, piece: Slice, out: memoryview) -> None:
        """The slice's bytes into ``out`` (its length is the slice's): one copy, by ``preadv``."""
        with self._using(piece) as region:
            got = os.preadv(region.fd, [out], region.offset + piece.offset)
        if got != len(out):
            raise InvalidArgument(f"{piece.where}: shared memory region '{region.name}' ('{region.key}') gave "
                                  f"{got} of {len(out)} bytes: the object was truncated while registered")

    def write(self, piece: Slice, data: memoryview) -> None:
        """``data`` (at most the slice's size) into the slice, by ``pwrite``."""
        with self._using(piece) as region:
            at, end = region.offset + piece.offset, region.offset + region.byte_size
            if os.fstat(region.fd).st_size < end:  # pwrite would grow it back: refuse instead
                raise InvalidArgument(f"{piece.where}: shared memory region '{region.name}' ('{region.key}') was "
                                      "truncated while registered: its outputs were not written")
            while data:
                n = os.pwrite(region.fd, data, at)
                data, at = data[n:], at + n

    @contextlib.contextmanager
    def _using(self, piece: Slice) -> Iterator[Region]:
        """The slice's region, held open while in use; 400 when it was unregistered (or its key
        unlinked or given to another object) since the request named it."""
        region = piece.region
        with self._lock:
            if region.gone or self._regions.get(region.name) is not region:
                raise InvalidArgument(f"{piece.where}: shared memory region '{region.name}' was unregistered while "
                                      "the request used it")
            region.users += 1
        try:
            self._check_identity(region, piece.where)
            yield region
        finally:
            with self._lock:
                region.users -= 1
                if region.gone and not region.users:
                    os.close(region.fd)

    def _check_identity(self, region: Region, where: str) -> None:
        try:
            info = os.stat(self._path(region.key), follow_symlinks=False)
        except OSError:
            info = None
        if info is None or (info.st_dev, info.st_ino) != region.identity:
            raise InvalidArgument(f"{where}: the shared memory object '{region.key}' of region '{region.name}' was "
                                  "unlinked (or replaced) while registered; register the region again")

    # -- the objects ---------------------------------------------------------------------------
    def opened(self, key: object, name: str = "") -> tuple[int, tuple[int, int], int]:
        """(descriptor, identity, size) of the POSIX shared-memory object ``key`` names;
        InvalidArgument saying why not (module docstring: what a key may name)."""
        path = self._path(_check_key(key, name))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise InvalidArgument(f"Unable to open shared memory region: '{key}': no POSIX shared memory object of "
                                  "that name (create it with shm_open, as tritonclient's "
                                  "create_shared_memory_region does)") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENODEV):
                kind = "a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or "").lower()
                raise InvalidArgument(f"Unable to open shared memory region: '{key}' names something other than a "
                                      f"POSIX shared memory object ({kind})") from None
            raise InvalidArgument(f"Unable to open shared memory region: '{key}': "
                                  f"{(exc.strerror or str(exc)).lower()}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise InvalidArgument(f"Unable to open shared memory region: '{key}' names something other than a "
                                  "POSIX shared memory object")
        return fd, (info.st_dev, info.st_ino), info.st_size

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key.lstrip("/"))

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise InvalidArgument("system shared memory is turned off on this device ([shared_memory] enabled = "
                                  "false)")


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name or len(name) > 1024 or _BAD_NAME.search(name):
        raise InvalidArgument("'region name' is necessary to register system shared memory region, printable and "
                              "at most 1024 characters")


def _check_numbers(name: str, offset: object, byte_size: object) -> None:
    for label, value in (("offset", offset), ("byte_size", byte_size)):
        if type(value) is not int or value < 0 or value >= 1 << 63:
            raise InvalidArgument(f"failed to register shared memory region '{name}': '{label}' must be a "
                                  f"non-negative integer, got {value!r}")


def _check_key(key: object, name: str) -> str:
    """A key as shm_open takes it: leading slashes, then one path component."""
    bare = key.lstrip("/") if isinstance(key, str) else ""
    if not bare or "/" in bare or bare in (".", "..") or "\x00" in bare or len(bare.encode()) > NAME_MAX:
        raise InvalidArgument(f"cannot register shared memory region '{name}' - invalid shm key {key!r}: a POSIX "
                              "shared memory name is '/' and one name of at most 255 bytes")
    if bare.startswith(RESERVED_PREFIX):
        raise InvalidArgument(f"cannot register shared memory region '{name}' with key '{key}' as the key contains "
                              f"the reserved prefix '{RESERVED_PREFIX}'")
    return bare
