"""A training's children in the cluster: made, adopted, patched, or found gone. Blocking calls.

Children are named after their GpuTraining, so a create that finds the name taken (409) reads
the object and adopts it when its controller ownerReference is ours (the operator restarted
mid-reconcile, or a retried create had succeeded); a stranger's is never touched.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any, Final

from gpuop.api.identity import WOKEN_AT_ANNOTATION
from gpuop.api.spec import GpuTraining
from gpuop.api.status import GpuTrainingStatus
from gpuop.backends import registry
from gpuop.backends.registry import JobApi
from gpuop.controller.kube import ApiError, Kube
from gpuop.controller.table import Tracked
from gpuop.observing import observe

log = logging.getLogger(__name__)

# How long a woken controller has before it is woken again, should it not have acted (it was
# restarting, or missed the event): the real one acts within a second. One PATCH each time.
WAKE_AGAIN: Final = timedelta(seconds=30)


def wake_due(tracked: Tracked, api: JobApi, now: datetime) -> bool:
    """Whether a clock the job's controller sleeps through has come, and it was not woken for
    it within :data:`WAKE_AGAIN`."""
    if tracked.child is None or not any(due <= now for due in api.wake_times(tracked.child)):
        return False
    return tracked.woken_at is None or now - tracked.woken_at >= WAKE_AGAIN


def conflict(kind: str, name: str) -> str:
    """Why a training has no job: a stranger holds its name."""
    return (
        f"a {kind} named {name} already exists and is not owned by this GpuTraining; it is left "
        "untouched: delete it or rename the GpuTraining"
    )


class Children:
    """Makes, adopts and patches one training's objects through the API client."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube

    def ensure(
        self, tracked: Tracked, training: GpuTraining, api: JobApi, objects: list[dict[str, Any]]
    ) -> tuple[str, str | None]:
        """Create the job (after its companions), adopt ours, or refuse a stranger's; bring a
        running job's mutable fields to the spec's. Returns (outcome, conflict message)."""
        uid = training.uid
        namespace, name = objects[-1]["metadata"].get("namespace") or "default", training.name
        for obj in objects:
            obj["metadata"]["namespace"] = namespace
        desired = objects[-1]
        outcome = "unchanged"
        if tracked.child is None:
            for companion in objects[:-1]:  # e.g. the TrainJob's runtime: its webhook wants it first
                kind = companion["kind"]
                plural = api.companion_plurals.get(kind) or registry.COMMON_COMPANIONS[kind]
                made, _ = self._create_or_adopt(companion["apiVersion"], plural, companion)
                if observe.owner_uid(made) != uid:
                    made_name = str((made.get("metadata") or {}).get("name") or name)
                    return "conflict", conflict(str(made.get("kind")), made_name)
            made, outcome = self._create_or_adopt(api.api_version, api.plural, desired)
            tracked.child = observe.slim_job(made)
            if outcome == "created":
                log.info("gputraining %s/%s: created %s %s", namespace, name, api.kind, name)
        child = tracked.child
        if observe.owner_uid(child) != uid:
            # Forget it: a stranger may not carry our label, so no event would say it left;
            # each tick asks again (409 + GET) until the name is free.
            tracked.child = None
            return "conflict", conflict(api.kind, name)
        if not observe.finished(api.conditions(child)) and observe.job_stop(child) is None:
            # With a queue, suspend is Kueue's: undoing its suspension would release queued and
            # preempted jobs. A job the operator stopped for good stays as it is.
            owned_by_kueue = training.spec.scheduling.queue_name is not None
            patch = api.mutable_patch(desired, child, skip=("suspend",) if owned_by_kueue else ())
            if patch is not None:
                tracked.child = observe.slim_job(
                    self.kube.patch_object(api.api_version, api.plural, namespace, name, patch)
                )
                log.info("gputraining %s/%s: updated the %s: %s", namespace, name, api.kind, patch)
                outcome = "updated" if outcome == "unchanged" else outcome
        return outcome, None

    def stop(self, tracked: Tracked, training: GpuTraining, api: JobApi, why: tuple[str, str, str]) -> bool:
        """Stop the job for good, so that its pods go and free their GPUs (``why``: derive.stop_for):
        suspended; under Kueue, whose suspend it is (it resumes an admitted job anyone else
        suspends), its Workload deactivated (spec.active false: Kueue evicts it, suspends the job
        and admits it no more). The job is annotated with ``why`` in the same patch as its suspend
        (after the Workload, under Kueue): it says itself that it is stopped, so a status write
        that fails after it loses nothing, and :meth:`ensure` never resumes it. Returns False when
        it cannot be stopped (Kueue's Workload not to be read or found): its pods then restart as
        Kubeflow restarts them."""
        child = tracked.child
        if child is None:
            return False
        meta = child.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name"))
        patch: dict[str, Any] = {"metadata": {"annotations": observe.stop_annotation(why)}}
        if training.spec.scheduling.queue_name is not None:
            workloads = self.kube.list_workloads(namespace, str(meta.get("uid")))
            if not workloads:
                log.warning("gputraining %s/%s: its pods fail in a way no restart mends, and its Kueue "
                            "Workload cannot be read to stop it (may the operator list workloads?)",
                            namespace, name)  # fmt: skip
                return False
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
        tracked.child = observe.slim_job(
            self.kube.patch_object(api.api_version, api.plural, namespace, name, patch)
        )
        log.info("gputraining %s/%s: stopped the %s: pod %s's %s, which no restart mends", namespace, name,
                 api.kind, why[0], why[1])  # fmt: skip
        return True

    def wake(self, tracked: Tracked, api: JobApi, now: datetime) -> bool:
        """Touch the job when :func:`wake_due`: a changed annotation is an update event to its
        controller, which then fails it past its deadline or deletes it past its TTL, by its own
        rules and with its own reasons. Returns whether it touched it."""
        if not wake_due(tracked, api, now):
            return False
        assert tracked.child is not None
        meta = tracked.child.get("metadata") or {}
        namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name"))
        patch = {"metadata": {"annotations": {WOKEN_AT_ANNOTATION: now.isoformat(timespec="seconds")}}}
        try:
            tracked.child = observe.slim_job(
                self.kube.patch_object(api.api_version, api.plural, namespace, name, patch)
            )
        except ApiError as exc:
            if exc.status != 404:
                raise  # not woken: the next reconcile tries again
            tracked.woken_at = now  # gone already (its controller acted): its DELETED event follows
            return False
        tracked.woken_at = now
        log.info("gputraining %s/%s: woke the %s's controller for its clock", namespace, name, api.kind)
        return True

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

    def finished_and_gone(
        self, tracked: Tracked, previous: GpuTrainingStatus | None, training: GpuTraining, api: JobApi
    ) -> bool:
        """Whether this GpuTraining finished with a job that is gone since.

        Unseen is not gone: after a restart the GpuTraining's event can come before its job's,
        so the job is asked for once before it counts as deleted.
        """
        if previous is None or previous.phase not in ("Succeeded", "Failed"):
            return False
        if previous.pytorch_job is None and previous.train_job is None:
            return False
        if tracked.child is not None:
            return False
        if not tracked.child_gone:
            namespace = training.namespace or "default"
            found = self.kube.get_object(api.api_version, api.plural, namespace, training.name)
            if found is not None and observe.owner_uid(found) == training.uid:
                tracked.child = observe.slim_job(found)
                return False
            tracked.child_gone = True
        return True
