"""The configuration's sections for what the APIs offer beyond a model's answer: shared memory,
KServe v2's model control, generation (streams and their queue) and rollouts. Part of
appliance/core/config.py (which re-exports them and documents loading), kept apart so that
neither file outgrows a reader's screenful of sections.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from appliance.core.errors import ConfigError


@dataclass
class SharedMemoryConfig:
    """Triton's system shared-memory extension (appliance/core/shared_memory.py): apps on the
    device register regions of POSIX shared memory and name them instead of sending tensors."""

    enabled: bool = True
    max_regions: int = 64  # regions registered at once
    max_bytes: int = 2 << 30  # their byte_size together
    # Who may use them: callers on this host only (a loopback peer or the Unix socket; a remote
    # peer cannot share this host's memory anyway), unless true (a container reaching the host's
    # /dev/shm through a bridge address, say).
    allow_remote: bool = False
    # Prefixes of the objects' keys (their /dev/shm names) a region may open; empty: any the
    # service's user can open.
    allowed_keys: list[str] = field(default_factory=list)

    def validate(self, key: str) -> None:
        if any(not isinstance(p, str) or not p.strip("/") for p in self.allowed_keys):
            raise ConfigError(f"{key}.allowed_keys", "every prefix must be a non-empty string")
        if not 1 <= self.max_regions <= 65536:
            raise ConfigError(f"{key}.max_regions", "must be between 1 and 65536")
        if self.max_bytes < 1:
            raise ConfigError(f"{key}.max_bytes", "must be at least 1")


@dataclass
class KServeConfig:
    """The KServe v2 / Triton API's model control (appliance/core/model_control.py).

    ``model_control``: Triton's ``--model-control-mode``. "none" (the default): every model
    the sources have is served, and the repository API's load and unload are refused;
    "explicit": the repository API loads and unloads models, and only the models in
    ``startup_models`` (Triton's ``--load-model``; "*": all) are loaded at start.
    ``model_control_scope``: who may load and unload: "admin" (the default: the admin token,
    as every other state-changing endpoint) or "inference" (the inference token, or anyone
    when none is set: what lets Triton's unchanged model-control examples, which send no
    token, run). Read at start, as the route table is built."""

    # The name server metadata gives (Triton's --id, whose default is "triton"; Triton's
    # health/metadata examples check it): ours by default.
    server_id: str = "edge-appliance"
    model_control: str = "none"
    startup_models: list[str] = field(default_factory=lambda: ["*"])
    model_control_scope: str = "admin"

    def validate(self, key: str) -> None:
        if self.model_control not in ("none", "explicit"):
            raise ConfigError(f"{key}.model_control", f"{self.model_control!r} is not a mode (none or explicit)")
        if self.model_control_scope not in ("admin", "inference"):
            raise ConfigError(f"{key}.model_control_scope", f"{self.model_control_scope!r} is not admin or inference")
        if not all(isinstance(m, str) and m for m in self.startup_models):
            raise ConfigError(f"{key}.startup_models", "must be a list of model names (or \"*\")")


@dataclass
class GenerationConfig:
    """Token streaming from generative models (``:generate``, appliance/core/generation.py)."""

    cache_memory_mb: float = 0.0  # KV cache all running streams may hold (MiB); 0: a quarter of the memory; more wait in a queue
    max_streams: int = 4096  # a ceiling on the streams running at once, all models (the cache memory bounds them first)
    max_streams_per_model: int = 0  # streams at once of one model; 0: no cap of its own (appliance/core/stream_limits.py)
    reserved_streams_per_model: int = 0  # kept in the pool for each other generative model that holds fewer (0: off)
    max_queued_per_model: int = 256  # requests of one model waiting for a stream; more: 503 + Retry-After
    queue_timeout_s: float = 60.0  # the longest a request waits for a stream before its 503 + Retry-After
    max_streams_per_step: int = 0  # streams per decode call; 0: the model's batching.max_batch_size
    step_batching: bool = True  # false: one decode call per stream per step (the bench's baseline)
    default_max_new_tokens: int = 64  # when a request names none
    max_new_tokens_limit: int = 1024  # the most a request may ask for

    def validate(self, key: str) -> None:
        for name in ("max_streams", "default_max_new_tokens", "max_new_tokens_limit"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{key}.{name}", "must be at least 1")
        if not self.cache_memory_mb >= 0:
            raise ConfigError(f"{key}.cache_memory_mb", "must not be negative (0: a quarter of the memory)")
        if not self.queue_timeout_s >= 0:
            raise ConfigError(f"{key}.queue_timeout_s", "must not be negative (0: refuse at once when full)")
        for name in ("max_streams_per_model", "reserved_streams_per_model", "max_queued_per_model"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{key}.{name}", "must not be negative (0: off)")
        if self.max_streams_per_step < 0:
            raise ConfigError(f"{key}.max_streams_per_step", "must not be negative (0: batching.max_batch_size)")
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise ConfigError(f"{key}.default_max_new_tokens",
                              f"must not exceed max_new_tokens_limit ({self.max_new_tokens_limit})")


@dataclass
class RolloutConfig:
    """A candidate version next to the serving one, and how it is judged (docs/rollouts.md).

    ``mode`` off: a newer version replaces the serving one as soon as it is loaded (TF
    Serving's behaviour). shadow / canary: it is loaded next to the serving one as the
    candidate and promoted or aborted on the gates below.
    """

    mode: str = "off"  # off | shadow | canary
    shadow_percent: float = 100.0  # share of requests copied to the candidate in shadow mode
    canary_percent: float = 10.0  # share of requests the candidate answers in canary mode
    sticky_header: str = "X-Client-Key"  # canary: the same key always gets the same version
    min_requests: int = 100  # candidate requests observed before a promotion
    max_duration_s: float = 3600.0  # undecided after this long (too little traffic): abort
    max_error_rate: float = 0.01  # candidate failures where the serving version succeeded
    max_p99_latency_ratio: float = 1.5  # candidate p99 / serving p99
    max_output_drift: float = 0.05  # mean |difference| of numeric outputs, or top-1 disagreement rate
    shadow_queue: int = 64  # shadow copies waiting; beyond this they are dropped (never the answer)
    shadow_busy_share: float = 0.05  # the shadow thread runs at most this share of the time; the rest is shed

    def validate(self, key: str) -> None:
        if self.mode not in ("off", "shadow", "canary"):
            raise ConfigError(f"{key}.mode", f"must be off, shadow or canary, got {self.mode!r}")
        for name in ("shadow_percent", "canary_percent"):
            if not 0 <= getattr(self, name) <= 100:
                raise ConfigError(f"{key}.{name}", "must be between 0 and 100")
        if self.min_requests < 1:
            raise ConfigError(f"{key}.min_requests", "must be at least 1")
        if self.shadow_queue < 1:
            raise ConfigError(f"{key}.shadow_queue", "must be at least 1")
        if not 0 < self.shadow_busy_share <= 1:
            raise ConfigError(f"{key}.shadow_busy_share", "must be in (0, 1]")
        for name in ("max_duration_s", "max_p99_latency_ratio"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{key}.{name}", "must be positive")
        for name in ("max_error_rate", "max_output_drift"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{key}.{name}", "must not be negative")


__all__ = ["GenerationConfig", "KServeConfig", "RolloutConfig", "SharedMemoryConfig"]
