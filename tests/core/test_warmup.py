"""appliance/core/warmup.py reads ``assets.extra/tf_serving_warmup_requests`` as TF Serving does.

Every file here is written by TensorFlow's own ``tf.io.TFRecordWriter`` from
``tensorflow_serving.apis`` messages; what TF Serving accepts runs, what it refuses is refused
with its text (servables/tensorflow/saved_model_warmup{,_util}.cc, multi_inference.cc,
util.cc), and for a damaged file the expected text is what TensorFlow's own RecordReader
(``tf.data.TFRecordDataset``) says about the same bytes.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow")
apis = pytest.importorskip("tensorflow_serving.apis.prediction_log_pb2")
from tensorflow_serving.apis import (classification_pb2, inference_pb2, predict_pb2,  # noqa: E402
                                     regression_pb2)
from tensorflow_serving.apis import prediction_log_pb2 as plog  # noqa: E402

from appliance.core import warmup  # noqa: E402
from appliance.core.errors import InvalidArgument, Unimplemented  # noqa: E402

SUFFIX = ". Please verify your warmup data is in TFRecord format."


# --- building files ---------------------------------------------------------------------
def write(version_dir: Path, records: list[bytes]) -> Path:
    path = version_dir / "assets.extra" / "tf_serving_warmup_requests"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record)
    return path


def example(**features: Any) -> Any:
    ex = tf.train.Example()
    for key, value in features.items():
        feature = ex.features.feature[key]
        if isinstance(value, bytes):
            feature.bytes_list.value.append(value)
        elif isinstance(value, int):
            feature.int64_list.value.append(value)
        else:
            feature.float_list.value.append(value)
    return ex


def predict_log(inputs: dict[str, Any], signature: str = "") -> bytes:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = "m"
    request.model_spec.signature_name = signature
    for key, value in inputs.items():
        request.inputs[key].CopyFrom(tf.make_tensor_proto(value))
    return plog.PredictionLog(predict_log=plog.PredictLog(request=request)).SerializeToString()


def classify_log(examples: list[Any], signature: str = "classify_x_to_y") -> bytes:
    request = classification_pb2.ClassificationRequest()
    request.model_spec.signature_name = signature
    request.input.example_list.examples.extend(examples)
    return plog.PredictionLog(classify_log=plog.ClassifyLog(request=request)).SerializeToString()


def regress_log(examples: list[Any], context: Any = None, signature: str = "regress_x_to_y") -> bytes:
    request = regression_pb2.RegressionRequest()
    request.model_spec.signature_name = signature
    if context is None:
        request.input.example_list.examples.extend(examples)
    else:
        request.input.example_list_with_context.examples.extend(examples)
        request.input.example_list_with_context.context.CopyFrom(context)
    return plog.PredictionLog(regress_log=plog.RegressLog(request=request)).SerializeToString()


def multi_log(tasks: list[tuple[str, str, str]], examples: list[Any]) -> bytes:
    request = inference_pb2.MultiInferenceRequest()
    for model, signature, method in tasks:
        task = request.tasks.add()
        task.model_spec.name = model
        task.model_spec.signature_name = signature
        task.method_name = method
    request.input.example_list.examples.extend(examples)
    return plog.PredictionLog(multi_inference_log=plog.MultiInferenceLog(request=request)).SerializeToString()


def parsed(serialized: np.ndarray, *keys: str) -> dict[str, np.ndarray]:
    """Serialized examples as TensorFlow parses them (float features x, y)."""
    spec = {k: tf.io.FixedLenFeature([1], tf.float32) for k in keys}
    return {k: v.numpy() for k, v in tf.io.parse_example(tf.constant(list(serialized)), spec).items()}


def tf_reader_error(path: Path) -> str:
    """What TensorFlow's RecordReader says about this file (the DATA_LOSS message)."""
    with pytest.raises(tf.errors.DataLossError) as caught:
        list(tf.data.TFRecordDataset(str(path)).as_numpy_iterator())
    found = re.search(r"((corrupted|truncated) record at .*?) \[Op:", str(caught.value))
    assert found, str(caught.value)
    return found.group(1)


