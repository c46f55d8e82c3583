"""A training's children in the cluster: made, adopted, patched, or found gone. Blocking calls.

Children are named after their GpuTraining, so a create that finds the name taken (409) reads
the object and adopts it when its controller ownerReference is ours (the operator restarted
mid-reconcile, or a retried create had succeeded); a stranger's is never touched.

Each call is given the job as last seen and returns the job as the call left it; the state
table is the reconcile's alone to update (:mod:`~gpuop.controller.reconciler`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from gpuop.api.identity import WOKEN_AT_ANNOTATION
from gpuop.api.spec import GpuTraining
from gpuop.backends import registry
from gpuop.backends.contract import JobApi
from gpuop.controller.apiclient import ApiError
from gpuop.controller.kube import Kube
from gpuop.observing import observe

log = logging.getLogger(__name__)

# How long a woken controller has before it is woken again, should it not have acted (it was
# restarting, or missed the event): the real one acts within a second. One PATCH each time.
WAKE_AGAIN: Final = timedelta(seconds=30)


def finished(child: dict[str, Any] | None) -> bool:
    """Whether the job has ended (its Succeeded or Failed condition is True), read by its own
    backend. Nothing of it may be left for later then: its TTL may delete it at any moment."""
    api = registry.of_kind(child.get("kind")) if child is not None else None
    return api is not None and child is not None and observe.finished(api.conditions(child))


def wake_due(child: dict[str, Any] | None, woken_at: datetime | None, api: JobApi, now: datetime) -> bool:
    """Whether a clock the job's controller sleeps through has come, and it was not woken (at
    ``woken_at``) within :data:`WAKE_AGAIN`."""
    if child is None or not any(due <= now for due in api.wake_times(child)):
        return False
    return woken_at is None or now - woken_at >= WAKE_AGAIN


def next_wake(
    child: dict[str, Any] | None, woken_at: datetime | None, api: JobApi, now: datetime
) -> datetime | None:
    """When :func:`wake_due` turns true if nothing else changes: the job's next clock, or, for
    one come and woken already, the end of the :data:`WAKE_AGAIN` it was given."""
    if child is None:
        return None
    times = []
    for due in api.wake_times(child):
        if due > now:
            times.append(due)
        elif woken_at is not None and woken_at + WAKE_AGAIN > now:
            times.append(woken_at + WAKE_AGAIN)
        else:
            times.append(now)  # due, and not woken: at once (wake_due holds)
    return min(times, default=None)


def conflict(kind: str, name: str) -> str:
    """Why a training has no job: a stranger holds its name."""
    return (
        f"a {kind} named {name} already exists and is not owned by this GpuTraining; it is left "
        "untouched: delete it or rename the GpuTraining"
    )


@dataclass(frozen=True)
class Ensured:
    """What :meth:`Children.ensure` did, and the job as it left it."""

    outcome: str  # "created", "adopted", "unchanged" or "conflict" (an update is update()'s)
    child: dict[str, Any] | None  # None: none made, or a stranger's name (forgotten)
    conflict: str | None = None  # why there is no job of ours, said in status


class Children:
    """Makes, adopts and patches one training's objects through the API client."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    def ensure(
        self, child: dict[str, Any] | None, training: GpuTraining, api: JobApi, objects: list[dict[str, Any]]
    ) -> Ensured:
        """Create the job (after its companions) when ``child`` (the job as last seen) is None,
        adopt ours, or refuse a stranger's. Then :meth:`update`: two calls, so that a job made
        here is kept by the reconcile even when its update fails."""
        uid = training.uid
        namespace, name = objects[-1]["metadata"].get("namespace") or "default", training.name
        for obj in objects:
            obj["metadata"]["namespace"] = namespace
        desired = objects[-1]
        outcome = "unchanged"
        if child is None:
            for companion in objects[:-1]:  # e.g. the TrainJob's runtime: its webhook wants it first
                kind = companion["kind"]
                plural = api.companion_plurals.get(kind) or registry.COMMON_COMPANIONS[kind]
                made, _ = self._create_or_adopt(companion["apiVersion"], plural, companion)
                if observe.owner_uid(made) != uid:
                    made_name = str((made.get("metadata") or {}).get("name") or name)
                    return Ensured("conflict", None, conflict(str(made.get("kind")), made_name))
            made, outcome = self._create_or_adopt(api.api_version, api.plural, desired)
            child = observe.slim_job(made)
            if outcome == "created":
                log.info("gputraining %s/%s: created %s %s", namespace, name, api.kind, name)
        if observe.owner_uid(child) != uid:
            # Forget it: a stranger may not carry our label, so no event would say it left;
            # each tick asks again (409 + GET) until the name is free.
            return Ensured("conflict", None, conflict(api.kind, name))
        return Ensured(outcome, child)

    def update(
        self, child: dict[str, Any], training: GpuTraining, api: JobApi, desired: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Bring our running job's mutable fields to the spec's (``desired``, as rendered); the
        job as patched, or None when nothing was to change."""
        if observe.finished(api.conditions(child)) or observe.job_stop(child) is not None:
            return None  # a job the operator stopped for good stays as it is
        # With a queue, suspend is Kueue's: undoing its suspension would release queued and
        # preempted jobs.
        owned_by_kueue = training.spec.scheduling.queue_name is not None
        patch = api.mutable_patch(desired, child, skip=("suspend",) if owned_by_kueue else ())
        if patch is None:
            return None
        namespace, name = desired["metadata"].get("namespace") or "default", training.name
        patched = self.kube.patch_object(api.api_version, api.plural, namespace, name, patch)
        log.info("gputraining %s/%s: updated the %s: %s", namespace, name, api.kind, patch)
        return observe.slim_job(patched)

    def stop(
        self, child: dict[str, Any], training: GpuTraining, api: JobApi, why: tuple[str, str, str]
    ) -> dict[str, Any] | None:
        """Stop the job for good, so that its pods go and free their GPUs (``why``: diagnosis.stop_for):
        suspended; under Kueue, whose suspend it is (it resumes an admitted job anyone else
        suspends), its Workload deactivated (spec.active false: Kueue evicts it, suspends the job
        and admits it no more). The job is annotated with ``why`` in the same patch as its suspend
        (after the Workload, under Kueue): it says itself that it is stopped, so a status write
        that fails after it loses nothing, and :meth:`ensure` never resumes it. Returns the job
        as stopped, or None when it cannot be stopped (Kueue's Workload not to be read or found):
        its pods then restart as Kubeflow restarts them."""
        meta = child.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name"))
        patch: dict[str, Any] = {"metadata": {"annotations": observe.stop_annotation(why)}}
        if training.spec.scheduling.queue_name is not None:
            workloads = self.kube.list_workloads(namespace, str(meta.get("uid")))
            if not workloads:
                log.warning("gputraining %s/%s: its pods fail in a way no restart mends, and its Kueue "
                            "Workload cannot be read to stop it (may the operator list workloads?)",
                            namespace, name)  # fmt: skip
                return None
            for workload in workloads:
                if (workload.get("spec") or {}).get("active") is False:
                    continue
                self.kube.patch_object(
                    str(workload["apiVersion"]), "workloads", namespace,
                    str((workload.get("metadata") or {}).get("name")), {"spec": {"active": False}},
                )  # fmt: skip
                log.info("gputraining %s/%s: deactivated its Kueue Workload", namespace, name)
        else:
            patch = {**api.suspend_patch(), **patch}
        stopped = observe.slim_job(
            self.kube.patch_object(api.api_version, api.plural, namespace, name, patch)
        )
        log.info("gputraining %s/%s: stopped the %s: pod %s's %s, which no restart mends", namespace, name,
                 api.kind, why[0], why[1])  # fmt: skip
        return stopped

    def wake(self, child: dict[str, Any], api: JobApi, now: datetime) -> dict[str, Any] | None:
        """Touch the job (when :func:`wake_due`): a changed annotation is an update event to its
        controller, which then fails it past its deadline or deletes it past its TTL, by its own
        rules and with its own reasons. Returns the job as touched, or None when it is gone
        already (its controller acted: its DELETED event follows)."""
        meta = child.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name"))
        patch = {"metadata": {"annotations": {WOKEN_AT_ANNOTATION: now.isoformat(timespec="seconds")}}}
        try:
            woken = observe.slim_job(
                self.kube.patch_object(api.api_version, api.plural, namespace, name, patch)
            )
        except ApiError as exc:
            if exc.status != 404:
                raise  # not woken: the next reconcile tries again
            return None
        log.info("gputraining %s/%s: woke the %s's controller for its clock", namespace, name, api.kind)
        return woken

    def _create_or_adopt(
        self, api_version: str, plural: str, desired: dict[str, Any]
    ) -> tuple[dict[str, Any], str]:
        """Create an object, or find the one of its name (ours from an earlier life, or someone
        else's: the caller tells them apart by owner)."""
        meta = desired["metadata"]
        try:
            return self.kube.create_object(desired, plural), "created"
        except ApiError as exc:
            if exc.status != 409:
                raise
            found = self.kube.get_object(api_version, plural, meta["namespace"], meta["name"])
            if found is None:  # deleted in between: the next call creates it
                raise
            return found, "adopted"

    def find_ours(self, training: GpuTraining, api: JobApi) -> dict[str, Any] | None:
        """The training's job, asked of the API server: None when there is none of ours."""
        namespace = training.namespace or "default"
        found = self.kube.get_object(api.api_version, api.plural, namespace, training.name)
        return (
            observe.slim_job(found)
            if found is not None and observe.owner_uid(found) == training.uid
            else None
        )
