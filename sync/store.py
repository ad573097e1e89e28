"""The device's model store and the sync side's durable records.

Layout under the state directory::

    models/<name>/<version>/   complete, verified versions only (what the manager serves)
    staging/                   downloads in progress; emptied at start-up
    sync/parked/<name>/<v>/    verified versions moved out of the way by a channel move back
                               or a pin (kept for a move forward again; retention trims them)
    sync/trust.json            per model: the highest version ever trusted and the newest
                               channel pointer seen (outside the model store)
    sync/pins.json             per model: the version ``appliance rollback`` pinned

Every change of ``models/`` is one ``rename()`` on the same filesystem after the files and
the directories are fsynced, so a power cut leaves the old set of versions or the new one.
Not thread-safe: one sync loop owns a store; ``pins.json`` is also written by the CLI, with
an atomic replace.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from typing import Any, Iterable

from .manifest import MANIFEST


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file, then every directory bottom-up, under ``root``."""
    for dirpath, _, names in os.walk(root, topdown=False):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def write_json_atomic(path: str, doc: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, sort_keys=True, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            doc = json.load(f)
        return doc if isinstance(doc, dict) else {}
    except (OSError, ValueError):
        return {}


def pins_path(state_dir: str) -> str:
    return os.path.join(state_dir, "sync", "pins.json")


class Store:
    def __init__(self, state_dir: str):
        self.state_dir = state_dir
        self.models_dir = os.path.join(state_dir, "models")
        self.staging_dir = os.path.join(state_dir, "staging")
        self.sync_dir = os.path.join(state_dir, "sync")
        self.parked_dir = os.path.join(self.sync_dir, "parked")

    def open(self) -> "Store":
        """Create the folders and throw away whatever a previous run left in staging."""
        for path in (self.models_dir, self.sync_dir, self.parked_dir):
            os.makedirs(path, exist_ok=True)
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        os.makedirs(self.staging_dir, exist_ok=True)
        return self

    # -- versions ------------------------------------------------------------------------
    @staticmethod
    def _versions(base: str) -> dict[int, str]:
        try:
            names = os.listdir(base)
        except OSError:
            return {}
        return {int(n): os.path.join(base, n) for n in names if n.isdigit() and os.path.isdir(os.path.join(base, n))}

    def versions(self, model: str) -> dict[int, str]:
        return self._versions(os.path.join(self.models_dir, model))

    def parked(self, model: str) -> dict[int, str]:
        return self._versions(os.path.join(self.parked_dir, model))

    def stage_dir(self, model: str, version: int) -> str:
        return os.path.join(self.staging_dir, model, str(version))

    def reuse_index(self, model: str) -> dict[str, str]:
        """sha256 -> a committed file with that content (any version on disk of ``model``)."""
        index: dict[str, str] = {}
        for path in list(self.versions(model).values()) + list(self.parked(model).values()):
            for entry in read_json(os.path.join(path, MANIFEST)).get("files", []):
                candidate = os.path.join(path, *str(entry.get("path", "")).split("/"))
                if os.path.isfile(candidate) and os.path.getsize(candidate) == entry.get("size"):
                    index.setdefault(str(entry.get("sha256")), candidate)
        return index

    def commit(self, stage: str, model: str, version: int) -> str:
        """Move a fully fsynced staging directory into the store with one rename."""
        parent = os.path.join(self.models_dir, model)
        if not os.path.isdir(parent):
            os.makedirs(parent)
            fsync_dir(self.models_dir)
        target = os.path.join(parent, str(version))
        fsync_tree(stage)
        os.rename(stage, target)
        fsync_dir(parent)
        return target

    def park(self, model: str, version: int) -> None:
        """Move a version out of the served store (a channel move back or a pin)."""
        self._move(os.path.join(self.models_dir, model), os.path.join(self.parked_dir, model), version)

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

    def retain(self, model: str, keep: int, protect: Iterable[int], bad: Iterable[int]) -> list[int]:
        """Keep the ``keep`` newest good versions (plus ``protect``); returns those deleted.

        Quarantined (``bad``) versions newer than every good one stay, so the manager does
        not see them vanish and reappear; older bad ones go."""
        protect, bad = set(protect), set(bad)
        deleted = []
        for where in (self.versions(model), self.parked(model)):
            good = sorted((v for v in where if v not in bad), reverse=True)
            newest_good = good[0] if good else -1
            for version, path in where.items():
                if version in protect or (version in good[:keep]) or (version in bad and version > newest_good):
                    continue
                self.remove(path)
                deleted.append(version)
        return sorted(deleted)

    # -- durable records -----------------------------------------------------------------
    def trust(self, model: str) -> dict[str, Any]:
        return read_json(os.path.join(self.sync_dir, "trust.json")).get(model, {})

    def set_trust(self, model: str, record: dict[str, Any]) -> None:
        path = os.path.join(self.sync_dir, "trust.json")
        doc = read_json(path)
        doc[model] = record
        write_json_atomic(path, doc)

    def pins(self) -> dict[str, int]:
        return {k: int(v) for k, v in read_json(pins_path(self.state_dir)).items() if isinstance(v, int)}


def set_pin(state_dir: str, model: str, version: int | None) -> None:
    """Pin ``model`` to ``version`` (None: remove the pin). Used by ``appliance rollback``."""
    path = pins_path(state_dir)
    doc = read_json(path)
    if version is None:
        doc.pop(model, None)
    else:
        doc[model] = int(version)
    write_json_atomic(path, doc)