# --- accepted ---------------------------------------------------------------------------
def test_predict_logs_replay_their_tensors(tmp_path: Path) -> None:
    x = np.array([[1.0, 2.0, 5.0]], np.float32)
    words = np.array([b"a", b"bc"], dtype=object)
    write(tmp_path, [predict_log({"x": x}), predict_log({"s": words, "n": np.int64(7)}, "named")])
    runs = warmup.warmup_requests(str(tmp_path))
    assert [(kind, sig) for kind, sig, _ in runs] == [("predict", "serving_default"), ("predict", "named")]
    np.testing.assert_array_equal(runs[0][2]["x"], x)
    assert runs[0][2]["x"].dtype == np.float32
    assert runs[1][2]["s"].tolist() == [b"a", b"bc"] and runs[1][2]["n"] == 7


def test_classify_and_regress_logs_replay_their_examples(tmp_path: Path) -> None:
    examples = [example(x=1.0), example(x=2.0)]
    write(tmp_path, [classify_log(examples), regress_log(examples, signature="")])
    runs = warmup.warmup_requests(str(tmp_path))
    assert [(kind, sig) for kind, sig, _ in runs] == [("classify", "classify_x_to_y"), ("regress", "serving_default")]
    for _, _, serialized in runs:
        assert [tf.train.Example.FromString(s) for s in serialized] == examples
        np.testing.assert_array_equal(parsed(serialized, "x")["x"], [[1.0], [2.0]])


def test_example_list_with_context_puts_the_context_in_each_example(tmp_path: Path) -> None:
    """TF Serving prepends the serialized context; where both name a feature, the example's wins."""
    write(tmp_path, [regress_log([example(x=1.0), example(x=2.0, y=9.0)], context=example(y=5.0, x=0.0))])
    ((kind, _, serialized),) = warmup.warmup_requests(str(tmp_path))
    assert kind == "regress"
    values = parsed(serialized, "x", "y")
    np.testing.assert_array_equal(values["x"], [[1.0], [2.0]])
    np.testing.assert_array_equal(values["y"], [[5.0], [9.0]])


def test_multi_inference_log_runs_each_task_on_the_same_examples(tmp_path: Path) -> None:
    tasks = [("m", "classify_x_to_y", "tensorflow/serving/classify"),
             ("m", "regress_x_to_y", "tensorflow/serving/regress")]
    write(tmp_path, [multi_log(tasks, [example(x=3.0)])])
    runs = warmup.warmup_requests(str(tmp_path))
    assert [(kind, sig) for kind, sig, _ in runs] == [("classify", "classify_x_to_y"), ("regress", "regress_x_to_y")]
    for _, _, serialized in runs:
        np.testing.assert_array_equal(parsed(serialized, "x")["x"], [[3.0]])


def test_records_without_a_log_it_runs_are_skipped_as_tf_serving_skips_them(tmp_path: Path) -> None:
    """saved_model_warmup.cc: no log_type (and a kind it has no case for) falls to ``default: break``."""
    streamed = plog.PredictionLog(predict_streamed_log=plog.PredictStreamedLog()).SerializeToString()
    write(tmp_path, [b"", plog.PredictionLog().SerializeToString(), streamed])
    assert warmup.warmup_requests(str(tmp_path)) == []


def test_no_file_no_requests_and_a_short_tail_is_the_end_of_the_file(tmp_path: Path) -> None:
    """A partial header after the last record is end-of-file to TF's RecordReader, not an error."""
    assert warmup.warmup_requests(str(tmp_path)) == []
    path = write(tmp_path, [predict_log({"x": np.float32(1)})])
    path.write_bytes(path.read_bytes() + b"\x05\x00\x00")
    assert len(list(tf.data.TFRecordDataset(str(path)).as_numpy_iterator())) == 1
    assert len(warmup.warmup_requests(str(tmp_path))) == 1


def test_a_thousand_records_are_accepted(tmp_path: Path) -> None:
    write(tmp_path, [predict_log({"x": np.float32(1)})] * warmup.MAX_RECORDS)
    assert len(warmup.warmup_requests(str(tmp_path))) == 1000


