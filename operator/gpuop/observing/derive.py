"""What the operator observed -> the GpuTraining status. Pure: no clock, no API calls.

The operator gathers an :class:`Observation` (the job's conditions, the training
pods, their scraped metrics and termination messages, the time) and hands it here with the
status it last wrote. :func:`derive_status` decides the phase and conditions;
:func:`status_patch` says whether anything changed, so an unchanged job costs no write.

Time-dependent figures are written only when something else changed or the job finished:
``gpuHours`` grows every second and ``progress.updatedAt`` moves with every scrape, and
writing them on every tick would turn each running job into a steady stream of patches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Final

from gpuop.api.identity import FETCH_CONTAINER
from gpuop.api.status import (
    TERMINAL_PHASES,
    TIME_FORMAT,
    Condition,
    ConditionStatus,
    GpuTrainingStatus,
    GpuUsage,
    JobReference,
    Phase,
    ProgressStatus,
    WorkerCounts,
    condition_reason,
    parse_time,
)
from gpuop.observing import alarms, diagnosis, figures, nodeloss
from gpuop.observing.records import Event, Observation, Thresholds

_ALARMS: Final = (
    "BackendUnavailable",
    "PodsNotStarting",
    "Failed",
    "InvalidSpec",
    "Stalled",
    "Underutilized",
    "Restarting",
    "NameConflict",
    "SpecNotApplied",
    "NodeLost",
)
# Conditions that turn False (reason Cleared) when they stop holding, instead of vanishing.
_CLEARABLE: Final = frozenset(
    {
        "FetchingDataset",
        "PodsNotStarting",
        "Queued",
        "Suspended",
        "Restarting",
        "Stalled",
        "Underutilized",
        "NameConflict",
        "SpecNotApplied",
        "BackendUnavailable",
        "NodeLost",
    }
)
# Kubeflow v1 job condition types, most decisive first: the first True one is the phase.
_JOB_PHASES: Final[tuple[Phase, ...]] = (
    "Failed",
    "Succeeded",
    "Suspended",
    "Restarting",
    "Running",
    "Created",
)
# Named in a message before any backend is chosen ("waiting for the PyTorchJob"): the one
# a GpuTraining ran on before there were others.
_DEFAULT_KIND: Final = "PyTorchJob"


def _stamp(moment: datetime) -> str:
    return moment.strftime(TIME_FORMAT)


def _phase(obs: Observation) -> Phase:
    if obs.invalid_spec is not None:
        return "Failed"
    if obs.job_name is None:
        return "Pending"
    true = {c.type for c in obs.job_conditions if c.status == "True"}
    return next((phase for phase in _JOB_PHASES if phase in true), "Created")


def _job_deleted_after_finishing(
    previous: GpuTrainingStatus, obs: Observation, now: str
) -> GpuTrainingStatus:
    """A finished training whose job is gone: all it reported stays, and the deletion is
    recorded once (the job is never made again: that would train again on the GPUs)."""
    if any(c.type == "JobDeleted" for c in previous.conditions):
        return previous
    kind = _kind(obs)
    deleted = Condition(
        type="JobDeleted", status="True", reason=f"{kind}Deleted",
        message=f"{kind} {previous.job_name} was deleted after the training "
        "finished (Kubeflow's runPolicy.ttlSecondsAfterFinished, or by hand); it is not made again, and "
        "this status keeps the result",
        last_transition_time=now, observed_generation=obs.generation,
    )  # fmt: skip
    return dataclasses.replace(previous, conditions=(*previous.conditions, deleted))


def _merge_conditions(
    previous: tuple[Condition, ...], wanted: list[Condition], keep_types: set[str], now: str
) -> tuple[Condition, ...]:
    """Conditions as wanted, keeping each one's lastTransitionTime while its status holds.

    A previously reported condition of a type in ``keep_types`` that is no longer wanted
    turns False instead of vanishing, so ``kubectl describe`` shows that it cleared.
    """
    old = {c.type: c for c in previous}
    merged: dict[str, Condition] = {}
    for condition in wanted:
        before = old.get(condition.type)
        same = before is not None and before.status == condition.status
        stamp = before.last_transition_time if same and before is not None else now
        merged[condition.type] = dataclasses.replace(condition, last_transition_time=stamp)
    for kind in keep_types:
        before = old.get(kind)
        if kind not in merged and before is not None:
            if before.status == "False":
                merged[kind] = before
            else:
                merged[kind] = Condition(
                    type=kind,
                    status="False",
                    reason="Cleared",
                    message="",
                    last_transition_time=now,
                    observed_generation=before.observed_generation,
                )
    order = {c.type: i for i, c in enumerate(previous)}
    return tuple(sorted(merged.values(), key=lambda c: (order.get(c.type, len(order)), c.type)))


def _stop_conditions(m: _Moment, stop: tuple[str, str, str]) -> tuple[list[Condition], str]:
    """Failed with the pod's own reason and line, and JobStopped saying what the operator did."""
    pod, reason, line = stop
    step = "dataset step" if reason == "DatasetFetchFailed" else "trainer"
    how = f"suspended the {m.kind}"
    if m.obs.queue_name is not None:
        how = f"deactivated its Kueue Workload, so that Kueue suspends the {m.kind}"
    message = (f"pod {pod}'s {step} failed: {line}; a restart would fail the same way, so the job is stopped "
               "and its pods go, holding no GPUs: correct it, then delete the GpuTraining and apply it "
               "again")  # fmt: skip
    said = (f"the operator {how} {m.obs.job_name} when pod {pod}'s {step} failed in a way no restart mends "
            "(Failed says how); it is not resumed")  # fmt: skip
    failed = m.condition("Failed", "True", reason, message)
    return [failed, m.condition("JobStopped", "True", "RestartCannotMend", said)], message


