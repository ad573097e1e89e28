"""MANIFEST.json and channel pointers: building, canonical JSON, Ed25519 signatures, checks.

A manifest is ``{model, version, files: [{path, size, sha256}], created, publisher, expires,
compat}`` plus an optional ``signature`` (base64 Ed25519 over the canonical JSON of every
other key: sorted keys, no spaces, UTF-8). A channel pointer is ``{model, channel, version,
created, expires}`` signed the same way. ``expires`` and ``created`` are Unix seconds
(``expires`` 0: never). Verification functions raise ``Refused`` with the reason.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import posixpath
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping

from .errors import Refused
from .json_types import JSONObject, JSONValue, ReadJSONObject

if TYPE_CHECKING:  # the key types, for annotations: cryptography is imported where keys are used
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

MANIFEST = "MANIFEST.json"
# TF Serving's version numbers are int64 (a folder name beyond it is ignored there); so are
# ours wherever a number enters through the bucket: publish, manifests, pointers, indexes.
MAX_VERSION = 2**63 - 1


def check_version_number(value: object, what: str) -> int:
    """``value`` as a version number, or ``Refused`` naming ``what`` and the bound."""
    if type(value) is str and value.isascii() and value.isdigit():
        value = int(value)
    if type(value) is not int or not 0 <= value <= MAX_VERSION:
        shown = value if len(repr(value)) < 40 else repr(value)[:40] + "..."
        raise Refused(f"{what}: version {shown!r} is not a whole number from 0 to {MAX_VERSION} "
                      "(versions are int64, as in TF Serving)")
    return value


def is_version_name(name: str) -> bool:
    """A folder name that is a version number within bounds (others are ignored, as TF Serving does)."""
    return name.isdigit() and name.isascii() and int(name) <= MAX_VERSION


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    model: str
    version: int
    files: tuple[FileEntry, ...]
    doc: JSONObject

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def canonical(doc: ReadJSONObject) -> bytes:
    """The signed bytes: every key but ``signature``, sorted, compact, UTF-8."""
    body = {k: v for k, v in doc.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def dumps(doc: ReadJSONObject) -> bytes:
    return json.dumps(doc, sort_keys=True, indent=1).encode()


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def safe_path(path: object) -> str:
    """A manifest path that stays inside the version directory, or ``Refused``."""
    if not isinstance(path, str) or not path or "\x00" in path or "\\" in path:
        raise Refused(f"file path {path!r} is not a plain relative path")
    if path.startswith("/") or posixpath.normpath(path) != path or path in (".", MANIFEST):
        raise Refused(f"file path {path!r} is absolute, not normalised or reserved")
    if any(part in ("..", ".", "") for part in path.split("/")):
        raise Refused(f"file path {path!r} escapes the version directory")
    return path


def build(model: str, version: int, directory: str, publisher: str, expires: float = 0,
          compat: Iterable[str] = ()) -> JSONObject:
    """The manifest of a local version directory; symbolic links are refused."""
    check_version_number(version, f"{model} version")
    files: list[JSONValue] = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names) + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, directory).replace(os.sep, "/")
            if os.path.islink(full):
                raise Refused(f"{rel} is a symbolic link; publish real files only")
            if rel == MANIFEST:
                continue
            files.append({"path": safe_path(rel), "size": os.path.getsize(full), "sha256": sha256_file(full)})
    return {"model": model, "version": int(version), "files": files, "created": time.time(),
            "publisher": publisher, "expires": float(expires), "compat": [tag for tag in sorted(compat)]}


# -- keys and signatures -----------------------------------------------------------------
def keygen(private_path: str, public_path: str) -> None:
    """Write a new Ed25519 key pair as PEM (private key file mode 0600)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private)
    with open(public_path, "wb") as f:
        f.write(public)


def load_private_key(path: str) -> Ed25519PrivateKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    with open(path, "rb") as f:
        key = serialization.load_pem_private_key(f.read(), password=None)
    if not isinstance(key, Ed25519PrivateKey):  # what `appliance keygen` makes and devices verify
        raise Refused(f"{path} holds a {type(key).__name__}; signing keys are Ed25519 (appliance keygen)")
    return key


def load_public_key(path: str) -> Ed25519PublicKey:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    with open(path, "rb") as f:
        key = serialization.load_pem_public_key(f.read())
    if not isinstance(key, Ed25519PublicKey):
        raise Refused(f"{path} holds a {type(key).__name__}; signature keys are Ed25519 (appliance keygen)")
    return key


def sign(doc: JSONObject, private_key: Ed25519PrivateKey) -> JSONObject:
    signature = private_key.sign(canonical(doc))
    return {**doc, "signature": base64.b64encode(signature).decode()}


