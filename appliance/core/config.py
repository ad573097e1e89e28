"""Configuration: one TOML file, every key with a default, CLI flags on top.

Loading validates every value and does no I/O beyond reading the file: an unknown key
or a bad value raises ``ConfigError`` naming the dotted key and the reason, so the
service refuses to start instead of running on a typo. ``systemd/appliance.toml``
documents every key.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

# Re-exported: the API sections live in config_apis.py, and their users import them from here.
from appliance.core.config_apis import GenerationConfig as GenerationConfig
from appliance.core.config_apis import KServeConfig as KServeConfig
from appliance.core.config_apis import RolloutConfig as RolloutConfig
from appliance.core.config_apis import SharedMemoryConfig as SharedMemoryConfig
from appliance.core.errors import ConfigError

BACKEND_CHOICES = ("auto", "tf-gpu", "tf-cpu", "tflite", "litertlm")


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8501
    threads: int = 32  # HTTP worker threads: must cover the concurrent clients batching can merge
    # Front worker processes that parse HTTP and decode/encode JSON on every core while the
    # serving process batches (appliance/fronts/): 0 = one per CPU (and per 512 MiB of
    # memory at most); 1 (or a one-CPU device) = the single-process path, HTTP in the
    # serving process itself.
    workers: int = 0
    # A front worker that sends nothing (its loop's once-a-second figures) for this long is
    # killed and replaced (appliance/fronts/supervisor.py): well past the longest stall of a
    # healthy worker's loop, well within the 15 s a client should wait for a new connection.
    worker_timeout_s: float = 10.0
    max_body_bytes: int = 64 * 1024 * 1024
    drain_timeout_s: float = 20.0
    # Also serve REST on this Unix domain socket (HTTP over AF_UNIX, as the Docker API does):
    # local apps skip TCP, and the file's mode and group decide who may call. Empty: none.
    socket_path: str = ""
    socket_mode: str = "0660"  # octal, as chmod takes it
    socket_group: str = ""  # a group name; empty: the service's own

    def validate(self, key: str) -> None:
        if self.socket_path:
            if not os.path.isabs(self.socket_path) or len(os.fsencode(self.socket_path)) > 107:
                raise ConfigError(f"{key}.socket_path", "must be an absolute path of at most 107 bytes (sun_path)")
        try:
            mode = int(self.socket_mode, 8)
        except ValueError:
            mode = -1
        if not 0 <= mode <= 0o777:
            raise ConfigError(f"{key}.socket_mode", f"{self.socket_mode!r} is not a file mode (octal, as \"0660\")")


@dataclass
class BatchingConfig:
    """TF Serving's batching parameters, same names and units."""

    enable_batching: bool = True
    max_batch_size: int = 32
    batch_timeout_micros: int = 1000
    num_batch_threads: int = 0  # 0: the device's CPU count
    max_enqueued_batches: int = 64
    allowed_batch_sizes: list[int] = field(default_factory=list)
    pad_variable_length_inputs: bool = False
    split_large_requests: bool = True

    def validate(self, key: str) -> None:
        for name in ("max_batch_size", "max_enqueued_batches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{key}.{name}", "must be at least 1")
        for name in ("batch_timeout_micros", "num_batch_threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{key}.{name}", "must not be negative")
        sizes = self.allowed_batch_sizes
        if sizes:
            if sizes != sorted(set(sizes)) or sizes[0] < 1:
                raise ConfigError(f"{key}.allowed_batch_sizes", "must be strictly increasing positive integers")
            if sizes[-1] != self.max_batch_size:
                raise ConfigError(f"{key}.allowed_batch_sizes",
                                  f"the last entry ({sizes[-1]}) must equal max_batch_size ({self.max_batch_size})")


@dataclass
class TFLiteConfig:
    num_threads: int = 0  # 0: the device's CPU count
    delegate: str = "auto"  # auto | gpu | edgetpu | none
    gpu_delegate_path: str = ""
    edgetpu_delegate_path: str = ""


@dataclass
class TFConfig:
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    tftrt: bool = True
    precision: str = "FP16"


@dataclass
class LiteRTLMConfig:
    """``[runtime.litertlm]``: LiteRT-LM bundles (runtimes/litertlm.py)."""

    engines: int = 1  # engines per bundle version, lent one per stream: streams of one bundle at once

    def validate(self, key: str) -> None:
        if self.engines < 1:
            raise ConfigError(f"{key}.engines", "must be at least 1")


