"""The GpuTraining status: its shape, documented for ``kubectl explain``.

Shape only: :mod:`gpuop.observing.derive` decides what goes in it (phase, conditions, progress from the
trainers' reports, GPU utilization, gpuHours); the CRD's status schema is generated from these
classes like the spec's.
Field names follow what Kubeflow users know from Trainer v2's ``trainerStatus``
(``progressPercentage``, ``estimatedRemainingSeconds``) where the idea is the same.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final, Literal, get_args

from gpuop._kits.schema import SpecError, api_field, api_object, decode, encode
from gputrain.contract import CompileMode

ConditionStatus = Literal["True", "False", "Unknown"]
Phase = Literal["Pending", "Created", "Queued", "Running", "Restarting", "Suspended", "Succeeded", "Failed"]
PHASES: Final[tuple[str, ...]] = get_args(Phase)
# The phases a training never leaves: its job's own terminal conditions carry the same names.
TERMINAL_PHASES: Final[tuple[Phase, ...]] = ("Succeeded", "Failed")


# metav1.Condition's reason: a word of letters, digits, '_', ',' and ':'.
REASON_PATTERN: Final = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


def condition_reason(text: str | None, condition_type: str, status: str) -> str:
    """``text`` as the reason of a ``condition_type`` condition with ``status``. Reasons come
    from Kubeflow, Kueue and the trainer's record (a custom image writes what it likes): one the
    API server would refuse would stop this object's status writes, so it is made CamelCase
    here (``out of memory`` -> ``OutOfMemory``); for none, the type stands in (``NotType`` for
    a condition that does not hold)."""
    words = re.split(r"[^A-Za-z0-9_]+", text or "")
    camel = "".join(w[:1].upper() + w[1:] for w in words).lstrip("0123456789_")[:1024].rstrip("_")
    return camel or (condition_type if status == "True" else f"Not{condition_type}")


@api_object
class Condition:
    """A condition in the Kubernetes convention."""

    type: str = api_field(
        "Condition type: Created, Queued, Running, Succeeded, Failed, Suspended, Restarting, InvalidSpec, "
        "NameConflict, SpecNotApplied, Stalled, Underutilized, JobDeleted, JobStopped (a pod failed in a "
        "way no restart mends, and the operator stopped its job so that no GPU is held restarting "
        "into it), BackendSelected, "
        "BackendUnavailable, PodsNotStarting (the kubelet cannot start a pod's trainer: a Secret it "
        "names is missing, its image cannot be pulled, the dataset step failed; the reason and what to "
        "change), FetchingDataset (the dataset step copies spec.dataset.uri before training) or "
        "NodeLost (a pod's node is not Ready or gone: which nodes and pods, and when the operator "
        "starts the gang again; spec.nodeLossTimeoutSeconds).",
        max_length=64,
    )
    status: ConditionStatus = api_field("Whether the condition holds.")
    # Required, with metav1.Condition's rules, so that tools written for Kubernetes' own
    # conditions (kubectl wait, kstatus, Argo CD health checks) read ours the same way.
    reason: str = api_field(
        "A CamelCase word for the last transition (metav1.Condition's rule).",
        min_length=1,
        max_length=1024,
        pattern=REASON_PATTERN,
        pattern_hint="a CamelCase word",
    )
    message: str = api_field("What happened, for people; may be empty.", max_length=32768)
    last_transition_time: str = api_field("When status last changed.", date_time=True, max_length=64)
    observed_generation: int | None = api_field(
        "The metadata.generation this condition was set for.", default=None, minimum=0
    )


@api_object
class WorkerCounts:
    """Worker pods."""

    ready: int = api_field("Worker pods running and ready.", default=0, minimum=0)
    total: int = api_field("Worker pods the job asks for.", default=0, minimum=0)


# Where a training's progress figures came from (ProgressStatus.source).
ProgressSource = Literal["TrainerStatus", "TrainerMetrics", "TrainerResult"]
# What the training code may say it is doing besides optimizer steps (its reports' "activity"
# metric); the stall clock is paused meanwhile.
Activity = Literal["loading", "compiling", "evaluating", "saving"]


@api_object
class NamedMetric:
    """One metric a training code reported that no progress field holds."""

    name: str = api_field("The metric's name, as the training code sent it.", max_length=128)
    value: str = api_field("Its value, as sent.", max_length=64)


@api_object
class ProgressStatus:
    """Training progress: from the reports the training code sends (Kubeflow's trainerStatus
    protocol) while it runs, and from the trainer's termination message when it finishes."""

    percent: float | None = api_field(
        "Progress in percent of the run's data (epochs x the training split): unlike steps, it keeps "
        "its value when a resume changes the world size.",
        default=None,
        minimum=0,
        maximum=100,
    )
    epoch: int | None = api_field("Current epoch, from 1.", default=None, minimum=0)
    total_epochs: int | None = api_field("Epochs in the run.", default=None, minimum=0)
    step: int | None = api_field("Optimizer steps done.", default=None, minimum=0)
    total_steps: int | None = api_field("Optimizer steps in the run.", default=None, minimum=0)
    loss: float | None = api_field("Training loss, mean over the last logging interval.", default=None)
    accuracy: float | None = api_field(
        "Accuracy on the evaluation split, 0..1.", default=None, minimum=0, maximum=1
    )
    samples_per_second: float | None = api_field(
        "Training throughput of the whole job.", default=None, minimum=0
    )
    estimated_remaining_seconds: int | None = api_field(
        "Estimated seconds to completion.", default=None, minimum=0
    )
    eta: str | None = api_field(
        "estimatedRemainingSeconds for people, e.g. 1h12m.", default=None, max_length=32
    )
    percent_text: str | None = api_field(
        "percent for people, rounded down, e.g. 41% (kubectl get's Progress column).",
        default=None,
        max_length=8,
    )
    updated_at: str | None = api_field(
        "When these figures last changed.", default=None, date_time=True, max_length=64
    )
    step_advanced_at: str | None = api_field(
        "When the step counter last moved (or the job started running); Stalled is measured from it.",
        default=None,
        date_time=True,
        max_length=64,
    )
    activity: Activity | None = api_field(
        "What the training code says it is doing besides optimizer steps, for as long as its "
        "reports say so (gpureport's pause(), the Lightning callback's validation); absent: "
        "training. Stalled is not judged meanwhile, and its clock starts again when this ends.",
        default=None,
    )
    source: ProgressSource | None = api_field(
        "Where these figures came from: TrainerStatus (the training code's reports: Hugging Face's "
        "KubeflowCallback, the Kubeflow SDK, gpureport), TrainerMetrics (the built-in trainer's metrics "
        "endpoint) or TrainerResult (the trainer's final record).",
        default=None,
    )
    reported_by: str | None = api_field(
        "The pod whose report these figures are.", default=None, max_length=253
    )
    compile: CompileMode | None = api_field(
        "How the built-in trainer runs its model, and why (spec.training.compile): CompiledCacheHit or "
        "CompiledCacheMiss (compiled; the training's compile cache, beside its checkpoints, had an entry "
        "for it or not), EagerForced (compile: false), EagerOnCpu, EagerNoCompiler (no C compiler for "
        "Triton in the image) or EagerTooShort (the steps left would not win back the compile). Absent "
        "until the trainer has decided, and for other training code.",
        default=None,
    )
    metrics: tuple[NamedMetric, ...] = api_field(
        "Other metrics of the latest report (learning rate, grad norm, eval loss, ...), as sent.",
        default=(),
        max_items=16,
        list_map_key="name",
    )


