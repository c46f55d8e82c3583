"""Status derivation: phases, conditions, progress, alarms, and patching only on change."""

from __future__ import annotations

import dataclasses
import json
import re
from datetime import UTC, datetime, timedelta

import pytest

from gpuop._kits.schema import encode
from gpuop.api.status import (
    REASON_PATTERN,
    GpuTrainingStatus,
    condition_reason,
    status_from_json,
    status_patch,
)
from gpuop.backends.pytorchjob import PYTORCHJOB
from gpuop.observing import diagnosis
from gpuop.observing.derive import derive_status, events
from gpuop.observing.records import (
    JobCondition,
    Observation,
    PodObservation,
    QueueState,
    ReceivedReport,
    Thresholds,
)
from gpuop.observing.reports import parse_report
from gpuop.observing.scrape import GpuFigures, TrainerMetrics
from gputrain.contract import Result

T0 = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
THRESHOLDS = Thresholds(stall_timeout_seconds=900, underutilized_percent=30, underutilized_seconds=600)
RUNNING = (JobCondition("Created", "True"), JobCondition("Running", "True", "PyTorchJobRunning", "running"))


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def metrics(step: int, util: float | None = 95.0, loss: float = 0.5) -> TrainerMetrics:
    gpus = () if util is None else (GpuFigures("0", "NVIDIA H100 80GB HBM3", util, 10 * 2**30, 80 * 2**30),)
    return TrainerMetrics(
        epoch=1 + step // 100,
        total_epochs=10,
        step=step,
        total_steps=1000,
        percent=step / 10,
        loss=loss,
        accuracy=None,
        samples_per_second=2500.0,
        estimated_remaining_seconds=(1000 - step) * 0.5,
        gpus=gpus,
    )


def observe(
    seconds: float,
    *,
    conditions: tuple[JobCondition, ...] = RUNNING,
    pods: tuple[PodObservation, ...] = (),
    **kw: object,
) -> Observation:
    fields: dict[str, object] = {
        "now": at(seconds),
        "generation": 1,
        "workers_total": 2,
        "gpus": 2,
        "job_name": "demo",
        "job_conditions": conditions,
        "job_start_time": "2026-11-21T12:00:00Z",
        "pods": pods,
    }
    fields.update(kw)
    fields.setdefault("job_api", PYTORCHJOB.facts)  # the backend, once chosen
    return Observation(**fields)  # type: ignore[arg-type]


def running_pods(step: int, util: float | None = 95.0) -> tuple[PodObservation, ...]:
    return (
        PodObservation("demo-master-0", "Running", True, metrics=metrics(step, util)),
        PodObservation("demo-worker-0", "Running", True, metrics=metrics(max(0, step - 5), util)),
    )


def types(status: GpuTrainingStatus) -> dict[str, str]:
    return {c.type: c.status for c in status.conditions}


def test_a_spec_warning_is_said_once_in_the_created_condition_and_its_event() -> None:
    """A model written to an emptyDir is valid but lost with the pod: `kubectl describe` says so."""
    warning = "spec.output.volume: not set: the trained model is written to an emptyDir"
    created = derive_status(None, observe(0, spec_warnings=(warning,)), THRESHOLDS)
    condition = next(c for c in created.conditions if c.type == "Created")
    assert condition.message.endswith(f"; warning: {warning}")
    said = [e for e in events(None, created) if warning in e.message]
    assert [e.reason for e in said] == ["PyTorchJobCreated"]
    later = derive_status(created, observe(30, spec_warnings=(warning,)), THRESHOLDS)
    assert not [e for e in events(created, later) if warning in e.message]
    plain = derive_status(None, observe(0), THRESHOLDS)
    assert "warning" not in next(c for c in plain.conditions if c.type == "Created").message


def test_pending_until_the_pytorchjob_exists() -> None:
    status = derive_status(None, observe(0, job_name=None, conditions=(), job_start_time=None), THRESHOLDS)
    assert (status.phase, status.conditions, status.start_time) == ("Pending", (), None)


def test_created_then_running_with_progress_and_gpu_figures() -> None:
    created = derive_status(None, observe(0, conditions=(JobCondition("Created", "True"),)), THRESHOLDS)
    assert created.phase == "Created"
    assert types(created) == {"Created": "True", "Running": "False"}
    running = derive_status(created, observe(30, pods=running_pods(120)), THRESHOLDS)
    assert running.phase == "Running"
    assert types(running) == {"Created": "True", "Running": "True"}
    assert running.conditions[0].last_transition_time == "2026-11-21T12:00:00Z"  # Created held
    assert running.workers is not None
    assert (running.workers.ready, running.workers.total) == (2, 2)
    progress = running.progress
    assert progress is not None
    assert (progress.step, progress.percent, progress.eta) == (120, 12.0, "7m20s")  # the most advanced pod
    assert progress.step_advanced_at == "2026-11-21T12:00:30Z"
    assert running.gpu is not None
    assert (running.gpu.count, running.gpu.utilization_percent, running.gpu.memory_used_bytes) == (
        2,
        95.0,
        20 * 2**30,
    )
    # For `kubectl get`: figures with units, and the model for -o wide.
    assert (progress.percent_text, running.gpu.utilization_text) == ("12%", "95%")
    assert running.gpu.model == "NVIDIA H100 80GB HBM3"
    # Every condition has what metav1.Condition requires: a reason, a message, a time.
    for condition in (*created.conditions, *running.conditions):
        assert condition.reason
        assert isinstance(condition.message, str)
        assert condition.last_transition_time
    assert created.conditions[1].reason == "NotRunning"  # Kubeflow gave none
    assert running.start_time == "2026-11-21T12:00:00Z"
    assert running.gpu_hours == 0.0  # Created (pods starting) held none; counting starts now
    assert running.gpu_hours_counted_at == "2026-11-21T12:00:30Z"
    assert [(e.type, e.reason) for e in events(created, running)] == [("Normal", "PyTorchJobRunning")]


def test_nothing_changed_means_no_patch_even_as_time_passes() -> None:
    first = derive_status(None, observe(0, pods=running_pods(100)), THRESHOLDS)
    again = derive_status(first, observe(10, pods=running_pods(100)), THRESHOLDS)
    assert again is first
    assert status_patch(first, again) is None
    assert events(first, again) == []


def test_progress_moves_and_is_written_with_fresh_gpu_hours() -> None:
    first = derive_status(None, observe(0, pods=running_pods(100)), THRESHOLDS)
    later = derive_status(first, observe(3600, pods=running_pods(400)), THRESHOLDS)
    patch = status_patch(first, later)
    assert patch is not None
    assert patch["status"]["progress"]["step"] == 400
    assert patch["status"]["progress"]["updatedAt"] == "2026-11-21T13:00:00Z"
    assert patch["status"]["gpuHours"] == 2.0


