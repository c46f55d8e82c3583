"""API objects as the operator reads them: a job's conditions, a pod, Kueue's Workloads.
Pure.

Each function takes the JSON the API server returned and keeps only what the status
derivation needs, as the typed records of :mod:`gpuop.observing.records`, so
:mod:`gpuop.observing.derive` never sees the shape of a Kubernetes object and these readings
are unit-tested on plain dicts. What differs between job kinds is read by each backend
(:mod:`gpuop.backends`), with the helpers here.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from gpuop.api.identity import (
    CREATED_FROM_ANNOTATION,
    DEFAULT_CONTAINER_ANNOTATION,
    FETCH_CONTAINER,
    STOPPED_ANNOTATION,
    TRAINING_LABEL,
)
from gpuop.api.status import TERMINAL_PHASES
from gpuop.observing.records import JobCondition, NodeLoss, PodObservation, QueueState
from gpuop.observing.scrape import GpuFigures, TrainerMetrics
from gputrain.contract import Result


def conditions_of(job: Mapping[str, Any] | None) -> tuple[JobCondition, ...]:
    """An object's ``status.conditions`` (metav1-style: type, status, reason, message), as written."""
    out = []
    for c in ((job or {}).get("status") or {}).get("conditions") or ():
        if isinstance(c, Mapping) and isinstance(c.get("type"), str):
            out.append(
                JobCondition(
                    type=c["type"],
                    status=str(c.get("status", "Unknown")),
                    reason=c.get("reason"),
                    message=c.get("message"),
                    last_transition_time=c.get("lastTransitionTime"),
                )
            )
    return tuple(out)


def renamed_conditions(
    job: Mapping[str, Any], types: Mapping[str, str], created: str, ready: int, running: tuple[str, str, str]
) -> tuple[JobCondition, ...]:
    """The conditions of a job whose controller writes neither Created nor Running, in the
    PyTorchJob's terms: Created since it exists (reason ``created``); each of its conditions
    that ``types`` names, renamed (the first True one of a type wins: a Job says
    SuccessCriteriaMet, then Complete); Running while ``ready`` (pods or child jobs) is above 0
    and it neither ended nor is suspended, ``running`` giving the reasons for True and False
    and the message."""
    out = [JobCondition(type="Created", status="True", reason=created)]
    for c in conditions_of(job):
        kind = types.get(c.type)
        if kind is not None and not any(o.type == kind and o.status == "True" for o in out):
            out.append(dataclasses.replace(c, type=kind))
    settled = any(c.status == "True" for c in out if c.type in ("Succeeded", "Failed", "Suspended"))
    is_running = ready > 0 and not settled
    yes, no, message = running
    status, reason = ("True", yes) if is_running else ("False", no)
    out.append(JobCondition("Running", status, reason, message or None))
    return tuple(out)


def finished(conditions: Sequence[JobCondition]) -> bool:
    """Whether a job's conditions (in the PyTorchJob's terms) say it ended, either way."""
    return any(c.type in TERMINAL_PHASES and c.status == "True" for c in conditions)


def finished_at(conditions: Sequence[JobCondition]) -> str | None:
    """When the job's Succeeded or Failed condition turned True, if one has."""
    return next(
        (c.last_transition_time for c in conditions if c.type in TERMINAL_PHASES and c.status == "True"), None
    )


def times(job: Mapping[str, Any] | None, conditions: Sequence[JobCondition]) -> tuple[str | None, str | None]:
    """When a job started and finished, as its status says; where it records no completion
    time (a TrainJob records neither), when its Succeeded or Failed condition turned True."""
    status = (job or {}).get("status") or {}
    return status.get("startTime"), status.get("completionTime") or finished_at(conditions)


def changed(
    want: Mapping[str, Any], have: Mapping[str, Any], fields: Sequence[str], skip: Sequence[str] = ()
) -> dict[str, Any]:
    """The ``fields`` (but those in ``skip``) whose wanted value differs from the one there."""
    return {k: want.get(k) for k in fields if k not in skip and want.get(k) != have.get(k)}


