"""The trainers' figures in the status's shape, and what ``status.progress`` and ``status.gpu``
say at one observation: progress from a training code's report, a running built-in trainer's
scrape or a finished one's result (most authoritative first), and the job's GPU figures over
its pods (the nodes' dcgm-exporter first, the trainer's NVML where none is read). Pure.

Used by :mod:`gpuop.observing.derive` (the operator) and by ``gpuop run`` alike, so a local
run's status reads as a cluster one's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from gpuop.api.status import (
    TIME_FORMAT,
    CheckpointStatus,
    GpuSource,
    GpuUsage,
    NamedMetric,
    Phase,
    ProgressSource,
    ProgressStatus,
    WorkerGpu,
    format_eta,
    format_percent,
)
from gpuop.observing.records import Observation, ReceivedReport, Thresholds
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
        activity=report.activity,
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
        compile=figures.compile,
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


# -- what status.progress and status.gpu say, from one observation ----------------------------


def trainer_record(obs: Observation, phase: str) -> Result | None:
    """The first termination message of the given phase among the pods (master first)."""
    for pod in sorted(obs.pods, key=lambda p: ("master" not in p.name, p.name)):
        if pod.result is not None and pod.result.phase == phase:
            return pod.result
    return None


def _latest_metrics(obs: Observation) -> TrainerMetrics | None:
    """The most advanced scrape: every pod reports the job-wide figures, some a tick late."""
    scraped = [p.metrics for p in obs.pods if p.metrics is not None and p.metrics.total_steps]
    return max(scraped, key=lambda m: m.step or 0, default=None)


def _same_figures(a: ProgressStatus | None, b: ProgressStatus | None) -> bool:
    if a is None or b is None:
        return a is b
    return dataclasses.replace(a, updated_at=None, step_advanced_at=None) == dataclasses.replace(
        b, updated_at=None, step_advanced_at=None
    )


def _latest_report(obs: Observation) -> ReceivedReport | None:
    """The newest report: only rank 0 reports, but a restarted pod's old one may linger."""
    return max(obs.reports, key=lambda r: r.received_at, default=None)


def _completed(progress: ProgressStatus) -> ProgressStatus:
    """A training that succeeded is done, whatever its code last sent (a client may end
    without a final report, or between two of its throttled ones)."""
    return dataclasses.replace(
        progress, percent=100.0, percent_text=format_percent(100.0), estimated_remaining_seconds=0,
        eta=format_eta(0),
    )  # fmt: skip


def _fresh_progress(
    previous: ProgressStatus | None, obs: Observation, phase: Phase, now: str
) -> ProgressStatus | None:
    """The figures as the sources say now: at the end, the trainer's final record; while it runs,
    the most advanced of the training code's latest report and the built-in trainer's scrape.

    The built-in trainer gives both, and they never race: the scrape is read every tick and the
    reports are throttled to one per 5 s (a trainer held or hung right after a throttled report
    would otherwise show an older step for good), so the higher step wins, a tie going to the
    report. Other code gives reports only; older trainer images the scrape only."""
    report = _latest_report(obs)
    if phase == "Succeeded":
        record = trainer_record(obs, "Succeeded")
        if record is not None:
            return progress_from_result(record, now)
        last = progress_from_report(report, now) if report is not None else previous
        return _completed(last) if last is not None else None
    metrics = _latest_metrics(obs)
    if report is not None and (metrics is None or (report.report.step or 0) >= (metrics.step or 0)):
        return progress_from_report(report, now)
    return progress_from_metrics(metrics, now) if metrics is not None else previous


def progress(
    previous: ProgressStatus | None, obs: Observation, phase: Phase, now: str
) -> ProgressStatus | None:
    fresh = _fresh_progress(previous, obs, phase, now)
    if fresh is None:
        # No figures yet: our trainer reports within seconds, so the stall clock starts all the
        # same (a hang before step 1, in NCCL's init say, is a stall). A custom command may
        # never report: no clock, no verdict until its first report, rather than a false Stalled.
        if phase == "Running" and obs.reports_progress:
            return ProgressStatus(step_advanced_at=now)
        return None
    if previous is not None and _same_figures(previous, fresh):
        return previous
    advanced = now
    # A step that went back is a restart from an older checkpoint: activity, not a stall. A
    # client that sends percent and no steps (the Kubeflow SDK's) advances with its percent. A
    # pause begun or ended (evaluating, saving, ...) starts the clock again, as a resume does.
    if (
        previous is not None
        and previous.step_advanced_at is not None
        and fresh.step == previous.step
        and (fresh.step is not None or fresh.percent == previous.percent)
        and fresh.activity == previous.activity
    ):
        advanced = previous.step_advanced_at
    return dataclasses.replace(fresh, updated_at=now, step_advanced_at=advanced)


def gpu(previous: GpuUsage | None, obs: Observation, thresholds: Thresholds, now: str) -> GpuUsage | None:
    # The node's exporter sees any image's GPUs and needs nothing of the trainer; the built-in
    # trainer's NVML figures serve where no exporter is read (a GPU cluster without it).
    exported = {p.name: p.exporter_gpus for p in obs.pods if p.exporter_gpus}
    scraped = {p.name: p.metrics.gpus for p in obs.pods if p.metrics is not None and p.metrics.gpus}
    if not exported and not scraped:
        if previous is not None:  # finished or between scrapes: keep the last figures
            return previous if previous.count == obs.gpus else dataclasses.replace(previous, count=obs.gpus)
        # A trainer that serves figures but no GPUs (a CPU run) still says it holds none.
        observed = any(p.metrics is not None for p in obs.pods)
        return GpuUsage(count=obs.gpus) if obs.gpus or observed else None
    if exported:
        usage = gpu_usage(exported, obs.gpus, "DcgmExporter")
    else:
        usage = gpu_usage(scraped, obs.gpus, "Trainer")
    low = (
        usage.utilization_percent is not None and usage.utilization_percent < thresholds.underutilized_percent
    )
    since = None
    if low:
        since = previous.underutilized_since if previous is not None and previous.underutilized_since else now
    return dataclasses.replace(usage, underutilized_since=since)


def checkpoint(previous: CheckpointStatus | None, obs: Observation) -> CheckpointStatus | None:
    """The last complete checkpoint: as the newest report that names one says it, else as the
    status said before (kept across restarts, preemptions and an operator restart, when the
    reports are gone). A report without a time is dated when it came."""
    received = max((r for r in obs.reports if r.report.checkpoint is not None),
                   key=lambda r: r.received_at, default=None)  # fmt: skip
    if received is None or received.report.checkpoint is None:
        return previous
    said = received.report.checkpoint
    heard = received.received_at.strftime(TIME_FORMAT)
    # A time ahead of when it came is a skewed clock: its age would read negative.
    moment = min(said.time, heard) if said.time is not None else None
    if moment is None:
        moment = heard
        if previous is not None and (previous.step, previous.uri) == (said.step, said.uri):
            moment = previous.time  # the same one, heard again
    return CheckpointStatus(step=said.step, time=moment, uri=said.uri)