def test_a_job_whose_step_stops_moving_is_stalled_then_recovers() -> None:
    status = derive_status(None, observe(0, pods=running_pods(100)), THRESHOLDS)
    status = derive_status(status, observe(899, pods=running_pods(100)), THRESHOLDS)
    assert "Stalled" not in types(status)
    stalled = derive_status(status, observe(900, pods=running_pods(100)), THRESHOLDS)
    assert types(stalled)["Stalled"] == "True"
    condition = next(c for c in stalled.conditions if c.type == "Stalled")
    assert condition.reason == "NoProgress"
    assert condition.message is not None
    assert condition.message.startswith("step 100 has not advanced for 15m00s")
    assert [(e.type, e.reason) for e in events(status, stalled)] == [("Warning", "NoProgress")]
    moving = derive_status(stalled, observe(960, pods=running_pods(101)), THRESHOLDS)
    assert types(moving)["Stalled"] == "False"
    assert events(stalled, moving) == []


def test_a_job_that_never_reports_a_step_stalls_too() -> None:
    status = derive_status(None, observe(0), THRESHOLDS)
    assert status.progress is not None
    assert status.progress.step_advanced_at == "2026-11-21T12:00:00Z"
    assert "Stalled" in types(derive_status(status, observe(1000), THRESHOLDS))


def test_stall_check_can_be_disabled() -> None:
    off = Thresholds(stall_timeout_seconds=0)
    status = derive_status(None, observe(0, pods=running_pods(5)), off)
    assert "Stalled" not in types(derive_status(status, observe(10**6, pods=running_pods(5)), off))


def test_low_gpu_utilization_for_a_while_is_underutilized() -> None:
    status = derive_status(None, observe(0, pods=running_pods(100, util=12)), THRESHOLDS)
    assert status.gpu is not None
    assert status.gpu.underutilized_since == "2026-11-21T12:00:00Z"
    status = derive_status(status, observe(300, pods=running_pods(200, util=14)), THRESHOLDS)
    assert "Underutilized" not in types(status)
    status = derive_status(status, observe(600, pods=running_pods(300, util=10)), THRESHOLDS)
    assert types(status)["Underutilized"] == "True"
    busy = derive_status(status, observe(700, pods=running_pods(400, util=90)), THRESHOLDS)
    assert types(busy)["Underutilized"] == "False"
    assert busy.gpu is not None
    assert busy.gpu.underutilized_since is None


def test_success_reads_the_final_result_from_the_termination_message() -> None:
    running = derive_status(None, observe(0, pods=running_pods(990)), THRESHOLDS)
    result = {
        "phase": "Succeeded",
        "epoch": 10,
        "totalEpochs": 10,
        "step": 1000,
        "totalSteps": 1000,
        "loss": 0.01,
        "accuracy": 0.99,
        "samplesPerSecond": 2600.0,
    }
    done = derive_status(
        running,
        observe(
            7200,
            conditions=(
                JobCondition("Created", "True"),
                JobCondition("Running", "False"),
                JobCondition("Succeeded", "True"),
            ),
            job_completion_time="2026-11-21T14:00:00Z",
            pods=(PodObservation("demo-master-0", "Succeeded", result=Result.from_json(json.dumps(result))),),
        ),
        THRESHOLDS,
    )
    assert done.phase == "Succeeded"
    assert types(done) == {"Created": "True", "Running": "False", "Succeeded": "True"}
    assert done.progress is not None
    assert (done.progress.percent, done.progress.step, done.progress.accuracy) == (100.0, 1000, 0.99)
    assert done.completion_time == "2026-11-21T14:00:00Z"
    assert done.gpu_hours == 4.0  # 2 GPUs x 2 hours
    assert done.gpu is not None
    assert done.gpu.utilization_percent == 95.0
    assert [e.reason for e in events(running, done)] == ["TrainingSucceeded"]


def test_failure_carries_the_trainers_own_reason() -> None:
    record = {
        "phase": "Failed",
        "reason": "DatasetMissing",
        "message": "dataset mnist: ... not found under /data",
    }
    failed = derive_status(
        None,
        observe(
            60,
            conditions=(
                JobCondition("Created", "True"),
                JobCondition("Failed", "True", "PyTorchJobFailed", "job failed"),
            ),
            pods=(PodObservation("demo-master-0", "Failed", result=Result.from_json(json.dumps(record))),),
        ),
        THRESHOLDS,
    )
    assert failed.phase == "Failed"
    condition = next(c for c in failed.conditions if c.type == "Failed")
    assert (condition.reason, condition.message) == ("DatasetMissing", record["message"])
    assert failed.message == record["message"]
    assert [(e.type, e.reason) for e in events(None, failed)][-1] == ("Warning", "DatasetMissing")


def test_a_crash_log_in_the_termination_message_falls_back_to_the_job_condition() -> None:
    failed = derive_status(
        None,
        observe(
            60,
            conditions=(JobCondition("Failed", "True", "PyTorchJobFailed", "pod demo-master-0 exited 1"),),
            pods=(
                PodObservation(
                    "demo-master-0", "Failed", result=Result.from_json("Traceback (most recent call last):")
                ),
            ),
        ),
        THRESHOLDS,
    )
    condition = next(c for c in failed.conditions if c.type == "Failed")
    assert (condition.reason, condition.message) == ("PyTorchJobFailed", "pod demo-master-0 exited 1")


def test_invalid_spec_fails_once_without_a_retry_loop() -> None:
    obs = observe(0, job_name=None, conditions=(), invalid_spec="spec.workers: must be >= 1 (got 0)")
    failed = derive_status(None, obs, THRESHOLDS)
    assert failed.phase == "Failed"
    assert types(failed) == {"InvalidSpec": "True", "Failed": "True"}
    assert failed.message == "spec.workers: must be >= 1 (got 0)"
    # InvalidSpec and Failed say the same thing: one Event, not two.
    assert [(e.type, e.reason) for e in events(None, failed)] == [("Warning", "InvalidSpec")]
    again = derive_status(
        failed, observe(60, job_name=None, conditions=(), invalid_spec=obs.invalid_spec), THRESHOLDS
    )
    assert again is failed
    assert events(failed, again) == []


def test_suspend_and_resume() -> None:
    running = derive_status(None, observe(0, pods=running_pods(10)), THRESHOLDS)
    suspended = derive_status(
        running,
        observe(
            60,
            conditions=(
                JobCondition("Created", "True"),
                JobCondition("Suspended", "True", "JobSuspended", "suspended"),
            ),
        ),
        THRESHOLDS,
    )
    assert suspended.phase == "Suspended"
    assert types(suspended)["Suspended"] == "True"
    resumed = derive_status(suspended, observe(120, pods=running_pods(11)), THRESHOLDS)
    assert resumed.phase == "Running"
    assert types(resumed)["Suspended"] == "False"


