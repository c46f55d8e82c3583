"""The alarms of a training that holds its GPUs: Stalled (no step for longer than its stall
timeout) and Underutilized (its GPUs idle for longer than the threshold), each read over the time
it has run since its last pause. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from gpuop.api.status import (
    TIME_FORMAT,
    Condition,
    GpuTrainingStatus,
    GpuUsage,
    Phase,
    ProgressStatus,
    format_eta,
    parse_time,
)
from gpuop.observing.records import Thresholds

# The conditions of a pause: a training that runs again after one was neither stalled nor
# underutilized while it waited (suspended, queued or preempted by Kueue).
PAUSES: Final = ("Suspended", "Queued")
# The phases whose pods hold their GPUs: what gpuHours counts, and where the alarms' clocks run
# (Restarting too: a gang whose restarted pod never comes back holds its GPUs with no step).
# Created (pods starting, perhaps not yet placed), Queued and Suspended (no pods) do not.
HOLDING_GPUS: Final[tuple[Phase, ...]] = ("Running", "Restarting")


def seconds_between(start: str, end: datetime) -> float:
    """Seconds from a status time to ``end``."""
    return (end.replace(tzinfo=None) - parse_time(start)).total_seconds()


def resumed_at(before: Sequence[Condition], now: str) -> str | None:
    """When the training last came out of a pause: ``now`` while the last status (``before``)
    still says it is paused, else the moment its pause condition turned False (kept in status,
    so an operator that restarts knows it too); None if it never paused."""
    ended = []
    for c in before:
        if c.type in PAUSES:
            if c.status == "True":
                return now
            if c.last_transition_time:
                ended.append(c.last_transition_time)
    return max(ended, default=None)


def running_alarms(
    progress: ProgressStatus | None,
    gpu: GpuUsage | None,
    thresholds: Thresholds,
    now: datetime,
    condition: Any,
    resumed_at: str | None,
    phase: Phase,
) -> list[Condition]:
    """Stalled and Underutilized, each over the time the training has run since its last pause:
    a pause is neither (its clocks are not reset in status, only read from the resume on)."""
    alarms: list[Condition] = []
    advanced = progress.step_advanced_at if progress is not None else None
    if advanced is not None and resumed_at is not None:
        advanced = max(advanced, resumed_at)
    # While the code says it evaluates, saves, loads or compiles, no step is due: a long one is
    # no stall. The price: a hang inside it is not Stalled either (Underutilized, on a GPU, and
    # the chart's no-report alert still see it), until the code says it is training again.
    paused = progress is not None and progress.activity is not None
    if thresholds.stall_timeout_seconds and advanced is not None and not paused:
        idle = seconds_between(advanced, now)
        if idle >= thresholds.stall_timeout_seconds:
            step = progress.step if progress is not None and progress.step is not None else 0
            when, likely = (
                (
                    " while restarting",
                    "a pod that cannot come back (its node lost, a checkpoint that will not load)",
                )
                if phase == "Restarting"
                else ("", "a hung NCCL collective or data loader")
            )
            alarms.append(
                condition(
                    "Stalled",
                    "True",
                    "NoProgress",
                    f"step {step} has not advanced for {format_eta(idle)}{when} (stallTimeoutSeconds "
                    f"{thresholds.stall_timeout_seconds}); {likely} is likely",
                )
            )
    since = gpu.underutilized_since if gpu is not None else None
    if since is not None and resumed_at is not None:
        since = max(since, resumed_at)
    if since is not None and seconds_between(since, now) >= thresholds.underutilized_seconds:
        assert gpu is not None
        low_for = format_eta(seconds_between(since, now))
        alarms.append(
            condition(
                "Underutilized",
                "True",
                "LowGpuUtilization",
                f"mean GPU utilization {gpu.utilization_percent:.0f}% for {low_for} (under "
                f"{thresholds.underutilized_percent:.0f}%); the job is likely input-bound: raise "
                "dataset.loaderWorkers or resources.cpu",
            )
        )
    return alarms


def next_alarm_at(status: GpuTrainingStatus | None, thresholds: Thresholds, now: datetime) -> datetime | None:
    """When Stalled or Underutilized comes due if nothing else changes (``status`` as last
    written): the time a reconcile is needed by the clock alone. None while neither clock runs
    (not holding GPUs, paused, already raised, or nothing to time from)."""
    if status is None or status.phase not in HOLDING_GPUS:
        return None
    raised = {c.type for c in status.conditions if c.status == "True"}
    resumed = resumed_at(status.conditions, now.astimezone(UTC).strftime(TIME_FORMAT))
    due: list[datetime] = []
    progress = status.progress
    advanced = progress.step_advanced_at if progress is not None else None
    if (
        thresholds.stall_timeout_seconds
        and "Stalled" not in raised
        and advanced is not None
        and progress is not None
        and progress.activity is None
    ):
        start = max(advanced, resumed) if resumed is not None else advanced
        due.append(_at(start, thresholds.stall_timeout_seconds))
    since = status.gpu.underutilized_since if status.gpu is not None else None
    if status.phase == "Running" and "Underutilized" not in raised and since is not None:
        start = max(since, resumed) if resumed is not None else since
        due.append(_at(start, thresholds.underutilized_seconds))
    return min(due, default=None)


def _at(start: str, seconds: float) -> datetime:
    return parse_time(start).replace(tzinfo=UTC) + timedelta(seconds=seconds)