def check_signature(doc: ReadJSONObject, public_key: Ed25519PublicKey | None, what: str) -> None:
    """Refuse an unsigned or mis-signed document when a key is configured."""
    from cryptography.exceptions import InvalidSignature

    if public_key is None:
        return
    signature = doc.get("signature")
    if not signature or not isinstance(signature, str):
        raise Refused(f"{what} is not signed and this device requires signatures (sync.public_key)")
    try:
        public_key.verify(base64.b64decode(signature, validate=True), canonical(doc))
    except (InvalidSignature, ValueError) as exc:
        raise Refused(f"{what} has an invalid signature") from exc


# -- device-side checks ----------------------------------------------------------------
def parse_json(data: bytes, what: str) -> JSONObject:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise Refused(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise Refused(f"{what} is not a JSON object")
    parsed: JSONObject = doc  # json.loads gives JSON values only
    return parsed


def check_expiry(doc: ReadJSONObject, what: str, now: float | None = None) -> None:
    """The freeze-attack check: a document past its ``expires`` is refused (0: never)."""
    expires = doc.get("expires") or 0
    if isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires) or expires < 0:
        raise Refused(f"{what} has a malformed expires field {expires!r}")
    if expires and expires < (now or time.time()):
        raise Refused(f"{what} expired at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(expires))}")


def verify(data: bytes, model: str, version: int, public_key: Ed25519PublicKey | None, device_tags: Iterable[str],
           now: float | None = None) -> Manifest:
    """Parse and check a manifest against what the device asked for; ``Refused`` on any flaw."""
    what = f"{model} version {version} manifest"
    doc = parse_json(data, what)
    check_signature(doc, public_key, what)
    # The signature covers model, version, compat and every file: a signed manifest copied
    # to another model or version number (replay, mix-and-match) fails here.
    if type(doc.get("version")) is int:
        check_version_number(doc["version"], what)
    if doc.get("model") != model or type(doc.get("version")) is not int or doc.get("version") != version:
        raise Refused(f"{what} names {doc.get('model')!r} version {doc.get('version')!r}")
    check_expiry(doc, what, now)
    compat = doc.get("compat") or []
    if not isinstance(compat, list) or not all(isinstance(t, str) for t in compat):
        raise Refused(f"{what} has a malformed compat field (a list of device tags)")
    tags = [t for t in compat if isinstance(t, str)]  # every one of them (checked above)
    missing = sorted(set(tags) - set(device_tags))
    if missing:
        raise Refused(f"{what} needs {', '.join(missing)}; this device offers {', '.join(sorted(device_tags))}")
    return Manifest(model, version, _files(doc.get("files"), what), doc)


def file_entries(manifest: ReadJSONObject) -> list[ReadJSONObject]:
    """The file entries ({path, size, sha256}) a manifest lists, unchecked (``build``'s own, or
    one a publisher reads back; a device checks them with ``verify``)."""
    listed = manifest.get("files") or []
    return [entry for entry in listed if isinstance(entry, Mapping)] if isinstance(listed, (list, tuple)) else []


def _files(raw: JSONValue, what: str) -> tuple[FileEntry, ...]:
    if not isinstance(raw, list) or not raw:
        raise Refused(f"{what} lists no files")
    seen: set[str] = set()
    out = []
    for item in raw:
        if not isinstance(item, dict):
            raise Refused(f"{what} has a malformed file entry")
        path, size, digest = safe_path(item.get("path")), item.get("size"), item.get("sha256")
        if not isinstance(size, int) or size < 0 or not isinstance(digest, str) or len(digest) != 64:
            raise Refused(f"{what}: {path} has a malformed size or sha256")
        if path in seen or any(p.startswith(path + "/") or path.startswith(p + "/") for p in seen):
            raise Refused(f"{what}: {path} is listed twice or clashes with a directory")
        seen.add(path)
        out.append(FileEntry(path, size, digest.lower()))
    return tuple(out)


def channel_doc(model: str, channel: str, version: int, expires: float = 0) -> JSONObject:
    return {"model": model, "channel": channel, "version": int(version), "created": time.time(),
            "expires": float(expires)}


def verify_channel(data: bytes, model: str, channel: str, public_key: Ed25519PublicKey | None, now: float | None = None) -> JSONObject:
    what = f"{model} channel {channel}"
    doc = parse_json(data, what)
    check_signature(doc, public_key, what)
    if public_key is not None and (doc.get("model") != model or doc.get("channel") != channel):
        raise Refused(f"{what} pointer names {doc.get('model')!r}/{doc.get('channel')!r}")
    check_expiry(doc, what, now)
    if type(doc.get("version")) is not int:
        raise Refused(f"{what} pointer has no integer version")
    check_version_number(doc["version"], f"{what} pointer")
    if doc.get("candidate") is not None:
        check_version_number(doc["candidate"], f"{what} pointer's candidate")
    return doc