@dataclass
class RuntimeConfig:
    backend: str = "auto"
    prefer_tflite_below_mb: int = 0
    # A new version is first loaded, measured and warmed up in a child process (its trial,
    # appliance/core/loader_child.py): these bound it. 0 MB: 80 % of the memory available then.
    load_memory_mb: int = 0
    load_timeout_s: float = 600.0  # the most any trial may take
    # A trial's own deadline grows with its version's size: load_timeout_base_s plus this many
    # seconds per MB of its files (at most load_timeout_s), so that a small version whose load
    # hangs holds the next one up for a minute, not ten. 0: every trial gets load_timeout_s.
    load_timeout_s_per_mb: float = 2.0
    load_timeout_base_s: float = 60.0
    # A version whose artifacts do not all load (a corrupt saved_model.pb beside a good
    # model.tflite) fails; true: it serves from what loaded, shown as degraded.
    allow_partial_versions: bool = False
    tflite: TFLiteConfig = field(default_factory=TFLiteConfig)
    tf: TFConfig = field(default_factory=TFConfig)
    litertlm: LiteRTLMConfig = field(default_factory=LiteRTLMConfig)


@dataclass
class SyncConfig:
    """Fleet sync from a central bucket (issue: fleet sync). Empty bucket: no sync."""

    bucket: str = ""  # file:///path | s3://bucket/prefix | https://host/prefix
    channel: str = ""  # empty: the newest committed version
    models: list[str] = field(default_factory=list)  # models to follow; empty: every model in the bucket
    poll_interval_s: float = 30.0
    jitter: float = 0.2  # +-20 % on each interval so a fleet does not poll in lockstep
    max_backoff_s: float = 600.0  # the longest Retry-After honoured from a bucket saying "slow down" (429, 503 SlowDown)
    models_refresh_s: float = 300.0  # with models empty: how often the bucket's list of models is read again
    public_key: str = ""  # Ed25519 public key file; when set, unsigned or mis-signed versions are refused
    retain: int = 2  # good versions kept on disk per model
    report_interval_s: float = 300.0
    s3_endpoint_url: str = ""  # else AWS_ENDPOINT_URL / the AWS config
    s3_region: str = ""
    max_manifest_bytes: int = 4 << 20  # cap on a manifest, channel pointer or index read (endless data)
    stall_timeout_s: float = 30.0  # a transfer moving < 1 KiB/s (or nothing) this long is abandoned

    def validate(self, key: str) -> None:
        if self.max_manifest_bytes < 4096:
            raise ConfigError(f"{key}.max_manifest_bytes", "must be at least 4096")
        if not self.stall_timeout_s > 0:
            raise ConfigError(f"{key}.stall_timeout_s", "must be positive")
        if not self.report_interval_s > 0:
            raise ConfigError(f"{key}.report_interval_s", "must be positive (the fleet view calls a device "
                              "stale after three of them without a report)")


@dataclass
class DiscoveryConfig:
    enabled: bool = True
    name: str = ""  # instance name; empty: the hostname
    interfaces: list[str] = field(default_factory=list)  # empty: all
    recheck_interval_s: float = 30.0


