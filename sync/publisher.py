"""The publisher side: upload a version, move a channel, read the fleet's reports.

``publish`` uploads every file of a version directory, then ``MANIFEST.json`` **last**
(its presence commits the version), then the index files a read-only (https) mirror
needs: ``<model>/versions.json`` and ``_models.json``. Versions are immutable: publishing
over a committed version is refused; ``repair`` re-uploads the files of a committed version
from a directory that matches its manifest (a corrupted object fixed in place: devices that
refused it try again when they see its ETag change). Version numbers are int64, as in TF
Serving: a bigger one is refused here, before any device sees it. Two publishers racing on one model may both pick
the same next version number; the second one's manifest upload is then refused only if
it sees the first one's manifest (S3 has no compare-and-swap here) — publish from one
place per model.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from typing import TYPE_CHECKING, Iterable

from .errors import Refused
from .follower import MODEL_NAME
from .json_types import JSONObject
from .manifest import (MANIFEST, build, channel_doc, check_version_number, dumps, file_entries, is_version_name,
                       parse_json, sha256_file, sign)
from .source import MISSING, join, Source
from .waves import check_failure_threshold, check_rollout_policy, parse_waves

if TYPE_CHECKING:  # the key types, for annotations: cryptography is imported where keys are used
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

DAY_S = 86400.0
ON_FAILURE = ("halt", "rollback")  # what the rollout controller does at the failure threshold (Greengrass's failureHandlingPolicy)


def _check_name(model: str) -> None:
    if not MODEL_NAME.match(model):
        raise Refused(f"model name {model!r}: use letters, digits, '.', '_' and '-'")


def committed_versions(source: Source, model: str) -> list[int]:
    index = source.read(f"{model}/versions.json")
    if index.status != MISSING:
        return sorted(int(v) for v in json.loads(index.data).get("versions", []) if is_version_name(str(v)))
    listed = [int(v) for v in source.list_dirs(model) if is_version_name(v)]
    return sorted(v for v in listed if source.head(f"{model}/{v}/{MANIFEST}").status != MISSING)


def next_version(source: Source, model: str) -> int:
    """One above every version in the bucket (committed or a leftover partial upload);
    folder names beyond int64 are ignored, as devices ignore them."""
    listed = [int(v) for v in source.list_dirs(model) if is_version_name(v)] if source.writable else []
    return check_version_number(max(committed_versions(source, model) + listed, default=0) + 1, f"next {model} version")


def publish(source: Source, model: str, directory: str, version: int | None = None, channel: str = "",
            sign_key: Ed25519PrivateKey | None = None, publisher: str = "", expires_days: float = 365, compat: Iterable[str] = (),
            api_change: str = "") -> JSONObject:
    """Upload ``directory`` as ``model``/``version``; returns the manifest written. ``api_change``:
    why this version may serve less than the one before (a signature, input or output dropped or
    changed); without it, a device refuses such a version (appliance/core/loader_api.py)."""
    _check_name(model)
    if not os.path.isdir(directory):
        raise Refused(f"{directory} is not a directory")
    root = getattr(source, "root", None)
    if root:  # a new folder bucket: the publisher creates it
        os.makedirs(root, exist_ok=True)
    version = next_version(source, model) if version is None else check_version_number(version, f"{model} --version")
    if source.head(f"{model}/{version}/{MANIFEST}").status != MISSING:
        raise Refused(f"{model} version {version} is already published; versions are immutable")
    expires = time.time() + expires_days * DAY_S if expires_days else 0
    doc = build(model, version, directory, publisher or _whoami(), expires, compat)
    if api_change:
        doc["api_change"] = api_change
    if sign_key is not None:
        doc = sign(doc, sign_key)
    for entry in file_entries(doc):
        path = str(entry["path"])
        with open(os.path.join(directory, *path.split("/")), "rb") as f:
            source.put(join(model, str(version), path), f.read())
    source.put(join(model, str(version), MANIFEST), dumps(doc))  # the commit point
    _update_indexes(source, model, version)
    if channel:
        set_channel(source, model, channel, version, sign_key, expires_days)
    return doc


def repair(source: Source, model: str, version: int, directory: str) -> list[str]:
    """Re-upload every file of committed ``model``/``version`` from ``directory``, which must
    hold exactly what its manifest lists (same paths, sizes and sha256): the fix for objects
    corrupted or lost in the bucket. The manifest (and its signature) is left as it is.
    Returns the paths uploaded."""
    check_version_number(version, f"{model} --version")
    fetched = source.read(f"{model}/{version}/{MANIFEST}")
    if fetched.status == MISSING:
        raise Refused(f"{model} version {version} is not published (no {MANIFEST}); publish it instead")
    files = file_entries(parse_json(fetched.data, f"{model} version {version} manifest"))
    for entry in files:
        local = os.path.join(directory, *str(entry["path"]).split("/"))
        if not os.path.isfile(local) or os.path.getsize(local) != entry["size"] or sha256_file(local) != entry["sha256"]:
            raise Refused(f"{local} is not the file {model} version {version} signed ({entry['path']}: size "
                          f"{entry['size']}, sha256 {str(entry['sha256'])[:12]}...); nothing uploaded")
    for entry in files:
        with open(os.path.join(directory, *str(entry["path"]).split("/")), "rb") as f:
            source.put(join(model, str(version), str(entry["path"])), f.read())
    return [str(entry["path"]) for entry in files]



def _update_indexes(source: Source, model: str, version: int) -> None:
    versions = sorted(set(committed_versions(source, model)) | {version})
    source.put(f"{model}/versions.json", dumps({"model": model, "versions": versions, "latest": versions[-1],
                                                "updated": time.time()}))
    models = source.read("_models.json")
    names = set(json.loads(models.data).get("models", [])) if models.status != MISSING else set()
    if model not in names:
        source.put("_models.json", dumps({"models": sorted(names | {model}), "updated": time.time()}))


def set_channel(source: Source, model: str, channel: str, version: int, sign_key: Ed25519PrivateKey | None = None,
                expires_days: float = 365, waves: list[JSONObject] | None = None,
                candidate: int | None = None, rollout: JSONObject | None = None,
                failure_threshold: JSONObject | None = None, on_failure: str | None = None) -> JSONObject:
    """Point ``channel`` at a committed version (signed when a key is given), optionally in
    staged ``waves`` and with a ``candidate`` for devices to judge (sync/waves.py) under the
    ``rollout`` policy (the keys of a model's [models.rollout]; devices validate them).
    ``failure_threshold`` (``{"percent": P, "min_devices": N}``) is the share of devices in
    the open waves failing the version at which ``appliance rollout watch`` or the controller
    acts; ``on_failure`` (``rollback`` | ``halt``, Greengrass's failure handling) says what the
    controller does then. The pointer records the version it replaces (``previous_version``):
    the last good one a rollback returns to."""
    _check_name(model)
    if not MODEL_NAME.match(channel):
        raise Refused(f"channel name {channel!r}: use letters, digits, '.', '_' and '-'")
    version = check_version_number(version, f"{model} channel {channel}")
    if source.head(f"{model}/{version}/{MANIFEST}").status == MISSING:
        raise Refused(f"{model} version {version} is not published (no {MANIFEST})")
    doc = channel_doc(model, channel, version, time.time() + expires_days * DAY_S if expires_days else 0)
    doc.update(_previous(source, model, channel, version))
    if on_failure is not None:
        doc["on_failure"] = check_on_failure(on_failure, f"{model} channel {channel}")
    if waves:
        parse_waves({"waves": waves}, f"{model} channel {channel}")  # refuse a bad plan before devices see it
        doc["waves"] = list(waves)
    if failure_threshold is not None:
        doc["failure_threshold"] = check_failure_threshold(failure_threshold, f"{model} channel {channel}")
    if candidate is not None:
        candidate = check_version_number(candidate, f"{model} channel {channel} candidate")
        if source.head(f"{model}/{candidate}/{MANIFEST}").status == MISSING:
            raise Refused(f"candidate {model} version {candidate} is not published (no {MANIFEST})")
        if candidate <= version:
            raise Refused(f"candidate version {candidate} must be above the channel's version {version}")
        doc["candidate"] = int(candidate)
    if rollout is not None:
        doc["rollout"] = check_rollout_policy(rollout, f"{model} channel {channel}")
    return _put_channel(source, model, channel, doc, sign_key)


def _previous(source: Source, model: str, channel: str, version: int) -> JSONObject:
    """``{"previous_version": N}``: the version the channel pointed at before, when it changes
    now (else the one it already recorded); {} for a new channel."""
    fetched = source.read(f"{model}/channels/{channel}.json")
    if fetched.status == MISSING:
        return {}
    try:
        old = json.loads(fetched.data)
    except ValueError:
        return {}
    before = old.get("version") if old.get("version") != version else old.get("previous_version")
    return {"previous_version": before} if type(before) is int else {}


def check_on_failure(value: object, where: str) -> str:
    if value not in ON_FAILURE:
        raise Refused(f"{where}: on_failure must be one of {', '.join(ON_FAILURE)}, got {value!r}")
    return str(value)


def roll_back_channel(source: Source, model: str, channel: str, to_version: int, sign_key: Ed25519PrivateKey | None = None,
                      reason: str = "", by: str = "", judged: int | None = None) -> JSONObject:
    """Point the channel back at ``to_version`` at once (no waves, no threshold: it is the version
    that served before), recording ``rolled_back`` {from, to, reason, at, by}. A new pointer
    (a newer ``created``): every device moves, those that took the failed version included.
    ``judged``: the version the caller found failing; if the channel points elsewhere now (an
    operator published a fix meanwhile), nothing is written (Refused)."""
    fetched = source.read(f"{model}/channels/{channel}.json")
    if fetched.status == MISSING:
        raise Refused(f"{model} has no channel {channel!r} in the bucket")
    try:
        old = json.loads(fetched.data)
    except ValueError as exc:
        raise Refused(f"{model} channel {channel}: the pointer does not parse ({exc}); not rolled back") from exc
    if judged is not None and old.get("version") != judged:
        raise Refused(f"{model} channel {channel} moved to version {old.get('version')} after version {judged} "
                      "was judged failing; not rolled back")
    doc = channel_doc(model, channel, to_version, float(old.get("expires") or 0))
    doc["rolled_back"] = {"from": old.get("version"), "to": to_version, "reason": reason, "at": time.time(),
                          "by": by or _whoami()}
    return _put_channel(source, model, channel, doc, sign_key)


def halt_channel(source: Source, model: str, channel: str, sign_key: Ed25519PrivateKey | None = None, halt: bool = True,
                 reason: str = "", by: str = "") -> JSONObject:
    """Set (or clear) ``halt`` in a channel pointer: no device moves while it is set. The
    pointer keeps its ``created`` (devices do not read a halt as a new rollout) and records
    why, when and by whom in ``halted``."""
    fetched = source.read(f"{model}/channels/{channel}.json")
    if fetched.status == MISSING:
        raise Refused(f"{model} has no channel {channel!r} in the bucket")
    doc = {k: v for k, v in json.loads(fetched.data).items() if k != "signature"}
    if halt:
        doc["halt"] = True
        doc["halted"] = {"reason": reason or "halted by hand (appliance rollout halt)", "at": time.time(),
                         "by": by or _whoami()}
    else:
        doc.pop("halt", None)
        doc.pop("halted", None)
    return _put_channel(source, model, channel, doc, sign_key)


def _put_channel(source: Source, model: str, channel: str, doc: JSONObject,
                 sign_key: Ed25519PrivateKey | None) -> JSONObject:
    if sign_key is not None:
        doc = sign(doc, sign_key)
    source.put(f"{model}/channels/{channel}.json", dumps(doc))
    return doc


def _whoami() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"
