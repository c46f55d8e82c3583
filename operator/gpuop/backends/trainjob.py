"""GpuTraining -> Kubeflow Trainer v2: a TrainJob and the TrainingRuntime made for it. Pure.

Each GpuTraining gets a namespaced **TrainingRuntime** of its own name, owned by it like the
TrainJob, rather than one shared ClusterTrainingRuntime plus ``runtimePatches``. A TrainJob
(v2.3.0) and its patches cannot say several things the PyTorchJob path guarantees: the Job's
backoffLimit (spec.runPolicy.backoffLimit), the pods' priorityClassName, the container's
metrics port and termination-message file. A runtime per job can: its pod template is the
very one the PyTorchJob's replicas get, from the same functions in :mod:`gpuop.backends.pod`. The
runtime is fixed once made, like the GpuTraining's fixed fields.

* The **TrainingRuntime** (:func:`render_runtime`) carries the pod: volumes (the sized
  /dev/shm, checkpoints, output, data), placement, security contexts, ports, the
  termination message, ``restartPolicy: OnFailure`` (a failed trainer restarts in place and
  keeps its emptyDir checkpoints) and the Job's backoffLimit.
* The **TrainJob** (:func:`render_trainjob`) carries what Kubeflow's SDK and UI show as the
  trainer: image, command, args, env, numNodes, numProcPerNode, resourcesPerNode; and
  suspend, activeDeadlineSeconds, our labels (Kueue's queue among them), owner and record.

What Trainer v2 adds to the container and so must not be rendered here:
:data:`CONTROLLER_ENV` (torchrun reads them), and the trainer port 29500. What neither object
can carry is refused by the CRD and at rendering (:data:`GAPS`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any, Final

from gpuop.api.gaps import SpecGap, refuse_gaps
from gpuop.api.identity import DEFAULT_TRAINER_IMAGE
from gpuop.api.spec import GpuTraining, GpuTrainingSpec
from gpuop.backends import pod, reportwiring
from gpuop.backends.contract import AccessRule
from gpuop.observing import observe
from gpuop.observing.records import JobCondition, JobKind
from gputrain.contract import METRICS_PORT, METRICS_PORT_NAME

BACKEND: Final = "trainjob"  # spec.backend's name for it
TRAINER_GROUP: Final = "trainer.kubeflow.org"
TRAINJOB_API_VERSION: Final = f"{TRAINER_GROUP}/v1alpha1"
TRAINJOB_KIND: Final = "TrainJob"
RUNTIME_KIND: Final = "TrainingRuntime"
TRAINJOB_CONTAINER: Final = "node"  # the torch runtime's trainer container, which TrainJob fields override
# The variables Trainer v2.3's torch plugin adds to the trainer container: a $(VAR) in a spec's
# command, args or env may name them; the e2e chain checks them on the real pods.
CONTROLLER_ENV: Final = frozenset(
    {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
)
# The replicated job and container Trainer's torch plugin injects its PET_* variables into.
_ANCESTOR_LABEL: Final = "trainer.kubeflow.org/trainjob-ancestor-step"
_FRAMEWORK_LABEL: Final = "trainer.kubeflow.org/framework"
RUNTIME_PLURAL: Final = "trainingruntimes"
# What may change on a made TrainJob: of runPolicy only suspend (its activeDeadlineSeconds is
# immutable, and backoffLimit is in its TrainingRuntime, made once).
TRAINJOB_MUTABLE_FIELDS: Final = ("runPolicy.suspend", "stallTimeoutSeconds", "nodeLossTimeoutSeconds")


def _launch(spec: GpuTrainingSpec) -> tuple[list[str], list[str] | None]:
    """Command and args: torchrun takes nodes, rank, processes and the master from PET_*."""
    if spec.command is not None:
        return list(spec.command), list(spec.args) if spec.args is not None else None
    return ["torchrun"], ["-m", "gputrain"]


# What neither a TrainJob nor the TrainingRuntime made for it can say (Trainer v2.3.0).
GAPS: Final = (
    SpecGap(
        BACKEND, ".elastic", "has(self.elastic)", lambda s: s.elastic is not None,
        "Trainer v2 has no elastic PyTorch yet; use backend pytorchjob or drop elastic",
    ),
    SpecGap(
        BACKEND, ".scheduling.gang", "self.scheduling.gang", lambda s: s.scheduling.gang,
        "Trainer v2 gangs pods through a podGroupPolicy plugin chosen per cluster; use backend "
        "pytorchjob, or Kueue (scheduling.queueName), which admits the job whole",
    ),
    SpecGap(
        BACKEND, ".runPolicy.ttlSecondsAfterFinished", "has(self.runPolicy.ttlSecondsAfterFinished)",
        lambda s: s.run_policy.ttl_seconds_after_finished is not None,
        "a TrainJob has no time-to-live (its JobSet's would delete the pods, not the TrainJob); use "
        "backend pytorchjob or drop it",
    ),
    SpecGap(
        BACKEND, ".runPolicy.cleanPodPolicy", "self.runPolicy.cleanPodPolicy != 'Running'",
        lambda s: s.run_policy.clean_pod_policy != "Running",
        "a TrainJob's JobSet deletes its running pods when it ends and keeps the finished ones, as "
        "cleanPodPolicy Running; use backend pytorchjob or drop it",
    ),
)  # fmt: skip


def render_runtime(
    training: GpuTraining,
    *,
    default_image: str = DEFAULT_TRAINER_IMAGE,
    reports: reportwiring.ReportEndpoint | None = None,
) -> dict[str, Any]:
    """The TrainingRuntime of one GpuTraining's TrainJob; raises SpecError for what it cannot say."""
    spec = training.spec
    refuse_gaps(GAPS, spec)
    name = training.name
    ports = [{"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"}]
    # The TrainJob's trainer overrides image, command, args, env and resources; they are
    # rendered here too because a pod template must be whole, and they agree by construction.
    container = pod.trainer_container(
        name,
        spec,
        spec.image or default_image,
        container_name=TRAINJOB_CONTAINER,
        launch=_launch(spec),
        ports=ports,
        reports=reportwiring.training_reports(training, reports),
    )
    template = pod.pod_template(name, spec, container, reportwiring.training_reports(training, reports),
                                fetch_image=pod.fetch_image(spec, default_image))  # fmt: skip
    template["spec"] = {"restartPolicy": "OnFailure", **template["spec"]}
    job: dict[str, Any] = {"template": template}
    if spec.run_policy.backoff_limit is not None:
        # The Job controller, like the training-operator, sums every container's restarts.
        job = {
            "backoffLimit": pod.kubeflow_backoff_limit(spec.run_policy.backoff_limit, spec.workers),
            **job,
        }
    # The TrainJob carries Kueue's queue and the record; the runtime is only its pod template.
    metadata = pod.object_metadata(training, {**pod.labels(name), _FRAMEWORK_LABEL: "torch"})
    return {
        "apiVersion": TRAINJOB_API_VERSION,
        "kind": RUNTIME_KIND,
        "metadata": metadata,
        "spec": {
            "mlPolicy": {"numNodes": spec.workers, "torch": {}},
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "name": TRAINJOB_CONTAINER,
                            "replicas": 1,
                            "template": {"metadata": {"labels": {_ANCESTOR_LABEL: "trainer"}}, "spec": job},
                        }
                    ]
                }
            },
        },
    }