# Sections for the API, security and rollout parts. Each part owns its dataclass: add
# fields there (with defaults that protect a small device) and check them in ``validate``.
@dataclass
class GRPCConfig:
    """TF Serving's gRPC API (and the KServe v2 gRPC service) on one port."""

    port: int = 8500  # TF Serving's; 0: no gRPC
    socket_path: str = ""  # as --grpc_socket_path: also listen on this Unix domain socket
    max_message_bytes: int = 64 * 1024 * 1024  # TF Serving users hit gRPC's 4 MB default
    # "lean": appliance/transport/grpc/h2_server.py, unary calls over libnghttp2 (through cffi, a
    # fraction of grpcio's CPU per call; bench/RESULTS.md); "grpcio": grpcio's grpc.aio server, the
    # fallback (and what "lean" becomes where libnghttp2 is missing)
    transport: str = "lean"
    # A port that cannot be bound: false (TF Serving's behaviour) fails start-up with the
    # address and the reason; true retries with backoff (0.5 s doubling to 30 s) while the
    # device reports not ready and the page shows gRPC as down.
    bind_retry: bool = False
    # TLS on the TCP port (appliance/core/grpc_tls.py), one of: true, with [security]'s
    # certificate, key and client CA; or TF Serving's --ssl_config_file (an SSLConfig text proto).
    tls: bool = False
    ssl_config_file: str = ""
    # Bounds against hostile or broken clients (appliance/transport/grpc/limits.py). Names after
    # gRPC's own server arguments where it has one (grpc.max_concurrent_streams, ...).
    max_concurrent_streams: int = 100  # calls in flight on one connection (SETTINGS_MAX_CONCURRENT_STREAMS)
    max_metadata_size: int = 16 * 1024  # a request's headers (SETTINGS_MAX_HEADER_LIST_SIZE), as grpc's
    # Connections open at once (fewer when the descriptor limit is lower: REST's connections and
    # the files come first); at the cap the one idle longest makes room for a new one.
    max_connections: int = 1024
    handshake_timeout_s: float = 10.0  # preface + SETTINGS after the accept (grpc.server_handshake_timeout_ms)
    stall_timeout_s: float = 30.0  # a request or answer that moves no byte this long is reset and freed
    # An answer the client gives no flow-control credit for (its window at 0: a zero-window
    # stall) this long is reset and counted against its address as an abandoned call (the
    # lean server only; past stall_timeout_s it is reset as stalled, uncounted).
    send_stall_timeout_s: float = 5.0
    # Bytes held for calls (request messages in methods, answers the client has not taken), per
    # connection and all together; a call past either gets RESOURCE_EXHAUSTED.
    max_connection_buffer_bytes: int = 96 * 1024 * 1024  # at least max_message_bytes + 5
    max_buffer_bytes: int = 512 * 1024 * 1024
    # Streams open on all connections together (each holds a request or an answer): what clients
    # that never read their answers (zero windows) can make the device keep, however many
    # connections they open. Past it new streams are refused (REFUSED_STREAM; clients retry).
    max_open_streams: int = 4096

    def validate(self, key: str) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"{key}.port", f"{self.port} is not a TCP port (0 turns gRPC off)")
        if self.transport not in ("lean", "grpcio"):
            raise ConfigError(f"{key}.transport", f"{self.transport!r} is not a gRPC server (lean or grpcio)")
        if self.tls and self.ssl_config_file:
            raise ConfigError(f"{key}.tls", "set either tls (the [security] certificate) or ssl_config_file "
                              "(TF Serving's SSLConfig), not both")
        if self.max_message_bytes < 1024:
            raise ConfigError(f"{key}.max_message_bytes", "must be at least 1024")
        self._validate_bounds(key)

    def _validate_bounds(self, key: str) -> None:
        if not 1 <= self.max_concurrent_streams <= 65536:
            raise ConfigError(f"{key}.max_concurrent_streams", "must be between 1 and 65536")
        if not 1024 <= self.max_metadata_size <= 1024 * 1024:
            raise ConfigError(f"{key}.max_metadata_size", "must be between 1024 and 1048576")
        if not 1 <= self.max_connections <= 1_000_000:
            raise ConfigError(f"{key}.max_connections", "must be between 1 and 1000000")
        if not self.max_concurrent_streams <= self.max_open_streams <= 10_000_000:
            raise ConfigError(f"{key}.max_open_streams", "must be at least max_concurrent_streams (one full "
                              "connection) and at most 10000000")
        for name in ("handshake_timeout_s", "stall_timeout_s", "send_stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{key}.{name}", "must be positive")
        if self.max_connection_buffer_bytes < self.max_message_bytes + 5:
            raise ConfigError(f"{key}.max_connection_buffer_bytes", f"must be at least max_message_bytes + 5 "
                              f"({self.max_message_bytes + 5}): a largest answer must fit")
        if self.max_buffer_bytes < self.max_connection_buffer_bytes:
            raise ConfigError(f"{key}.max_buffer_bytes", "must be at least max_connection_buffer_bytes")


@dataclass
class TFServingFilesConfig:
    """tensorflow_model_server's own config files, read as it reads them."""

    model_config_file: str = ""
    model_config_file_poll_wait_seconds: float = 0.0  # 0: read once (and on reload)
    batching_parameters_file: str = ""
    monitoring_config_file: str = ""
    # tensorflow_model_server's start-up order (appliance/service/models_wait.py): the ports open
    # once every configured model is AVAILABLE; `appliance tfs` sets it, `serve` leaves it off.
    wait_for_models: bool = False
    wait_for_models_timeout_s: float = 600.0  # then start-up fails, naming the models

    def validate(self, key: str) -> None:
        if self.model_config_file_poll_wait_seconds < 0:
            raise ConfigError(f"{key}.model_config_file_poll_wait_seconds", "must not be negative")
        if self.wait_for_models_timeout_s <= 0:
            raise ConfigError(f"{key}.wait_for_models_timeout_s", "must be more than 0 (seconds)")


