"""Plain Kubernetes: an Indexed ``batch/v1`` Job and a headless Service. Pure.

For clusters that run no Kubeflow: nothing to install, and Kueue admits a ``batch/v1`` Job
natively. One GpuTraining becomes:

* a **headless Service** of its name (made first), selecting its pods and publishing them
  before they are ready, so that worker 0 has a stable DNS name, ``<name>-0.<name>``, from
  the moment its pod exists: the rendezvous's address (MASTER_ADDR);
* an **Indexed Job** with ``completions = parallelism = workers``: the Job controller names
  each pod's host ``<name>-<index>`` and the pod's subdomain is the Service. The index is the
  node rank (read from the pod's completion-index annotation); the rest of what the
  training-operator would add to the container (MASTER_*, PET_*, WORLD_SIZE, RANK) is
  rendered here, ahead of the spec's own env so that a ``$(VAR)`` there may name it.

The gang: when one worker fails, all restart together from the last checkpoint, as on the
other backends, and by the same means. ``restartPolicy: OnFailure`` restarts a failed trainer
in its own pod (its emptyDir checkpoints kept); the other ranks' collectives fail with it,
their torchrun exits, and each restarts in place into a new rendezvous at worker 0. A pod
that is lost (evicted, its node gone) is replaced under the same index, hence the same host
name, and ``podReplacementPolicy: Failed`` makes the replacement wait until the old pod is
gone, so two pods never answer to one rank. The Job controller counts container restarts
against ``backoffLimit`` as the training-operator does (:func:`pod.kubeflow_backoff_limit`);
with no limit in the spec its largest value is set (Kubernetes' default of 6 would fail a long
training on its seventh restart, where Kubeflow's jobs retry without end). Suspend, Kueue,
activeDeadlineSeconds and ttlSecondsAfterFinished are the Job's own, and its controller keeps
their clocks. What a Job cannot do is refused (:data:`GAPS`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Final

from gpuop.api.gaps import SpecGap, refuse_gaps
from gpuop.api.identity import DEFAULT_TRAINER_IMAGE, TRAINING_LABEL
from gpuop.api.spec import MUTABLE_SPEC_FIELDS, GpuTraining, GpuTrainingSpec
from gpuop.backends import pod, reportwiring
from gpuop.backends.contract import AccessRule
from gpuop.observing import observe
from gpuop.observing.records import JobCondition, JobKind
from gputrain.contract import METRICS_PORT, METRICS_PORT_NAME, RENDEZVOUS_PORT, RENDEZVOUS_PORT_NAME

BACKEND: Final = "job"  # spec.backend's name for it
JOB_API_VERSION: Final = "batch/v1"
JOB_KIND: Final = "Job"
SERVICE_KIND: Final = "Service"
JOB_CONTAINER: Final = "trainer"
# Kubernetes writes each pod's index here (and names its host <job>-<index>).
COMPLETION_INDEX_ANNOTATION: Final = "batch.kubernetes.io/job-completion-index"
# What may change on a made Job and its controller acts on (the rest of its spec is fixed).
MUTABLE_JOB_FIELDS: Final = ("suspend", "activeDeadlineSeconds", "ttlSecondsAfterFinished", "backoffLimit")
# A Job's backoffLimit is an int32; "no limit" is its largest value.
_NO_BACKOFF_LIMIT: Final = 2**31 - 1

GAPS: Final = (
    SpecGap(
        BACKEND, ".elastic", "has(self.elastic)", lambda s: s.elastic is not None,
        "a Job has a fixed number of pods; use backend pytorchjob for elastic training, or drop elastic",
    ),
    SpecGap(
        BACKEND, ".scheduling.gang", "self.scheduling.gang", lambda s: s.scheduling.gang,
        "a Job makes no PodGroup; use Kueue (scheduling.queueName), which admits the Job whole, or "
        "backend pytorchjob",
    ),
    SpecGap(
        BACKEND, ".runPolicy.cleanPodPolicy", "self.runPolicy.cleanPodPolicy != 'Running'",
        lambda s: s.run_policy.clean_pod_policy != "Running",
        "a Job deletes its running pods when it ends and keeps the finished ones, as cleanPodPolicy "
        "Running; use backend pytorchjob or drop it",
    ),
)  # fmt: skip


def master_address(name: str) -> str:
    """Worker 0's DNS name: its host name under the headless Service, in its own namespace."""
    return f"{name}-0.{name}"


