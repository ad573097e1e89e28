"""The device's model store and the sync side's durable records.

Layout under the state directory::

    models/<name>/<version>/   complete, verified versions only (what the manager serves);
                               regular files (read-only, 0444) and folders, nothing else
    staging/                   downloads in progress (0700: only the service reaches them);
                               emptied at start-up
    sync/parked/<name>/<v>/    verified versions moved out of the way by a channel move back
                               or a pin (kept for a move forward again; retention trims them)
    sync/withdrawn.json        per model: versions still in models/ that the manager must no
                               longer serve (a move back or a pin) but may still hold open: they
                               stay where their servable reads its files (LiteRT opens interpreters
                               from the path as load grows) until the manager has unloaded them,
                               and only then are parked
    sync/trust.json            per model: the highest version ever trusted and the newest
                               channel pointer seen (outside the model store, 0700 folder).
                               Never lower than the newest committed version still on disk, so
                               losing or corrupting the file does not reopen old versions
    sync/pins.json             per model: the version ``appliance rollback`` pinned
    sync/served.json           per model: the versions that served on this device, the most
                               recently served last (retention keeps the most recent of them,
                               ``appliance rollback`` goes back to them)

Every change of ``models/`` is one ``rename()`` on the same filesystem after the files and
the directories are fsynced, so a power cut leaves the old set of versions or the new one.
Not thread-safe: one sync loop owns a store; ``pins.json`` is also written by the CLI, with
an atomic replace.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile
import time
import uuid
from typing import Any, Iterable

from .errors import Refused
from .json_types import JSONObject, ReadJSONObject, ReadJSONValue
from .manifest import MANIFEST, MAX_VERSION, file_entries, sha256_file

log = logging.getLogger("sync.store")
PRIVATE = 0o700
KEEP_SERVED = 50  # versions remembered per model in sync/served.json
SHARED_READ_ONLY = 0o755  # others may read and traverse, only the service writes


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str, read_only: bool = False) -> None:
    """fsync every file, then every directory bottom-up; with ``read_only`` files become 0444
    and folders 0755 (whatever the umask was when they were made)."""
    for dirpath, _, names in os.walk(root, topdown=False):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                if read_only:
                    os.fchmod(fd, 0o444)
                os.fsync(fd)
            finally:
                os.close(fd)
        if read_only:
            os.chmod(dirpath, SHARED_READ_ONLY)
        fsync_dir(dirpath)


def unsafe_entries(root: str) -> list[str]:
    """Whatever under a version directory is not a plain folder or regular file: symbolic
    links (they could point anywhere: /etc, /dev/zero, another model), devices, FIFOs,
    sockets. Nothing is followed or opened."""
    found = []
    for dirpath, dirs, names in os.walk(root):
        for name in dirs + names:
            full = os.path.join(dirpath, name)
            mode = os.lstat(full).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                kind = {stat.S_IFLNK: "symbolic link", stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket",
                        stat.S_IFCHR: "character device", stat.S_IFBLK: "block device"}.get(stat.S_IFMT(mode), "special file")
                found.append(f"{os.path.relpath(full, root)} ({kind})")
    return sorted(found)


def check_version_tree(root: str) -> None:
    """``Refused`` when a version directory (or the directory itself) holds anything but
    folders and regular files. The model manager calls it before loading any version."""
    if os.path.islink(root):
        raise Refused(f"{root} is a symbolic link; a version directory must be a real folder")
    bad = unsafe_entries(root)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise Refused(f"{root} holds {shown}; a model version may hold only folders and regular files")


def check_version(root: str) -> None:
    """Every load-time check of a version directory (the model manager runs it right before
    loading): ``Refused`` for links, devices or FIFOs, and for bytes changed since the
    fetcher verified them against ``MANIFEST.json``."""
    check_version_tree(root)
    changed = verify_version(root)
    if changed:
        raise Refused(f"{root} no longer matches its verified manifest: " + "; ".join(changed[:3]))


def verify_version(root: str) -> list[str]:
    """Differences between a version directory and its ``MANIFEST.json`` (empty: intact).
    Re-hashes every file: what a load-time check calls to catch bytes changed after the
    fetcher verified them. A directory without a manifest (``--models DIR``) has none."""
    path = os.path.join(root, MANIFEST)
    if not os.path.exists(path):
        return []
    try:
        with open(path, "rb") as f:
            files = json.load(f)["files"]
        problems = [f"{e['path']}: missing or changed since it was verified" for e in files
                    if not _same(os.path.join(root, *str(e["path"]).split("/")), e)]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"{MANIFEST} unreadable: {exc}"]
    listed = {str(e["path"]) for e in files} | {MANIFEST}
    extra = [rel for rel in _regular_files(root) if rel not in listed]
    return problems + [f"{rel}: not in the manifest" for rel in extra]


def _same(path: str, entry: ReadJSONObject) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == entry.get("size") and sha256_file(path) == entry.get("sha256")


def _regular_files(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root).replace(os.sep, "/")
                  for d, _, names in os.walk(root) for n in names)


def write_json_atomic(path: str, doc: ReadJSONValue) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, sort_keys=True, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def read_json(path: str) -> JSONObject:
    """The JSON object in ``path``; {} when it is missing, unreadable or not an object."""
    try:
        with open(path) as f:
            doc = json.load(f)
        found: JSONObject = doc if isinstance(doc, dict) else {}  # json.load's object
        return found
    except (OSError, ValueError):
        return {}


def pins_path(state_dir: str) -> str:
    return os.path.join(state_dir, "sync", "pins.json")


def rollout_policies_path(state_dir: str) -> str:
    """Per model, the candidate and rollout policy its channel pointer carries,
    ``{"candidate": N | null, "policy": {...} | null}`` (the manager reads it)."""
    return os.path.join(state_dir, "sync", "rollout.json")


def rollout_policies(state_dir: str) -> dict[str, JSONObject]:
    return {k: v for k, v in read_json(rollout_policies_path(state_dir)).items() if isinstance(v, dict)}


def set_rollout_policy(state_dir: str, model: str, policy: JSONObject | None) -> bool:
    """Record (None: forget) the channel's rollout entry of ``model``; True when it changed."""
    path = rollout_policies_path(state_dir)
    doc = read_json(path)
    if doc.get(model) == policy or (policy is None and model not in doc):
        return False
    if policy is None:
        doc.pop(model, None)
    else:
        doc[model] = policy
    write_json_atomic(path, doc)
    return True