def test_patch_nulls_what_is_gone_and_status_reads_back() -> None:
    previous = derive_status(None, observe(0, pods=running_pods(10)), THRESHOLDS)
    assert status_from_json(encode(previous)) == previous
    pending = derive_status(previous, observe(5, job_name=None, conditions=()), THRESHOLDS)
    patch = status_patch(previous, pending)
    assert patch is not None
    assert patch["status"]["pytorchJob"] is None
    assert patch["status"]["startTime"] == "2026-11-21T12:00:00Z"
    assert status_from_json({"phase": "Exploded"}) is None
    assert status_from_json(None) is None


def test_a_fixed_field_changed_past_the_crd_is_reported_once_and_clears_when_reverted() -> None:
    running = derive_status(None, observe(0, pods=running_pods(100)), THRESHOLDS)
    changed = derive_status(
        running, observe(10, pods=running_pods(100), spec_not_applied=("spec.workers (2 -> 4)",)), THRESHOLDS
    )
    assert changed.phase == "Running"  # the job runs on as created
    condition = next(c for c in changed.conditions if c.type == "SpecNotApplied")
    assert (condition.status, condition.reason) == ("True", "FixedFieldChanged")
    assert condition.message == (
        "spec.workers (2 -> 4) changed after the PyTorchJob was created and cannot change on it (only "
        "spec.runPolicy, spec.stallTimeoutSeconds and spec.nodeLossTimeoutSeconds can); the job runs as created: change it back, or "
        "delete the GpuTraining and create it again"
    )
    assert [(e.type, e.reason) for e in events(running, changed)] == [("Warning", "FixedFieldChanged")]
    still = derive_status(
        changed, observe(20, pods=running_pods(100), spec_not_applied=("spec.workers (2 -> 4)",)), THRESHOLDS
    )
    assert still is changed
    reverted = derive_status(still, observe(30, pods=running_pods(100)), THRESHOLDS)
    assert types(reverted)["SpecNotApplied"] == "False"


def _succeeded() -> GpuTrainingStatus:
    result = {"phase": "Succeeded", "step": 1000, "totalSteps": 1000, "accuracy": 0.99, "loss": 0.01}
    return derive_status(
        None,
        observe(
            7200,
            conditions=(JobCondition("Created", "True"), JobCondition("Succeeded", "True")),
            job_completion_time="2026-11-21T14:00:00Z",
            pods=(PodObservation("demo-master-0", "Succeeded", result=Result.from_json(json.dumps(result))),),
        ),
        THRESHOLDS,
    )


def test_a_finished_trainings_deleted_job_is_recorded_once_and_nothing_else_changes() -> None:
    done = _succeeded()
    gone = derive_status(
        done, observe(9000, job_deleted=True, job_name=None, conditions=(), pods=()), THRESHOLDS
    )
    assert gone.phase == "Succeeded"
    assert (gone.completion_time, gone.progress, gone.gpu_hours) == (
        done.completion_time,
        done.progress,
        done.gpu_hours,
    )
    deleted = next(c for c in gone.conditions if c.type == "JobDeleted")
    assert (deleted.status, deleted.reason) == ("True", "PyTorchJobDeleted")
    assert "not made again" in (deleted.message or "")
    assert [(e.type, e.reason) for e in events(done, gone)] == [("Normal", "PyTorchJobDeleted")]
    later = derive_status(
        gone, observe(99000, job_deleted=True, job_name=None, conditions=(), pods=()), THRESHOLDS
    )
    assert later is gone  # no second write, however long it stays gone


def test_a_termination_message_with_wrong_types_is_read_without_them() -> None:
    record = {"phase": "Succeeded", "loss": "not-a-number", "accuracy": float("nan"), "step": True,
              "totalSteps": 100, "message": ["x"]}  # fmt: skip
    parsed = Result.from_json(json.dumps(record))
    assert parsed is not None
    assert (parsed.loss, parsed.accuracy, parsed.step, parsed.message) == (None, None, None, None)
    assert parsed.total_steps == 100
    done = derive_status(
        None,
        observe(60, conditions=(JobCondition("Succeeded", "True"),),
                pods=(PodObservation("demo-master-0", "Succeeded", result=Result.from_json(json.dumps(record))),)),
        THRESHOLDS,
    )  # fmt: skip
    assert done.phase == "Succeeded"
    assert done.progress is not None
    assert done.progress.loss is None


def test_a_restart_from_an_older_checkpoint_restarts_the_stall_clock() -> None:
    """The step goes back (the last checkpoint was older): that is the trainer working, not a
    stall; the old clock would have said Stalled one tick after resuming."""
    status = derive_status(None, observe(0, pods=running_pods(500)), THRESHOLDS)
    status = derive_status(status, observe(899, pods=running_pods(500)), THRESHOLDS)
    resumed = derive_status(status, observe(900, pods=running_pods(300)), THRESHOLDS)
    assert "Stalled" not in types(resumed)
    assert resumed.progress is not None
    assert resumed.progress.step_advanced_at == "2026-11-21T12:15:00Z"
    assert "Stalled" not in types(derive_status(resumed, observe(1700, pods=running_pods(300)), THRESHOLDS))
    assert (
        types(derive_status(resumed, observe(1800, pods=running_pods(300)), THRESHOLDS))["Stalled"] == "True"
    )


def test_a_custom_command_that_publishes_no_progress_is_never_called_stalled() -> None:
    status = derive_status(None, observe(0, reports_progress=False), THRESHOLDS)
    assert status.progress is None
    later = derive_status(status, observe(10**5, reports_progress=False), THRESHOLDS)
    assert "Stalled" not in types(later)
    assert later.phase == "Running"
    # One that does publish gputrain_* figures is watched like ours.
    status = derive_status(None, observe(0, pods=running_pods(7), reports_progress=False), THRESHOLDS)
    assert types(derive_status(status, observe(900, pods=running_pods(7), reports_progress=False),
                               THRESHOLDS))["Stalled"] == "True"  # fmt: skip


def _restarted(started_at: str | None, step: int = 50) -> tuple[PodObservation, ...]:
    """The master's trainer container restarted once; None: exited, not started again yet."""
    return (
        PodObservation(
            "demo-master-0",
            "Running",
            started_at is not None,
            metrics=metrics(step),
            restarts=1,
            trainer_started_at=started_at,
        ),
        PodObservation("demo-worker-0", "Running", True, metrics=metrics(step)),
    )