def rank_env(name: str, spec: GpuTrainingSpec) -> list[dict[str, Any]]:
    """What the training-operator adds to a PyTorchJob's containers, rendered: torchrun reads the
    PET_* ones, code launched without torchrun the rest."""
    index = f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"
    fixed = {
        "PYTHONUNBUFFERED": "1",
        "MASTER_ADDR": master_address(name),
        "MASTER_PORT": str(RENDEZVOUS_PORT),
        "PET_MASTER_ADDR": master_address(name),
        "PET_MASTER_PORT": str(RENDEZVOUS_PORT),
        "WORLD_SIZE": str(spec.workers),
        "PET_NNODES": str(spec.workers),
        "PET_NPROC_PER_NODE": str(spec.processes_per_worker),
    }
    return [
        *(pod.env_var(key, value) for key, value in fixed.items()),
        *(
            {"name": key, "valueFrom": {"fieldRef": {"fieldPath": index}}}
            for key in ("PET_NODE_RANK", "RANK")
        ),
    ]


def render_service(training: GpuTraining) -> dict[str, Any]:
    """The headless Service that gives each pod of the Job its DNS name."""
    return {
        "apiVersion": "v1",
        "kind": SERVICE_KIND,
        "metadata": pod.object_metadata(training, pod.labels(training.name)),
        "spec": {
            "clusterIP": "None",
            "selector": {TRAINING_LABEL: training.name},
            # Worker 0's name resolves while its pod starts: the rendezvous waits on it, not on DNS.
            "publishNotReadyAddresses": True,
            "ports": [{"name": RENDEZVOUS_PORT_NAME, "port": RENDEZVOUS_PORT, "protocol": "TCP"}],
        },
    }