@api_object
class WorkerGpu:
    """GPU figures of one worker pod."""

    pod: str = api_field("Worker pod name.", max_length=253)
    utilization_percent: float | None = api_field(
        "Mean utilization of the pod's GPUs, percent.", default=None, minimum=0, maximum=100
    )
    memory_used_bytes: int | None = api_field(
        "GPU memory in use, summed over its GPUs.", default=None, minimum=0
    )
    memory_total_bytes: int | None = api_field(
        "GPU memory in all, summed over its GPUs.", default=None, minimum=0
    )


# Where a training's GPU figures came from (GpuUsage.source).
GpuSource = Literal["DcgmExporter", "Trainer"]


@api_object
class GpuUsage:
    """GPU usage of the job: from NVIDIA's dcgm-exporter on the nodes (any image), or from NVML
    inside the built-in trainer."""

    count: int | None = api_field("GPUs the job holds (workers x gpusPerWorker).", default=None, minimum=0)
    utilization_percent: float | None = api_field(
        "Mean GPU utilization over all workers, percent.", default=None, minimum=0, maximum=100
    )
    memory_used_bytes: int | None = api_field("GPU memory in use over all workers.", default=None, minimum=0)
    memory_total_bytes: int | None = api_field("GPU memory in all over all workers.", default=None, minimum=0)
    utilization_text: str | None = api_field(
        "utilizationPercent for people, e.g. 87% (kubectl get's GPU-Util column).", default=None, max_length=8
    )
    model: str | None = api_field(
        "The GPU model the trainers see (NVML's name, e.g. NVIDIA H100 80GB HBM3); several, comma-separated, "
        "when the workers' differ.",
        default=None,
        max_length=512,
    )
    underutilized_since: str | None = api_field(
        "Since when mean utilization has stayed under the Underutilized threshold.",
        default=None,
        date_time=True,
        max_length=64,
    )
    per_worker: tuple[WorkerGpu, ...] = api_field(
        "Per worker pod.", default=(), max_items=1024, list_map_key="pod"
    )
    source: GpuSource | None = api_field(
        "Where these figures came from: DcgmExporter (the node's exporter, any image) or Trainer "
        "(NVML inside the built-in trainer).",
        default=None,
    )


