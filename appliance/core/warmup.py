"""Warm-up requests: TF Serving's ``assets.extra/tf_serving_warmup_requests``, or synthetic.

The file is a TFRecord of ``PredictionLog`` protos; predict, classify and regress logs are
replayed through the servable before its version becomes AVAILABLE, so the first real
request does not pay for graph optimisation or tensor allocation. Without the file, one
synthetic request per signature (zeros of the right dtype and shape) is run instead.
"""

from __future__ import annotations

import os
import struct
from typing import Iterator

import numpy as np

from appliance.protos.tfserving import wire as pw

WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")
MAX_RECORDS = 1000  # TF Serving's cap on warm-up records


def _crc32c_python(data: bytes) -> int:
    """CRC32C in pure Python (~8 MB/s): only where google-crc32c has no wheel."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC32C_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


try:  # C (or hardware) CRC32C: a 100 MB warm-up file is checked in well under a second
    from google_crc32c import value as crc32c
except ImportError:  # pragma: no cover - the wheel exists for every platform we ship
    _CRC32C_TABLE = _crc_table()
    crc32c = _crc32c_python


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC32C."""
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def records(path: str) -> Iterator[bytes]:
    """The payloads of a TFRecord file; a bad length, CRC or truncation fails as TF Serving's does."""
    bad = f"{path}: corrupt TFRecord. Please verify your warmup data is in TFRecord format."
    with open(path, "rb") as f:
        while True:
            header = f.read(12)
            if not header:
                return
            if len(header) < 12 or masked_crc(header[:8]) != struct.unpack("<I", header[8:])[0]:
                raise ValueError(bad)
            (length,) = struct.unpack("<Q", header[:8])
            data = f.read(length)
            footer = f.read(4)
            if len(data) < length or len(footer) < 4 or masked_crc(data) != struct.unpack("<I", footer)[0]:
                raise ValueError(bad)
            yield data


def _examples(input_msg: bytes) -> np.ndarray:
    """Serialized tf.Examples of a serving ``Input`` (example_list or ..._with_context)."""
    out = []
    for n, _, v in pw.fields(input_msg):
        if n == 1:
            out += [bytes(e) for m, _, e in pw.fields(v) if m == 1]
        elif n == 2:
            context = bytes(pw.first(v, 2, b""))
            out += [pw.merge_examples(context, bytes(e)) for m, _, e in pw.fields(v) if m == 1]
    return np.array(out, dtype=object)


def parse_log(log: bytes) -> tuple[str, str, dict[str, np.ndarray] | np.ndarray]:
    """(kind, signature name, inputs) of one PredictionLog; kind is predict|classify|regress."""
    for n, _, v in pw.fields(log):
        if n in (2, 3, 6):
            request = pw.first(v, 1, b"")
            spec = pw.first(request, 1, b"")
            signature = bytes(pw.first(spec, 3, b"")).decode() or "serving_default"
            if n == 6:
                inputs = {}
                for m, _, entry in pw.fields(request):
                    if m == 2:
                        key = bytes(pw.first(entry, 1, b"")).decode()
                        inputs[key] = pw.decode_tensor(bytes(pw.first(entry, 2, b"")))
                return "predict", signature, inputs
            return ("classify" if n == 2 else "regress"), signature, _examples(bytes(pw.first(request, 2, b"")))
    raise ValueError("warm-up record holds no predict, classify or regress log")


def warmup_requests(version_dir: str) -> list[tuple[str, str, dict[str, np.ndarray] | np.ndarray]]:
    path = os.path.join(version_dir, WARMUP_FILE)
    if not os.path.isfile(path):
        return []
    out = []
    for i, data in enumerate(records(path)):
        if i >= MAX_RECORDS:
            raise ValueError(f"Number of warmup records exceeds the maximum ({MAX_RECORDS}) at {path}")
        out.append(parse_log(data))
    return out