def test_a_trainer_restarted_in_place_is_restarting_until_the_step_moves_again() -> None:
    """Kubeflow keeps an OnFailure job Running while kubelet restarts a container (the real
    training-operator does): the status says Restarting until training advances past the restart."""
    running = derive_status(None, observe(0, pods=running_pods(50)), THRESHOLDS)
    table = [
        # (seconds, pods, phase)
        (10, _restarted(None), "Restarting"),  # exited, waiting to start again
        (12, _restarted("2026-11-21T12:00:12Z"), "Restarting"),  # started, loading its checkpoint
        (40, _restarted("2026-11-21T12:00:12Z", step=60), "Running"),  # training again
        (70, _restarted("2026-11-21T12:00:12Z", step=70), "Running"),
    ]
    status = running
    for seconds, pods, phase in table:
        status = derive_status(status, observe(seconds, pods=pods), THRESHOLDS)
        assert status.phase == phase, seconds
        if phase == "Restarting":
            restarting = next(c for c in status.conditions if c.type == "Restarting")
            assert (restarting.reason, types(status)["Running"]) == ("TrainerRestarted", "False")
            assert "demo-master-0's trainer restarted (1 so far)" in restarting.message
    assert types(status)["Restarting"] == "False"


def test_a_restart_that_never_resumes_is_stalled_but_never_underutilized() -> None:
    """A gang whose restarted pod cannot come back (its node lost: Kubeflow says Restarting while
    the pod is stuck Terminating) holds its GPUs with no step: Stalled once the stall timeout
    has passed since its last step, saying it happened while restarting. Its idle GPUs are the
    restart's, not an input-bound training's: no Underutilized."""
    restarting = (
        JobCondition("Created", "True"),
        JobCondition("Restarting", "True", "PyTorchJobRestarting", "pod demo-worker-0 deleted"),
    )
    idle = (PodObservation("demo-master-0", "Running", True, metrics=metrics(50, util=0)),)
    status = derive_status(None, observe(0, pods=running_pods(50)), THRESHOLDS)
    status = derive_status(status, observe(60, conditions=restarting, pods=idle), THRESHOLDS)
    assert status.phase == "Restarting"
    status = derive_status(status, observe(899, conditions=restarting, pods=idle), THRESHOLDS)
    assert "Stalled" not in types(status)
    stalled = derive_status(status, observe(900, conditions=restarting, pods=idle), THRESHOLDS)
    assert stalled.phase == "Restarting"
    assert types(stalled)["Stalled"] == "True"
    message = next(c.message for c in stalled.conditions if c.type == "Stalled")
    assert message.startswith("step 50 has not advanced for 15m00s while restarting")
    assert "its node lost" in message
    assert ("Warning", "NoProgress") in [(e.type, e.reason) for e in events(status, stalled)]
    hours_later = derive_status(stalled, observe(7200, conditions=restarting, pods=idle), THRESHOLDS)
    assert "Underutilized" not in types(hours_later)
    # Back on its feet, it trains again: the alarm clears with the first step.
    back = derive_status(hours_later, observe(7260, pods=running_pods(51)), THRESHOLDS)
    assert (back.phase, types(back)["Stalled"]) == ("Running", "False")


def test_a_restart_in_place_that_never_trains_again_is_stalled() -> None:
    """The kubelet restarting a trainer container while Kubeflow keeps the job Running: Restarting
    by the pod's restart count, and Stalled all the same once no step came for the timeout."""
    status = derive_status(None, observe(0, pods=running_pods(50)), THRESHOLDS)
    stuck = derive_status(status, observe(950, pods=_restarted("2026-11-21T12:00:12Z")), THRESHOLDS)
    assert stuck.phase == "Restarting"
    assert types(stuck)["Stalled"] == "True"


def test_a_trainer_killed_for_memory_says_so_restarting_then_failed() -> None:
    """The kernel's OOM kill leaves no record and a log cut mid-step; the kubelet's reason
    (OOMKilled, in lastState once the container restarts) is the one place that says why, and the
    status names the pod, the limit and the fix, as it restarts and once the job gives up."""
    oom = {"oom_killed": True, "memory_limit": "2Gi"}
    restarting = derive_status(
        derive_status(None, observe(0, pods=running_pods(50)), THRESHOLDS),
        observe(10, pods=(
            PodObservation("demo-master-0", "Running", True, metrics=metrics(50)),
            PodObservation("demo-worker-0", "Running", False, metrics=metrics(50), restarts=2, **oom),
        )),
        THRESHOLDS,
    )  # fmt: skip
    assert restarting.phase == "Restarting"
    condition = next(c for c in restarting.conditions if c.type == "Restarting")
    assert condition.reason == "OOMKilled"
    assert condition.message.startswith(
        "pod demo-worker-0's trainer restarted (2 so far) after it ran out of memory"
    )
    assert "its memory limit of 2Gi" in condition.message
    assert "spec.resources.memory" in condition.message
    failed = derive_status(
        restarting,
        observe(
            60,
            conditions=(
                JobCondition("Created", "True"),
                JobCondition("Failed", "True", "BackoffLimitExceeded", "PyTorchJob demo has failed"),
            ),
            pods=(
                PodObservation("demo-master-0", "Running", True, metrics=metrics(50)),
                PodObservation("demo-worker-0", "Failed", **oom),
            ),
        ),
        THRESHOLDS,
    )
    assert failed.phase == "Failed"
    condition = next(c for c in failed.conditions if c.type == "Failed")
    assert condition.reason == "OOMKilled"
    assert condition.message.startswith("pod demo-worker-0's trainer ran out of memory: the kernel killed it")
    assert [(e.type, e.reason) for e in events(restarting, failed)][-1] == ("Warning", "OOMKilled")
    # With no limit set, it says so rather than naming one.
    unlimited = derive_status(
        None,
        observe(60, conditions=(JobCondition("Failed", "True"),),
                pods=(PodObservation("demo-master-0", "Failed", oom_killed=True),)),
        THRESHOLDS,
    )  # fmt: skip
    assert (
        "the node's memory (no limit set)"
        in next(c for c in unlimited.conditions if c.type == "Failed").message
    )


SUSPENDED = (JobCondition("Created", "True"), JobCondition("Suspended", "True", "JobSuspended", "suspended"))


def test_a_job_kueue_holds_is_queued_with_kueues_reason_then_runs() -> None:
    pending = QueueState(False, "Pending", "couldn't assign flavors to pod set master: insufficient quota")
    queued = derive_status(
        None, observe(0, conditions=SUSPENDED, job_suspended=True, queue_name="team-a", queue=pending, job_start_time=None),
        THRESHOLDS,
    )  # fmt: skip
    assert queued.phase == "Queued"
    assert types(queued) == {"Created": "True", "Running": "False", "Queued": "True"}
    condition = next(c for c in queued.conditions if c.type == "Queued")
    assert condition.reason == "Pending"
    assert condition.message == (
        "queued in Kueue LocalQueue team-a: couldn't assign flavors to pod set master: insufficient quota"
    )
    assert queued.gpu_hours is None  # nothing allocated while queued
    assert [(e.type, e.reason) for e in events(None, queued)] == [
        ("Normal", "PyTorchJobCreated"), ("Normal", "Pending")]  # fmt: skip
    running = derive_status(queued, observe(60, pods=running_pods(10), queue_name="team-a"), THRESHOLDS)
    assert running.phase == "Running"
    assert types(running)["Queued"] == "False"