@api_object
class JobReference:
    """The object a training's backend made to run it."""

    api_version: str = api_field("Its apiVersion, e.g. kubeflow.org/v1.", max_length=253)
    kind: str = api_field("Its kind, e.g. PyTorchJob.", max_length=63)
    name: str = api_field("Its name, in the GpuTraining's namespace.", max_length=253)


@api_object
class GpuTrainingStatus:
    """What the operator observed."""

    phase: Phase | None = api_field(
        "Pending, Created (PyTorchJob or TrainJob made), Queued (suspended by Kueue until it admits the "
        "job; the Queued condition carries Kueue's reason), Running, Restarting, Suspended, Succeeded "
        "or Failed.",
        default=None,
    )
    conditions: tuple[Condition, ...] = api_field(
        "Conditions, one per type.", default=(), max_items=32, list_map_key="type"
    )
    observed_generation: int | None = api_field(
        "The metadata.generation the status describes.", default=None, minimum=0
    )
    # A name, not an enum: the operator writes it from its backends (gpuop.backends), and a
    # status must still read back after a backend is added or retired.
    backend: str | None = api_field(
        "The job API the training runs on (a spec.backend value other than auto), chosen once when its "
        "job is made (the BackendSelected condition says why).",
        default=None,
        max_length=63,
        pattern=r"^[a-z][a-z0-9]*$",
        pattern_hint="a backend name such as pytorchjob",
    )
    job: JobReference | None = api_field(
        "The object that runs the training (a PyTorchJob, a TrainJob: its backend's job), once made.",
        default=None,
    )
    # Written beside job through 0.1.x, for the dashboards and scripts that read them.
    pytorch_job: str | None = api_field(
        "Deprecated, removed in 0.2.0: read job.name. Name of the PyTorchJob that runs the training "
        "(backend pytorchjob).",
        default=None,
        max_length=253,
    )
    train_job: str | None = api_field(
        "Deprecated, removed in 0.2.0: read job.name. Name of the TrainJob that runs the training "
        "(backend trainjob).",
        default=None,
        max_length=253,
    )
    workers: WorkerCounts | None = api_field("Worker pods ready and asked for.", default=None)
    progress: ProgressStatus | None = api_field("Training progress.", default=None)
    gpu: GpuUsage | None = api_field("GPU utilization and memory.", default=None)
    checkpoint: CheckpointStatus | None = api_field(
        "The last complete checkpoint the training code reported: its step, time and location. Kept "
        "across restarts and preemptions until a newer one is reported.",
        default=None,
    )
    start_time: str | None = api_field(
        "When the job started running.", default=None, date_time=True, max_length=64
    )
    completion_time: str | None = api_field(
        "When the job finished.", default=None, date_time=True, max_length=64
    )
    gpu_hours: float | None = api_field(
        "GPU-hours allocated to the training: its GPUs x the hours it was Running or Restarting (pods "
        "up), added up across suspensions, Kueue preemptions, restarts and operator restarts; time "
        "Pending, Queued or Suspended does not count. Brought up to date whenever the status is written "
        "(not every second), so it can lag the clock by up to one write.",
        default=None,
        minimum=0,
    )
    gpu_hours_counted_at: str | None = api_field(
        "Up to when gpuHours is counted, while the training holds its GPUs; the time since is added at "
        "the next write.",
        default=None,
        date_time=True,
        max_length=64,
    )
    message: str | None = api_field("The latest notable event, for people.", default=None, max_length=32768)

    @property
    def job_name(self) -> str | None:
        """The name of the training's job, from a status of this release or an older one."""
        return self.job.name if self.job is not None else self.pytorch_job or self.train_job