def _kueue_phase(obs: Observation, phase: Phase) -> Phase:
    """The phase of a job under Kueue (a queue is named), where suspend is Kueue's, never the
    user's: Queued while the job is suspended (from its creation on, before Kubeflow says
    Suspended) and its Workload not admitted; Created while it is being resumed. The real Kueue
    showed two such moments, both of which read as Suspended: admitted with the job still
    suspended, and the job resumed with Kubeflow's Suspended condition not yet cleared."""
    if obs.queue_name is None or phase not in ("Created", "Suspended"):
        return phase
    admitted = obs.queue is not None and obs.queue.admitted
    if obs.job_suspended and not admitted:
        return "Queued"
    return "Created"


def _queued(obs: Observation, kind: str) -> tuple[str, str]:
    """Kueue's reason and message for a queued job (its Workload's), or why there is none yet."""
    if obs.queue is not None:
        return obs.queue.reason, f"queued in Kueue LocalQueue {obs.queue_name}: {obs.queue.message}"
    return "WaitingForKueue", (
        f"the {kind} waits, suspended, for Kueue to admit it from LocalQueue {obs.queue_name}; Kueue has "
        f"made no Workload for it yet (if this lasts: is Kueue installed, with its {kind} integration on?)"
    )


def _kind(obs: Observation) -> str:
    """The kind of the training's job (PyTorchJob until a backend is chosen), or its runner."""
    return obs.runner or (obs.job_api.kind if obs.job_api is not None else _DEFAULT_KIND)


def _mutable_fields(obs: Observation) -> str:
    """What may change once the job is made, for the SpecNotApplied message: "a, b and c"."""
    fields = [f"spec.{f}" for f in (obs.job_api.mutable_fields if obs.job_api is not None else ())]
    return " and ".join(filter(None, (", ".join(fields[:-1]), *fields[-1:])))


def _job_reference(obs: Observation) -> JobReference | None:
    """status.job: the job, once made."""
    if obs.job_api is None or obs.job_name is None:
        return None
    return JobReference(api_version=obs.job_api.api_version, kind=obs.job_api.kind, name=obs.job_name)


def _deprecated_job_field(obs: Observation) -> dict[str, str | None]:
    """The backend's deprecated field that names the job (status.pytorchJob, status.trainJob)."""
    if obs.job_api is None or obs.job_api.status_field is None:
        return {}
    return {obs.job_api.status_field: obs.job_name}


