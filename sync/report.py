"""Device reports, ``<prefix>/_devices/<device-id>.json``: signed by the device, checked by the view.

Each device writes only its own report (docs/fleet.md has the schema and a least-privilege
bucket policy per backend). A report carries ``device_key`` (``ed25519:<base64 of the raw
public key>``) and ``signature`` (base64 Ed25519 over the canonical JSON of every other key,
as manifests are signed: sync/manifest.py). The device's key is made at its first start
(``<state>/device-key.pem``, 0600) and never leaves it.

The view trusts a key when it is in the registry ``_fleet/device-keys.json`` (written by an
operator: ``appliance fleet --register-keys`` records the keys reports carry now, trust on
first use, or a provisioning step writes them). What the view says of each report:

    signed        the signature holds and the key is the registered one
    unregistered  the signature holds, but nobody has registered this device's key yet
    key-changed   the signature holds for a key other than the registered one (a re-imaged
                  device, or someone else writing this device's report)
    mis-signed    the signature does not hold (the report was changed after signing)
    unsigned      no signature (an old device, or someone else writing the report)

Thread-safety: pure functions, except ``device_key`` (file creation; call it from one thread).
"""

from __future__ import annotations

import base64
import json
import os
import time
from typing import TYPE_CHECKING

from .json_types import JSONObject, ReadJSONObject
from .manifest import canonical, parse_json
from .source import MISSING, Source

if TYPE_CHECKING:  # the key types, for annotations: cryptography is imported where keys are used
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

SCHEMA = 2
KEY_FILE = "device-key.pem"
REGISTRY = "_fleet/device-keys.json"
SIGNED, UNREGISTERED, KEY_CHANGED, MISSIGNED, UNSIGNED = "signed", "unregistered", "key-changed", "mis-signed", "unsigned"
TRUST_MARKS = (SIGNED, UNREGISTERED, KEY_CHANGED, MISSIGNED, UNSIGNED)


def device_key(state_dir: str) -> Ed25519PrivateKey:
    """The device's Ed25519 private key, made on first use (``<state>/device-key.pem``, 0600)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = os.path.join(state_dir, KEY_FILE)
    try:
        with open(path, "rb") as f:
            loaded = serialization.load_pem_private_key(f.read(), password=None)
    except FileNotFoundError:
        pass
    else:
        if not isinstance(loaded, Ed25519PrivateKey):  # only something else wrote it: say so, never sign with it
            raise ValueError(f"{path} holds a {type(loaded).__name__}, not the device's Ed25519 key; move it away")
        return loaded
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return key


def public_text(private_key: Ed25519PrivateKey) -> str:
    """``ed25519:<base64>`` of the raw 32-byte public key (what reports and the registry hold)."""
    from cryptography.hazmat.primitives import serialization

    raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + base64.b64encode(raw).decode()


def sign_report(doc: JSONObject, private_key: Ed25519PrivateKey) -> JSONObject:
    """``doc`` with ``device_key`` and ``signature`` (over everything else)."""
    body: JSONObject = {k: v for k, v in doc.items() if k != "signature"}
    body["device_key"] = public_text(private_key)
    return {**body, "signature": base64.b64encode(private_key.sign(canonical(body))).decode()}


def trust_mark(doc: ReadJSONObject, registered: str | None, holds: bool | None = None) -> str:
    """One of ``TRUST_MARKS`` for a report, given the device's registered key (or None).
    ``holds``: ``signature_holds(doc)`` when the caller already knows it (the listing caches
    it per ETag: an Ed25519 check is most of a 10,000-device view's CPU)."""
    if not doc.get("signature"):
        return UNSIGNED
    if not (signature_holds(doc) if holds is None else holds):
        return MISSIGNED
    key = doc.get("device_key")
    if registered is None:
        return UNREGISTERED
    return SIGNED if registered == key else KEY_CHANGED


def signature_holds(doc: ReadJSONObject) -> bool:
    """The report's signature verifies with the key it carries (says nothing of whose key)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    key, signature = doc.get("device_key"), doc.get("signature")
    try:
        if not isinstance(key, str) or not key.startswith("ed25519:") or not isinstance(signature, str):
            return False
        public = Ed25519PublicKey.from_public_bytes(base64.b64decode(key[8:], validate=True))
        public.verify(base64.b64decode(signature, validate=True), canonical(doc))
        return True
    except (InvalidSignature, ValueError):
        return False


def load_registry(source: Source) -> dict[str, str]:
    """device id -> registered key text, from ``_fleet/device-keys.json`` ({} when none)."""
    fetched = source.read(REGISTRY)
    if fetched.status == MISSING:
        return {}
    devices = parse_json(fetched.data, REGISTRY).get("devices") or {}
    if not isinstance(devices, dict):
        return {}
    return {str(d): str(v.get("key")) for d, v in devices.items() if isinstance(v, dict) and v.get("key")}


def register_keys(source: Source, keys: dict[str, str], how: str = "first report") -> int:
    """Add ``keys`` (device id -> key text) to the registry; never replaces a registered key
    (a changed key is resolved by hand: delete the entry first). Returns how many were added."""
    fetched = source.read(REGISTRY)
    doc = parse_json(fetched.data, REGISTRY) if fetched.status != MISSING else {}
    registered = doc.get("devices") or {}
    devices = dict(registered) if isinstance(registered, dict) else {}
    added = {d: {"key": k, "added": time.time(), "how": how} for d, k in keys.items() if d not in devices}
    if added:
        source.put(REGISTRY, json.dumps({"devices": {**devices, **added}}, sort_keys=True, indent=1).encode())
    return len(added)
