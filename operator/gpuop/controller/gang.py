"""A gang that lost a node, started again: when, and the deletes that do it.

:mod:`gpuop.observing.nodeloss` decides (pure); this carries it out for the reconcile
(:mod:`~gpuop.controller.sync`): it deletes every pod of the gang, so that its job's controller
makes them all again on the nodes left, and says so in one event. It hands back the pods it
deleted, which the reconcile keeps (``Tracked.deleted_pods``), so that a pod being deleted is
not deleted twice and a gang is judged without it.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from gpuop.backends.contract import JobApi
from gpuop.controller.apiclient import ApiError
from gpuop.controller.kube import Kube
from gpuop.controller.statuswriter import StatusWriter
from gpuop.controller.table import key_of
from gpuop.observing import nodeloss, observe
from gpuop.observing.records import Event, Observation, PodObservation

log = logging.getLogger(__name__)


def restart_at(
    gang: tuple[PodObservation, ...], observation: Observation, timeout_seconds: int, now: datetime
) -> datetime | None:
    """When ``gang`` is to be started again (None: not at all). An ended, stopped or suspended
    job's pods are never restarted."""
    if (
        observation.job_stopped is not None
        or observation.job_suspended
        or observe.finished(observation.job_conditions)
    ):
        return None
    return nodeloss.restart_at(gang, timeout_seconds, now)


class GangRestarts:
    """The deletes of the node-loss restarts of the trainings this replica reconciles."""

    def __init__(self, kube: Kube, status: StatusWriter) -> None:
        self.kube = kube
        self._status = status

    def restart(
        self, body: dict[str, Any], api: JobApi, gang: tuple[PodObservation, ...], now: datetime
    ) -> set[str]:
        """Delete every pod of ``gang``: those whose kubelet will not confirm a graceful stop at
        once, the others with their grace period, as a preemption would (their trainer may save
        a checkpoint); the uids deleted. A pod already being deleted is left to it; one whose
        delete fails is said in the log, and tried again at the next reconcile."""
        namespace, name = key_of(body)
        lost = nodeloss.lost_pods(gang)
        others = [p for p in gang if p.node_lost is None and not p.deleting]
        deleted: list[PodObservation] = []
        for pod in (*lost, *others):
            try:
                self.kube.delete_pod(namespace, pod.name, pod.uid, grace_seconds=nodeloss.grace_for(pod))
            except ApiError as exc:
                log.warning(
                    "gputraining %s: deleting pod %s of a gang that lost a node: %s", name, pod.name, exc
                )
                continue
            deleted.append(pod)
        if deleted:
            said = nodeloss.restart_words(
                api.facts.kind,
                [p for p in deleted if p.node_lost is not None],
                [p.name for p in deleted if p.node_lost is None],
            )
            self._status.emit(body, Event("Warning", "GangRestarted", said), now)
        return {p.uid for p in deleted if p.uid is not None}