def _backend_selected(before: GpuTrainingStatus, obs: Observation) -> tuple[str, str] | None:
    """Why the training runs on its backend: as chosen now, else as said when it was chosen."""
    if obs.backend_choice is not None:
        return obs.backend_choice
    earlier = next((c for c in before.conditions if c.type == "BackendSelected" and c.status == "True"), None)
    if earlier is not None and earlier.reason is not None and earlier.message is not None:
        return earlier.reason, earlier.message
    return None


def _job_reason(obs: Observation, kind: str) -> tuple[str | None, str | None]:
    for condition in obs.job_conditions:
        if condition.type == kind:
            return condition.reason, condition.message
    return None, None


@dataclass(frozen=True)
class _Moment:
    """What one derivation works from: the observation, the status before, and what was
    decided first (phase, figures), shared by the condition builders below."""

    obs: Observation
    before: GpuTrainingStatus
    thresholds: Thresholds
    now: str
    phase: Phase
    kind: str
    progress: ProgressStatus | None
    gpu: GpuUsage | None
    restart_note: tuple[str, str] | None  # (reason, message): why the job is Restarting
    selected: tuple[str, str] | None
    stop: tuple[str, str, str] | None = None  # (pod, reason, line): why the job is stopped for good

    def condition(
        self, kind: str, status: ConditionStatus, reason: str | None, message: str | None
    ) -> Condition:
        return Condition(
            type=kind,
            status=status,
            reason=condition_reason(reason, kind, status),
            message=message or "",
            last_transition_time=self.now,  # kept from the previous one while the status holds (merge)
            observed_generation=self.obs.generation,
        )


def derive_status(
    previous: GpuTrainingStatus | None, obs: Observation, thresholds: Thresholds
) -> GpuTrainingStatus:
    """The status to write. Returns ``previous`` itself when nothing meaningful changed."""
    now = _stamp(obs.now)
    if obs.job_deleted and previous is not None and previous.phase in TERMINAL_PHASES:
        return _job_deleted_after_finishing(previous, obs, now)
    if diagnosis.stopped(previous):
        assert previous is not None
        # Failed for good, its job stopped: what Kubeflow says of the job since is our doing, and
        # a spec edit changes nothing (it is seen: observedGeneration follows).
        if obs.generation is None or obs.generation == previous.observed_generation:
            return previous
        return dataclasses.replace(previous, observed_generation=obs.generation)
    phase = _kueue_phase(obs, _phase(obs))
    stop = diagnosis.stop_for(obs)
    if stop is not None:
        phase = "Failed"
    before = previous or GpuTrainingStatus()
    progress = figures.progress(before.progress, obs, phase, now)
    restart_note = diagnosis.restart_note(obs, progress) if phase == "Running" else None
    moment = _Moment(
        obs=obs, before=before, thresholds=thresholds, now=now,
        phase="Restarting" if restart_note is not None else phase, kind=_kind(obs), progress=progress,
        gpu=figures.gpu(before.gpu, obs, thresholds, now), restart_note=restart_note,
        selected=_backend_selected(before, obs), stop=stop,
    )  # fmt: skip
    wanted, message = _conditions(moment)
    candidate = _status(moment, wanted, message)
    if previous is not None and candidate == previous:
        return previous
    phase = moment.phase
    terminal = phase in TERMINAL_PHASES
    hours, counted_at = _gpu_hours(before, obs, phase, candidate.completion_time, now)
    if hours is None and terminal and candidate.start_time is not None:
        hours = 0.0  # it ran, perhaps between two looks (a short local run): none held since
    return dataclasses.replace(candidate, gpu_hours=hours, gpu_hours_counted_at=counted_at)