def render_trainjob(
    training: GpuTraining,
    *,
    default_image: str = DEFAULT_TRAINER_IMAGE,
    reports: reportwiring.ReportEndpoint | None = None,
) -> dict[str, Any]:
    """The TrainJob of a GpuTraining, on the runtime :func:`render_runtime` makes for it."""
    spec = training.spec
    refuse_gaps(GAPS, spec)
    command, args = _launch(spec)
    trainer: dict[str, Any] = {"image": spec.image or default_image, "command": command}
    if args is not None:
        trainer["args"] = args
    trainer.update(
        {
            "env": pod.trainer_env(training.name, spec, reportwiring.training_reports(training, reports)),
            "numNodes": spec.workers,
            # Always set: left out, Trainer v2 starts one process per CPU core on a CPU job.
            "numProcPerNode": spec.processes_per_worker,
            "resourcesPerNode": pod.resources(spec),
        }
    )
    job_spec: dict[str, Any] = {
        "runtimeRef": {"apiGroup": TRAINER_GROUP, "kind": RUNTIME_KIND, "name": training.name},
        "suspend": pod.job_suspended(spec),
        "trainer": trainer,
    }
    if spec.run_policy.active_deadline_seconds is not None:
        job_spec["activeDeadlineSeconds"] = spec.run_policy.active_deadline_seconds
    return {
        "apiVersion": TRAINJOB_API_VERSION,
        "kind": TRAINJOB_KIND,
        "metadata": pod.job_metadata(training, TRAINJOB_MUTABLE_FIELDS),
        "spec": job_spec,
    }


