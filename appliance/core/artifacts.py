"""The artifacts of a version that no backend on this device runs, checked all the same.

A version is *whole* when every artifact it ships is intact (appliance/core/loader.py). The
trial proves that for what it can run by loading it; a ``saved_model.pb`` on a LiteRT-only
device (the OCI image, a small board) is never loaded there, yet the fleet beside it runs it,
so it is checked here with what the service already has, never with TensorFlow:

- ``saved_model.pb`` parses as TensorFlow's ``SavedModel`` message (protobuf, on the
  descriptors appliance/protos/tfserving carries) and holds a MetaGraphDef tagged ``serve``,
  TF Serving's default tag set; its signatures are read from that graph (what the device
  could not serve of the version, shown as ``degraded``). ``saved_model.pbtxt`` parses as text.
- ``variables/variables.index``, where there is one: a TensorFlow checkpoint index is a
  LevelDB-format table (tensorflow/core/lib/io/format.h). A table ends in a 48-byte footer,
  two block handles padded to 40 bytes and a fixed 8-byte magic number, and both handles must
  point inside the file: a truncated or overwritten index loses its footer, which is the only
  part of the format readable without parsing every block. Every data shard the shard names
  promise (``variables.data-0000i-of-0000N``) must exist, and at least one (TensorFlow writes
  one beside every index, for a model without variables too).
- ``model.tflite`` on a device without LiteRT: the flatbuffer's ``TFL3`` identifier and a
  root table inside the file (a flatbuffer has no length or checksum to check beyond that).

Bytes the publisher's MANIFEST.json lists are re-hashed before any load by the source's
check (sync/store.py ``check_version``); these checks are for a file that was broken when
it was published, whose hashes therefore match.

``check(path, artifact_file)`` returns ``Checked``; a failure's code is ``DATA_LOSS``, as the
backend that runs the artifact reports a file that does not parse. Pure reads, no state.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field

from google.protobuf import text_format
from google.protobuf.message import DecodeError

from appliance.protos.tfserving import pb

SERVE_TAG = "serve"  # TF Serving's default --saved_model_tags
TABLE_MAGIC = 0xDB4775248B80FB57  # LevelDB's kTableMagicNumber, which TensorFlow's tables keep
FOOTER_BYTES = 48  # 2 block handles (varint64 offset + size each) padded to 40 bytes, then the magic
BLOCK_TRAILER = 5  # each block is followed by its compression type (1 byte) and crc32c (4)
SHARD = re.compile(r"^variables\.data-(\d+)-of-(\d+)$")


@dataclass
class Checked:
    """What the check of one artifact found: ``ok``, or ``error`` with ``code``; the
    signatures the artifact declares (a SavedModel's), to compare with what serves."""

    ok: bool
    error: str = ""
    code: str = ""
    signatures: list[str] = field(default_factory=list)
    how: str = ""


def check(version_dir: str, artifact: str) -> Checked:
    """Check ``artifact`` (a file name of the version: saved_model.pb, model.tflite...)."""
    try:
        if artifact in ("saved_model.pb", "saved_model.pbtxt"):
            return _saved_model(version_dir, artifact)
        if artifact.endswith(".tflite"):
            return _tflite(os.path.join(version_dir, artifact))
    except OSError as exc:
        return Checked(False, f"{artifact} could not be read: {exc}", "DATA_LOSS")
    return Checked(True, how="no check known for this kind of file")


def _saved_model(version_dir: str, artifact: str) -> Checked:
    with open(os.path.join(version_dir, artifact), "rb") as f:
        data = f.read()
    message = pb.SavedModel()
    try:
        if artifact.endswith(".pbtxt"):
            text_format.Parse(data.decode("utf-8"), message)
        else:
            message.ParseFromString(data)
    except (DecodeError, text_format.ParseError, UnicodeDecodeError) as exc:
        return Checked(False, f"does not parse as a SavedModel ({exc}; {len(data)} bytes)", "DATA_LOSS")
    graphs = [g for g in message.meta_graphs if SERVE_TAG in g.meta_info_def.tags]
    if not graphs:
        tags = [list(g.meta_info_def.tags) for g in message.meta_graphs]
        return Checked(False, f"holds no MetaGraphDef tagged {SERVE_TAG!r} (tag sets: {tags}; the file may be "
                              "truncated)", "DATA_LOSS")
    problem = _variables(os.path.join(version_dir, "variables"))
    if problem:
        return Checked(False, problem, "DATA_LOSS")
    signatures = sorted(k for k in graphs[0].signature_def if not k.startswith("__"))
    return Checked(True, signatures=signatures, how="parsed as a SavedModel; variables index and shards intact")


def _variables(folder: str) -> str:
    """'' when the checkpoint's index and shards are intact (module docstring), else why not."""
    index = os.path.join(folder, "variables.index")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    shards = [m for m in map(SHARD.match, names) if m]
    if not os.path.exists(index):
        return "variables/ holds data shards but no variables.index" if shards else ""
    with open(index, "rb") as f:
        data = f.read()
    footer = table_footer(data)
    if footer:
        return f"variables/variables.index is not a whole checkpoint index: {footer}"
    if not shards:  # TensorFlow writes at least one shard beside every index, empty ones too
        return "variables/ holds variables.index but no data shard (variables.data-00000-of-0000N)"
    total = shards[0].group(2)
    expected = [f"variables.data-{i:0{len(shards[0].group(1))}d}-of-{total}" for i in range(int(total))]
    missing = [name for name in expected if name not in names]
    if missing:
        return f"variables/ lacks the data shard{'s' if len(missing) > 1 else ''} {', '.join(missing[:3])}"
    return ""


def table_footer(data: bytes) -> str:
    """'' when ``data`` ends in a LevelDB table footer whose two block handles lie inside it."""
    if len(data) < FOOTER_BYTES:
        return f"{len(data)} bytes, shorter than a table's {FOOTER_BYTES}-byte footer"
    footer = data[-FOOTER_BYTES:]
    (magic,) = struct.unpack("<Q", footer[-8:])
    if magic != TABLE_MAGIC:
        return f"its last 8 bytes are not the table magic number (0x{magic:016x}): truncated or overwritten"
    pos, body = 0, len(data) - FOOTER_BYTES
    for name in ("metaindex", "index"):
        offset, pos = _varint(footer, pos)
        size, pos = _varint(footer, pos)
        if offset < 0 or size < 0 or offset + size + BLOCK_TRAILER > body:
            return f"its footer's {name} block handle points past the data ({offset}+{size} of {body} bytes)"
    return ""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """A LevelDB varint64 at ``pos``: (value, next position); (-1, pos) for a malformed one."""
    value = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return -1, pos


def _tflite(path: str) -> Checked:
    with open(path, "rb") as f:
        head = f.read(8)
        size = os.fstat(f.fileno()).st_size
    if len(head) < 8 or head[4:8] != b"TFL3":
        return Checked(False, "is not a TFLite flatbuffer (no 'TFL3' identifier)", "DATA_LOSS")
    (root,) = struct.unpack("<I", head[:4])
    if root + 4 > size:
        return Checked(False, f"its root table offset {root} lies past its {size} bytes: truncated", "DATA_LOSS")
    return Checked(True, how="a TFLite flatbuffer (identifier and root checked)")


__all__ = ["Checked", "check", "table_footer"]
