"""``appliance tfs [tensorflow_model_server flags]``: a TF Serving start-up line, unchanged.

    appliance tfs --port=8500 --rest_api_port=8501 --model_name=m --model_base_path=/models/m \\
                  --enable_batching --batching_parameters_file=/etc/batching.txt

Each flag keeps its name and meaning and becomes a config override (the table in
docs/migrating-from-tfserving.md). Both ``--flag=value`` and ``--flag value`` work, and
booleans as TF Serving's ``--enable_batching``, ``--enable_batching=true|false``. Flags that
make no sense here are accepted with a warning that says why they are ignored, never
silently. Our own ``--config``, ``--state``, ``--host`` and ``--no-discovery`` may be added.

Start-up order as tensorflow_model_server's: the ports open once every configured model is
AVAILABLE (appliance/service/models_wait.py; at most ``[tfs] wait_for_models_timeout_s``, then
start-up fails as TF Serving's does when a model cannot load). Our own ``--no-wait-for-models``
opens them at once instead, as ``appliance serve`` does (``/readyz`` says when the models serve).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from appliance.commands.common import Subcommands

# flag -> (config key, type); applied as overrides of the config file and the defaults
MAPPED: dict[str, tuple[str, Any]] = {
    "port": ("grpc.port", int),
    "grpc_socket_path": ("grpc.socket_path", str),
    "ssl_config_file": ("grpc.ssl_config_file", str),
    "grpc_max_message_size": ("grpc.max_message_bytes", int),
    "rest_api_port": ("server.port", int),
    "rest_api_num_threads": ("server.threads", int),
    "model_name": ("model_name", str),
    "model_base_path": ("models_dir", str),
    "model_config_file": ("tfs.model_config_file", str),
    "model_config_file_poll_wait_seconds": ("tfs.model_config_file_poll_wait_seconds", float),
    "batching_parameters_file": ("tfs.batching_parameters_file", str),
    "monitoring_config_file": ("tfs.monitoring_config_file", str),
    "file_system_poll_wait_seconds": ("poll_interval_s", float),
    "tensorflow_intra_op_parallelism": ("runtime.tf.intra_op_threads", int),
    "tensorflow_inter_op_parallelism": ("runtime.tf.inter_op_threads", int),
    "enable_batching": ("batching.enable_batching", bool),
}
# flags taken with a conversion of their own (see _special)
SPECIAL = ("rest_api_timeout_in_ms", "prefer_tflite_model", "enable_model_warmup")
# flags accepted and ignored, with the reason the warning gives
IGNORED: dict[str, str] = {
    "tensorflow_session_parallelism": "TensorFlow's session threads are runtime.tf.intra_op_threads / "
                                      "inter_op_threads here",
    "platform_config_file": "backends are chosen per device and version (runtime.backend, appliance probe)",
    "per_process_gpu_memory_fraction": "the TF-TRT backend lets TensorFlow grow GPU memory as needed",
    "saved_model_tags": "SavedModels are loaded with the 'serve' tag, as TF Serving's default",
    "max_num_load_retries": "a version that fails to load is quarantined until its files change",
    "load_retry_interval_micros": "a version that fails to load is quarantined until its files change",
    "grpc_channel_arguments": "the gRPC server takes [grpc] max_message_bytes; other arguments are not exposed",
    "enable_signature_method_name_check": "signatures are served by their method names as TF Serving 2.x does",
    "xla_cpu_compilation_enabled": "XLA is not used on these devices",
    "rest_api_enable_cors_support": "CORS headers are not sent; put a proxy in front for browser clients",
    "allow_version_labels_for_unavailable_models": "labels may name any configured version here",
    "enable_model_warmup_ops": "warm-up always uses assets.extra/tf_serving_warmup_requests when present",
    "num_load_threads": "versions load one at a time per model, the old one serving meanwhile",
    "num_unload_threads": "versions unload after their requests drain",
    "flush_filesystem_caches": "not needed: versions are read once at load",
    "remove_unused_fields_from_bundle_metagraph": "not needed here",
    "use_tflite_model": "the backend is chosen per device (runtime.backend); see --prefer_tflite_model",
    "enable_profiler": "no TensorFlow profiler endpoint here",
    "tensorflow_gpu_memory_fraction": "the TF-TRT backend lets TensorFlow grow GPU memory as needed",
    "grpc_max_threads": "gRPC handler threads follow server.threads",
    "rest_api_host": "the REST host is --host (server.host)",
}
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")


def add_commands(subparsers: Subcommands) -> None:
    # "+" as the prefix: every --flag, known here or not, reaches parse() untouched (+h: help).
    p = subparsers.add_parser("tfs", help="serve with tensorflow_model_server's flags (a drop-in start-up line)",
                              description=__doc__.split("\n\n")[0], prefix_chars="+")
    p.add_argument("flags", nargs="*", help="tensorflow_model_server flags")
    p.set_defaults(func=cmd_tfs)


def cmd_tfs(args: argparse.Namespace) -> int:
    from appliance.commands.serve import embedded_default
    from appliance.core.config_file import load as load_config
    from appliance.core.errors import ConfigError
    from appliance.fronts.zygote import start_early

    try:
        overrides, ours, warnings = parse(args.flags)
    except ValueError as exc:
        print(f"appliance tfs: {exc}", file=sys.stderr)
        return 2
    if ours.pop("version", False):
        from appliance.version import __version__

        print(f"edge-appliance {__version__} (tensorflow_model_server flags)")
        return 0
    for warning in warnings:
        print(f"appliance tfs: warning: {warning}", file=sys.stderr, flush=True)
    overrides.update({"state_dir": ours.get("state"), "server.host": ours.get("host"),
                      "discovery.enabled": False if ours.get("no_discovery") else None,
                      "tfs.wait_for_models": not ours.get("no_wait_for_models")})
    try:
        config = load_config(ours.get("config"), overrides)
    except ConfigError as exc:
        print(f"appliance tfs: {exc}", file=sys.stderr)
        return 2
    embedded_default(config)
    start_early(config)  # the front workers' zygote: forked before a thread or the service exists
    from appliance.service import main

    return main(config, ours.get("config"), overrides)


def parse(argv: list[str]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(config overrides, our own options, warnings) from a tensorflow_model_server line."""
    overrides: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    warnings: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("-"):
            raise ValueError(f"unexpected argument {arg!r} (flags look like --name=value)")
        name, eq, value = arg.lstrip("-").partition("=")
        if name in ("config", "state", "host"):
            if not eq:
                if i >= len(argv):
                    raise ValueError(f"--{name} needs a value")
                value, i = argv[i], i + 1
            ours[name] = value
            continue
        if name in ("no-discovery", "no_discovery", "no-wait-for-models", "no_wait_for_models", "version"):
            ours[name.replace("-", "_")] = True
            continue
        boolean = name in ("enable_batching", "prefer_tflite_model", "enable_model_warmup") or \
            name in IGNORED and not eq and (i >= len(argv) or argv[i].startswith("-"))
        if not eq and not boolean:
            if i >= len(argv):
                raise ValueError(f"--{name} needs a value")
            value, i = argv[i], i + 1
        elif not eq:
            value = "true"
        if name in IGNORED:
            warnings.append(f"--{name} is accepted and ignored: {IGNORED[name]}")
        elif name in MAPPED:
            key, kind = MAPPED[name]
            overrides[key] = _convert(name, value, kind)
        elif name in SPECIAL:
            _special(name, value, overrides, warnings)
        else:
            raise ValueError(f"unknown flag --{name} (tensorflow_model_server has no such flag, or it is not "
                             "known here: see docs/migrating-from-tfserving.md)")
    if overrides.get("server.port") == 0:
        warnings.append("--rest_api_port=0 would turn REST off; it stays on 8501 here (the status page and "
                        "health checks use it)")
        overrides["server.port"] = 8501
    if "model_name" in overrides and "models_dir" not in overrides:
        raise ValueError("--model_name needs --model_base_path")
    return overrides, ours, warnings


def _convert(name: str, value: str, kind: Any) -> Any:
    if kind is bool:
        if value.lower() in TRUE:
            return True
        if value.lower() in FALSE:
            return False
        raise ValueError(f"--{name} must be true or false, not {value!r}")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"--{name} must be {'an integer' if kind is int else 'a number'}, not {value!r}") from None


def _special(name: str, value: str, overrides: dict[str, Any], warnings: list[str]) -> None:
    if name == "rest_api_timeout_in_ms":
        ms = _convert(name, value, int)
        if ms > 0:  # TF Serving's per-request deadline; here the whole-request deadline of [limits]
            overrides["limits.request_timeout_s"] = max(ms / 1000.0, 1.0)
            overrides["limits.header_timeout_s"] = min(10.0, max(ms / 1000.0, 1.0))
    elif name == "prefer_tflite_model":
        if _convert(name, value, bool):
            overrides["runtime.prefer_tflite_below_mb"] = 1 << 30  # any device: LiteRT when a version has it
    elif name == "enable_model_warmup" and not _convert(name, value, bool):
        warnings.append("--enable_model_warmup=false is ignored: a version is always warmed up before it "
                        "serves (with assets.extra/tf_serving_warmup_requests when present), so the first "
                        "request never pays for it")