def test_a_job_kueue_resumes_is_created_while_kubeflow_still_says_suspended() -> None:
    """Seen on the real Kueue under load: the job's spec resumed, Kubeflow's Suspended condition
    not yet cleared; with a queue that is not a suspension but a start."""
    status = derive_status(
        None, observe(0, conditions=SUSPENDED, job_suspended=False, queue_name="q"), THRESHOLDS
    )
    assert status.phase == "Created"


def test_a_job_made_suspended_for_kueue_is_queued_before_kubeflow_says_suspended() -> None:
    created = (JobCondition("Created", "True"),)
    status = derive_status(
        None, observe(0, conditions=created, job_suspended=True, queue_name="q"), THRESHOLDS
    )
    assert status.phase == "Queued"
    # No queue: a job made suspended by the user is Created until Kubeflow says Suspended.
    status = derive_status(None, observe(0, conditions=created, job_suspended=True), THRESHOLDS)
    assert status.phase == "Created"


def test_a_queued_job_without_a_workload_yet_says_what_it_waits_for() -> None:
    status = derive_status(
        None, observe(0, conditions=SUSPENDED, job_suspended=True, queue_name="team-a"), THRESHOLDS
    )
    assert status.phase == "Queued"
    condition = next(c for c in status.conditions if c.type == "Queued")
    assert condition.reason == "WaitingForKueue"
    assert "LocalQueue team-a" in (condition.message or "")


@pytest.mark.parametrize("paused", ["suspended", "preempted"])
def test_an_hour_paused_is_no_stall_the_clock_starts_again_on_resume(paused: str) -> None:
    """Issue 28: the stall clock ran through a pause, so a training that resumed after an hour
    suspended (or preempted by Kueue) was Stalled at once, before it could take a step. It starts
    again when the training runs again; a resumed training that then takes no step for the stall
    timeout is still Stalled."""
    queue = {"queue_name": "team-a"} if paused == "preempted" else {}
    running = derive_status(None, observe(0, pods=running_pods(10), **queue), THRESHOLDS)
    if paused == "preempted":
        evicted = QueueState(False, "Preempted", "Preempted to accommodate a workload")
        pause = observe(60, conditions=SUSPENDED, job_suspended=True, queue=evicted, **queue)
    else:
        pause = observe(60, conditions=SUSPENDED)
    held = _round_trip(derive_status(running, pause, THRESHOLDS))  # as a restarted operator reads it
    assert held.phase in ("Suspended", "Queued")
    # An hour later it runs again; its pods are starting, so no figure is newer than step 10.
    resumed = derive_status(held, observe(3660, **queue), THRESHOLDS)
    assert resumed.phase == "Running"
    assert "Stalled" not in types(resumed), [c.message for c in resumed.conditions]
    resumed = _round_trip(resumed)
    still = derive_status(resumed, observe(3660 + 899, pods=running_pods(10), **queue), THRESHOLDS)
    assert "Stalled" not in types(still)
    stuck = derive_status(still, observe(3660 + 900, pods=running_pods(10), **queue), THRESHOLDS)
    assert types(stuck)["Stalled"] == "True"
    assert "has not advanced for 15m" in next(c.message for c in stuck.conditions if c.type == "Stalled")


def _said(step: int, seconds: float, activity: str | None = None) -> tuple[ReceivedReport, ...]:
    """What the training code reported last: its step and, in a pause, what it is doing."""
    metrics = [{"name": "current_step", "value": str(step)}, {"name": "total_steps", "value": "100"}]
    metrics += [{"name": "activity", "value": activity}] if activity is not None else []
    report = parse_report(json.dumps({"trainerStatus": {"metrics": metrics}}).encode())
    return (ReceivedReport("demo-master-0", report, at(seconds)),)


@pytest.mark.parametrize("activity", ["evaluating", "saving", "loading", "compiling"])
def test_an_hour_evaluating_or_saving_is_no_stall_and_the_clock_starts_again_after_it(activity: str) -> None:
    """Issue 28: the stall clock ran through evaluation and checkpoint saves (and data loading,
    torch.compile), so an hour's evaluation was "step 10 has not advanced for 1h". While the code
    says it is doing one (gpureport.pause, the Lightning callback's validation) no Stalled is
    judged, and the clock starts again when it says it trains; a step not taken for the stall
    timeout after that is still Stalled. An activity not among these is training."""
    running = derive_status(None, observe(0, reports=_said(10, 0)), THRESHOLDS)
    paused = derive_status(running, observe(60, reports=_said(10, 60, activity)), THRESHOLDS)
    assert paused.progress is not None
    assert paused.progress.activity == activity
    # An hour on, still in it (as a restarted operator reads the status): no stall.
    hour = derive_status(_round_trip(paused), observe(3660, reports=_said(10, 60, activity)), THRESHOLDS)
    assert "Stalled" not in types(hour), [c.message for c in hour.conditions]
    back = derive_status(hour, observe(3700, reports=_said(10, 3700)), THRESHOLDS)
    assert back.progress is not None
    assert back.progress.activity is None
    assert "Stalled" not in types(back)
    still = derive_status(_round_trip(back), observe(3700 + 899, reports=_said(10, 3700)), THRESHOLDS)
    assert "Stalled" not in types(still)
    stuck = derive_status(still, observe(3700 + 900, reports=_said(10, 3700)), THRESHOLDS)
    assert types(stuck)["Stalled"] == "True"
    assert "has not advanced for 15m" in next(c.message for c in stuck.conditions if c.type == "Stalled")


def test_an_activity_that_is_no_pause_is_training() -> None:
    running = derive_status(None, observe(0, reports=_said(10, 0)), THRESHOLDS)
    other = derive_status(running, observe(60, reports=_said(10, 60, "thinking")), THRESHOLDS)
    assert other.progress is not None
    assert other.progress.activity is None
    stuck = derive_status(other, observe(900, reports=_said(10, 60, "thinking")), THRESHOLDS)
    assert types(stuck)["Stalled"] == "True"


def test_a_moment_without_a_ready_child_job_is_no_pause_for_the_stall_clock() -> None:
    """A TrainJob reads Created while no child Job is ready (a pod's container restarting):
    that is no pause, so a training stuck at one step through such restarts is still Stalled."""
    running = derive_status(None, observe(0, pods=running_pods(10)), THRESHOLDS)
    blip = derive_status(running, observe(600, conditions=(JobCondition("Created", "True"),)), THRESHOLDS)
    assert blip.phase == "Created"
    again = derive_status(_round_trip(blip), observe(660, pods=running_pods(10)), THRESHOLDS)
    assert "Stalled" not in types(again)
    stuck = derive_status(again, observe(900, pods=running_pods(10)), THRESHOLDS)
    assert types(stuck)["Stalled"] == "True"


