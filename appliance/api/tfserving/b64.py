"""``{"b64": ...}`` values of TF Serving's JSON, decoded as TF Serving decodes them (absl's
standard alphabet, padding optional but correct when present), with the hint a client that sent
URL-safe base64 needs."""

from __future__ import annotations

import binascii
import re
from typing import Mapping

from appliance.core.errors import InvalidArgument

_URL_SAFE = re.compile(r"[-_]")


def b64_decode(obj: Mapping[str, object], where: str) -> bytes:
    """``{"b64": ...}`` decoded as absl::Base64Unescape does: the standard alphabet,
    padding optional but correct when present."""
    text = obj["b64"]
    if not isinstance(text, str):
        raise InvalidArgument(f"{where}: 'b64' value must be a string, got {type(text).__name__}")
    try:
        if "=" in text and len(text) % 4:
            raise ValueError("with padding, the length must be a multiple of 4")
        padded = text + "=" * (-len(text) % 4)
        return binascii.a2b_base64(padded.encode("ascii"), strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"{where}: 'b64' value is not valid base64{url_safe_hint(text)}: {exc}") from exc


def url_safe_hint(text: str) -> str:
    """What to say when base64 that fails to decode looks URL-safe."""
    return (" (URL-safe base64 with '-' or '_' is not accepted: use the standard alphabet with '+' and '/', as "
            "TF Serving does)" if _URL_SAFE.search(text) else "")