# A TrainJob says Complete where a PyTorchJob says Succeeded; Suspended and Failed are alike.
_TRAINJOB_TYPES: Final = {"Complete": "Succeeded", "Failed": "Failed", "Suspended": "Suspended"}


def _trainjob_conditions(job: Mapping[str, Any]) -> tuple[JobCondition, ...]:
    """A TrainJob's status as PyTorchJob conditions. Trainer v2 has no Created or Running
    condition: the job exists, so it is created, and it runs while a child Job is ready (all its
    pods running), which ``status.jobsStatus`` counts."""
    jobs = [j for j in (job.get("status") or {}).get("jobsStatus") or () if isinstance(j, Mapping)]
    ready = sum(j.get("ready") or 0 for j in jobs if isinstance(j.get("ready"), int))
    of = f"{ready} of {len(jobs)} child Jobs ready" if jobs else ""
    running = ("JobsReady", "JobsNotReady", of)
    return observe.renamed_conditions(job, _TRAINJOB_TYPES, "TrainJobCreated", ready, running)


class TrainJobApi:
    """The TrainJob as a backend (:class:`gpuop.backends.contract.JobApi`)."""

    backend: Final = BACKEND
    api_version: Final = TRAINJOB_API_VERSION
    kind: Final = TRAINJOB_KIND
    plural: Final = "trainjobs"
    summary: Final = "Kubeflow Trainer v2's TrainJob, on a TrainingRuntime made for it"
    installed_by: Final = "Kubeflow Trainer v2"
    facts: Final = JobKind(backend, TRAINJOB_API_VERSION, TRAINJOB_KIND, "train_job", TRAINJOB_MUTABLE_FIELDS)
    # Made before the TrainJob, whose webhook wants its runtime to exist.
    companion_plurals: Final[Mapping[str, str]] = {RUNTIME_KIND: RUNTIME_PLURAL}
    gaps: Final = GAPS
    access: Final = (
        AccessRule(TRAINER_GROUP, ("trainjobs",), ("get", "list", "watch", "create", "patch"),
                   "TrainJobs: created, read after a 409 (adopt or NameConflict), suspend patched"),
        AccessRule(TRAINER_GROUP, (RUNTIME_PLURAL,), ("get", "create"),
                   "The TrainingRuntime made for each TrainJob: created before it, read after a 409"),
    )  # fmt: skip

    def served(self, resources: Callable[[str], frozenset[str]]) -> bool:
        """Only beside its TrainingRuntime (one API group, one request)."""
        return {self.plural, RUNTIME_PLURAL} <= resources(self.api_version)

    def controller_env(self, spec: GpuTrainingSpec) -> frozenset[str]:
        return CONTROLLER_ENV

    def render(
        self, training: GpuTraining, *, default_image: str, reports: reportwiring.ReportEndpoint | None = None
    ) -> list[dict[str, Any]]:
        return [
            render_runtime(training, default_image=default_image, reports=reports),
            render_trainjob(training, default_image=default_image, reports=reports),
        ]

    def conditions(self, job: Mapping[str, Any] | None) -> tuple[JobCondition, ...]:
        return _trainjob_conditions(job) if job else ()

    def suspended(self, job: Mapping[str, Any] | None) -> bool:
        return bool(((job or {}).get("spec") or {}).get("suspend"))

    def times(self, job: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
        """A TrainJob records neither: it finished when its Complete or Failed turned True."""
        return observe.times(job, self.conditions(job))

    def mutable_patch(
        self, desired: Mapping[str, Any], child: Mapping[str, Any], skip: tuple[str, ...] = ()
    ) -> dict[str, Any] | None:
        """suspend, its only mutable field, unless Kueue owns it (in ``skip``)."""
        changes = observe.changed(desired["spec"], child.get("spec") or {}, ("suspend",), skip)
        return {"spec": changes} if changes else None

    def suspend_patch(self) -> dict[str, Any]:
        return {"spec": {"suspend": True}}

    def wake_times(self, job: Mapping[str, Any] | None) -> tuple[datetime, ...]:
        # The deadline is the Job controller's (through JobSet), which requeues itself for it; a
        # TrainJob has no TTL (the spec refuses one on this backend).
        return ()


TRAINJOB: Final = TrainJobApi()
