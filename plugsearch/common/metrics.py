"""Prometheus metrics, one registry per app (no import-time globals, so tests can build many apps). With
several workers, `PROMETHEUS_MULTIPROC_DIR` (set by `plugsearch.common.process.serve`) holds every metric in files
that `multiprocess_registry()` sums; gauges say how to combine (`multiprocess_mode`).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServiceMetrics:
    """HTTP-level metrics every service exports; services add their own to `registry`."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry or CollectorRegistry()
        self.requests = Counter(f"{service}_http_requests_total", "HTTP requests",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram(f"{service}_http_request_seconds", "HTTP request latency",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge(f"{service}_http_in_flight", "requests being served", registry=self.registry,
                               multiprocess_mode="livesum")
        self.admission_limit = Gauge(f"{service}_admission_limit", "requests admitted in flight at most now "
                                     "(adaptive; summed over workers)", registry=self.registry,
                                     multiprocess_mode="livesum")
        self.rejected = Counter(f"{service}_http_rejected_total", "requests refused before the handler",
                                ["reason"], registry=self.registry)
        self.upstream_seconds = Histogram(f"{service}_upstream_seconds", "calls to other services",
                                          ["upstream"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.upstream_errors = Counter(f"{service}_upstream_errors_total", "failed calls to other services",
                                       ["upstream", "kind"], registry=self.registry)
        self.cache_events = Counter(f"{service}_cache_events_total", "cache hits, misses and errors",
                                    ["cache", "event"], registry=self.registry)
        self.llm_tokens = Counter(f"{service}_llm_tokens_total", "LLM tokens used",
                                  ["llm", "kind"], registry=self.registry)


def forget_dead_workers() -> None:
    """Drop the live-gauge files of workers that are gone (a worker the supervisor replaced would otherwise
    keep, say, its in-flight count forever). Called as each worker starts; counters and histograms of
    dead workers stay, as prometheus_client intends."""
    path = os.environ.get(MULTIPROCESS_ENV)
    if not path:
        return
    pids = {name.rsplit("_", 1)[-1].removesuffix(".db") for name in os.listdir(path) if name.startswith("gauge_live")}
    for pid in pids:
        if pid.isdigit() and not _alive(int(pid)):
            mark_process_dead(int(pid), path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def multiprocess_registry() -> CollectorRegistry:
    """Every worker's metrics, summed (read from the files under `PROMETHEUS_MULTIPROC_DIR`)."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return registry
