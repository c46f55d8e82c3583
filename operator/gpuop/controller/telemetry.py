"""The operator's own Prometheus metrics: what it did, how long it took, what it costs the API,
and what users sum, chart and alert on: GPU-hours per namespace, trainings by phase, and a few
series per GpuTraining (its phase, since when, its Stalled and Underutilized conditions, its last
progress, and its figures as its status has them).

The figures per training (progress, loss, throughput, GPU use per pod) are read from the
GpuTraining's status, which has them for any training code: from the code's reports, or the
built-in trainer's, and from dcgm-exporter for any image. The trainer pods' own ``gputrain_*``
series exist only for the built-in trainer, so the chart's dashboards read these instead.

A registry of its own (not prometheus_client's global one) so that tests can run several
operators in one process and read each one's figures.

Series that name a training's namespace carry it as ``namespace``, as kube-state-metrics does:
the chart's ServiceMonitor sets ``honorLabels`` so that the label stays the training's rather than
becoming ``exported_namespace`` beside the operator pod's own. The operator's other series carry
no ``namespace``, so they get the operator pod's as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

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

from gpuop.api.identity import TrainingKey
from gpuop.api.status import PHASES

if TYPE_CHECKING:
    from gpuop.controller.table import Tracked

# The conditions exported per training: the two alarms the chart's alerts are made of. A fixed
# set, so two series per training at most.
ALARM_CONDITIONS: Final = ("Stalled", "Underutilized")
_TRAINING: Final = ["namespace", "gputraining"]
# status.progress fields exported per training: (series, help, field, scale, only while it runs).
# Throughput and time to go mean nothing once it stops; the last loss and progress still do. A
# Stalled training's throughput is 0, not its last report's (which status keeps): a chart that
# held the last figure would show a stalled job as healthy.
_FIGURES: Final = (
    ("gpuop_training_progress_ratio", "Progress of each GpuTraining, 0..1 (status.progress.percent).",
     "percent", 0.01, False),
    ("gpuop_training_loss", "Training loss of each GpuTraining (status.progress.loss).", "loss", 1.0, False),
    ("gpuop_training_accuracy_ratio", "Evaluation accuracy of each GpuTraining, 0..1 "
     "(status.progress.accuracy).", "accuracy", 1.0, False),
    ("gpuop_training_samples_per_second", "Throughput of each running GpuTraining's whole job "
     "(status.progress.samplesPerSecond).", "samplesPerSecond", 1.0, True),
    ("gpuop_training_estimated_remaining_seconds", "Estimated seconds to completion of each running "
     "GpuTraining (status.progress.estimatedRemainingSeconds).", "estimatedRemainingSeconds", 1.0, True),
)  # fmt: skip
_THROUGHPUT: Final = "samplesPerSecond"
# Its GPUs' figures only while Running: status keeps the last perWorker through a restart, whose
# pods may be gone. A model the figures never named (no dcgm-exporter, a custom image) is this.
UNKNOWN_MODEL: Final = "unknown"
# How a tick sets one series (and notes it as shown, so that the next tick can remove it).
_Show = Callable[[Gauge, tuple[str, ...], float], None]


@dataclass
class _Billed:
    """What the GPU-hours counter has taken from one training: its uid, and the most of its
    billable GPU-hours counted so far (a high-water mark, so that nothing is counted twice)."""

    uid: str
    hours: float


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
            "Reconciles that failed (an API error after retries, or a defect); each is retried after "
            "a backoff of its own, doubling from 0.5 s up to 60 s.",
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "gpuop_workqueue_depth",
            "GpuTrainings waiting for a reconcile: queued now, or at a later time (a first status's "
            "deadline, a retry's backoff).",
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
        # One series per phase (Unknown: no status yet) per namespace that holds a GpuTraining
        # this replica serves; a namespace's go when its last training does.
        self.trainings = Gauge(
            "gpuop_trainings",
            "GpuTrainings by status phase and namespace.",
            ["namespace", "phase"],
            registry=self.registry,
        )
        # What a namespace is billed: only grows, so increase() over a month is the month's
        # GPU-hours. One series per namespace that has had a GpuTraining since this process
        # started (kept at its value when its trainings go: a counter that vanished would lose
        # the tail of its last increase()). Nothing survives a restart: the new process starts at
        # 0, which increase() reads as a counter reset, and counts each training from its first
        # tick on; what goes uncounted is the time no operator ran (plus the old process's last
        # scrape interval). Counting instead from the status's gpuHoursCountedAt would count
        # twice what the old process had counted since its last status write, which can be
        # hours for a training whose status does not change; under-billing was chosen over that.
        # Each GpuTraining's status.gpuHours catches up at its next write and is the exact record.
        self.gpu_hours = Counter(
            "gpuop_gpu_hours",
            "GPU-hours held by GpuTrainings (GPUs x hours Running or Restarting, as status.gpuHours counts "
            "them), by namespace.",
            ["namespace"],
            registry=self.registry,
        )
        # Per training: bounded by the GpuTrainings that exist and that this replica serves. Each
        # tick sets the series of the trainings it saw and removes every other one, so a deleted
        # training's series go at the next tick, as do a training's old phase and, on a replica
        # that stops leading a namespace, that namespace's series.
        self.training_phase = Gauge(
            "gpuop_training_phase",
            "1 for each GpuTraining's current status phase (Unknown: no status yet).",
            [*_TRAINING, "phase"],
            registry=self.registry,
        )
        self.training_phase_since = Gauge(
            "gpuop_training_phase_since_timestamp_seconds",
            "When each GpuTraining entered its current phase (the lastTransitionTime of the condition "
            "named after it; for Pending and Unknown, when the GpuTraining was created), Unix seconds.",
            [*_TRAINING, "phase"],
            registry=self.registry,
        )
        self.training_condition = Gauge(
            "gpuop_training_condition",
            f"1 while a GpuTraining's {' or '.join(ALARM_CONDITIONS)} condition holds, 0 once it has "
            "cleared; absent before it was ever set.",
            [*_TRAINING, "condition"],
            registry=self.registry,
        )
        self.training_progress = Gauge(
            "gpuop_training_last_progress_timestamp_seconds",
            "For each Running GpuTraining, when its progress last came: its latest report, or its "
            "figures last changing, or else when it started running; Unix seconds.",
            _TRAINING,
            registry=self.registry,
        )
        self.training_figures = tuple(
            (Gauge(series, text, _TRAINING, registry=self.registry), field, scale, running_only)
            for series, text, field, scale, running_only in _FIGURES
        )
        self.training_gpu_utilization = Gauge(
            "gpuop_training_gpu_utilization_ratio",
            "Mean utilization of each worker pod's GPUs while its GpuTraining runs, 0..1 "
            "(status.gpu.perWorker: dcgm-exporter's figures for any image, or the built-in trainer's).",
            [*_TRAINING, "pod"],
            registry=self.registry,
        )
        self.training_gpu_memory = Gauge(
            "gpuop_training_gpu_memory_used_bytes",
            "GPU memory in use by each worker pod's GPUs while its GpuTraining runs (status.gpu.perWorker).",
            [*_TRAINING, "pod"],
            registry=self.registry,
        )
        self.training_gpus = Gauge(
            "gpuop_training_gpus",
            "GPUs each running GpuTraining holds, by the model its workers see (status.gpu; several "
            f"models come comma-separated in one label; {UNKNOWN_MODEL} when no figures named it).",
            [*_TRAINING, "model"],
            registry=self.registry,
        )
        self._billed: dict[TrainingKey, _Billed] = {}
        self._shown: dict[Gauge, set[tuple[str, ...]]] = {}

    def api_request(self, verb: str, resource: str, status: int, seconds: float) -> None:
        self.api_requests.labels(verb=verb, resource=resource, code=str(status)).inc()
        self.api_latency.labels(verb=verb, resource=resource).observe(seconds)

    def observe_trainings(self, trainings: Iterable[tuple[TrainingKey, Tracked]], now: datetime) -> None:
        """Every figure per namespace and per training, from the trainings this replica serves as
        of this tick (a standby's table is stale: its figures would add to the active replica's
        in a sum over pods, so a replica shows only what it leads)."""
        shown: dict[Gauge, set[tuple[str, ...]]] = {}

        def show(gauge: Gauge, labels: tuple[str, ...], value: float) -> None:
            gauge.labels(*labels).set(value)
            shown.setdefault(gauge, set()).add(labels)

        counts: dict[str, dict[str, int]] = {}
        seen: set[TrainingKey] = set()
        for key, tracked in trainings:
            namespace, name = key
            body = tracked.body
            status: Mapping[str, Any] = body.get("status") or {}
            phase = tracked.phase or "Unknown"
            per_phase = counts.setdefault(namespace, dict.fromkeys(("Unknown", *PHASES), 0))
            per_phase[phase] = per_phase.get(phase, 0) + 1
            seen.add(key)
            self._bill(key, body, status, now)
            show(self.training_phase, (namespace, name, phase), 1)
            conditions = {c.get("type"): c for c in status.get("conditions") or () if isinstance(c, Mapping)}
            since = _phase_since(phase, conditions, body)
            if since is not None:
                show(self.training_phase_since, (namespace, name, phase), since)
            for alarm in ALARM_CONDITIONS:
                if alarm in conditions:
                    show(self.training_condition, (namespace, name, alarm),
                         1 if conditions[alarm].get("status") == "True" else 0)  # fmt: skip
            if phase == "Running":
                progress = _last_progress(tracked, status, conditions)
                if progress is not None:
                    show(self.training_progress, (namespace, name), progress)
            figures = status.get("progress") or {}
            stalled = _holds(conditions, "Stalled")
            for gauge, field, scale, running_only in self.training_figures:
                value = _figure(figures.get(field))
                if value is not None and (phase == "Running" or not running_only):
                    show(gauge, (namespace, name), 0.0 if stalled and field == _THROUGHPUT else value * scale)
            if phase == "Running":
                self._show_gpus(show, (namespace, name), status.get("gpu") or {})
        for namespace, per_phase in counts.items():
            for phase, count in per_phase.items():
                show(self.trainings, (namespace, phase), count)
        for gauge in (self.trainings, self.training_phase, self.training_phase_since, self.training_condition,
                      self.training_progress, self.training_gpu_utilization, self.training_gpu_memory,
                      self.training_gpus, *(figure[0] for figure in self.training_figures)):  # fmt: skip
            for gone in self._shown.get(gauge, set()) - shown.get(gauge, set()):
                gauge.remove(*gone)
        self._shown = shown
        # A training not seen this tick is forgotten: should it come back (a namespace led
        # again), what it held meanwhile may have been counted by another replica.
        for key in self._billed.keys() - seen:
            del self._billed[key]

    def _show_gpus(self, show: _Show, training: tuple[str, str], gpu: Mapping[str, Any]) -> None:
        """A running training's GPU figures, per worker pod, and its GPUs by model."""
        for worker in gpu.get("perWorker") or ():
            pod = worker.get("pod") if isinstance(worker, Mapping) else None
            if not isinstance(pod, str):
                continue
            if (utilization := _figure(worker.get("utilizationPercent"))) is not None:
                show(self.training_gpu_utilization, (*training, pod), utilization / 100)
            if (used := _figure(worker.get("memoryUsedBytes"))) is not None:
                show(self.training_gpu_memory, (*training, pod), used)
        count, model = _figure(gpu.get("count")), gpu.get("model")
        if count is not None and count > 0:
            show(
                self.training_gpus,
                (*training, model if isinstance(model, str) and model else UNKNOWN_MODEL),
                count,
            )

    def _bill(
        self, key: TrainingKey, body: Mapping[str, Any], status: Mapping[str, Any], now: datetime
    ) -> None:
        """Add to its namespace's GPU-hours what a training has held since the last tick."""
        uid = str((body.get("metadata") or {}).get("uid"))
        hours = _billable_hours(status, now)
        # The namespace's series from its first training on, at 0 until it holds GPUs: a counter
        # whose first sample is already above 0 loses that much from increase().
        counter = self.gpu_hours.labels(key[0])
        billed = self._billed.get(key)
        if billed is None or billed.uid != uid:
            # First seen (this process started, took over the namespace, or the name was
            # re-created): what it held before is someone else's count or in its status.
            self._billed[key] = _Billed(uid, hours)
            return
        if hours > billed.hours:
            counter.inc(hours - billed.hours)
            billed.hours = hours

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)