def queue_state(workloads: Sequence[Mapping[str, Any]]) -> QueueState | None:
    """Where Kueue has a job, from the Workloads it made for it (newest first; None: none yet).

    Kueue's own conditions, in its order of events: QuotaReserved (False: still pending, with
    why), then Admitted; Evicted (True: preempted or otherwise put back in the queue) wins
    over an earlier admission until the Workload is admitted again.
    """
    if not workloads:
        return None
    newest = max(workloads, key=lambda w: str((w.get("metadata") or {}).get("creationTimestamp") or ""))
    conditions = {
        str(c.get("type")): c
        for c in (newest.get("status") or {}).get("conditions") or ()
        if isinstance(c, Mapping)
    }

    def said(kind: str) -> tuple[str, str] | None:
        c = conditions.get(kind)
        return (str(c.get("reason") or kind), str(c.get("message") or "")) if c else None

    def true(kind: str) -> bool:
        return (conditions.get(kind) or {}).get("status") == "True"

    if true("Admitted") and not true("Evicted"):
        return QueueState(True, *(said("Admitted") or ("Admitted", "")))
    for kind in ("Evicted", "QuotaReserved", "Admitted"):
        found = said(kind)
        if found is not None and (kind != "Evicted" or true(kind)):
            return QueueState(False, *found)
    # Not Kueue's own "Pending" (which comes with why): nothing has been decided yet.
    return QueueState(False, "WaitingForKueue", "Kueue has made its Workload and not considered it yet")


def created_from(job: Mapping[str, Any] | None) -> str | None:
    """The record of the fixed spec a PyTorchJob was made from (None: not recorded, e.g. by an
    older operator); :func:`gpuop.api.spec.fixed_spec_changes` reads it."""
    record = (((job or {}).get("metadata") or {}).get("annotations") or {}).get(CREATED_FROM_ANNOTATION)
    return record if isinstance(record, str) else None


def job_stop(job: Mapping[str, Any] | None) -> tuple[str, str, str] | None:
    """Why the operator stopped the job for good, if it did (:data:`STOPPED_ANNOTATION`):
    (pod, reason, line)."""
    text = (((job or {}).get("metadata") or {}).get("annotations") or {}).get(STOPPED_ANNOTATION)
    try:
        said = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        said = None
    if not isinstance(said, dict):
        return None
    fields = tuple(str(said.get(key) or "")[:1000] for key in ("pod", "reason", "line"))
    return fields if fields[1] else None  # type: ignore[return-value]


def stop_annotation(stop: tuple[str, str, str]) -> dict[str, str]:
    """The job's annotation that says why the operator stopped it (read by :func:`job_stop`)."""
    pod, reason, line = stop
    return {STOPPED_ANNOTATION: json.dumps({"pod": pod, "reason": reason, "line": line}, sort_keys=True)}


