"""API objects as the operator reads them: a PyTorchJob, a pod, a peering object. Pure.

Each function takes the JSON the API server returned and keeps only what the status
derivation needs, so :mod:`gpuop.derive` never sees the shape of a Kubernetes object and
these readings are unit-tested on plain dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuop.derive import JobCondition, PodObservation
from gpuop.render import CONTAINER_NAME, CREATED_FROM_ANNOTATION, TRAINING_LABEL
from gpuop.scrape import TrainerMetrics

_TERMINAL = ("Succeeded", "Failed")


def job_conditions(job: Mapping[str, Any] | None) -> tuple[JobCondition, ...]:
    """The PyTorchJob's status.conditions (the training-operator's Created, Running, ...)."""
    if not job:
        return ()
    out = []
    for c in (job.get("status") or {}).get("conditions") or ():
        if isinstance(c, Mapping) and isinstance(c.get("type"), str):
            out.append(
                JobCondition(
                    type=c["type"],
                    status=str(c.get("status", "Unknown")),
                    reason=c.get("reason"),
                    message=c.get("message"),
                )
            )
    return tuple(out)


def job_finished(job: Mapping[str, Any] | None) -> bool:
    return any(c.type in _TERMINAL and c.status == "True" for c in job_conditions(job))


def job_times(job: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    status = (job or {}).get("status") or {}
    return status.get("startTime"), status.get("completionTime")


def created_from(job: Mapping[str, Any] | None) -> str | None:
    """The record of the fixed spec a PyTorchJob was made from (None: not recorded, e.g. by an
    older operator); :func:`gpuop.spec.fixed_spec_changes` reads it."""
    record = (((job or {}).get("metadata") or {}).get("annotations") or {}).get(CREATED_FROM_ANNOTATION)
    return record if isinstance(record, str) else None


def slim_job(job: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator keeps of a PyTorchJob between reconciles: the fields the functions
    here and the runPolicy patch read. A stored job is ~25 KB of JSON with its pod template
    and managedFields, ~200 KB as Python objects; the table holds one per GpuTraining
    (measured at 1,000 jobs against a real API server: 311 MB peak RSS before, see
    docs/benchmarks.md)."""
    meta = job.get("metadata") or {}
    kept = {key: meta[key] for key in _KEPT_METADATA if key in meta}
    record = created_from(job)
    if record is not None:
        kept["annotations"] = {CREATED_FROM_ANNOTATION: record}
    return {
        "metadata": kept,
        "spec": {"runPolicy": (job.get("spec") or {}).get("runPolicy") or {}},
        "status": job.get("status") or {},
    }


_KEPT_METADATA = ("name", "namespace", "uid", "resourceVersion", "labels", "ownerReferences")


def owner_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of the object's controller, if it has one."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or ():
        if ref.get("controller"):
            uid = ref.get("uid")
            return uid if isinstance(uid, str) else None
    return None


def training_of(obj: Mapping[str, Any]) -> str | None:
    """The GpuTraining name a PyTorchJob or pod carries in its label."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    name = labels.get(TRAINING_LABEL)
    return name if isinstance(name, str) and name else None


def pod_ip(pod: Mapping[str, Any]) -> str | None:
    status = pod.get("status") or {}
    ip = status.get("podIP")
    return ip if isinstance(ip, str) and ip and status.get("phase") == "Running" else None


def _trainer_container(status: Mapping[str, Any]) -> Mapping[str, Any]:
    """The trainer container's entry of the pod's containerStatuses ({} when there is none)."""
    for container in status.get("containerStatuses") or ():
        if isinstance(container, Mapping) and container.get("name") == CONTAINER_NAME:
            return container
    return {}


def _termination_message(container: Mapping[str, Any]) -> str | None:
    # The current state first; after a restart the record is in lastState.
    for state in (container.get("state"), container.get("lastState")):
        terminated = (state or {}).get("terminated") or {}
        message = terminated.get("message")
        if isinstance(message, str) and message:
            return message
    return None


def pod_observation(pod: Mapping[str, Any], metrics: TrainerMetrics | None) -> PodObservation:
    status = pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()
    )
    trainer = _trainer_container(status)
    restarts = trainer.get("restartCount")
    started = ((trainer.get("state") or {}).get("running") or {}).get("startedAt")
    return PodObservation(
        name=str((pod.get("metadata") or {}).get("name", "")),
        phase=str(status.get("phase", "Unknown")),
        ready=ready,
        termination_message=_termination_message(trainer),
        metrics=metrics,
        restarts=restarts if isinstance(restarts, int) else 0,
        trainer_started_at=started if isinstance(started, str) else None,
    )


def peering_active(
    status: Mapping[str, Any] | None, identity: str, priority: int, now: datetime | None = None
) -> bool:
    """Whether this replica is the active one under Kopf's peering rule.

    Kopf pauses a replica's watches while a live peer has a higher or the same priority;
    the operator's own scrape loop must pause with them, or a standby replica would keep
    writing status. The rule is Kopf's: a peer is alive until lastseen + lifetime.
    """
    now = now or datetime.now(UTC)
    for peer_id, info in (status or {}).items():
        if peer_id == identity or not isinstance(info, Mapping):
            continue
        try:
            seen = datetime.fromisoformat(str(info["lastseen"]))
            lifetime = timedelta(seconds=int(info.get("lifetime", 60)))
            peer_priority = int(info.get("priority", 0))
        except (KeyError, ValueError, TypeError):
            continue
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=UTC)
        if seen + lifetime > now and peer_priority >= priority:
            return False
    return True