def test_low_gpu_use_before_a_pause_does_not_count_after_it() -> None:
    low = derive_status(None, observe(0, pods=running_pods(10, util=5.0)), THRESHOLDS)
    suspended = derive_status(low, observe(60, conditions=SUSPENDED), THRESHOLDS)
    resumed = derive_status(suspended, observe(3660, pods=running_pods(11, util=5.0)), THRESHOLDS)
    assert "Underutilized" not in types(resumed)
    later = derive_status(resumed, observe(3660 + 600, pods=running_pods(400, util=5.0)), THRESHOLDS)
    assert types(later)["Underutilized"] == "True"  # 600 s low since the resume: the threshold


def test_a_preempted_job_is_queued_again_with_kueues_reason() -> None:
    running = derive_status(None, observe(0, pods=running_pods(10), queue_name="team-a"), THRESHOLDS)
    evicted = QueueState(
        False, "Preempted", "Preempted to accommodate a workload (UID: x) due to prioritization"
    )
    queued = derive_status(running, observe(60, conditions=SUSPENDED, job_suspended=True, queue_name="team-a", queue=evicted),
                           THRESHOLDS)  # fmt: skip
    assert queued.phase == "Queued"
    assert next(c for c in queued.conditions if c.type == "Queued").reason == "Preempted"


def test_without_a_queue_a_suspended_job_is_suspended_not_queued() -> None:
    status = derive_status(None, observe(0, conditions=SUSPENDED), THRESHOLDS)
    assert status.phase == "Suspended"
    admitted = QueueState(True, "Admitted", "The workload is admitted")
    # Admitted, not yet resumed by Kueue (the next moment): starting, neither queued nor suspended.
    status = derive_status(
        None, observe(0, conditions=SUSPENDED, job_suspended=True, queue_name="q", queue=admitted), THRESHOLDS
    )
    assert status.phase == "Created"


def _round_trip(status: GpuTrainingStatus) -> GpuTrainingStatus:
    """As a restarted operator reads it back from the API server."""
    read = status_from_json(json.loads(json.dumps(encode(status))))
    assert read is not None
    return read


def test_gpu_hours_count_only_the_time_the_gpus_are_held_across_suspend_and_restarts() -> None:
    """8 GPUs: 1 h running, 2 h suspended, 30 min queued after a preemption, 1 h running again
    (Kubeflow moves the job's startTime at the resume), the operator restarted twice between
    writes, a restart in place on the way: 8 x 2 h = 16 GPU-hours, not 8 x 4.5 h."""
    suspended = (JobCondition("Created", "True"), JobCondition("Suspended", "True", "JobSuspended", "s"))
    preempted = {
        "conditions": suspended,
        "job_suspended": True,
        "queue_name": "q",
        "queue": QueueState(False, "Preempted", "p"),
    }
    steps: list[tuple[float, dict[str, object]]] = [
        (0, {"pods": running_pods(10)}),
        (1800, {"pods": running_pods(500)}),
        (3600, {"conditions": suspended}),  # 1 h held
        (3 * 3600, preempted),
        (3.5 * 3600, {"pods": running_pods(501), "job_start_time": "2026-11-21T15:30:00Z"}),
        (4 * 3600, {"pods": (PodObservation("demo-master-0", "Running", True, restarts=1),)}),  # Restarting
        (4.5 * 3600, {"pods": running_pods(900), "job_start_time": "2026-11-21T15:30:00Z"}),
    ]
    status: GpuTrainingStatus | None = None
    hours = []
    for seconds, changes in steps:
        status = derive_status(
            status and _round_trip(status), observe(seconds, gpus=8, **changes), THRESHOLDS
        )
        hours.append((status.phase, status.gpu_hours))
    assert hours == [
        ("Running", 0.0), ("Running", 4.0), ("Suspended", 8.0), ("Queued", 8.0), ("Running", 8.0),
        ("Restarting", 12.0), ("Running", 16.0)]  # fmt: skip
    assert status is not None
    done = derive_status(status, observe(
        5 * 3600, gpus=8, job_completion_time="2026-11-21T16:45:00Z",  # a quarter hour after the last write
        conditions=(JobCondition("Created", "True"), JobCondition("Succeeded", "True")),
    ), THRESHOLDS)  # fmt: skip
    assert (done.phase, done.gpu_hours, done.gpu_hours_counted_at) == ("Succeeded", 18.0, None)


def test_gpu_hours_are_absent_until_the_training_first_runs() -> None:
    pending = derive_status(None, observe(0, job_name=None, conditions=(), job_start_time=None), THRESHOLDS)
    assert pending.gpu_hours is None
    created = derive_status(None, observe(0, conditions=(JobCondition("Created", "True"),)), THRESHOLDS)
    assert created.gpu_hours is None
    on_cpus = derive_status(created, observe(60, gpus=0, pods=running_pods(1)), THRESHOLDS)
    assert on_cpus.gpu_hours == 0.0


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("PyTorchJobRunning", "PyTorchJobRunning"),
        ("out of memory", "OutOfMemory"),
        ("CUDA error: an illegal memory access", "CUDAErrorAnIllegalMemoryAccess"),
        ("42 failures", "Failures"),
        ("", "Fallback"),
        (None, "Fallback"),
        ("!!!", "Fallback"),
        ("x" * 2000, "X" + "x" * 1023),
    ],
)
def test_condition_reasons_always_meet_metav1_condition(text: str | None, reason: str) -> None:
    """Reasons from Kubeflow, Kueue or a custom image's record are made valid, not sent as they
    are to an API server that would refuse the whole status write."""
    assert condition_reason(text, "Fallback", "True") == reason
    assert re.fullmatch(REASON_PATTERN, reason)


def test_a_status_written_before_reasons_were_required_reads_back_whole() -> None:
    """An upgrade must not forget a finished training's status: conditions then could lack a
    reason or message."""
    old = {
        "phase": "Succeeded", "gpuHours": 3.5, "completionTime": "2026-11-21T12:00:00Z",
        "conditions": [
            {"type": "Running", "status": "False", "lastTransitionTime": "2026-11-21T11:00:00Z"},
            {"type": "Stalled", "status": "False", "reason": "Cleared", "message": None,
             "lastTransitionTime": "2026-11-21T11:00:00Z"},
        ],
    }  # fmt: skip
    status = status_from_json(old)
    assert status is not None
    assert (status.phase, status.gpu_hours) == ("Succeeded", 3.5)
    assert [(c.reason, c.message) for c in status.conditions] == [("NotRunning", ""), ("Cleared", "")]