def _conditions(m: _Moment) -> tuple[list[Condition], str]:
    """The conditions that hold now (before merging with the previous ones), and the message."""
    obs, kind = m.obs, m.kind
    wanted: list[Condition] = []
    if obs.invalid_spec is not None:
        message = obs.invalid_spec
        wanted += [
            m.condition("InvalidSpec", "True", "InvalidSpec", obs.invalid_spec),
            m.condition("Failed", "True", "InvalidSpec", obs.invalid_spec),
        ]
    elif obs.name_conflict is not None:
        message = obs.name_conflict
        wanted.append(m.condition("NameConflict", "True", "NameConflict", obs.name_conflict))
    elif m.phase == "Pending":
        message = f"waiting for the {kind} to be created"
        if obs.backend_unavailable is not None:
            message = obs.backend_unavailable[1]
            wanted.append(m.condition("BackendUnavailable", "True", *obs.backend_unavailable))
    else:
        message = _job_conditions(m, wanted)
    if m.selected is not None:
        wanted.insert(0, m.condition("BackendSelected", "True", *m.selected))
    return wanted, message


def _job_conditions(m: _Moment, wanted: list[Condition]) -> str:
    """Append the conditions of a training whose job exists; returns the status message."""
    obs, kind, phase = m.obs, m.kind, m.phase
    why = f" ({m.selected[1]})" if m.selected is not None else ""
    warned = "".join(f"; warning: {w}" for w in obs.spec_warnings)
    wanted.append(
        m.condition("Created", "True", f"{kind}Created", f"{kind} {obs.job_name} created{why}{warned}")
    )
    wanted.append(
        m.condition("Running", "True" if phase == "Running" else "False", *_job_reason(obs, "Running"))
    )
    message = f"{kind} {obs.job_name} is {phase.lower()}"
    if m.stop is not None:
        stopping, message = _stop_conditions(m, m.stop)
        wanted += stopping
        return message
    said = _phase_condition(m, message)
    if said is not None:
        wanted.append(said)
        message = said.message
    fetching = sorted(p.name for p in obs.pods if p.fetching_dataset) if phase not in TERMINAL_PHASES else []
    if fetching:
        # Named up to three (1,024 pods' names would pass the message's bound and fail the write).
        who = ", ".join(fetching[:3]) + (f" and {len(fetching) - 3} more" if len(fetching) > 3 else "")
        wanted.append(m.condition("FetchingDataset", "True", "CopyingDataset", (
            f"{who} copy spec.dataset.uri into the dataset path before training "
            f"(kubectl logs {fetching[0]} -c {FETCH_CONTAINER} shows its progress)")))  # fmt: skip
    lost = nodeloss.lost_words(obs.pods, m.thresholds.node_loss_timeout_seconds, obs.now)
    if lost is not None and phase in ("Created", "Running", "Restarting"):  # pods that should run
        wanted.append(m.condition("NodeLost", "True", *lost))
    blocked = diagnosis.cannot_start(obs) if phase not in TERMINAL_PHASES else None
    if blocked is not None:
        wanted.append(m.condition("PodsNotStarting", "True", *blocked))
        message = blocked[1]
    if phase in alarms.HOLDING_GPUS:
        # Restarting too: a gang whose restarted pod never comes back (its node lost, say) holds
        # its GPUs with no step, and would otherwise never alarm. Underutilized stays a verdict
        # on training: a restart's idle GPUs are the restart's, said by its own condition.
        gpu = m.gpu if phase == "Running" else None
        resumed = alarms.resumed_at(m.before.conditions, m.now)
        wanted += alarms.running_alarms(m.progress, gpu, m.thresholds, obs.now, m.condition, resumed, phase)
    if obs.spec_not_applied:
        wanted.append(
            m.condition(
                "SpecNotApplied",
                "True",
                "FixedFieldChanged",
                f"{', '.join(obs.spec_not_applied)} changed after the {kind} was created and "
                f"cannot change on it (only {_mutable_fields(obs)} can); the job runs "
                "as created: change it back, or delete the GpuTraining and create it again",
            )
        )
    return message


