"""The trainers' figures in the status's shape: progress from a training code's report, a
running built-in trainer's scrape or a finished one's result, and the job's GPU figures over
its pods. Pure.

Used by :mod:`gpuop.observing.derive` (the operator) and by ``gpuop run`` alike, so a local
run's status reads as a cluster one's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from gpuop.api.status import (
    GpuSource,
    GpuUsage,
    NamedMetric,
    ProgressSource,
    ProgressStatus,
    WorkerGpu,
    format_eta,
    format_percent,
)
from gpuop.observing.records import ReceivedReport
from gpuop.observing.reports import TrainerReport
from gpuop.observing.scrape import GpuFigures, TrainerMetrics
from gputrain.contract import Result


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def progress_from_metrics(metrics: TrainerMetrics, now: str) -> ProgressStatus:
    """ProgressStatus as scraped from a running trainer."""
    progress = _status_progress(metrics, metrics.percent, metrics.estimated_remaining_seconds, now)
    return dataclasses.replace(progress, source="TrainerMetrics")


def progress_from_result(result: Result, now: str) -> ProgressStatus:
    """ProgressStatus of a finished run, from the trainer's final result."""
    return dataclasses.replace(_status_progress(result, 100.0, 0, now), source="TrainerResult")


def progress_from_report(received: ReceivedReport, now: str) -> ProgressStatus:
    """ProgressStatus from a training code's report. A client that sends steps but no percent
    (a plain loop's first call, the SDK's metrics-only update) gets it from the steps."""
    report = received.report
    percent = report.percent
    if percent is None and report.step is not None and report.total_steps:
        percent = min(100.0, 100.0 * report.step / report.total_steps)
    progress = _status_progress(report, percent, report.estimated_remaining_seconds, now)
    source: ProgressSource = "TrainerStatus"
    return dataclasses.replace(
        progress,
        source=source,
        reported_by=received.pod,
        metrics=tuple(NamedMetric(name=n, value=v) for n, v in _unique(report.other)),
    )


def _unique(pairs: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    """The last value of each name (status lists them keyed by name)."""
    return list(dict(pairs).items())


def _status_progress(
    figures: TrainerMetrics | Result | TrainerReport, percent: float | None, eta: float | None, now: str
) -> ProgressStatus:
    """The trainer's figures (either report) in the status's shape and precision."""
    return ProgressStatus(
        percent=_round(percent, 1),
        epoch=figures.epoch,
        total_epochs=figures.total_epochs,
        step=figures.step,
        total_steps=figures.total_steps,
        loss=_round(figures.loss, 6),
        accuracy=_round(figures.accuracy, 6),
        samples_per_second=_round(figures.samples_per_second, 1),
        estimated_remaining_seconds=None if eta is None else round(eta),
        eta=format_eta(eta),
        percent_text=format_percent(percent),
        updated_at=now,
    )


def gpu_usage(
    per_pod: Mapping[str, tuple[GpuFigures, ...]], count: int, source: GpuSource | None = None
) -> GpuUsage:
    """GPU figures of the job: the mean utilization over every GPU, memory summed."""
    workers = []
    all_utilization: list[float] = []
    for pod, gpus in sorted(per_pod.items()):
        utilization = [g.utilization_percent for g in gpus if g.utilization_percent is not None]
        used = [g.memory_used_bytes for g in gpus if g.memory_used_bytes is not None]
        total = [g.memory_total_bytes for g in gpus if g.memory_total_bytes is not None]
        all_utilization += utilization
        workers.append(
            WorkerGpu(
                pod=pod,
                utilization_percent=round(sum(utilization) / len(utilization), 1) if utilization else None,
                memory_used_bytes=sum(used) if used else None,
                memory_total_bytes=sum(total) if total else None,
            )
        )
    models = sorted({g.name for gpus in per_pod.values() for g in gpus if g.name})
    used_all = [w.memory_used_bytes for w in workers if w.memory_used_bytes is not None]
    total_all = [w.memory_total_bytes for w in workers if w.memory_total_bytes is not None]
    mean = round(sum(all_utilization) / len(all_utilization), 1) if all_utilization else None
    return GpuUsage(
        count=count,
        utilization_percent=mean,
        utilization_text=format_percent(mean),
        model=", ".join(models)[:512] or None,
        memory_used_bytes=sum(used_all) if used_all else None,
        memory_total_bytes=sum(total_all) if total_all else None,
        per_worker=tuple(
            w for w in workers if w.utilization_percent is not None or w.memory_total_bytes is not None
        ),
        source=source,
    )