def slim_job(job: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator keeps of a job between reconciles: the fields the functions
    here and the runPolicy patch read. A stored job is ~25 KB of JSON with its pod template
    and managedFields, ~200 KB as Python objects; the table holds one per GpuTraining
    (measured at 1,000 jobs against a real API server: 311 MB peak RSS before, see
    docs/benchmarks.md)."""
    meta = job.get("metadata") or {}
    kept = {key: meta[key] for key in _KEPT_METADATA if key in meta}
    annotations = meta.get("annotations") or {}
    kept_annotations = {key: annotations[key] for key in (CREATED_FROM_ANNOTATION, STOPPED_ANNOTATION)
                        if isinstance(annotations.get(key), str)}  # fmt: skip
    if kept_annotations:
        kept["annotations"] = kept_annotations
    spec = job.get("spec") or {}
    return {
        "apiVersion": job.get("apiVersion"),
        "kind": job.get("kind"),
        "metadata": kept,
        # Copies (a runPolicy is a few fields): a job just made is the operator's cached render.
        "spec": {key: copy.deepcopy(value) for key, value in spec.items() if _small(value)},
        "status": job.get("status") or {},
    }


_KEPT_METADATA = (
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "labels",
    "ownerReferences",
    "creationTimestamp",
)
# Of a job's spec the operator keeps the small fields, whatever the backend: those it patches
# and reads (a PyTorchJob's runPolicy, a TrainJob's or a Job's suspend and deadline) are all
# small, and the big ones (pod templates, a TrainJob's trainer with its env) are what cost. The
# bound is generous: a field it reads that grew past it (a runPolicy whose schedulingPolicy
# lists many minResources) would look unset, and be patched on every reconcile; a pod template
# holds hundreds of values.
_SMALL_SPEC_VALUES = 64


def _small(value: Any, budget: int = _SMALL_SPEC_VALUES) -> bool:
    """Whether ``value`` holds at most ``budget`` values (scalars, lists, mappings), however nested."""
    return _values(value, budget) <= budget


def _values(value: Any, budget: int) -> int:
    """How many values ``value`` is and holds, counting no further than past ``budget``."""
    if isinstance(value, Mapping):
        items: Any = value.values()
    elif isinstance(value, list):
        items = value
    else:
        return 1
    count = 1
    for item in items:
        if count > budget:
            break
        count += _values(item, budget - count)
    return count


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


def _trainer_name(pod: Mapping[str, Any]) -> str | None:
    """The trainer container's name: the pod template's annotation for it; for a pod without one,
    its first container (every backend renders the trainer first, and alone)."""
    metadata = pod.get("metadata") or {}
    named = (metadata.get("annotations") or {}).get(DEFAULT_CONTAINER_ANNOTATION)
    if isinstance(named, str):
        return named
    containers = (pod.get("spec") or {}).get("containers") or ()
    first = containers[0] if containers and isinstance(containers[0], Mapping) else {}
    return first.get("name") if isinstance(first.get("name"), str) else None


def _trainer_entry(containers: Any, name: str | None) -> Mapping[str, Any]:
    """The trainer container's entry of a pod's list of containers (``spec.containers``) or
    their statuses (``status.containerStatuses``): the one named ``name`` (no name known: the
    first); {} when there is none."""
    for container in containers or ():
        if isinstance(container, Mapping) and (name is None or container.get("name") == name):
            return container
    return {}


def _terminations(container: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A container status's ``terminated`` records: the current state's first, then the one
    before its last restart (restartPolicy OnFailure restarts it in place)."""
    found = []
    for state in (container.get("state"), container.get("lastState")):
        terminated = state.get("terminated") if isinstance(state, Mapping) else None
        if isinstance(terminated, Mapping):
            found.append(terminated)
    return found


def _result(container: Mapping[str, Any]) -> Result | None:
    """The trainer's final record, if its termination message holds one (else, under
    FallbackToLogsOnError, it holds a crashed trainer's last log lines: no record)."""
    message = _termination_message(container)
    return Result.from_json(message) if message is not None else None


def _termination_message(container: Mapping[str, Any]) -> str | None:
    # The current state first; after a restart the record is in lastState.
    for terminated in _terminations(container):
        message = terminated.get("message")
        if isinstance(message, str) and message:
            return message
    return None


def _oom_killed(container: Mapping[str, Any]) -> bool:
    """Whether the kubelet says the kernel killed the container at its memory limit, now or
    before its last restart (the next start hides the kill but in lastState)."""
    return any(terminated.get("reason") == "OOMKilled" for terminated in _terminations(container))


# The kubelet's waiting reasons that no wait cures: the pod needs a change (a Secret made, an
# image name fixed). ContainerCreating and PodInitializing pass by themselves.
CANNOT_START: Final = frozenset({
    "CreateContainerConfigError", "CreateContainerError", "ErrImagePull", "ImagePullBackOff",
    "InvalidImageName", "ErrImageNeverPull",
})  # fmt: skip


def _cannot_start(container: Mapping[str, Any]) -> tuple[str, str] | None:
    waiting = (container.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason")
    if reason not in CANNOT_START:
        return None
    return str(reason), str(waiting.get("message") or "")[:500]


def _fetch_entry(statuses: Any) -> Mapping[str, Any]:
    """The dataset step's entry of ``status.initContainerStatuses``: {} when there is none."""
    return next(
        (c for c in statuses or () if isinstance(c, Mapping) and c.get("name") == FETCH_CONTAINER), {}
    )


def _fetching(fetch: Mapping[str, Any]) -> bool:
    """Whether the dataset step has yet to finish: copying, or waiting to copy again after a
    failure (one condition through the retries, not one a try)."""
    if not fetch or fetch.get("ready"):
        return False
    terminated = (fetch.get("state") or {}).get("terminated")
    return not (isinstance(terminated, Mapping) and terminated.get("exitCode") == 0)


def _fetch_failed(fetch: Mapping[str, Any]) -> tuple[str, str] | None:
    """Why the dataset step's last try failed, while it has yet to succeed (the kubelet runs it
    again, backing off): its own line from its termination message, or its exit code."""
    if not _fetching(fetch) or not fetch.get("restartCount"):
        return None
    terminated = next((t for t in _terminations(fetch) if t.get("exitCode")), None)
    if terminated is None:
        return None
    record = Result.from_json(str(terminated.get("message") or ""))
    said = (
        record.message
        if record is not None and record.message
        else f"it exited with {terminated.get('exitCode')}"
    )
    return (record.reason if record is not None and record.reason else "DatasetFetchFailed"), said[:1000]


def _needs_fix(container: Mapping[str, Any]) -> tuple[str, str] | None:
    """The (reason, message) of a container that is down after a failure its record says a
    restart cannot mend (:attr:`Result.permanent`). Only while it is down: one running again
    (after a fix, say, while the operator was away) keeps the old record in lastState."""
    if not container or (container.get("state") or {}).get("running"):
        return None
    newest = _terminations(container)[:1]  # the newest attempt's only: an older one's may predate a fix
    record = Result.from_json(str(newest[0].get("message") or "")) if newest else None
    if record is None or record.phase != "Failed" or not record.permanent:
        return None
    return record.reason or "TrainerFailed", (record.message or record.reason or "it failed")[:1000]


def created_at(obj: Mapping[str, Any] | None) -> str | None:
    """An object's creationTimestamp, as the API server wrote it (RFC 3339, UTC, seconds)."""
    stamp = ((obj or {}).get("metadata") or {}).get("creationTimestamp")
    return stamp if isinstance(stamp, str) else None


def _memory_limit(pod: Mapping[str, Any], trainer: str | None) -> str | None:
    """The ``trainer`` container's memory limit, as the pod's spec says it."""
    container = _trainer_entry((pod.get("spec") or {}).get("containers"), trainer)
    limit = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    return str(limit) if isinstance(limit, (str, int)) else None


def pod_observation(
    pod: Mapping[str, Any],
    metrics: TrainerMetrics | None,
    exporter_gpus: tuple[GpuFigures, ...] | None = None,
    node_lost: NodeLoss | None = None,
) -> PodObservation:
    status = pod.get("status") or {}
    meta = pod.get("metadata") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()
    )
    trainer_name = _trainer_name(pod)
    trainer = _trainer_entry(status.get("containerStatuses"), trainer_name)
    fetch = _fetch_entry(status.get("initContainerStatuses"))
    restarts = trainer.get("restartCount")
    started = ((trainer.get("state") or {}).get("running") or {}).get("startedAt")
    return PodObservation(
        name=str(meta.get("name", "")),
        phase=str(status.get("phase", "Unknown")),
        ready=ready,
        result=_result(trainer),
        metrics=metrics,
        exporter_gpus=exporter_gpus,
        restarts=restarts if isinstance(restarts, int) else 0,
        trainer_started_at=started if isinstance(started, str) else None,
        oom_killed=_oom_killed(trainer),
        memory_limit=_memory_limit(pod, trainer_name),
        cannot_start=_cannot_start(trainer) or _fetch_failed(fetch) or _cannot_start(fetch),
        fetching_dataset=_fetching(fetch),
        needs_fix=_needs_fix(trainer) or (_needs_fix(fetch) if _fetching(fetch) else None),
        created_at=created_at(pod),
        uid=str(meta["uid"]) if meta.get("uid") else None,
        deleting=bool(meta.get("deletionTimestamp")),
        node_lost=node_lost,
    )