# --- refused ----------------------------------------------------------------------------
def refusal(tmp_path: Path) -> Exception:
    with pytest.raises(Exception) as caught:
        warmup.warmup_requests(str(tmp_path))
    return caught.value


@pytest.mark.parametrize("where", ["data of the second record", "header of the first record",
                                   "header of the second record", "not a TFRecord file"])
def test_a_bad_crc_is_tf_serving_data_loss(tmp_path: Path, where: str) -> None:
    path = write(tmp_path, [predict_log({"x": np.float32(1)}), predict_log({"x": np.float32(2)})])
    data = bytearray(path.read_bytes())
    first = len(data) // 2
    flip = {"data of the second record": len(data) - 1, "header of the first record": 9,
            "header of the second record": first + 9, "not a TFRecord file": None}[where]
    if flip is None:
        data = bytearray(b"\x17garbage, not a TFRecord file" * 8)
    else:
        data[flip] ^= 0xFF
    path.write_bytes(bytes(data))
    error = refusal(tmp_path)
    assert str(error) == tf_reader_error(path) + SUFFIX
    assert "corrupted record at" in str(error)


@pytest.mark.parametrize("cut", [1, 4, 5, 30])
def test_a_truncated_record_is_tf_serving_data_loss(tmp_path: Path, cut: int) -> None:
    path = write(tmp_path, [predict_log({"x": np.float32(1)}), predict_log({"x": np.ones(8, np.float32)})])
    path.write_bytes(path.read_bytes()[:-cut])
    error = refusal(tmp_path)
    assert str(error) == tf_reader_error(path) + SUFFIX
    assert str(error).startswith("truncated record at ")


@pytest.mark.parametrize("length", [1 << 20, 1 << 62])
def test_a_length_past_the_end_of_the_file_is_refused_before_reading(tmp_path: Path, length: int) -> None:
    """A header whose CRC holds but whose length runs past the file: truncated, and nothing of
    that size is allocated (TensorFlow's reader tries to, and at 2**62 crashes the process)."""
    header = length.to_bytes(8, "little")
    path = write(tmp_path, [])
    path.write_bytes(header + warmup.masked_crc(header).to_bytes(4, "little") + b"tail")
    want = "truncated record at 0' failed with Read less bytes than requested" + SUFFIX
    assert str(refusal(tmp_path)) == want
    if length < 1 << 32:
        assert tf_reader_error(path) + SUFFIX == want


@pytest.mark.parametrize("payload", [b"\x0a\x05ab", "cut_predict_log", b"\xff\xff\xff"])
def test_a_truncated_or_invalid_protobuf_message_is_refused(tmp_path: Path, payload: Any) -> None:
    """The old hand-written reader gave field 1 = b"ab" for b"\\x0a\\x05ab"; protobuf (as TF
    Serving's ParseFromArray) refuses the record."""
    if payload == "cut_predict_log":
        payload = predict_log({"x": np.ones(4, np.float32)})[:-3]
    path = write(tmp_path, [predict_log({"x": np.float32(1)}), payload])
    with pytest.raises(DecodeError):  # TensorFlow's own copy of the message refuses it too
        plog.PredictionLog.FromString(payload)
    error = refusal(tmp_path)
    assert isinstance(error, InvalidArgument)
    assert str(error).startswith("Failed to parse warmup record: ") and str(error).endswith(f" from {path}")


def test_more_than_a_thousand_records_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, [predict_log({"x": np.float32(1)})] * (warmup.MAX_RECORDS + 1))
    error = refusal(tmp_path)
    assert isinstance(error, InvalidArgument)
    assert str(error) == f"Number of warmup records exceeds the maximum (1000) at {path}"


def test_a_session_run_log_is_unimplemented(tmp_path: Path) -> None:
    write(tmp_path, [plog.PredictionLog(session_run_log=plog.SessionRunLog()).SerializeToString()])
    error = refusal(tmp_path)
    assert isinstance(error, Unimplemented)
    assert str(error) == "Unsupported log_type for warmup: 5"  # PredictionLog::kSessionRunLog


