"""Warm-up requests: TF Serving's ``assets.extra/tf_serving_warmup_requests``, or synthetic.

The file is a TFRecord of ``PredictionLog`` protos (parsed by protobuf, on the message
classes of appliance/protos/tfserving); predict, classify, regress and multi-inference logs
are replayed through the servable before its version becomes AVAILABLE, so the first real
request does not pay for graph optimisation or tensor allocation. What is accepted and
refused, and the texts, are TF Serving's (servables/tensorflow/saved_model_warmup{,_util}.cc,
TensorFlow's RecordReader). Without the file, one synthetic request per signature (zeros of
the right dtype and shape) is run instead.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator

import numpy as np
from google.protobuf.message import DecodeError

from runtimes import (DEFAULT_SIGNATURE, RuntimeFailure, Servable, SignatureInfo, generative, synthetic_bytes,
                      synthetic_inputs)

from appliance.core.errors import InvalidArgument, Unimplemented
from appliance.protos.tfserving import pb
from appliance.protos.tfserving import wire as pw

WARMUP_FILE = os.path.join("assets.extra", "tf_serving_warmup_requests")
MAX_RECORDS = 1000  # TF Serving's cap on warm-up records
_EXAMPLE_LOGS = {"classify_log": "classify", "regress_log": "regress"}
_METHODS = {"tensorflow/serving/classify": "classify", "tensorflow/serving/regress": "regress"}


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
    c: int = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _data_loss(message: str) -> ValueError:
    """TF Serving's DATA_LOSS text for a bad TFRecord (saved_model_warmup_util.cc)."""
    return ValueError(f"{message}. Please verify your warmup data is in TFRecord format.")


def _at(offset: int) -> str:
    """TF's RecordReader names the offset, and at 0 asks whether this is a TFRecord at all."""
    return f"{offset} (Is this even a TFRecord file?)" if offset == 0 else str(offset)


def records(path: str) -> Iterator[bytes]:
    """The payloads of a TFRecord file, read as TensorFlow's RecordReader reads them: a short
    header is the end of the file; a bad CRC, an impossible length or a record cut short fails
    with its DATA_LOSS text (``corrupted record at N``, ``truncated record at N' ...``)."""
    with open(path, "rb") as f:
        size, offset = os.fstat(f.fileno()).st_size, 0
        while len(header := f.read(12)) == 12:
            if masked_crc(header[:8]) != struct.unpack("<I", header[8:])[0]:
                raise _data_loss(f"corrupted record at {_at(offset)}")
            (length,) = struct.unpack("<Q", header[:8])
            if length >= (1 << 64) - 5:  # n + sizeof(uint32) would overflow size_t
                raise _data_loss("record size too large")
            if offset + 12 + length + 4 > size:  # checked before reading: never allocate a bogus length
                raise _data_loss(f"truncated record at {offset}' failed with Read less bytes than requested")
            data, footer = f.read(length), f.read(4)
            if masked_crc(data) != struct.unpack("<I", footer)[0]:
                raise _data_loss(f"corrupted record at {offset + 12}")
            yield data
            offset += 12 + length + 4


Request = tuple[str, str, dict[str, np.ndarray] | np.ndarray]


def _shown(record: bytes) -> str:
    """The record in a parse error, as TF Serving prints it (its bytes), cut at 256 bytes."""
    text = record[:256].decode("utf-8", "backslashreplace")
    return text + (f"... ({len(record)} bytes)" if len(record) > 256 else "")


def _signature(spec: Any) -> str:
    return spec.signature_name or DEFAULT_SIGNATURE


def _examples(input_msg: Any) -> np.ndarray:
    """Serialized tf.Examples of a serving ``Input``, each with its list's context in front,
    as TF Serving's InputToSerializedExampleTensor builds them; none is TF's 'Input is empty.'"""
    out = pw.input_examples(input_msg)
    if not out:
        raise InvalidArgument("Input is empty.")
    return np.array(out, dtype=object)


def _predict(request: Any) -> list[Request]:
    inputs = {}
    for alias, tensor in request.inputs.items():
        try:
            inputs[alias] = pw.tensor_to_array(tensor)
        except ValueError as exc:
            raise InvalidArgument(f"tensor parsing error: {alias} ({exc})") from exc
    return [("predict", _signature(request.model_spec), inputs)]


def _multi_inference(request: Any) -> list[Request]:
    """One classify or regress run per task, with TF Serving's checks on the tasks
    (servables/tensorflow/multi_inference.cc), in its order."""
    model, seen, out = "", set(), []
    for task in request.tasks:
        if not task.model_spec.name:
            raise InvalidArgument("Found ModelSpec with an empty model name.")
        if model and task.model_spec.name != model:
            raise InvalidArgument("All ModelSpecs in a MultiInferenceRequest must access the same model name.")
        model, signature = task.model_spec.name, _signature(task.model_spec)
        if signature in seen:
            raise InvalidArgument(f"Duplicate evaluation of signature: {signature}")
        seen.add(signature)
        kind = _METHODS.get(task.method_name)
        if kind is None:
            raise Unimplemented(f"Unsupported signature method_name: {task.method_name}")
        out.append((kind, signature))
    if not out:
        return []
    examples = _examples(request.input)
    return [(kind, signature, examples) for kind, signature in out]


