"""tensorflow_model_server's own config files, read as it reads them.

* ``[tfs] model_config_file`` (``--model_config_file``): a ``ModelServerConfig`` in protobuf
  text format with a ``model_config_list``: ``name``, ``base_path``, ``model_platform``,
  ``model_version_policy`` (latest / all / specific) and ``version_labels``. It replaces
  the ``[[models]]`` of the TOML file and ``models_dir``. Re-read on every reload (SIGHUP,
  ``POST /api/reload``) and, with ``model_config_file_poll_wait_seconds`` > 0, whenever it
  changes (``attach`` polls it): a new model loads, a removed one unloads (then NOT_FOUND),
  a moved label moves, with no failed request meanwhile. A malformed file is refused with
  its line and the running config keeps serving.
* ``[tfs] batching_parameters_file`` (``--batching_parameters_file``): TF Serving's
  ``BatchingParameters`` text (``max_batch_size { value: 128 }``, ``allowed_batch_sizes: 8``
  ...) into ``[batching]``.
* ``[tfs] monitoring_config_file`` (``--monitoring_config_file``): a ``MonitoringConfig``
  (``prometheus_config { enable: true, path: "..." }``, protobuf text format as TF Serving
  reads it: ``:`` before a message and ``,`` or ``;`` between fields are allowed); metrics are
  always served at ``/monitoring/prometheus/metrics``, so another path is refused with the
  reason.

The file poller that follows ``model_config_file`` while serving is a part:
appliance/parts/config_poller.py.

A file protobuf cannot parse is refused with TF Serving's words (util/proto_util.h
``ParseProtoTextFile`` and protobuf's text-format error log)::

    Error parsing text-format tensorflow.serving.ModelServerConfig: 1:12: Message type
    "tensorflow.serving.ModelServerConfig" has no field named "improperly". (Invalid protobuf
    file: 'bad_model_config.txt')

(line:column as protobuf's C++ parser gives them for an unknown field: the token after the
name; for other errors, the Python parser's.) Any other invalid value is a ConfigError
naming the file, the line and the field. ModelServerConfig comes from the private descriptor
pool of appliance/protos/tfserving; MonitoringConfig (two small messages) is declared here;
no TensorFlow needed.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from appliance.core.config import Config, ModelConfig
from appliance.core.errors import ConfigError, InvalidArgument

log = logging.getLogger("appliance.tfs")
METRICS_PATH = "/monitoring/prometheus/metrics"
# BatchingParameters fields (session_bundle_config.proto): wrapped values and repeated ints
_WRAPPED = {"max_batch_size": int, "batch_timeout_micros": int, "num_batch_threads": int,
            "max_enqueued_batches": int, "pad_variable_length_inputs": bool}
_IGNORED_BATCHING = {"thread_pool_name", "enable_large_batch_splitting", "max_execution_batch_size",
                     "mixed_priority_batching_policy", "low_priority_max_batch_size",
                     "low_priority_batch_timeout_micros", "low_priority_max_enqueued_batches",
                     "low_priority_allowed_batch_sizes", "batch_padding_policy"}


def apply(config: Config) -> Config:
    """Read the files ``config.tfs`` names into ``config`` (models, batching)."""
    files = config.tfs
    if files.model_config_file:
        config.models = read_model_config_file(files.model_config_file)
        config.models_dir = ""
    if files.batching_parameters_file:
        for key, value in read_batching_parameters(files.batching_parameters_file).items():
            setattr(config.batching, key, value)
        config.batching.enable_batching = True
    if files.monitoring_config_file:
        read_monitoring_config(files.monitoring_config_file)
    return config


def _read(path: str, key: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror}") from exc


def read_model_config_file(path: str) -> list[ModelConfig]:
    from appliance.protos.tfserving import pb

    message = _parse_text(path, "tfs.model_config_file", pb.ModelServerConfig())
    if message.WhichOneof("config") != "model_config_list":
        raise ConfigError("tfs.model_config_file", f"{path}: needs a model_config_list (custom_model_config is "
                                                   "TF Serving's extension point, not served here)")
    models = []
    for i, entry in enumerate(message.model_config_list.config):
        try:
            models.append(model_config_from_proto(entry))
        except InvalidArgument as exc:
            raise ConfigError("tfs.model_config_file", f"{path}: config {i + 1}: {exc.message}") from exc
    return models


def _parse_text(path: str, key: str, message: Any) -> Any:
    """``message`` from the text-format file at ``path``, or TF Serving's refusal of it."""
    from google.protobuf import text_format

    text = _read(path, key)
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        where = exc.GetLine(), exc.GetColumn()
        reason = str(exc).split(" : ", 1)[-1]
        if where[0] is not None and "has no field named" in reason:
            where = _token_after_name(text, *where)
        at = f"{where[0]}:{where[1]}: " if where[0] is not None else ""
        raise ConfigError(key, f"Error parsing text-format {message.DESCRIPTOR.full_name}: {at}{reason} "
                               f"(Invalid protobuf file: '{path}')") from exc
    return message


_NAME = re.compile(r"[A-Za-z0-9_]*")
_GAP = re.compile(r"(?:\s|#[^\n]*)*")


