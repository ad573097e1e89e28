"""How many front workers, and each one's share of the port-wide limits: pure arithmetic on the
config, read by the serving process and by every worker (which imports nothing else of the pool).
"""

from __future__ import annotations

import dataclasses
import math
import os

from appliance.core.cgroup import total_bytes
from appliance.core.config import Config, GRPCConfig, LimitsConfig

MEMORY_PER_WORKER = 512 << 20  # the default runs a worker per CPU, and per this much memory at most


def workers_for(config: Config) -> int:
    """How many front workers to run: ``server.workers``, or by default one per CPU but no
    more than one per ``MEMORY_PER_WORKER`` of the device's memory, or of its cgroup's limit when
    smaller (a worker forked from the zygote costs ~8-10 MB PSS, bench/RESULTS.md); 0 or 1 means
    none (the single-process path)."""
    wanted = config.server.workers or auto_workers()
    return wanted if wanted > 1 else 0


def auto_workers() -> int:
    cpus = os.cpu_count() or 1
    try:
        memory = total_bytes(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))  # a container's limit
    except (ValueError, OSError):  # not a POSIX sysconf: by the CPUs alone
        return cpus
    return max(1, min(cpus, memory // MEMORY_PER_WORKER))


def worker_limits(limits: LimitsConfig, workers: int) -> LimitsConfig:
    """One worker's share of the REST port's limits."""
    return dataclasses.replace(limits, max_connections=_share(limits.max_connections, workers),
                               max_buffered_bytes=_share(limits.max_buffered_bytes, workers))


def worker_grpc(cfg: GRPCConfig, workers: int) -> GRPCConfig:
    """One worker's share of the gRPC port's limits (a connection's own bound stays)."""
    return dataclasses.replace(cfg, max_connections=_share(cfg.max_connections, workers),
                               max_buffer_bytes=_share(cfg.max_buffer_bytes, workers),
                               max_open_streams=max(cfg.max_concurrent_streams, _share(cfg.max_open_streams, workers)))


def _share(total: int, workers: int) -> int:
    return max(1, math.ceil(total / workers))