def parse_log(record: bytes, path: str = "") -> list[Request]:
    """The runs one warm-up record asks for: (kind, signature name, inputs), kind being
    predict|classify|regress. As TF Serving's SavedModel warm-up (saved_model_warmup.cc):
    predict, classify, regress and multi-inference logs run; a session-run log is
    UNIMPLEMENTED; a record with no log, or a log kind it does not know, runs nothing."""
    try:
        log = pb.PredictionLog.FromString(record)
    except DecodeError:
        raise InvalidArgument(f"Failed to parse warmup record: {_shown(record)} from {path}") from None
    kind = log.WhichOneof("log_type")
    if kind == "predict_log":
        return _predict(log.predict_log.request)
    if kind in _EXAMPLE_LOGS:
        request = getattr(log, kind).request
        return [(_EXAMPLE_LOGS[kind], _signature(request.model_spec), _examples(request.input))]
    if kind == "multi_inference_log":
        return _multi_inference(log.multi_inference_log.request)
    if kind == "session_run_log":
        number = log.DESCRIPTOR.fields_by_name[kind].number  # TF prints the oneof case number
        raise Unimplemented(f"Unsupported log_type for warmup: {number}")
    return []


def warmup_requests(version_dir: str) -> list[Request]:
    """Every run the version's warm-up file asks for, in order; [] without the file. At most
    MAX_RECORDS records, counted as TF Serving counts them (the next one is read, then refused)."""
    path = os.path.join(version_dir, WARMUP_FILE)
    if not os.path.isfile(path):
        return []
    out: list[Request] = []
    for count, record in enumerate(records(path), 1):
        out += parse_log(record, path)
        if count > MAX_RECORDS:
            raise InvalidArgument(f"Number of warmup records exceeds the maximum ({MAX_RECORDS}) at {path}")
    return out


@dataclass
class WarmupReport:
    """What a warm-up ran: ``kind`` is file (the version's own requests), generative (one real
    prompt and step), synthetic (one zeros call per signature) or none; ``ran`` the signatures
    warmed synthetically; ``warnings`` {signature: why} for those whose synthetic call failed or
    was not made."""

    kind: str = "none"
    ran: list[str] = field(default_factory=list)
    warnings: dict[str, str] = field(default_factory=dict)


def warm_up(servable: Servable, path: str, only: Collection[str] | None = None,
            max_feed_bytes: int | None = None) -> WarmupReport:
    """Warm ``servable`` up before its version serves. TF Serving's rule: the version's own
    ``assets.extra/tf_serving_warmup_requests`` is authoritative, and a record that fails
    refuses the version (raises). Without the file, one synthetic call per signature; one that
    fails is a warning on that signature and the version still serves, as TF Serving, which does
    no synthetic warm-up, would serve it. ``only``: the signatures to call synthetically (those
    whose call worked in the trial process); ``max_feed_bytes``: no synthetic call feeds more
    (the declared shapes say how much it would)."""
    requests = warmup_requests(path)
    if requests:
        replay(servable, requests)
        return WarmupReport("file")
    # Generation signatures (prefill/decode, generate_step) warm up with one real prompt
    # and step: zeros resized to "batch 1" do not fit a fixed-length prefill's input_pos.
    driver = generative.detect(servable)
    if driver is not None:
        driver.warm_up()
        return WarmupReport("generative")
    report = WarmupReport("synthetic")
    for sig in servable.signatures.values():
        if not sig.inputs or any(spec.is_string for spec in sig.inputs.values()):
            # no valid synthetic tf.Example; and a signature without inputs is an action (TF
            # Serving's counter model: incr_counter, reset_counter) a warm-up must not take
            continue
        if only is not None and sig.name not in only:
            continue
        _synthetic_call(servable, sig, max_feed_bytes, report)
    return report


def _synthetic_call(servable: Servable, sig: SignatureInfo, max_feed_bytes: int | None,
                    report: WarmupReport) -> None:
    size = synthetic_bytes(sig, 1)
    if max_feed_bytes is not None and size > max_feed_bytes:
        report.warnings[sig.name] = (f"its inputs at batch 1 would take {size} bytes by their declared shapes, "
                                     f"above the {max_feed_bytes} a load may feed; not called")
        return
    try:
        servable.run(sig.name, synthetic_inputs(sig, 1))
    except (RuntimeFailure, MemoryError) as exc:
        report.warnings[sig.name] = str(exc) or type(exc).__name__
    else:
        report.ran.append(sig.name)


def replay(servable: Servable, requests: list[Request]) -> None:
    """Run every warm-up request through ``servable``; the first that fails raises."""
    for kind, signature, inputs in requests:
        if kind != "predict":
            sig = servable.signatures.get(signature)
            if sig is None:
                raise RuntimeFailure(f"warm-up request names signature {signature!r}, which the model lacks",
                                     "INVALID_ARGUMENT")
            inputs = {next(iter(sig.inputs)): inputs}  # type: ignore[dict-item]  # examples feed the only input
        servable.run(signature, inputs)  # type: ignore[arg-type]  # examples feed the only input as one array (above)