def render_job(
    training: GpuTraining,
    *,
    default_image: str = DEFAULT_TRAINER_IMAGE,
    reports: reportwiring.ReportEndpoint | None = None,
) -> dict[str, Any]:
    """The Indexed Job of a GpuTraining; raises SpecError for what it cannot say."""
    spec = training.spec
    refuse_gaps(GAPS, spec)
    name = training.name
    training_reports = reportwiring.training_reports(training, reports)
    ports = [
        {"name": RENDEZVOUS_PORT_NAME, "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
        {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"},
    ]
    container = pod.trainer_container(
        name, spec, spec.image or default_image, container_name=JOB_CONTAINER,
        launch=pod.torchrun_launch(spec), ports=ports, reports=training_reports,
    )  # fmt: skip
    container["env"] = rank_env(name, spec) + container["env"]
    template = pod.pod_template(
        name, spec, container, training_reports, fetch_image=pod.fetch_image(spec, default_image)
    )
    template["spec"] = {"restartPolicy": "OnFailure", "subdomain": name, **template["spec"]}
    rp = spec.run_policy
    backoff = rp.backoff_limit
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": spec.workers,
        "parallelism": spec.workers,
        "backoffLimit": _NO_BACKOFF_LIMIT
        if backoff is None
        else pod.kubeflow_backoff_limit(backoff, spec.workers),
        "podReplacementPolicy": "Failed",
        "suspend": pod.job_suspended(spec),
    }
    if rp.active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = rp.active_deadline_seconds
    if rp.ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = rp.ttl_seconds_after_finished
    job_spec["template"] = template
    return {
        "apiVersion": JOB_API_VERSION,
        "kind": JOB_KIND,
        "metadata": pod.job_metadata(training, MUTABLE_SPEC_FIELDS),
        "spec": job_spec,
    }


# A Job's conditions in the PyTorchJob's terms. Since Kubernetes 1.31 SuccessCriteriaMet and
# FailureTarget come first, while the last pods stop; the outcome is decided then.
_JOB_TYPES: Final = {
    "Complete": "Succeeded",
    "SuccessCriteriaMet": "Succeeded",
    "Failed": "Failed",
    "FailureTarget": "Failed",
    "Suspended": "Suspended",
}


def _job_conditions(job: Mapping[str, Any]) -> tuple[JobCondition, ...]:
    """A Job's status as PyTorchJob conditions: it runs while one of its pods is ready (our
    pods have no readiness probe: ready is running)."""
    status = job.get("status") or {}
    ready = status.get("ready") if isinstance(status.get("ready"), int) else status.get("active")
    ready = ready if isinstance(ready, int) else 0
    of = f"{ready} of {(job.get('spec') or {}).get('parallelism', '?')} pods ready"
    return observe.renamed_conditions(job, _JOB_TYPES, "JobCreated", ready, ("PodsReady", "PodsNotReady", of))


class BatchJobApi:
    """The Indexed Job as a backend (:class:`gpuop.backends.contract.JobApi`)."""

    backend: Final = BACKEND
    summary: Final = "an Indexed batch/v1 Job and a headless Service: plain Kubernetes, nothing to install"
    api_version: Final = JOB_API_VERSION
    kind: Final = JOB_KIND
    plural: Final = "jobs"
    installed_by: Final = "Kubernetes' batch/v1 API"
    facts: Final = JobKind(backend, JOB_API_VERSION, JOB_KIND, None, MUTABLE_SPEC_FIELDS)
    # Made before the Job: its first pod's name must resolve.
    companion_plurals: Final[Mapping[str, str]] = {SERVICE_KIND: "services"}
    gaps: Final = GAPS
    access: Final = (
        AccessRule("batch", ("jobs",), ("get", "list", "watch", "create", "patch"),
                   "Jobs: created, read after a 409 (adopt or NameConflict), suspend and limits patched"),
        AccessRule("", ("services",), ("get", "create"),
                   "The headless Service of each Job's pods: created before it, read after a 409"),
    )  # fmt: skip

    def served(self, resources: Callable[[str], frozenset[str]]) -> bool:
        return self.plural in resources(self.api_version)

    def controller_env(self, spec: GpuTrainingSpec) -> frozenset[str]:
        return frozenset()  # the Job controller adds nothing we read; rank_env is rendered

    def render(
        self, training: GpuTraining, *, default_image: str, reports: reportwiring.ReportEndpoint | None = None
    ) -> list[dict[str, Any]]:
        return [render_service(training), render_job(training, default_image=default_image, reports=reports)]

    def conditions(self, job: Mapping[str, Any] | None) -> tuple[JobCondition, ...]:
        return _job_conditions(job) if job else ()

    def suspended(self, job: Mapping[str, Any] | None) -> bool:
        return bool(((job or {}).get("spec") or {}).get("suspend"))

    def times(self, job: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
        """startTime, and completionTime (a Job records it on success only; else the condition)."""
        return observe.times(job, self.conditions(job))

    def mutable_patch(
        self, desired: Mapping[str, Any], child: Mapping[str, Any], skip: tuple[str, ...] = ()
    ) -> dict[str, Any] | None:
        """The fields the Job controller acts on, as the spec now says, but those in ``skip``
        (suspend, when Kueue owns it)."""
        changes = observe.changed(desired["spec"], child.get("spec") or {}, MUTABLE_JOB_FIELDS, skip)
        return {"spec": changes} if changes else None

    def suspend_patch(self) -> dict[str, Any]:
        return {"spec": {"suspend": True}}

    def wake_times(self, job: Mapping[str, Any] | None) -> tuple[datetime, ...]:
        return ()  # the Job and TTL controllers requeue themselves for their deadlines


JOB: Final = BatchJobApi()
