"""The operator's own Prometheus metrics: what it did, how long it took, what it costs the API.

A registry of its own (not prometheus_client's global one) so that tests can run several
operators in one process and read each one's figures.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from gpuop.api.status import PHASES


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # The process and runtime figures every Python exporter serves (memory, CPU, GC).
        for runtime in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(runtime)
        self.reconciles = Counter(
            "gpuop_reconciles_total",
            "Reconciles of a GpuTraining, by what they did.",
            ["outcome"],
            registry=self.registry,
        )
        self.errors = Counter(
            "gpuop_reconcile_errors_total",
            "Reconciles that failed on an API error after retries (retried on the next event or tick).",
            registry=self.registry,
        )
        self.duration = Histogram(
            "gpuop_reconcile_duration_seconds",
            "Time one reconcile took, API calls included.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.api_requests = Counter(
            "gpuop_api_requests_total",
            "Requests to the Kubernetes API by Kubernetes verb (get, list, create, patch, ...), resource "
            "(pytorchjobs, gputrainings/status, ...) and HTTP status code (0: no reply); each retry counts.",
            ["verb", "resource", "code"],
            registry=self.registry,
        )
        self.api_latency = Histogram(
            "gpuop_api_request_duration_seconds",
            "Time from sending a Kubernetes API request to its reply (or to giving up on it), by verb "
            "and resource.",
            ["verb", "resource"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.status_patches = Counter(
            "gpuop_status_patches_total", "Status patches written.", registry=self.registry
        )
        self.scrapes = Counter(
            "gpuop_scrapes_total",
            "Trainer metrics scrapes, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.reports = Counter(
            "gpuop_reports_total",
            "Progress reports (trainerStatus) received, by outcome: accepted, or why refused.",
            ["outcome"],
            registry=self.registry,
        )
        self.report_latency = Histogram(
            "gpuop_report_duration_seconds",
            "Time to answer one progress report, authentication included.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.trainings = Gauge(
            "gpuop_trainings", "GpuTrainings by status phase.", ["phase"], registry=self.registry
        )

    def api_request(self, verb: str, resource: str, status: int, seconds: float) -> None:
        self.api_requests.labels(verb=verb, resource=resource, code=str(status)).inc()
        self.api_latency.labels(verb=verb, resource=resource).observe(seconds)

    def set_phases(self, phases: Iterable[str | None]) -> None:
        counts = dict.fromkeys(("Unknown", *PHASES), 0)
        for phase in phases:
            key = phase or "Unknown"
            counts[key] = counts.get(key, 0) + 1
        for phase, count in counts.items():
            self.trainings.labels(phase=phase).set(count)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