@dataclass
class SecurityConfig:
    """Bearer tokens per scope (admin, inference, read) and TLS for the REST port.

    A ``*_token_file`` is an absolute path, or a bare name looked up in systemd's
    ``$CREDENTIALS_DIRECTORY`` (``LoadCredential=``). With neither token nor file, the
    credential ``admin-token`` / ``inference-token`` / ``read-token`` is used when the unit
    provides it. No admin token at all: admin endpoints are off (403). No inference or
    read token: that scope is open. Files are read at start-up and on reload, not here.
    """

    admin_token: str = ""
    admin_token_file: str = ""
    inference_token: str = ""
    inference_token_file: str = ""
    read_token: str = ""
    read_token_file: str = ""
    tls_cert_file: str = ""  # PEM certificate chain; with tls_key_file, the REST port speaks HTTPS only
    tls_key_file: str = ""  # PEM private key (unencrypted)
    tls_client_ca_file: str = ""  # PEM CA bundle: when set, clients must present a certificate it signed
    tls_min_version: str = "TLSv1.2"  # TLSv1.2 | TLSv1.3

    def validate(self, key: str) -> None:
        for scope in ("admin", "inference", "read"):
            token = getattr(self, f"{scope}_token")
            if token and getattr(self, f"{scope}_token_file"):
                raise ConfigError(f"{key}.{scope}_token", f"set either {scope}_token or {scope}_token_file, not both")
            if token and (len(token) < 16 or token != token.strip()):
                raise ConfigError(f"{key}.{scope}_token", "must be at least 16 characters with no surrounding spaces "
                                  "(generate one: openssl rand -hex 32)")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError(f"{key}.tls_key_file" if self.tls_cert_file else f"{key}.tls_cert_file",
                              "TLS needs both tls_cert_file and tls_key_file")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError(f"{key}.tls_client_ca_file", "client certificates need TLS on (tls_cert_file, tls_key_file)")
        if self.tls_min_version not in ("TLSv1.2", "TLSv1.3"):
            raise ConfigError(f"{key}.tls_min_version", "must be TLSv1.2 or TLSv1.3")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)


