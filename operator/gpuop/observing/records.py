"""The typed records the observing edge produces and the derivation reads. Pure data.

:mod:`gpuop.observing.observe` (and each backend's readers) build them from API objects;
:mod:`gpuop.observing.derive` decides from them. Kept apart so that the producer does not
import its consumer.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from gpuop.observing.reports import TrainerReport
from gpuop.observing.scrape import GpuFigures, TrainerMetrics
from gputrain.contract import Result


@dataclass(frozen=True)
class JobKind:
    """What status says of the job API a training runs on (its backend's: :mod:`gpuop.backends`)."""

    backend: str  # status.backend
    api_version: str  # status.job.apiVersion
    kind: str  # the job's kind, in condition reasons and messages (status.job.kind)
    status_field: str | None  # the deprecated GpuTrainingStatus field that names the job, if any
    mutable_fields: tuple[str, ...]  # spec fields that may change once the job is made


@dataclass(frozen=True)
class JobCondition:
    """One condition of the job, in the PyTorchJob's terms (each backend's ``conditions``)."""

    type: str
    status: str
    reason: str | None = None
    message: str | None = None
    last_transition_time: str | None = None


@dataclass(frozen=True)
class QueueState:
    """Where Kueue has the job's Workload (:func:`gpuop.observing.observe.queue_state`)."""

    admitted: bool
    reason: str  # Kueue's own: Pending, Preempted, QuotaReserved, ...
    message: str


@dataclass(frozen=True)
class NodeLoss:
    """The node a pod runs on is lost (:mod:`gpuop.observing.nodeloss`)."""

    node: str
    reason: str  # its Ready condition's reason (NodeStatusUnknown: no kubelet posts), or NodeDeleted
    since: str | None  # when its Ready condition left True; None: not said (or the Node is gone)


@dataclass(frozen=True)
class PodObservation:
    """One training pod: its state, the trainer's termination message, its scraped metrics."""

    name: str
    phase: str
    ready: bool = False
    result: Result | None = None  # the trainer's final record, from its termination message
    metrics: TrainerMetrics | None = None
    # The pod's GPUs as the node's dcgm-exporter sees them (any image; None: not read).
    exporter_gpus: tuple[GpuFigures, ...] | None = None
    restarts: int = 0  # the trainer container's restartCount
    trainer_started_at: str | None = None  # when its current container started, if running
    # The kernel killed the trainer container at its memory limit (OOMKilled), now or before its
    # last restart; and that limit as the pod spec says it (None: none set).
    oom_killed: bool = False
    memory_limit: str | None = None
    # Why the kubelet cannot start the trainer container, (reason, its message), when it cannot:
    # a Secret or ConfigMap it names is missing, its image cannot be pulled, the dataset step
    # before it failed (DatasetFetchFailed, its own line). None otherwise.
    cannot_start: tuple[str, str] | None = None
    # The dataset step (spec.dataset.uri) is copying into the pod's dataset path now.
    fetching_dataset: bool = False
    # (reason, message) while the trainer, or the dataset step before it, is down after a failure
    # its own record says no restart mends (Result.permanent: wrong credentials, a missing bucket,
    # bad settings): the operator stops the job rather than let it restart into the same failure.
    needs_fix: tuple[str, str] | None = None
    created_at: str | None = None  # metadata.creationTimestamp: a pod of an older job is older
    uid: str | None = None  # a deletion's precondition: never the replacement of that name
    deleting: bool = False  # it has a deletionTimestamp
    node_lost: NodeLoss | None = None  # its node is lost (read only for a pod not ready or deleting)


@dataclass(frozen=True)
class ReceivedReport:
    """A training code's latest progress report, as the endpoint accepted it from one pod."""

    pod: str
    report: TrainerReport
    received_at: datetime


@dataclass(frozen=True)
class Thresholds:
    """When a running job is Stalled or Underutilized, and when its pods on a lost node are
    given up on."""

    stall_timeout_seconds: int  # spec.stallTimeoutSeconds; 0 disables
    underutilized_percent: float = 30.0
    underutilized_seconds: int = 600
    node_loss_timeout_seconds: int = 60  # spec.nodeLossTimeoutSeconds; 0: never


@dataclass(frozen=True)
class Observation:
    """Everything the operator read about one GpuTraining, at one moment."""

    now: datetime
    generation: int | None
    workers_total: int
    gpus: int
    invalid_spec: str | None = None  # the parse error, for a spec that got past the CRD
    name_conflict: str | None = None  # a job of our name that is not ours (never touched)
    # Fixed fields changed since the job was made (past a CRD without transition rules).
    spec_not_applied: tuple[str, ...] = ()
    job_api: JobKind | None = None  # the backend, once chosen
    # What runs the training when no Kubeflow job does (`gpuop run`: torchrun here), named in
    # the conditions' reasons and messages instead of a job kind.
    runner: str | None = None
    # Why this backend, when chosen now (None: as status already says).
    backend_choice: tuple[str, str] | None = None  # (reason, message)
    backend_unavailable: tuple[str, str] | None = None  # (reason, message): none can run it here
    job_name: str | None = None  # None until the job exists
    job_conditions: tuple[JobCondition, ...] = ()
    job_start_time: str | None = None
    job_completion_time: str | None = None
    job_created_at: str | None = None  # the job's creationTimestamp
    # (pod, reason, line): the operator stopped the job for good, as its annotation says.
    job_stopped: tuple[str, str, str] | None = None
    pods: tuple[PodObservation, ...] = ()
    # The training finished and its job is gone since (Kubeflow's TTL, or by hand).
    job_deleted: bool = False
    # Whether the trainer is ours (it reports from its first seconds); a custom command may
    # never report, and is judged Stalled only once a report has come.
    reports_progress: bool = True
    # The training code's progress reports (trainerStatus), the latest per pod.
    reports: tuple[ReceivedReport, ...] = ()
    queue_name: str | None = None  # spec.scheduling.queueName: Kueue owns the job's suspend
    queue: QueueState | None = None  # its Workload, while the job is suspended (None: not found)
    job_suspended: bool = False  # the job's spec says suspended (Kueue's hold, or the user's)
    # What is valid but likely unintended (`spec.warnings`, such as a model written to an
    # emptyDir): said once, in the Created condition and its event, where `kubectl describe` shows it.
    spec_warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class Event:
    """A transition worth a Kubernetes Event."""

    type: str  # Normal or Warning
    reason: str
    message: str
