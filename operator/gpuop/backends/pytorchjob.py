"""Kubeflow's v1 training-operator: the PyTorchJob. Legacy (no longer maintained upstream),
still on most clusters.

What the training-operator (v1.9) adds to this manifest when it makes pods, and so must not
be rendered here: :data:`FIXED_JOB_ENV` and :data:`ELASTIC_JOB_ENV`. Its conditions are already
the terms status is derived in (Created, Running, Suspended, Restarting, Succeeded, Failed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, Final

from gpuop.api.identity import DEFAULT_TRAINER_IMAGE
from gpuop.api.spec import MUTABLE_SPEC_FIELDS, GpuTraining, GpuTrainingSpec
from gpuop.backends import pod
from gpuop.backends.contract import AccessRule
from gpuop.backends.reportwiring import ReportEndpoint, TrainingReports, training_reports
from gpuop.observing import observe
from gpuop.observing.records import JobCondition, JobKind
from gputrain.contract import METRICS_PORT, METRICS_PORT_NAME, RENDEZVOUS_PORT, RENDEZVOUS_PORT_NAME

PYTORCHJOB_API_VERSION: Final = "kubeflow.org/v1"
PYTORCHJOB_KIND: Final = "PyTorchJob"
PYTORCHJOB_CONTAINER: Final = "pytorch"  # the training-operator finds its container by this name
# The fields of a running PyTorchJob the training-operator acts on when they change.
MUTABLE_RUN_POLICY: Final = ("suspend", "activeDeadlineSeconds", "ttlSecondsAfterFinished", "backoffLimit")
# The variables the training-operator v1.9.4 adds to every container of the job's pods (its
# pkg/controller.v1/pytorch, envvar.go, master.go and elastic.go, for what this module renders:
# nprocPerNode always, a Master in fixed jobs, maxRestarts and c10d in elastic ones). A $(VAR) in
# a spec's command, args or env may name them; the e2e chain checks them on the real pods.
FIXED_JOB_ENV: Final = frozenset({
    "PYTHONUNBUFFERED", "MASTER_ADDR", "MASTER_PORT", "PET_MASTER_ADDR", "PET_MASTER_PORT", "WORLD_SIZE",
    "RANK", "PET_NODE_RANK", "PET_NNODES", "PET_NPROC_PER_NODE",
})  # fmt: skip
ELASTIC_JOB_ENV: Final = frozenset({
    "PYTHONUNBUFFERED", "PET_RDZV_ENDPOINT", "PET_RDZV_BACKEND", "PET_NNODES", "PET_NPROC_PER_NODE",
    "PET_MAX_RESTARTS",
})  # fmt: skip


def _pytorchjob_pod_template(
    name: str, spec: GpuTrainingSpec, image: str, reports: TrainingReports | None, fetch_image: str
) -> dict[str, Any]:
    """The pod template shared by Master and Worker."""
    ports = [
        {"name": RENDEZVOUS_PORT_NAME, "containerPort": RENDEZVOUS_PORT, "protocol": "TCP"},
        {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"},
    ]
    container = pod.trainer_container(
        name, spec, image, container_name=PYTORCHJOB_CONTAINER, launch=pod.torchrun_launch(spec), ports=ports,
        reports=reports,
    )  # fmt: skip
    return pod.pod_template(name, spec, container, reports, fetch_image=fetch_image)


def _replica_specs(
    name: str, spec: GpuTrainingSpec, image: str, reports: TrainingReports | None, fetch_image: str
) -> dict[str, Any]:
    # OnFailure restarts the container inside the same pod, so a checkpoint on the default
    # emptyDir survives the restart. (ExitCode would re-create the pod and lose it; and under
    # torchrun the pod's exit code is the agent's, not the trainer's.)
    restart = "OnFailure"
    if spec.elastic is not None:
        # Elastic jobs are Worker-only, as in Kubeflow's elastic examples: every pod joins
        # the c10d rendezvous on worker-0 and the Worker count may scale.
        return {
            "Worker": {
                "replicas": spec.workers,
                "restartPolicy": restart,
                "template": _pytorchjob_pod_template(name, spec, image, reports, fetch_image),
            }
        }
    replicas = {
        "Master": {
            "replicas": 1,
            "restartPolicy": restart,
            "template": _pytorchjob_pod_template(name, spec, image, reports, fetch_image),
        }
    }
    if spec.workers > 1:
        replicas["Worker"] = {
            "replicas": spec.workers - 1,
            "restartPolicy": restart,
            "template": _pytorchjob_pod_template(name, spec, image, reports, fetch_image),
        }
    return replicas


def _run_policy(spec: GpuTrainingSpec) -> dict[str, Any]:
    rp = spec.run_policy
    out: dict[str, Any] = {"cleanPodPolicy": rp.clean_pod_policy, "suspend": pod.job_suspended(spec)}
    if rp.backoff_limit is not None:
        out["backoffLimit"] = pod.kubeflow_backoff_limit(rp.backoff_limit, spec.workers)
    if rp.active_deadline_seconds is not None:
        out["activeDeadlineSeconds"] = rp.active_deadline_seconds
    if rp.ttl_seconds_after_finished is not None:
        out["ttlSecondsAfterFinished"] = rp.ttl_seconds_after_finished
    if spec.scheduling.gang:
        policy: dict[str, Any] = {"minAvailable": spec.workers}
        if spec.scheduling.queue_name is not None:
            policy["queue"] = spec.scheduling.queue_name
        if spec.scheduling.priority_class_name is not None:
            policy["priorityClass"] = spec.scheduling.priority_class_name
        out["schedulingPolicy"] = policy
    return out


def render_pytorchjob(
    training: GpuTraining,
    *,
    default_image: str = DEFAULT_TRAINER_IMAGE,
    reports: ReportEndpoint | None = None,
) -> dict[str, Any]:
    """The PyTorchJob for a GpuTraining."""
    spec = training.spec
    name = training.name
    image = spec.image or default_image
    metadata = pod.job_metadata(training, MUTABLE_SPEC_FIELDS)

    job_spec: dict[str, Any] = {
        # The webhook forbids elasticPolicy.nProcPerNode beside this; we only set this one.
        "nprocPerNode": str(spec.processes_per_worker),
        "pytorchReplicaSpecs": _replica_specs(
            name, spec, image, training_reports(training, reports), pod.fetch_image(spec, default_image)
        ),
        "runPolicy": _run_policy(spec),
    }
    if spec.elastic is not None:
        job_spec["elasticPolicy"] = {
            "minReplicas": spec.elastic.min_workers,
            "maxReplicas": spec.elastic.max_workers,
            "maxRestarts": spec.elastic.max_restarts,
            "rdzvBackend": "c10d",
        }
    return {
        "apiVersion": PYTORCHJOB_API_VERSION,
        "kind": PYTORCHJOB_KIND,
        "metadata": metadata,
        "spec": job_spec,
    }


class PyTorchJobApi:
    """The PyTorchJob as a backend (:class:`gpuop.backends.contract.JobApi`)."""

    backend: Final = "pytorchjob"
    summary: Final = "the v1 training-operator's PyTorchJob"
    api_version: Final = PYTORCHJOB_API_VERSION
    kind: Final = PYTORCHJOB_KIND
    plural: Final = "pytorchjobs"
    installed_by: Final = "the Kubeflow training-operator v1"
    facts: Final = JobKind(
        backend, PYTORCHJOB_API_VERSION, PYTORCHJOB_KIND, "pytorch_job", MUTABLE_SPEC_FIELDS
    )
    companion_plurals: Final[Mapping[str, str]] = {}
    gaps: Final = ()  # the GpuTraining API was made on it: it carries every field
    access: Final = (
        AccessRule("kubeflow.org", ("pytorchjobs",), ("get", "list", "watch", "create", "patch"),
                   "PyTorchJobs: created, read after a 409 (adopt or NameConflict), runPolicy patched"),
    )  # fmt: skip

    def served(self, resources: Callable[[str], frozenset[str]]) -> bool:
        return self.plural in resources(self.api_version)

    def controller_env(self, spec: GpuTrainingSpec) -> frozenset[str]:
        return ELASTIC_JOB_ENV if spec.elastic is not None else FIXED_JOB_ENV

    def render(
        self, training: GpuTraining, *, default_image: str, reports: ReportEndpoint | None = None
    ) -> list[dict[str, Any]]:
        return [render_pytorchjob(training, default_image=default_image, reports=reports)]

    def conditions(self, job: Mapping[str, Any] | None) -> tuple[JobCondition, ...]:
        return observe.conditions_of(job)

    def suspended(self, job: Mapping[str, Any] | None) -> bool:
        return bool((((job or {}).get("spec") or {}).get("runPolicy") or {}).get("suspend"))

    def times(self, job: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
        return observe.times(job, self.conditions(job))

    def mutable_patch(
        self, desired: Mapping[str, Any], child: Mapping[str, Any], skip: tuple[str, ...] = ()
    ) -> dict[str, Any] | None:
        """The runPolicy fields the training-operator acts on, as the spec now says, but those
        in ``skip`` (suspend, when Kueue owns it)."""
        want, have = desired["spec"]["runPolicy"], (child.get("spec") or {}).get("runPolicy") or {}
        changes = observe.changed(want, have, MUTABLE_RUN_POLICY, skip)
        return {"spec": {"runPolicy": changes}} if changes else None

    def suspend_patch(self) -> dict[str, Any]:
        return {"spec": {"runPolicy": {"suspend": True}}}

    def wake_times(self, job: Mapping[str, Any] | None) -> tuple[datetime, ...]:
        """Its deadline while it runs, its TTL's end once finished.

        The training-operator v1.9.4 checks both only when it reconciles the job, and schedules
        that reconcile on a work queue that drops delayed additions (kubeflow/trainer#3358): on
        the real controller a quiet job ran minutes past a 20 s deadline, and a finished one
        outlived its TTL. Any change to the job makes it reconcile (its watch has no update
        filter), so the operator touches the job at these times.
        """
        run_policy = ((job or {}).get("spec") or {}).get("runPolicy") or {}
        status = (job or {}).get("status") or {}
        if run_policy.get("suspend"):
            return ()  # neither clock runs while suspended (nor does the controller's check)
        if not observe.finished(self.conditions(job)):
            clock, seconds = status.get("startTime"), run_policy.get("activeDeadlineSeconds")
        else:  # the controller counts from completionTime alone (none: it cannot clean up)
            clock, seconds = status.get("completionTime"), run_policy.get("ttlSecondsAfterFinished")
        if not isinstance(clock, str) or not isinstance(seconds, int):
            return ()
        try:
            return (datetime.fromisoformat(clock) + timedelta(seconds=seconds),)
        except ValueError:
            return ()  # not a time the controller wrote: it could not count from it either


PYTORCHJOB: Final = PyTorchJobApi()