def _token_after_name(text: str, line: int, column: int) -> tuple[int, int]:
    """Where protobuf's C++ tokenizer stands after a field name (its error position) given
    where the name starts (the Python parser's): past the name, spaces and comments; columns
    count a tab to the next multiple of 8, as io::Tokenizer does."""
    lines = text.split("\n")
    offset = sum(len(lines[i]) + 1 for i in range(line - 1)) + column - 1
    offset = _GAP.match(text, _NAME.match(text, offset).end()).end()  # type: ignore[union-attr]  # both patterns match the empty string: never None
    start = text.rfind("\n", 0, offset) + 1
    col = 0
    for char in text[start:offset]:
        col += 8 - col % 8 if char == "\t" else 1
    return text.count("\n", 0, offset) + 1, col + 1


_FIELD = re.compile(r"^\s*(\w+)\s*(?::\s*(\S+?)\s*|\{\s*value\s*:\s*(\S+?)\s*\})\s*(?:#.*)?$")


def read_batching_parameters(path: str) -> dict[str, int | list[int]]:
    """TF Serving's BatchingParameters text format as ``[batching]`` values (a flag is a bool)."""
    values: dict[str, int | list[int]] = {}
    sizes: list[int] = []  # allowed_batch_sizes, one line each
    for number, line in enumerate(_read(path, "tfs.batching_parameters_file").splitlines(), 1):
        if not line.strip() or line.strip().startswith("#"):
            continue
        match = _FIELD.match(line)
        if match is None:
            raise ConfigError("tfs.batching_parameters_file", f"{path}: line {number}: cannot parse {line.strip()!r}")
        name, plain, wrapped = match.groups()
        where = f"{path}: line {number}: {name}"
        if name in _IGNORED_BATCHING:
            log.warning("%s is accepted and ignored: this batcher has no such setting", where)
            continue
        if name == "allowed_batch_sizes" and plain is not None:
            sizes.append(_number(plain, int, where))
            values[name] = sizes
        elif name in _WRAPPED and wrapped is not None:
            values[name] = _number(wrapped, _WRAPPED[name], where)
        else:
            raise ConfigError("tfs.batching_parameters_file", f"{where}: unknown field (or a wrapped value "
                                                              "written plain: max_batch_size { value: 32 })")
    return values


def _number(text: str, kind: type, where: str) -> int:  # a bool for kind bool
    if kind is bool:
        if text not in ("true", "false"):
            raise ConfigError("tfs.batching_parameters_file", f"{where}: must be true or false, not {text}")
        return text == "true"
    try:
        return int(text)
    except ValueError:
        raise ConfigError("tfs.batching_parameters_file", f"{where}: must be an integer, not {text}") from None


def read_monitoring_config(path: str) -> None:
    config = _parse_text(path, "tfs.monitoring_config_file", _monitoring_config_class()())
    wanted = config.prometheus_config.path
    if wanted not in ("", METRICS_PATH):
        raise ConfigError("tfs.monitoring_config_file", f"{path}: metrics are served at {METRICS_PATH}, not "
                                                        f"{wanted}")
    if not config.prometheus_config.enable:
        log.warning("%s: prometheus_config is not enabled; metrics are served at %s all the same", path, METRICS_PATH)


def _monitoring_config_class() -> Any:
    """TF Serving's MonitoringConfig (tensorflow_serving/config/monitoring_config.proto), declared on
    protobuf's descriptors in a pool of its own: its text format is protobuf's, field for field."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="tensorflow_serving/config/monitoring_config.proto",
                                              package="tensorflow.serving", syntax="proto3")
    prometheus = file.message_type.add(name="PrometheusConfig")
    prometheus.field.add(name="enable", number=1, type=f.TYPE_BOOL, label=f.LABEL_OPTIONAL)
    prometheus.field.add(name="path", number=2, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    file.message_type.add(name="MonitoringConfig").field.add(
        name="prometheus_config", number=1, type=f.TYPE_MESSAGE, label=f.LABEL_OPTIONAL,
        type_name=".tensorflow.serving.PrometheusConfig")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    descriptor = pool.FindMessageTypeByName("tensorflow.serving.MonitoringConfig")
    try:
        return message_factory.GetMessageClass(descriptor)
    except AttributeError:  # protobuf < 4.22
        return message_factory.MessageFactory(pool).GetPrototype(descriptor)


def model_config_from_proto(config: Any) -> ModelConfig:
    """A ``tensorflow.serving.ModelConfig`` as this service's ModelConfig (also used for
    ``--model_config_file``)."""
    if not config.name or not config.base_path:
        raise InvalidArgument("a ModelConfig needs name and base_path")
    if config.model_platform not in ("", "tensorflow", "tflite"):
        raise InvalidArgument(f"model {config.name}: model_platform {config.model_platform!r} is not served here "
                              "(tensorflow or tflite)")
    model = ModelConfig(name=config.name, base_path=config.base_path, labels=dict(config.version_labels))
    policy = config.model_version_policy.WhichOneof("policy_choice")
    if policy == "all":
        model.version_policy = "all"
    elif policy == "specific":
        model.version_policy = "specific"
        model.versions = sorted(int(v) for v in config.model_version_policy.specific.versions)
    elif policy == "latest":
        model.latest = int(config.model_version_policy.latest.num_versions) or 1
    return model