@dataclass
class LimitsConfig:
    """Request limits that protect a small device from one hostile or careless client."""

    # Connections (appliance/transport/http/server.py). A connection that sends nothing is closed after
    # idle_timeout_s; once a request's first byte arrives its headers must be complete within
    # header_timeout_s and the whole request (headers and body) within request_timeout_s,
    # however slowly the bytes trickle in (a timer reset by every byte stops no slowloris).
    # At most this many open HTTP connections (fewer if the descriptor limit is lower); at the cap
    # the one idle longest is closed for a new one, and with none idle new ones wait in the kernel.
    max_connections: int = 16384
    max_header_bytes: int = 64 * 1024  # a request's line and headers (431 past it)
    # Request bodies held in memory, every connection together (one is at most
    # server.max_body_bytes): a body that would pass it gets 503 + Retry-After before it is read.
    max_buffered_bytes: int = 512 * 1024 * 1024
    idle_timeout_s: float = 30.0  # a keep-alive (or fresh) connection with no request in progress
    header_timeout_s: float = 10.0
    request_timeout_s: float = 60.0
    # Overload: a complete request that waited longer than this for a worker thread gets 503
    # + Retry-After at once instead of running late; accepted requests keep a bounded latency.
    max_queue_wait_s: float = 2.0  # 0: never shed
    # JSON request bodies (appliance/api/tfserving/json_format.py), checked before and right after parsing: a
    # hostile body gets a 400 naming the limit, never a deep recursion or an allocation past its size.
    max_json_depth: int = 100  # nesting of [ and { (TF Serving's and Triton's tests use 100)
    max_tensor_elements: int = 4 * 1024 * 1024  # values in a request's tensors, all inputs together
    max_instances: int = 4096  # rows of "instances" (and "examples") in one request

    def validate(self, key: str) -> None:
        self._validate_connections(key)
        self._validate_json(key)

    def _validate_json(self, key: str) -> None:
        if not 2 <= self.max_json_depth <= 1000:  # the JSON parser itself stops at 1024
            raise ConfigError(f"{key}.max_json_depth", "must be between 2 and 1000")
        for name in ("max_tensor_elements", "max_instances"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{key}.{name}", "must be at least 1")

    def _validate_connections(self, key: str) -> None:
        if not 1 <= self.max_connections <= 1_000_000:
            raise ConfigError(f"{key}.max_connections", "must be between 1 and 1000000")
        if not 1024 <= self.max_header_bytes <= 16 * 1024 * 1024:
            raise ConfigError(f"{key}.max_header_bytes", "must be between 1024 and 16777216")
        if self.max_buffered_bytes < 1024 * 1024:
            raise ConfigError(f"{key}.max_buffered_bytes", "must be at least 1048576")
        for name in ("idle_timeout_s", "header_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{key}.{name}", "must be positive")
        if self.request_timeout_s < self.header_timeout_s:
            raise ConfigError(f"{key}.request_timeout_s", "must be at least header_timeout_s")
        if self.max_queue_wait_s < 0:
            raise ConfigError(f"{key}.max_queue_wait_s", "must not be negative (0: never shed)")


@dataclass
class ModelConfig:
    """One served model. ``version_policy``: latest | all | specific (with ``versions``)."""

    name: str = ""
    base_path: str = ""
    version_policy: str = "latest"
    latest: int = 1
    versions: list[int] = field(default_factory=list)
    labels: dict[str, int] = field(default_factory=dict)
    backend: str = ""  # empty: runtime.backend
    batching: dict[str, Any] = field(default_factory=dict)  # overrides of [batching]
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    allow_partial_versions: bool = False  # as [runtime]'s, for this model (either one allows)
    # Versions that may serve less than the one before (a signature, input or output dropped or
    # changed): the operator's way to declare an intended API change (a publisher's: api_change
    # in the version's MANIFEST.json, `appliance publish --api-change WHY`).
    accept_api_change: list[int] = field(default_factory=list)


@dataclass
class Config:
    state_dir: str = ""
    models_dir: str = ""  # a TF Serving model base directory (DIR/<model>/<version>)
    model_name: str = "default"  # for a single-model base path DIR/<version>
    poll_interval_s: float = 2.0
    log_level: str = "info"
    server: ServerConfig = field(default_factory=ServerConfig)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    grpc: GRPCConfig = field(default_factory=GRPCConfig)
    tfs: TFServingFilesConfig = field(default_factory=TFServingFilesConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    shared_memory: SharedMemoryConfig = field(default_factory=SharedMemoryConfig)
    kserve: KServeConfig = field(default_factory=KServeConfig)
    models: list[ModelConfig] = field(default_factory=list)

    def batching_for(self, model: ModelConfig) -> BatchingConfig:
        merged = dataclasses.replace(self.batching)
        for key, value in model.batching.items():
            set_field(merged, key, value, f"models.{model.name}.batching")
        merged.validate(f"models.{model.name}.batching")
        return merged


def default_state_dir() -> str:
    """systemd's StateDirectory when set, else ~/.local/state/edge-appliance."""
    if os.environ.get("STATE_DIRECTORY"):
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "edge-appliance")


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a table, got {type(value).__name__}")
        assert isinstance(hint, type)  # a section's annotation names its class
        return build(hint, value, key)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"must be a list, got {type(value).__name__}")
        (item,) = get_args(hint)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a table, got {type(value).__name__}")
        _, item = get_args(hint)
        return {k: _coerce(v, item, f"{key}.{k}") for k, v in value.items()}
    if hint is Any:
        return value
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise ConfigError(key, f"must be {hint.__name__}, got {value!r}")
    return value


_Section = TypeVar("_Section")  # a config dataclass: build() returns the class it is given


def set_field(obj: Any, name: str, value: Any, prefix: str) -> None:
    """``obj.name = value``, checked against the field's type; ConfigError naming ``prefix.name``."""
    hints = get_type_hints(type(obj))
    key = f"{prefix}.{name}" if prefix else name
    if name not in hints:
        raise ConfigError(key, "unknown key")
    setattr(obj, name, _coerce(value, hints[name], key))


