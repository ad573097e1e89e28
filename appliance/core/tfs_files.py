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
* ``[tfs] monitoring_config_file`` (``--monitoring_config_file``): ``prometheus_config {
  enable: true path: "..." }``; metrics are always served at
  ``/monitoring/prometheus/metrics``, so another path is refused with the reason.

The file poller that follows ``model_config_file`` while serving is a part:
appliance/parts/config_poller.py.

An unknown or invalid field is a ConfigError naming the file, the line and the field.
The messages are parsed with the private descriptor pool of appliance/protos/tfserving (no
TensorFlow needed).
"""

from __future__ import annotations

import logging
import os
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


def read_model_config_file(path: str) -> list[Any]:
    from google.protobuf import text_format

    from appliance.protos.tfserving import pb

    text = _read(path, "tfs.model_config_file")
    message = pb.ModelServerConfig()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        raise ConfigError("tfs.model_config_file", f"{path}: line {_where(exc)}") from exc
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


def _where(exc: Any) -> str:
    """'3: Message type ... has no field named "foo".' from protobuf's '3:5 : ...'."""
    line = getattr(exc, "GetLine", lambda: None)()
    text = str(exc)
    message = text.split(" : ", 1)[1] if " : " in text else text
    return f"{line}: {message}" if line else message


_FIELD = re.compile(r"^\s*(\w+)\s*(?::\s*(\S+?)\s*|\{\s*value\s*:\s*(\S+?)\s*\})\s*(?:#.*)?$")


def read_batching_parameters(path: str) -> dict[str, Any]:
    """TF Serving's BatchingParameters text format as ``[batching]`` values."""
    values: dict[str, Any] = {}
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
            values.setdefault(name, []).append(_number(plain, int, where))
        elif name in _WRAPPED and wrapped is not None:
            values[name] = _number(wrapped, _WRAPPED[name], where)
        else:
            raise ConfigError("tfs.batching_parameters_file", f"{where}: unknown field (or a wrapped value "
                                                              "written plain: max_batch_size { value: 32 })")
    return values


def _number(text: str, kind: type, where: str) -> Any:
    if kind is bool:
        if text not in ("true", "false"):
            raise ConfigError("tfs.batching_parameters_file", f"{where}: must be true or false, not {text}")
        return text == "true"
    try:
        return int(text)
    except ValueError:
        raise ConfigError("tfs.batching_parameters_file", f"{where}: must be an integer, not {text}") from None


def read_monitoring_config(path: str) -> None:
    text = _read(path, "tfs.monitoring_config_file")
    match = re.search(r'path\s*:\s*"([^"]*)"', text)
    unknown = re.sub(r'prometheus_config|enable\s*:\s*(true|false)|path\s*:\s*"[^"]*"|[{}\s,]|#[^\n]*', "", text)
    if unknown:
        raise ConfigError("tfs.monitoring_config_file", f"{path}: cannot parse {unknown[:60]!r} (expected "
                                                        'prometheus_config { enable: true path: "..." })')
    if match and match.group(1) not in ("", METRICS_PATH):
        raise ConfigError("tfs.monitoring_config_file", f"{path}: metrics are served at {METRICS_PATH}, not "
                                                        f"{match.group(1)}")


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