def _holds(conditions: Mapping[Any, Mapping[str, Any]], kind: str) -> bool:
    condition = conditions.get(kind)
    return condition is not None and condition.get("status") == "True"


def _figure(value: Any) -> float | None:
    """A status figure a gauge can take: a number, not a bool (JSON's true is Python's 1)."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _timestamp(text: Any) -> float | None:
    """An RFC 3339 time of the API (``2026-11-24T10:00:00Z``) as Unix seconds."""
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _billable_hours(status: Mapping[str, Any], now: datetime) -> float:
    """The GPU-hours a training has held up to ``now``: its status's gpuHours, and while it holds
    its GPUs (gpuHoursCountedAt is set then, and only then), the GPUs times the time since that
    count. Grows with the clock, and a status write moves the span into gpuHours without a jump."""
    hours = status.get("gpuHours")
    total = float(hours) if isinstance(hours, int | float) else 0.0
    counted = _timestamp(status.get("gpuHoursCountedAt"))
    gpus = (status.get("gpu") or {}).get("count")
    if counted is not None and isinstance(gpus, int) and gpus > 0:
        total += gpus * max(0.0, now.timestamp() - counted) / 3600
    return total


def _phase_since(
    phase: str, conditions: Mapping[Any, Mapping[str, Any]], body: Mapping[str, Any]
) -> float | None:
    """When the training entered ``phase``: the condition named after the phase holds since its
    last transition; Pending and Unknown have none, and last since the object was made."""
    condition = conditions.get(phase)
    if condition is not None and condition.get("status") == "True":
        return _timestamp(condition.get("lastTransitionTime"))
    if phase in ("Pending", "Unknown"):
        return _timestamp((body.get("metadata") or {}).get("creationTimestamp"))
    return None


def _last_progress(
    tracked: Tracked, status: Mapping[str, Any], conditions: Mapping[Any, Mapping[str, Any]]
) -> float | None:
    """When a running training's progress last came: the newest report received (it counts even
    when its figures are the same as before: the code is alive, and Stalled is the verdict on
    its step), the figures last changing (a scrape), or the start of this run, for code that has
    sent nothing yet."""
    moments: list[float | None] = [r.received_at.timestamp() for r in tracked.reports]
    moments.append(_timestamp((status.get("progress") or {}).get("updatedAt")))
    running = conditions.get("Running")
    if running is not None and running.get("status") == "True":
        moments.append(_timestamp(running.get("lastTransitionTime")))
    return max((m for m in moments if m is not None), default=None)