def test_a_pod_whose_trainer_cannot_start_says_why_and_what_to_change_until_it_starts() -> None:
    """A Secret the pod names is missing (spec.checkpoint.secretName): the kubelet retries on its
    own and says why only in the pod; the training stays Created, and before it said nothing."""
    created = (JobCondition("Created", "True"),)
    waiting = PodObservation(
        "demo-master-0", "Pending", cannot_start=("CreateContainerConfigError", 'secret "s3-creds" not found')
    )
    blocked = derive_status(None, observe(0, conditions=created, pods=(waiting,)), THRESHOLDS)
    assert blocked.phase == "Created"
    condition = next(c for c in blocked.conditions if c.type == "PodsNotStarting")
    assert (condition.status, condition.reason) == ("True", "CreateContainerConfigError")
    assert condition.message == (
        'pod demo-master-0\'s trainer cannot start: secret "s3-creds" not found; create what it names in '
        "the GpuTraining's namespace, or correct the name (spec.checkpoint.secretName, spec.env)"
    )
    assert blocked.message == condition.message
    assert [(e.type, e.reason) for e in events(None, blocked)][-1] == (
        "Warning",
        "CreateContainerConfigError",
    )
    started = derive_status(blocked, observe(60, pods=running_pods(10)), THRESHOLDS)
    cleared = next(c for c in started.conditions if c.type == "PodsNotStarting")
    assert (cleared.status, cleared.reason) == ("False", "Cleared")


def test_a_trainer_restarting_after_its_own_failure_says_that_failure() -> None:
    """A store that refuses the trainer's credentials: the trainer ends with its reason and one
    line, the kubelet restarts it (restartPolicy OnFailure), and the Restarting condition says
    that line, not only that it restarted."""
    said = "s3://ckpt/demo: list failed: access denied (SignatureDoesNotMatch); check the credentials"
    record = Result("Failed", reason="CheckpointStorageFailed", message=said)
    pods = (
        PodObservation("demo-master-0", "Running", restarts=2, result=record),
        PodObservation("demo-worker-0", "Running", True),
    )
    restarting = derive_status(None, observe(60, pods=pods), THRESHOLDS)
    assert restarting.phase == "Restarting"
    condition = next(c for c in restarting.conditions if c.type == "Restarting")
    assert condition.reason == "CheckpointStorageFailed"
    assert condition.message == f"pod demo-master-0's trainer restarted (2 so far) after it failed: {said}"


def test_a_trainer_restarting_after_a_peers_stop_says_only_that_it_restarted() -> None:
    """torchrun stops the other ranks when one dies, and they write "Preempted": that record is
    no failure of their own, so the note stays the general one."""
    stopped = Result(
        "Failed", reason="Preempted", message="stopped by SIGTERM at step 40; the next start resumes"
    )
    pods = (PodObservation("demo-master-0", "Running", restarts=1, result=stopped),)
    restarting = derive_status(None, observe(60, pods=pods), THRESHOLDS)
    condition = next(c for c in restarting.conditions if c.type == "Restarting")
    assert condition.reason == "TrainerRestarted"


# -- status.checkpoint (issue 27) ----------------------------------------------------------------


def _checkpointed(pod: str, step: int, seconds: float, **said: str) -> ReceivedReport:
    """A report whose code said its checkpoint of ``step`` is complete."""
    values = {"current_step": str(step + 3), "total_steps": "100", "checkpoint_step": str(step), **said}
    report = parse_report(json.dumps({"trainerStatus": {"metrics": [
        {"name": n, "value": v} for n, v in values.items()]}}).encode())  # fmt: skip
    return ReceivedReport(pod, report, at(seconds))


def test_the_last_checkpoint_is_in_status_kept_across_a_restart_until_a_newer_one() -> None:
    """What the newest report says; when the reports are gone (a restarted pod, a preemption, an
    operator restart), what the status said; a report without a time is dated when it came."""
    first = _checkpointed("demo-master-0", 20, 60, checkpoint_time="2026-11-21T12:00:55Z",
                          checkpoint_uri="s3://ckpt/demo/step-00000020-aa.pt")  # fmt: skip
    status = derive_status(None, observe(60, reports=(first,)), THRESHOLDS)
    assert status.checkpoint is not None
    assert (status.checkpoint.step, status.checkpoint.time, status.checkpoint.uri) == (
        20, "2026-11-21T12:00:55Z", "s3://ckpt/demo/step-00000020-aa.pt")  # fmt: skip
    assert encode(status)["checkpoint"] == {"step": 20, "time": "2026-11-21T12:00:55Z",
                                            "uri": "s3://ckpt/demo/step-00000020-aa.pt"}  # fmt: skip
    restarted = derive_status(_round_trip(status), observe(120, reports=_said(21, 120)), THRESHOLDS)
    assert restarted.checkpoint == status.checkpoint
    # Of two pods' reports (a restarted pod's old one lingers), the newest; no time: when it came.
    newer = _checkpointed("demo-worker-0", 40, 180, checkpoint_uri="/checkpoints/step-00000040-bb.pt")
    later = derive_status(restarted, observe(180, reports=(first, newer)), THRESHOLDS)
    assert later.checkpoint is not None
    assert (later.checkpoint.step, later.checkpoint.time, later.checkpoint.uri) == (
        40, "2026-11-21T12:03:00Z", "/checkpoints/step-00000040-bb.pt")  # fmt: skip
    # The same report again, later: the same checkpoint, not a new time (and no write).
    again = derive_status(later, observe(240, reports=(first, newer)), THRESHOLDS)
    assert again.checkpoint == later.checkpoint
    assert status_patch(later, derive_status(later, observe(181, reports=(first, newer)), THRESHOLDS)) is None


def test_a_training_fetching_its_dataset_says_so_then_clears_and_a_failed_copy_says_why() -> None:
    """spec.dataset.uri: while the pods' dataset step copies, FetchingDataset (no alarm; the
    phase stays Created); when training runs it turns False; a copy that fails is
    PodsNotStarting with the step's own line and where its log is."""
    created = (JobCondition("Created", "True"),)
    copying = (PodObservation("demo-master-0", "Pending", fetching_dataset=True),
               PodObservation("demo-worker-0", "Pending", fetching_dataset=True))  # fmt: skip
    fetching = derive_status(None, observe(0, conditions=created, pods=copying), THRESHOLDS)
    assert fetching.phase == "Created"
    condition = next(c for c in fetching.conditions if c.type == "FetchingDataset")
    assert (condition.status, condition.reason) == ("True", "CopyingDataset")
    assert condition.message == (
        "demo-master-0, demo-worker-0 copy spec.dataset.uri into the dataset path before training "
        "(kubectl logs demo-master-0 -c fetch-dataset shows its progress)"
    )
    assert [(e.type, e.reason) for e in events(None, fetching)][-1] == ("Normal", "CopyingDataset")
    running = derive_status(fetching, observe(60, pods=running_pods(10)), THRESHOLDS)
    assert types(running)["FetchingDataset"] == "False"
    said = "s3://data/demo: list failed: access denied (InvalidAccessKeyId); check the credentials"
    failing = PodObservation("demo-master-0", "Pending", cannot_start=("DatasetFetchFailed", said))
    failed = derive_status(None, observe(0, conditions=created, pods=(failing,)), THRESHOLDS)
    condition = next(c for c in failed.conditions if c.type == "PodsNotStarting")
    assert (condition.status, condition.reason) == ("True", "DatasetFetchFailed")
    assert condition.message == (
        f"pod demo-master-0's dataset step cannot copy spec.dataset.uri: {said}; the kubelet retries it "
        "(kubectl logs demo-master-0 -c fetch-dataset)"
    )