@pytest.mark.parametrize("record, message", [
    (classify_log([]), "Input is empty."),
    (regress_log([], context=example(x=1.0)), "Input is empty."),
    (multi_log([("m", "a", "tensorflow/serving/classify")], []), "Input is empty."),
    (multi_log([("", "a", "tensorflow/serving/classify")], [example(x=1.0)]),
     "Found ModelSpec with an empty model name."),
    (multi_log([("m", "a", "tensorflow/serving/classify"), ("n", "b", "tensorflow/serving/regress")],
               [example(x=1.0)]), "All ModelSpecs in a MultiInferenceRequest must access the same model name."),
    (multi_log([("m", "", "tensorflow/serving/classify"), ("m", "serving_default", "tensorflow/serving/regress")],
               [example(x=1.0)]), "Duplicate evaluation of signature: serving_default"),
    (multi_log([("m", "a", "tensorflow/serving/predict")], [example(x=1.0)]),
     "Unsupported signature method_name: tensorflow/serving/predict"),
])
def test_requests_tf_serving_refuses_are_refused_with_its_text(tmp_path: Path, record: bytes, message: str) -> None:
    write(tmp_path, [record])
    error = refusal(tmp_path)
    assert isinstance(error, (InvalidArgument, Unimplemented)) and str(error) == message
    assert isinstance(error, Unimplemented) == message.startswith("Unsupported")


def test_a_tensor_that_does_not_parse_is_tf_serving_tensor_parsing_error(tmp_path: Path) -> None:
    request = predict_pb2.PredictRequest()
    bad = request.inputs["x"]
    bad.CopyFrom(tf.make_tensor_proto(np.ones(4, np.float32)))
    bad.tensor_content = bad.tensor_content[:-1]  # 15 bytes for 4 float32s
    write(tmp_path, [plog.PredictionLog(predict_log=plog.PredictLog(request=request)).SerializeToString()])
    error = refusal(tmp_path)
    assert isinstance(error, InvalidArgument) and str(error).startswith("tensor parsing error: x")


# --- replayed by the server -------------------------------------------------------------
def test_a_served_model_replays_example_logs_and_refuses_what_tf_serving_refuses(
        module_server: Any, models_dir: Path, tmp_path: Path) -> None:
    """half_plus_two on tf-cpu: classify, regress (with context) and multi-inference records are
    run before the version is AVAILABLE; a session-run record fails the load with TF's text."""
    import shutil

    from tests.core.test_manager import config_file, settled

    examples = [example(x=1.0), example(x=2.0)]
    tasks = [("half_plus_two", "classify_x_to_y", "tensorflow/serving/classify"),
             ("half_plus_two", "regress_x_to_y2", "tensorflow/serving/regress")]
    files = {
        "examples": [classify_log(examples), regress_log([example()], context=example(x=3.0)),
                     multi_log(tasks, examples), predict_log({"x": np.array([1.0], np.float32)})],
        "session_run": [plog.PredictionLog(session_run_log=plog.SessionRunLog()).SerializeToString()],
        "no_such_signature": [regress_log(examples, signature="no_such_signature")],  # proof the logs are run
    }
    for name, records in files.items():
        version = tmp_path / "models" / name / "1"
        shutil.copytree(models_dir / "half_plus_two" / "1", version)
        (version / "assets.extra" / "tf_serving_warmup_requests").unlink()
        write(version, records)
    srv = module_server("--models", str(tmp_path / "models"), "--backend", "tf-cpu", "--config",
                        config_file(tmp_path), ready=False)
    outcome = {name: srv.wait_for(lambda n=name: settled(srv, n, 1), timeout=120, what=f"{name} to settle")
               for name in files}
    assert outcome["examples"]["state"] == "AVAILABLE", outcome["examples"]
    assert outcome["session_run"]["state"] == "END"
    assert "Unsupported log_type for warmup: 5" in outcome["session_run"]["status"]["error_message"]
    assert outcome["no_such_signature"]["state"] == "END"
    assert "no_such_signature" in outcome["no_such_signature"]["status"]["error_message"]
