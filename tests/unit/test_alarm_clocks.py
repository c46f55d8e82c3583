"""When a training's alarms come due by the clock alone (alarms.next_alarm_at): the time its
last reconcile queues its key for, so that Stalled and Underutilized come then with no tick.
Each case is read against what running_alarms raises at that time and a second before."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gpuop.api.status import Condition, GpuTrainingStatus, GpuUsage, ProgressStatus
from gpuop.observing import alarms
from gpuop.observing.records import Thresholds

NOW = datetime(2026, 11, 28, 10, 0, 0, tzinfo=UTC)
THRESHOLDS = Thresholds(stall_timeout_seconds=60, underutilized_percent=30, underutilized_seconds=600)


def _at(seconds: int) -> str:
    return (NOW + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(phase: str = "Running", **fields: Any) -> GpuTrainingStatus:
    return GpuTrainingStatus(phase=phase, **fields)  # type: ignore[arg-type]


def _raised(status: GpuTrainingStatus, at: datetime) -> set[str]:
    """What running_alarms raises at ``at`` for the status's figures, as derive would ask."""
    resumed = alarms.resumed_at(status.conditions, at.strftime("%Y-%m-%dT%H:%M:%SZ"))
    gpu = status.gpu if status.phase == "Running" else None
    made = alarms.running_alarms(
        status.progress, gpu, THRESHOLDS, at, lambda kind, *_: Condition(type=kind, status="True", reason="", message="", last_transition_time=""),
        resumed, status.phase,  # type: ignore[arg-type]
    )  # fmt: skip
    return {c.type for c in made}


CASES = {
    "stall from the last step": (
        _status(progress=ProgressStatus(step=5, step_advanced_at=_at(-10))),
        50,
        "Stalled",
    ),
    "stall while restarting": (
        _status("Restarting", progress=ProgressStatus(step=5, step_advanced_at=_at(0))),
        60,
        "Stalled",
    ),
    "stall from a resume after the last step": (
        _status(
            progress=ProgressStatus(step=5, step_advanced_at=_at(-100)),
            conditions=(
                Condition(
                    type="Suspended",
                    status="False",
                    reason="Resumed",
                    message="",
                    last_transition_time=_at(-30),
                ),
            ),
        ),
        30,
        "Stalled",
    ),
    "underutilized before the stall": (
        _status(
            progress=ProgressStatus(step=5, step_advanced_at=_at(0)),
            gpu=GpuUsage(utilization_percent=5, underutilized_since=_at(-590)),
        ),
        10,
        "Underutilized",
    ),
}


@pytest.mark.parametrize(("status", "seconds", "alarm"), CASES.values(), ids=CASES.keys())
def test_the_next_alarm_is_when_it_is_raised(status: GpuTrainingStatus, seconds: int, alarm: str) -> None:
    due = alarms.next_alarm_at(status, THRESHOLDS, NOW)
    assert due == NOW + timedelta(seconds=seconds)
    assert alarm not in _raised(status, due - timedelta(seconds=1))
    assert alarm in _raised(status, due)


NO_CLOCK = {
    "not holding GPUs": _status("Suspended", progress=ProgressStatus(step=5, step_advanced_at=_at(0))),
    "a pause the code says": _status(
        progress=ProgressStatus(step=5, step_advanced_at=_at(0), activity="evaluating")
    ),
    "stalled already": _status(
        progress=ProgressStatus(step=5, step_advanced_at=_at(-100)),
        conditions=(
            Condition(
                type="Stalled", status="True", reason="NoProgress", message="", last_transition_time=_at(-40)
            ),
        ),
    ),
    "no step yet": _status(progress=None),
    "underutilized while restarting is no verdict": _status(
        "Restarting", gpu=GpuUsage(utilization_percent=5, underutilized_since=_at(0))
    ),
}


@pytest.mark.parametrize("status", NO_CLOCK.values(), ids=NO_CLOCK.keys())
def test_no_clock_runs(status: GpuTrainingStatus) -> None:
    assert alarms.next_alarm_at(status, THRESHOLDS, NOW) is None


def test_a_disabled_stall_timeout_runs_no_clock() -> None:
    status = _status(progress=ProgressStatus(step=5, step_advanced_at=_at(0)))
    assert alarms.next_alarm_at(status, Thresholds(stall_timeout_seconds=0), NOW) is None