class Store:
    def __init__(self, state_dir: str):
        self.state_dir = state_dir
        self.models_dir = os.path.join(state_dir, "models")
        self.staging_dir = os.path.join(state_dir, "staging")
        self.sync_dir = os.path.join(state_dir, "sync")
        self.parked_dir = os.path.join(self.sync_dir, "parked")
        self.problems: list[str] = []  # integrity findings (a corrupt trust record) for the status page

    def open(self) -> "Store":
        """Create the folders and throw away whatever a previous run left in staging.
        Staging and the sync records are private to the service (0700, whatever the umask)."""
        for path in (self.models_dir, self.sync_dir, self.parked_dir):
            os.makedirs(path, exist_ok=True)
        os.chmod(self.models_dir, SHARED_READ_ONLY)  # a world-writable store would let anyone add a version
        os.chmod(self.sync_dir, PRIVATE)
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        os.makedirs(self.staging_dir, mode=PRIVATE, exist_ok=True)
        os.chmod(self.staging_dir, PRIVATE)
        return self

    # -- versions ------------------------------------------------------------------------
    @staticmethod
    def _versions(base: str) -> dict[int, str]:
        """Version directories under ``base``: ASCII-digit names within int64 (TF Serving's
        versions; any other name is not a version, as TF Serving's source ignores it)."""
        try:
            names = os.listdir(base)
        except OSError:
            return {}
        return {int(n): os.path.join(base, n) for n in names
                if n.isascii() and n.isdigit() and int(n) <= MAX_VERSION and os.path.isdir(os.path.join(base, n))}

    def versions(self, model: str) -> dict[int, str]:
        return self._versions(os.path.join(self.models_dir, model))

    def previous_version(self, model: str) -> int | None:
        """What ``appliance rollback`` goes back to: the newest version that served on this
        device below the newest one on disk (else the newest that served at all), so there is a
        target whenever one ever served; without that record, the version before the newest."""
        on_disk = sorted(set(self.versions(model)) | set(self.parked(model)))
        served = [v for v in self.served(model) if v in on_disk]
        below = [v for v in served if on_disk and v < on_disk[-1]]
        if below or served:
            return max(below or served)
        return on_disk[-2] if len(on_disk) >= 2 else None

    def withdrawn(self, model: str) -> set[int]:
        """Versions of ``model`` in ``models/`` that are set aside but may still be loaded (not
        pushed to the manager; parked once it has unloaded them)."""
        values = read_json(self._withdrawn_path()).get(model, [])
        return {int(v) for v in values if isinstance(v, int)} if isinstance(values, list) else set()

    def served_versions(self, model: str) -> dict[int, str]:
        """What the manager may serve: the versions in ``models/`` less the withdrawn ones."""
        hidden = self.withdrawn(model)
        return {v: p for v, p in self.versions(model).items() if v not in hidden}

    def withdraw(self, model: str, version: int) -> None:
        self._set_withdrawn(model, self.withdrawn(model) | {int(version)})

    def restore(self, model: str, version: int) -> None:
        """Serve a withdrawn version again (a move forward before it was parked)."""
        self._set_withdrawn(model, self.withdrawn(model) - {int(version)})

    def _set_withdrawn(self, model: str, versions: set[int]) -> None:
        doc = read_json(self._withdrawn_path())
        listed = doc.get(model) or []
        if isinstance(listed, list) and set(listed) == versions:
            return
        if versions:
            doc[model] = [v for v in sorted(versions)]
        else:
            doc.pop(model, None)
        write_json_atomic(self._withdrawn_path(), doc)

    def _withdrawn_path(self) -> str:
        return os.path.join(self.sync_dir, "withdrawn.json")

    def parked(self, model: str) -> dict[int, str]:
        return self._versions(os.path.join(self.parked_dir, model))

    def stage_dir(self, model: str, version: int) -> str:
        return os.path.join(self.staging_dir, model, str(version))

    def reuse_index(self, model: str) -> dict[str, str]:
        """sha256 -> a committed file with that content (any version on disk of ``model``)."""
        index: dict[str, str] = {}
        for path in list(self.versions(model).values()) + list(self.parked(model).values()):
            for entry in file_entries(read_json(os.path.join(path, MANIFEST))):
                candidate = os.path.join(path, *str(entry.get("path", "")).split("/"))
                if os.path.isfile(candidate) and os.path.getsize(candidate) == entry.get("size"):
                    index.setdefault(str(entry.get("sha256")), candidate)
        return index

    def commit(self, stage: str, model: str, version: int) -> str:
        """Move a fully fsynced staging directory into the store with one rename. Its files
        become read-only; anything but folders and regular files is ``Refused``."""
        check_version_tree(stage)
        parent = os.path.join(self.models_dir, model)
        if not os.path.isdir(parent):
            os.makedirs(parent)
            os.chmod(parent, SHARED_READ_ONLY)
            fsync_dir(self.models_dir)
        target = os.path.join(parent, str(version))
        fsync_tree(stage, read_only=True)  # the stage was private: the served version is readable, not writable, by others
        os.rename(stage, target)
        fsync_dir(parent)
        return target

    def park(self, model: str, version: int) -> None:
        """Move a version out of the served store (a channel move back or a pin), once nothing
        holds it open (see ``withdraw``)."""
        self._move(os.path.join(self.models_dir, model), os.path.join(self.parked_dir, model), version)
        self.restore(model, version)

    def unpark(self, model: str, version: int) -> None:
        self._move(os.path.join(self.parked_dir, model), os.path.join(self.models_dir, model), version)

    @staticmethod
    def _move(src_parent: str, dst_parent: str, version: int) -> None:
        os.makedirs(dst_parent, exist_ok=True)
        target = os.path.join(dst_parent, str(version))
        if os.path.exists(target):  # a stale copy from an interrupted move: the source wins
            shutil.rmtree(target)
        os.rename(os.path.join(src_parent, str(version)), target)
        fsync_dir(src_parent)
        fsync_dir(dst_parent)

    def remove(self, path: str) -> None:
        """Delete a version: first renamed into staging (one atomic step), then removed."""
        trash = os.path.join(self.staging_dir, f".trash-{uuid.uuid4().hex}")
        os.rename(path, trash)
        fsync_dir(os.path.dirname(path))
        shutil.rmtree(trash, ignore_errors=True)

    def retain(self, model: str, keep: int, protect: Iterable[int], bad: Iterable[int], target: int | None = None,
               serving: int | None = None) -> list[int]:
        """Delete what cannot be rolled back to, keeping what can; returns the versions deleted.

        ``serving`` (the version the manager serves now) goes to the end of the durable record of
        versions that served here, most recent last (``served_order``). Then, over the served
        store and the parked versions:

        - nothing is deleted while ``target`` has neither served nor failed: retention never
          runs before the new version has loaded;
        - kept: ``protect`` (target, serving, candidate, whatever the manager still holds, the
          channel's previous target), and up to ``keep`` versions by rank: those that served,
          the most recently served first whatever their numbers (after 12 -> 13 -> 12 -> 14 it
          is 14 and 12, the version a move back returns to), then those never loaded;
        - so failed (``bad``, quarantined) and never-served versions go first."""
        if serving is not None:
            self.note_served(model, serving)
        order, bad = self.served_order(model), set(bad)
        if target is not None and target not in order and target not in bad:
            return []
        where = {**self.parked(model), **self.versions(model)}
        keep_set = _kept(sorted(where), keep, set(protect), order, bad)
        deleted = sorted(v for v in where if v not in keep_set)
        for version in deleted:
            self.remove(where[version])
            self.restore(model, version)  # no withdrawn record outlives its directory
        return deleted

    def note_served(self, model: str, version: int) -> None:
        """Record that ``version`` of ``model`` serves on this device now (``sync/served.json``:
        most recently served last). No write while it is already the last."""
        order = self.served_order(model)
        if order and order[-1] == version:
            return
        doc = read_json(self._served_path())
        doc[model] = [v for v in ([v for v in order if v != version] + [int(version)])[-KEEP_SERVED:]]
        write_json_atomic(self._served_path(), doc)

    def served_order(self, model: str) -> list[int]:
        """The versions of ``model`` that served on this device, the most recently served last
        (a record written before the order was kept is sorted by number: read as that order)."""
        values = read_json(self._served_path()).get(model, [])
        return [int(v) for v in values if isinstance(v, int)] if isinstance(values, list) else []

    def served(self, model: str) -> set[int]:
        """The versions of ``model`` that served on this device, as far as it recorded."""
        return set(self.served_order(model))

    def _served_path(self) -> str:
        return os.path.join(self.sync_dir, "served.json")

    # -- durable records -----------------------------------------------------------------
    def trust(self, model: str) -> dict[str, Any]:
        """The model's trust record, its ``version`` never below the newest committed version
        on disk (served or parked): a lost, deleted or corrupt ``trust.json`` cannot make
        an older version acceptable again while a newer one is still here."""
        record = dict(self._trust_doc().get(model) or {})
        if not isinstance(record.get("version", -1), int) or record.get("version", -1) > MAX_VERSION:
            record.pop("version", None)  # a number beyond int64 (trusted before versions were bounded): void
        floor = self._committed_floor(model)
        if floor > int(record.get("version", -1)):
            record["version"] = floor
        return record

    def set_trust(self, model: str, record: dict[str, Any]) -> None:
        path = os.path.join(self.sync_dir, "trust.json")
        doc = self._trust_doc()
        doc[model] = record
        write_json_atomic(path, doc)

    def _trust_doc(self) -> dict[str, Any]:
        """trust.json; a corrupt one is moved aside (kept for a look) and reported."""
        path = os.path.join(self.sync_dir, "trust.json")
        try:
            with open(path) as f:
                doc = json.load(f)
            if isinstance(doc, dict) and all(isinstance(v, dict) for v in doc.values()):
                return doc
            raise ValueError("not an object of per-model records")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            aside = f"{path}.corrupt-{int(time.time())}"
            try:
                os.replace(path, aside)
            except OSError:
                aside = "(could not be moved aside)"
            problem = (f"sync trust records {path} were unreadable ({exc}); moved to {aside}; the highest "
                       "trusted version falls back to the newest committed version on disk")
            log.error(problem)
            self.problems.append(problem)
            return {}

    def _committed_floor(self, model: str) -> int:
        """The newest version on disk that sync committed (it has a manifest), or -1."""
        committed = [v for v, path in {**self.versions(model), **self.parked(model)}.items()
                     if v <= MAX_VERSION and os.path.isfile(os.path.join(path, MANIFEST))]
        return max(committed, default=-1)

    def pins(self) -> dict[str, int]:
        return {k: int(v) for k, v in read_json(pins_path(self.state_dir)).items() if isinstance(v, int)}


def _kept(versions: list[int], keep: int, protect: set[int], order: list[int], bad: set[int]) -> set[int]:
    """What retention keeps of ``versions`` (``Store.retain``'s ranking: ``order`` is the served
    record, most recently served last)."""
    present = set(versions)
    ranked = [v for v in reversed(order) if v in present] + \
             [v for v in reversed(versions) if v not in order and v not in bad]
    last_good = [v for v in ranked if v in order][:1]
    return {v for v in versions if v in protect} | set(last_good) | set(ranked[:max(keep, 0)])


def set_pin(state_dir: str, model: str, version: int | None) -> None:
    """Pin ``model`` to ``version`` (None: remove the pin). Used by ``appliance rollback``."""
    path = pins_path(state_dir)
    doc = read_json(path)
    if version is None:
        doc.pop(model, None)
    else:
        doc[model] = int(version)
    write_json_atomic(path, doc)
