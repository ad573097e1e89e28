"""``file:///path``: a local folder or an NFS mount laid out like the bucket.

ETags are ``<mtime_ns>-<size>`` from one ``stat()``, so an idle poll is a stat, not a read.
Writes go to a temporary file, are fsynced and renamed, so a reader never sees half an
object. A missing root folder is an unreachable bucket (``SourceError``), not an empty one.
Objects are opened without following a symbolic link and must be regular files: a link
to ``/dev/zero`` or a FIFO planted in the bucket folder is ``Refused``, never read.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from typing import BinaryIO

from . import faults
from .errors import Refused, SourceError
from .source import MISSING, NOT_MODIFIED, OK, Fetched, Limits, Listed, copy_limited, read_limited


def _tag(st: os.stat_result) -> str:
    """The folder's ETag of a file: its mtime and size (a stat, never a read)."""
    return f"{st.st_mtime_ns:x}-{st.st_size:x}"


class FileSource:
    writable = True

    def __init__(self, url: str, root: str, limits: Limits | None = None):
        self.url, self.root = url, root
        self.limits = limits or Limits()
        self.requests = 0

    def _open_object(self, key: str) -> BinaryIO:
        """The object as a regular file, never through a final symbolic link, never blocking
        on a FIFO (O_NONBLOCK) or reading a device."""
        try:
            kind = stat.S_IFMT(os.lstat(self._path(key)).st_mode)
        except OSError:
            kind = stat.S_IFREG  # missing: the open below says so
        if kind not in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK):  # never open a device at all
            raise Refused(f"{key} is not a regular file in the bucket folder (a device, FIFO or socket)")
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Refused(f"{key} is a symbolic link in the bucket folder; objects must be regular files") from exc
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, "is a directory", key)
            raise Refused(f"{key} is not a regular file in the bucket folder (a device, FIFO or socket)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _check_root(self) -> None:
        if not os.path.isdir(self.root):
            raise SourceError(f"bucket folder {self.root} is not there (unmounted or removed?)")

    def read(self, key: str, etag: str = "") -> Fetched:
        self.requests += 1
        self._check_root()
        try:
            with self._open_object(key) as f:
                tag = _tag(os.fstat(f.fileno()))
                if etag and tag == etag:
                    return Fetched(NOT_MODIFIED, etag=tag)
                return Fetched(OK, read_limited(f.read, self.limits.max_document_bytes, key, etag=tag), tag)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return Fetched(MISSING)
        except OSError as exc:
            raise SourceError(f"reading {key}: {exc.strerror}") from exc

    def head(self, key: str) -> Fetched:
        self.requests += 1
        self._check_root()
        try:
            st = os.lstat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return Fetched(MISSING)
        except OSError as exc:
            raise SourceError(f"stat {key}: {exc.strerror}") from exc
        return Fetched(OK, etag=_tag(st)) if stat.S_ISREG(st.st_mode) else Fetched(MISSING)

    def download(self, key: str, path: str, offset: int = 0, limit: int | None = None) -> str:
        self.requests += 1
        self._check_root()
        tag = None
        try:
            with self._open_object(key) as src, open(path, "r+b" if offset else "wb") as dst:
                tag = _tag(os.fstat(src.fileno()))
                src.seek(offset)
                dst.seek(offset)
                dst.truncate()
                first = True

                def write(block: bytes) -> None:
                    nonlocal first
                    dst.write(block)
                    if first:
                        dst.flush()
                        faults.point("mid_download")
                        first = False

                copy_limited(src.read, write, None if limit is None else max(0, limit - offset), key)
                return tag
        except Refused as exc:
            raise Refused(str(exc), key=key, etag=tag) from None
        except FileNotFoundError as exc:
            raise Refused(f"{key} is listed in the manifest but missing from the bucket", key=key, etag="") from exc
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT) or (os.path.exists(path) and exc.filename == path):
                raise  # the local disk, not the bucket: the fetcher wipes the stage (DiskFull)
            raise SourceError(f"reading {key}: {exc.strerror}") from exc

    def put(self, key: str, data: bytes) -> None:
        self.requests += 1
        self._check_root()  # never recreate a missing (unmounted) bucket folder by writing into it
        target = self._path(key)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(target))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def list_dirs(self, prefix: str) -> list[str]:
        self.requests += 1
        self._check_root()
        try:
            with os.scandir(self._path(prefix) if prefix else self.root) as it:
                return sorted(e.name for e in it if e.is_dir() and not e.name.startswith("."))
        except FileNotFoundError:
            return []

    def list_keys(self, prefix: str) -> list[str]:
        self.requests += 1
        self._check_root()
        try:
            with os.scandir(self._path(prefix)) as it:
                return sorted(e.name for e in it if e.is_file() and not e.name.startswith("."))
        except FileNotFoundError:
            return []

    def list_objects(self, prefix: str) -> list[Listed]:
        self.requests += 1
        self._check_root()
        try:
            with os.scandir(self._path(prefix)) as it:
                entries = [(e.name, e.stat(follow_symlinks=False)) for e in it
                           if e.is_file(follow_symlinks=False) and not e.name.startswith(".")]
        except FileNotFoundError:
            return []
        return sorted(Listed(name, _tag(st), st.st_size, st.st_mtime) for name, st in entries)

    def sibling(self) -> "FileSource":
        return FileSource(self.url, self.root, self.limits)

    def close(self) -> None:
        pass