def test_a_thousand_pods_fetching_are_named_three_and_a_count() -> None:
    """The message stays within its bound however many workers copy (1,024 names would not)."""
    copying = tuple(PodObservation(f"demo-worker-{i}", "Pending", fetching_dataset=True) for i in range(1024))
    status = derive_status(
        None, observe(0, conditions=(JobCondition("Created", "True"),), pods=copying), THRESHOLDS
    )
    condition = next(c for c in status.conditions if c.type == "FetchingDataset")
    assert condition.message.startswith("demo-worker-0, demo-worker-1, demo-worker-10 and 1021 more copy ")
    assert len(condition.message) < 300


# -- a failure no restart mends (Result.permanent) ---------------------------------------------------


def test_a_pod_down_after_a_failure_no_restart_mends_fails_the_training_and_stops_its_job() -> None:
    """Wrong credentials: Failed at once with the trainer's reason and line, JobStopped saying
    what the operator did (the reconciler suspends the job first), one Warning; from then on the
    status stays as written, whatever Kubeflow says of the suspended job."""
    line = "s3://ckpt/demo: list failed: access denied (InvalidAccessKeyId); check the credentials"
    pods = (
        PodObservation("demo-master-0", "Running", needs_fix=("CheckpointStorageFailed", line)),
        PodObservation("demo-worker-0", "Running", True),
    )
    failed = derive_status(None, observe(30, pods=pods), THRESHOLDS)
    assert failed.phase == "Failed"
    assert diagnosis.stop_for(observe(30, pods=pods)) == ("demo-master-0", "CheckpointStorageFailed", line)
    condition = next(c for c in failed.conditions if c.type == "Failed")
    assert (condition.status, condition.reason) == ("True", "CheckpointStorageFailed")
    assert (
        condition.message
        == failed.message
        == (
            f"pod demo-master-0's trainer failed: {line}; a restart would fail the same way, so the job is "
            "stopped and its pods go, holding no GPUs: correct it, then delete the GpuTraining and apply it again"
        )
    )
    stopped = next(c for c in failed.conditions if c.type == "JobStopped")
    assert stopped.status == "True"
    assert stopped.message.startswith("the operator suspended the PyTorchJob demo when pod demo-master-0's")
    assert failed.completion_time is not None
    assert [(e.type, e.reason) for e in events(None, failed)][-2:] == [
        ("Warning", "CheckpointStorageFailed"),
        ("Normal", "RestartCannotMend"),
    ]
    assert diagnosis.stopped(failed)
    suspended = (
        JobCondition("Created", "True"),
        JobCondition("Suspended", "True", "JobSuspended", "suspended"),
    )
    assert derive_status(failed, observe(60, conditions=suspended), THRESHOLDS) is failed
    assert derive_status(failed, observe(90, conditions=RUNNING, pods=running_pods(10)), THRESHOLDS) is failed


def test_under_kueue_the_stop_is_a_deactivated_workload_and_a_dataset_step_is_named() -> None:
    line = "s3://data/mnist: list failed: the bucket does not exist; create it or correct the URI"
    pods = (PodObservation("demo-master-0", "Pending", needs_fix=("DatasetFetchFailed", line)),)
    failed = derive_status(None, observe(30, pods=pods, queue_name="team-a"), THRESHOLDS)
    assert failed.phase == "Failed"
    assert failed.message.startswith(f"pod demo-master-0's dataset step failed: {line}; ")
    stopped = next(c for c in failed.conditions if c.type == "JobStopped")
    assert "deactivated its Kueue Workload, so that Kueue suspends the PyTorchJob demo" in stopped.message


def test_a_finished_job_or_a_failure_a_restart_may_mend_is_not_stopped() -> None:
    """A store down past its retries (no permanent flag: the pod has no needs_fix) restarts as
    before; a job Kubeflow already finished is Kubeflow's to say."""
    line = "s3://ckpt/demo: list failed: 503 Service Unavailable"
    transient = (PodObservation("demo-master-0", "Running", restarts=1,
                                result=Result("Failed", reason="CheckpointStorageFailed", message=line)),)  # fmt: skip
    assert derive_status(None, observe(30, pods=transient), THRESHOLDS).phase == "Restarting"
    assert diagnosis.stop_for(observe(30, pods=transient)) is None
    needs_fix = (PodObservation("demo-master-0", "Failed", needs_fix=("InvalidSettings", "bad")),)
    done = (
        JobCondition("Created", "True"),
        JobCondition("Failed", "True", "BackoffLimitExceeded", "too many"),
    )
    assert diagnosis.stop_for(observe(30, conditions=done, pods=needs_fix)) is None
    assert not diagnosis.stopped(
        derive_status(None, observe(30, conditions=done, pods=needs_fix), THRESHOLDS)
    )


def test_a_job_that_says_it_was_stopped_fails_the_training_whatever_its_pods_say_now() -> None:
    """The stop is on the job (its annotation): a status write lost after the suspend is made
    good on the next look, when the pods are gone; a pod older than the job (of a training of
    the same name, deleted and applied again) stops nothing; a spec edit of a stopped training
    is acknowledged and nothing else."""
    why = ("demo-master-0", "CheckpointStorageFailed", "s3://ckpt/demo: list failed: access denied")
    suspended = (
        JobCondition("Created", "True"),
        JobCondition("Suspended", "True", "JobSuspended", "suspended"),
    )
    failed = derive_status(None, observe(30, conditions=suspended, job_stopped=why), THRESHOLDS)
    assert (failed.phase, diagnosis.stopped(failed)) == ("Failed", True)
    assert next(c for c in failed.conditions if c.type == "Failed").message.startswith(
        f"pod demo-master-0's trainer failed: {why[2]}; "
    )
    old = (PodObservation("demo-master-0", "Running", needs_fix=("InvalidSettings", "bad"),
                          created_at="2026-11-21T11:59:00Z"),)  # fmt: skip
    fresh = observe(30, pods=old, job_created_at="2026-11-21T12:00:00Z")
    assert diagnosis.stop_for(fresh) is None
    assert derive_status(None, fresh, THRESHOLDS).phase == "Running"
    edited = derive_status(failed, observe(60, generation=2), THRESHOLDS)
    assert edited.observed_generation == 2
    assert dataclasses.replace(edited, observed_generation=failed.observed_generation) == failed