def _phase_condition(m: _Moment, message: str) -> Condition | None:
    """The condition named after the phase, for the phases that have one, with its words."""
    obs, kind, phase = m.obs, m.kind, m.phase
    if phase == "Failed":
        record = figures.trainer_record(obs, "Failed")
        earlier = next((c for c in m.before.conditions if c.type == "Failed" and c.status == "True"), None)
        oom = diagnosis.oom_failure(obs)
        if record is not None:
            reason, text = record.reason, record.message
        elif oom is not None:
            reason, text = oom
        elif earlier is not None:  # the pods (and their records) may be gone by now
            reason, text = earlier.reason, earlier.message
        else:
            reason, text = _job_reason(obs, "Failed")
        return m.condition("Failed", "True", reason or f"{kind}Failed", text or f"the {kind} failed")
    if phase == "Succeeded":
        return m.condition("Succeeded", "True", "TrainingSucceeded", "training finished")
    if phase == "Queued":
        return m.condition("Queued", "True", *_queued(obs, kind))
    if phase in ("Suspended", "Restarting"):
        reason, text = _job_reason(obs, phase)
        if m.restart_note is not None:
            reason, text = m.restart_note
        return m.condition(phase, "True", reason or f"{kind}{phase}", text or message)
    return None


def _status(m: _Moment, wanted: list[Condition], message: str) -> GpuTrainingStatus:
    """The status of this moment, its gpuHours as they were (brought up to date by the caller)."""
    obs, before, phase, now = m.obs, m.before, m.phase, m.now
    start = obs.job_start_time or before.start_time
    if start is None and phase in ("Running", "Restarting"):
        start = now
    terminal = phase in TERMINAL_PHASES
    return GpuTrainingStatus(
        phase=phase,
        conditions=_merge_conditions(before.conditions, wanted, set(_CLEARABLE), now),
        observed_generation=obs.generation,
        backend=obs.job_api.backend if obs.job_api is not None else before.backend,
        job=_job_reference(obs),
        **_deprecated_job_field(obs),
        workers=WorkerCounts(ready=sum(1 for p in obs.pods if p.ready and p.phase == "Running"),
                             total=obs.workers_total),
        progress=m.progress,
        gpu=m.gpu,
        checkpoint=figures.checkpoint(before.checkpoint, obs),
        start_time=start,
        completion_time=(obs.job_completion_time or before.completion_time or now) if terminal else None,
        gpu_hours=before.gpu_hours,
        gpu_hours_counted_at=before.gpu_hours_counted_at,
        message=message,
    )  # fmt: skip


def _gpu_hours(
    before: GpuTrainingStatus, obs: Observation, phase: Phase, completion: str | None, now: str
) -> tuple[float | None, str | None]:
    """gpuHours brought up to date: the span since it was last counted is added when the status
    last written said the GPUs were held (the phase only changes at a write, so that span is
    one phase's); a finished training's span ends at its completion. Accumulated, never
    recomputed from the job's start time, which Kubeflow moves on every resume."""
    hours = before.gpu_hours
    counted = before.gpu_hours_counted_at
    if before.phase in alarms.HOLDING_GPUS and counted is not None and obs.gpus:
        end = completion if phase in TERMINAL_PHASES and completion is not None else now
        held = max(0.0, (parse_time(end) - parse_time(counted)).total_seconds())
        hours = round((hours or 0.0) + obs.gpus * held / 3600, 4)
    if phase in alarms.HOLDING_GPUS and hours is None:
        hours = 0.0  # from the first moment it holds its GPUs (or runs, on none): 0, not absent
    return hours, now if phase in alarms.HOLDING_GPUS else None


def events(previous: GpuTrainingStatus | None, new: GpuTrainingStatus) -> list[Event]:
    """One Event per condition that became True, Warning for the bad ones.

    Two conditions telling the same thing at once (InvalidSpec and Failed, both with the
    parse error) make one Event: ``kubectl describe`` should not say it twice.
    """
    before = {c.type: c.status for c in (previous.conditions if previous else ())}
    out: list[Event] = []
    for c in new.conditions:
        # The Created event says why this backend; BackendSelected, True with it, would repeat it.
        if c.type == "BackendSelected":
            continue
        if c.status == "True" and before.get(c.type) != "True":
            kind = "Warning" if c.type in _ALARMS else "Normal"
            event = Event(kind, c.reason or c.type, c.message or c.type)
            if event not in out:
                out.append(event)
    return out
