"""The alarms of a training that holds its GPUs: Stalled (no step for longer than its stall
timeout) and Underutilized (its GPUs idle for longer than the threshold), each read over the time
it has run since its last pause. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

from gpuop.api.status import Condition, GpuUsage, Phase, ProgressStatus, format_eta, parse_time
from gpuop.observing.records import Thresholds

# The conditions of a pause: a training that runs again after one was neither stalled nor
# underutilized while it waited (suspended, queued or preempted by Kueue).
PAUSES: Final = ("Suspended", "Queued")


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