@api_object
class CheckpointStatus:
    """The training's last complete checkpoint, as its code reported it (the built-in trainer,
    gpureport's ``checkpointed()``, the Lightning and Hugging Face callbacks): where a restarted
    training resumes from, and a preempted or evicted one too when its checkpoints outlive the
    pod (spec.checkpoint.volume or uri; the default emptyDir goes with the pod)."""

    step: int = api_field("The optimizer step it holds.", minimum=0)
    time: str | None = api_field(
        "When it was complete (kubectl get -o wide shows its age).", default=None, date_time=True,
        max_length=64,
    )  # fmt: skip
    uri: str | None = api_field(
        "Where it is: an s3://, gs:// or az:// key, or a path in the trainer's container.",
        default=None,
        max_length=1024,
    )


# --------------------------------------------------------------------------------------------
# How the status writes figures for people (its ``eta`` and ``*Text``, and derive's messages).


# How the status writes a moment: RFC 3339 in UTC, to the second (as Kubernetes' own).
TIME_FORMAT: Final = "%Y-%m-%dT%H:%M:%SZ"


def parse_time(text: str) -> datetime:
    """A time as the status writes it (:data:`TIME_FORMAT`), naive UTC."""
    return datetime.strptime(text, TIME_FORMAT).replace(tzinfo=None)


def format_eta(seconds: float | None) -> str | None:
    """Seconds for people: ``1h12m``, ``3m05s``, ``42s``."""
    if seconds is None:
        return None
    total = max(0, round(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_percent(percent: float | None) -> str | None:
    """A percent for people, rounded down so that 100% means done: ``41%``."""
    if percent is None:
        return None
    return f"{max(0, min(100, math.floor(percent)))}%"


# -- the status as JSON: read back, and the patch from one to the next -----------------------


def status_from_json(document: Mapping[str, Any] | None) -> GpuTrainingStatus | None:
    """The status the operator wrote before, read back (unknown or malformed: start afresh)."""
    if not document:
        return None
    try:
        return decode(GpuTrainingStatus, _upgraded(document), "status")
    except SpecError:
        return None


def _upgraded(document: Mapping[str, Any]) -> Mapping[str, Any]:
    """A status written by an earlier version, in today's shape: conditions then could lack
    a reason or message (metav1.Condition requires both), and reading such a status as
    malformed would forget what it holds (a finished training's result, its gpuHours)."""
    conditions = document.get("conditions")
    if not isinstance(conditions, list):
        return document
    fixed = []
    for c in conditions:
        if isinstance(c, dict) and isinstance(c.get("type"), str):
            reason = c.get("reason")
            c = {**c, "reason": condition_reason(reason if isinstance(reason, str) else None, c["type"],
                                                 str(c.get("status"))),
                 "message": c.get("message") or ""}  # fmt: skip
        fixed.append(c)
    return {**document, "conditions": fixed}


def status_patch(previous: GpuTrainingStatus | None, new: GpuTrainingStatus) -> dict[str, Any] | None:
    """The merge patch for the status subresource, or None when there is nothing to write."""
    if previous is not None and new == previous:
        return None
    document: dict[str, Any] = encode(new)
    old: dict[str, Any] = encode(previous) if previous is not None else {}
    # A merge patch removes a key only when told to: null out what is gone.
    for key in old:
        if key not in document:
            document[key] = None
    return {"status": document}
