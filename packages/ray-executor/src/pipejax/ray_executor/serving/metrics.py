"""Prometheus metrics of an API server, labelled by DP engine (names follow the established ``vllm:`` set).

With several API server processes, ``PROMETHEUS_MULTIPROC_DIR`` is set by the launcher before they
start; each process writes its share there and ``/metrics`` in any of them reports the sum
(the engine gauges come from the coordinator, so every process holds the same value: most recent wins).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r, engine = self.registry, ["engine"]
        self.running = Gauge("pipejax:num_requests_running", "Requests in an engine's running set", engine,
                             registry=r, multiprocess_mode="mostrecent")
        self.waiting = Gauge("pipejax:num_requests_waiting", "Requests waiting in an engine's queue", engine,
                             registry=r, multiprocess_mode="mostrecent")
        self.alive = Gauge("pipejax:engine_alive", "1 while a data-parallel engine serves, 0 once it died", engine,
                           registry=r, multiprocess_mode="mostrecent")
        self.prompt_tokens = Counter("pipejax:prompt_tokens", "Prompt tokens of finished requests", engine,
                                     registry=r)
        self.generation_tokens = Counter("pipejax:generation_tokens", "Tokens generated", engine, registry=r)
        self.requests = Counter("pipejax:request_success", "Finished requests by finish reason",
                                engine + ["finished_reason"], registry=r)
        self.migrated = Counter("pipejax:requests_migrated", "Requests moved to a live engine when theirs died "
                                "(by the engine lost)", engine, registry=r)
        self.failed = Counter("pipejax:request_failure", "Requests that failed by kind", engine + ["kind"],
                              registry=r)
        self.ttft = Histogram("pipejax:time_to_first_token_seconds", "Time to first token", engine,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pipejax:inter_token_latency_seconds", "Time between two outputs of a request", engine,
                             buckets=LATENCY_BUCKETS, registry=r)
        self._health = _HealingCollector()
        r.register(self._health)
        self.e2e = Histogram("pipejax:e2e_request_latency_seconds", "Request latency, arrival to last token", engine,
                             buckets=LATENCY_BUCKETS, registry=r)

    def set_engine_health(self, health: dict) -> None:
        """Each engine's ``EngineHealth`` as last known (the coordinator's: the same in every API server)."""
        self._health.health = dict(health)

    def set_engine_load(self, counts: list[list[int]], ready: set[int], dead: set[int]) -> None:
        for index, (waiting, running) in enumerate(counts):
            label = str(index)
            self.waiting.labels(label).set(waiting)
            self.running.labels(label).set(running)
            self.alive.labels(label).set(1 if index in ready and index not in dead else 0)

    def render(self) -> bytes:
        # prometheus_client's own switch (serve.py sets it for --api-server-count > 1), not a pipejax setting.
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            registry.register(self._health)
            return generate_latest(registry)
        return generate_latest(self.registry)


class _HealingCollector:
    """The engines' own cumulative healing figures, exported as counters (they count in the engine, so every
    API server reports the same value rather than a share to be summed)."""

    def __init__(self):
        self.health: dict = {}

    def collect(self):
        recoveries = CounterMetricFamily("pipejax:engine_recoveries", "Lost stages healed (recoveries done)",
                                         labels=["engine"])
        moved = CounterMetricFamily("pipejax:requests_moved", "Requests in flight requeued to be prefilled again "
                                    "by a recovery", labels=["engine"])
        seconds = CounterMetricFamily("pipejax:recovery_seconds", "Seconds spent recovering (detection to the "
                                      "pipeline relinked)", labels=["engine"])
        recovering = GaugeMetricFamily("pipejax:engine_recovering", "1 while an engine replaces a lost stage",
                                       labels=["engine"])
        for index, h in sorted(self.health.items()):
            label = [str(index)]
            recoveries.add_metric(label, h.recoveries)
            moved.add_metric(label, h.requests_moved)
            seconds.add_metric(label, h.recovery_seconds)
            recovering.add_metric(label, 1 if h.recovering else 0)
        return [recoveries, moved, seconds, recovering]
