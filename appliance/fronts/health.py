"""How the front workers are doing, as the service shows it: memory, restarts, the metrics.

- ``process_memory(pid)``: a process's RSS, PSS and USS (private) bytes, from
  ``/proc/PID/smaps_rollup`` (PSS counts each shared page divided among the processes sharing
  it, so the workers' PSS added to the serving process's is the whole tree's true cost).
- ``RestartCounters``: a Prometheus collector on the core's registry:
  ``edge_appliance_worker_restarts_total{reason}`` (reason: heartbeat, signal, exit, spawn;
  appliance/fronts/supervisor.py), ``edge_appliance_workers{state}`` (configured, serving) and
  ``edge_appliance_worker_memory_bytes{worker,kind}`` (pss, uss).
- ``serving_problem``: the words ``/readyz``, ``/api/status`` and the page show while fewer
  workers than configured serve; ``serving_report``: those words and whether they are critical.

Thread-safety: everything here reads; the collector runs on a scrape's thread.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_KINDS = {"Rss": "rss_bytes", "Pss": "pss_bytes"}


def process_memory(pid: int) -> dict[str, int]:
    """{"rss_bytes", "pss_bytes", "uss_bytes"} of ``pid``; {} when it cannot be read (gone)."""
    fields: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                name, _, rest = line.partition(":")
                value = rest.split()
                if len(value) == 2 and value[1] == "kB":
                    fields[name] = int(value[0]) * 1024
    except (OSError, ValueError):
        return {}
    out = {key: fields.get(name, 0) for name, key in _KINDS.items()}
    out["uss_bytes"] = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return out


def serving_problem(serving: int, configured: int, why: Mapping[int, str]) -> str | None:
    """None when every configured worker serves; else how many do, and why each other does not."""
    if serving >= configured:
        return None
    reasons = "; ".join(f"worker {index} {words}" for index, words in sorted(why.items()))
    return f"{serving} of {configured} front workers serving" + (f" ({reasons})" if reasons else "")


def serving_report(configured: int, missing: Mapping[int, str], started_all: bool) -> tuple[str | None, bool, bool]:
    """The pool's problem while fewer workers than configured serve (``missing``: why each other
    does not): (the words, whether critical, whether every worker has served once by now).
    Critical (not ready) until every worker has served once, and whenever none serves; shown,
    not critical, while one of several is being replaced (the port is answered meanwhile)."""
    started_all = started_all or not missing
    problem = serving_problem(configured - len(missing), configured, missing)
    return problem, not started_all or len(missing) >= configured, started_all


class RestartCounters(Collector):
    """The workers' Prometheus series (module docstring), read from ``source`` at each scrape:
    ``source()`` -> (restarts by reason, configured, serving, {index: memory})."""

    def __init__(self, source: Callable[[], tuple[Mapping[str, int], int, int, Mapping[int, Mapping[str, int]]]]):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        restarts, configured, serving, memory = self.source()
        counter = CounterMetricFamily("edge_appliance_worker_restarts", "Front workers replaced, by the reason "
                                      "(heartbeat: silent past [server] worker_timeout_s; signal; exit; spawn)",
                                      labels=["reason"])
        for reason, count in sorted(restarts.items()):
            counter.add_metric([reason], count)
        yield counter
        workers = GaugeMetricFamily("edge_appliance_workers", "Front worker processes configured and serving",
                                    labels=["state"])
        workers.add_metric(["configured"], configured)
        workers.add_metric(["serving"], serving)
        yield workers
        sizes = GaugeMetricFamily("edge_appliance_worker_memory_bytes", "Each front worker's memory "
                                  "(pss: its share of shared pages; uss: its own)", labels=["worker", "kind"])
        for index, figures in sorted(memory.items()):
            for kind in ("pss", "uss"):
                if f"{kind}_bytes" in figures:
                    sizes.add_metric([str(index), kind], figures[f"{kind}_bytes"])
        yield sizes

    def describe(self) -> list[Metric]:
        return []  # collected at scrape time only (the registry then never calls collect early)
