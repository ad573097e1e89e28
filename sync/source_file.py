"""``file:///path``: a local folder or an NFS mount laid out like the bucket.

ETags are ``<mtime_ns>-<size>`` from one ``stat()``, so an idle poll is a stat, not a read.
Writes go to a temporary file, are fsynced and renamed, so a reader never sees half an
object. A missing root folder is an unreachable bucket (``SourceError``), not an empty one.
"""

from __future__ import annotations

import errno
import os
import tempfile

from . import faults
from .errors import Refused, SourceError
from .source import MISSING, NOT_MODIFIED, OK, Fetched


class FileSource:
    writable = True

    def __init__(self, url: str, root: str):
        self.url, self.root = url, root
        self.requests = 0

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def _check_root(self) -> None:
        if not os.path.isdir(self.root):
            raise SourceError(f"bucket folder {self.root} is not there (unmounted or removed?)")

    def read(self, key: str, etag: str = "") -> Fetched:
        self.requests += 1
        self._check_root()
        try:
            with open(self._path(key), "rb") as f:
                st = os.fstat(f.fileno())
                tag = f"{st.st_mtime_ns:x}-{st.st_size:x}"
                if etag and tag == etag:
                    return Fetched(NOT_MODIFIED, etag=tag)
                return Fetched(OK, f.read(), tag)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return Fetched(MISSING)
        except OSError as exc:
            raise SourceError(f"reading {key}: {exc.strerror}") from exc

    def download(self, key: str, path: str, offset: int = 0) -> None:
        self.requests += 1
        self._check_root()
        try:
            with open(self._path(key), "rb") as src, open(path, "r+b" if offset else "wb") as dst:
                src.seek(offset)
                dst.seek(offset)
                dst.truncate()
                first = True
                while block := src.read(1 << 20):
                    dst.write(block)
                    if first:
                        dst.flush()
                        faults.point("mid_download")
                        first = False
        except FileNotFoundError as exc:
            raise Refused(f"{key} is listed in the manifest but missing from the bucket") from exc
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

    def close(self) -> None:
        pass