def build(cls: type[_Section], data: dict[str, Any], prefix: str) -> _Section:
    """A ``cls`` (a config section) from a TOML table, every key checked (``set_field``)."""
    obj = cls()
    for name, value in data.items():
        set_field(obj, name, value, prefix)
    return obj


def from_dict(data: dict[str, Any]) -> Config:
    """A ``Config`` from ``dataclasses.asdict`` of one (how a config crosses to a front worker)."""
    return build(Config, data, "")


def validate(config: Config) -> Config:
    if not 0 < config.server.port < 65536:
        raise ConfigError("server.port", f"{config.server.port} is not a TCP port")
    if config.grpc.port == config.server.port:  # TF Serving refuses it too (server.cc)
        # Both listen with SO_REUSEPORT for the front workers, so the kernel would hand REST
        # clients to the gRPC server and the other way round, a connection at a time.
        raise ConfigError("grpc.port", f"{config.grpc.port} is the REST port (server.port) too: give gRPC another "
                          "port (--grpc-port), or 0 to turn it off")
    grpc_socket, rest_socket = config.grpc.socket_path, config.server.socket_path
    if grpc_socket and rest_socket and os.path.normpath(grpc_socket) == os.path.normpath(rest_socket):
        # Each removes a stale socket file before it listens: the second would unlink the first's.
        raise ConfigError("grpc.socket_path", f"{config.grpc.socket_path} is the REST socket (server.socket_path) "
                          "too: give each its own path")
    if config.server.workers < 0:
        raise ConfigError("server.workers", "must be 0 (one per CPU) or a number of processes")
    if not 2.0 <= config.server.worker_timeout_s <= 3600:  # a worker's heartbeat comes every second
        raise ConfigError("server.worker_timeout_s", "must be between 2 and 3600 seconds (a worker speaks every second)")
    if config.runtime.backend not in BACKEND_CHOICES:
        raise ConfigError("runtime.backend", f"must be one of {', '.join(BACKEND_CHOICES)}")
    if config.poll_interval_s < 0:
        raise ConfigError("poll_interval_s", "must not be negative")
    if config.runtime.tflite.delegate not in ("auto", "gpu", "edgetpu", "none"):
        raise ConfigError("runtime.tflite.delegate", "must be auto, gpu, edgetpu or none")
    if config.runtime.tf.precision.upper() not in ("FP32", "FP16"):
        raise ConfigError("runtime.tf.precision", "must be FP32 or FP16")
    if config.runtime.load_memory_mb < 0:
        raise ConfigError("runtime.load_memory_mb", "must be 0 (80 % of the memory available) or a number of MB")
    if config.runtime.load_timeout_s <= 0:
        raise ConfigError("runtime.load_timeout_s", "must be positive")
    if config.runtime.load_timeout_s_per_mb < 0:
        raise ConfigError("runtime.load_timeout_s_per_mb", "must not be negative (0: every trial gets load_timeout_s)")
    if config.runtime.load_timeout_base_s <= 0:
        raise ConfigError("runtime.load_timeout_base_s", "must be positive")
    config.batching.validate("batching")
    config.runtime.litertlm.validate("runtime.litertlm")
    if config.discovery.recheck_interval_s <= 0:
        raise ConfigError("discovery.recheck_interval_s", "must be positive")
    if len(config.discovery.name.encode()) > 63:
        raise ConfigError("discovery.name", "must be at most 63 bytes (a DNS label)")
    for section in ("server", "sync", "grpc", "tfs", "security", "limits", "generation", "shared_memory", "kserve"):
        getattr(config, section).validate(section)
    names = set()
    for i, model in enumerate(config.models):
        key = f"models[{i}]"
        if not model.name:
            raise ConfigError(f"{key}.name", "is required")
        if model.name in names:
            raise ConfigError(f"{key}.name", f"model {model.name!r} is configured twice")
        names.add(model.name)
        if model.version_policy not in ("latest", "all", "specific"):
            raise ConfigError(f"{key}.version_policy", "must be latest, all or specific")
        if model.version_policy == "specific" and not model.versions:
            raise ConfigError(f"{key}.versions", "version_policy specific needs a list of versions")
        if model.backend and model.backend not in BACKEND_CHOICES:
            raise ConfigError(f"{key}.backend", f"must be one of {', '.join(BACKEND_CHOICES)}")
        config.batching_for(model)
        model.rollout.validate(f"{key}.rollout")
    if not config.state_dir:
        config.state_dir = default_state_dir()
    return config
