"""A pod's node lost: which nodes are read, when a node counts as lost, when the gang is started
again, the NodeLost condition and its event (gpuop.observing.nodeloss, derive, PodReader)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from gpuop.backends.pytorchjob import PYTORCHJOB
from gpuop.controller.pods import PodReader
from gpuop.controller.reconciler import Reconciler
from gpuop.controller.settings import OperatorSettings
from gpuop.controller.telemetry import OperatorMetrics
from gpuop.observing import nodeloss
from gpuop.observing.derive import derive_status, events
from gpuop.observing.records import JobCondition, NodeLoss, Observation, PodObservation, Thresholds
from support.specs import minimal
from support.toyjob import Store, ToyJobApi
from support.waiting import wait_for

T0 = datetime(2026, 11, 21, 12, 0, 0, tzinfo=UTC)
LOST_AT = "2026-11-21T12:00:00Z"
RUNNING = (JobCondition("Created", "True"), JobCondition("Running", "True", "PyTorchJobRunning", "running"))


def pod(
    name: str = "demo-worker-0",
    *,
    node: str | None = "gpu-1",
    ready: bool = False,
    deleting: bool = False,
    phase: str = "Running",
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                            "labels": {"gpuop.io/gputraining": "demo"}}  # fmt: skip
    if deleting:
        meta["deletionTimestamp"] = LOST_AT
    return {
        "metadata": meta,
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]},
    }


def node(ready: str, since: str = LOST_AT, reason: str = "NodeStatusUnknown") -> dict[str, Any]:
    return {"status": {"conditions": [
        {"type": "MemoryPressure", "status": "False"},
        {"type": "Ready", "status": ready, "reason": reason, "lastTransitionTime": since},
    ]}}  # fmt: skip


def test_only_the_node_of_a_bound_pod_that_is_not_ready_or_is_being_deleted_is_read() -> None:
    assert nodeloss.suspect_node(pod(ready=True)) is None
    assert nodeloss.suspect_node(pod(ready=False)) == "gpu-1"
    assert nodeloss.suspect_node(pod(ready=True, deleting=True)) == "gpu-1"
    assert nodeloss.suspect_node(pod(node=None)) is None  # not placed yet
    assert nodeloss.suspect_node(pod(phase="Succeeded")) is None  # done: its node no longer matters


def test_a_node_is_lost_while_its_ready_condition_is_not_true_or_when_it_is_gone() -> None:
    assert nodeloss.node_loss("gpu-1", node("True")) is None
    assert nodeloss.node_loss("gpu-1", node("Unknown")) == NodeLoss("gpu-1", "NodeStatusUnknown", LOST_AT)
    assert nodeloss.node_loss("gpu-1", node("False", reason="KubeletNotReady")) == NodeLoss(
        "gpu-1", "KubeletNotReady", LOST_AT
    )
    assert nodeloss.node_loss("gpu-1", None) == NodeLoss("gpu-1", nodeloss.NODE_DELETED, None)
    assert nodeloss.node_loss("gpu-1", {"status": {}}) is None  # says nothing: not judged lost


LOST = NodeLoss("gpu-1", "NodeStatusUnknown", LOST_AT)
GANG = (
    PodObservation("demo-master-0", "Running", True, uid="m"),
    PodObservation("demo-worker-0", "Running", False, uid="w", node_lost=LOST),
)


def test_the_gang_is_started_again_the_timeout_after_the_node_was_lost_or_at_once_when_it_is_gone() -> None:
    assert nodeloss.restart_at(GANG, 60, T0) == T0 + timedelta(seconds=60)
    assert nodeloss.restart_at(GANG, 60, T0 + timedelta(seconds=59)) == T0 + timedelta(seconds=60)
    assert nodeloss.restart_at(GANG, 0, T0) is None  # 0: left to Kubernetes
    assert nodeloss.restart_at(GANG[:1], 60, T0) is None  # nothing lost
    gone = (
        PodObservation("demo-worker-0", "Running", uid="w", node_lost=NodeLoss("gpu-1", "NodeDeleted", None)),
    )
    assert nodeloss.restart_at(gone, 60, T0) == T0  # at once
    untimed = (
        PodObservation(
            "demo-worker-0", "Running", uid="w", node_lost=NodeLoss("gpu-1", "KubeletNotReady", None)
        ),
    )
    assert nodeloss.restart_at(untimed, 60, T0) is None  # said, never timed


def _observe(seconds: float, pods: tuple[PodObservation, ...]) -> Observation:
    return Observation(
        now=T0 + timedelta(seconds=seconds), generation=1, workers_total=2, gpus=2, job_name="demo",
        job_conditions=RUNNING, job_start_time="2026-11-21T11:00:00Z", pods=pods, job_api=PYTORCHJOB.facts,
    )  # fmt: skip


def test_node_lost_names_the_node_and_the_pods_and_when_the_gang_starts_again_then_clears() -> None:
    thresholds = Thresholds(stall_timeout_seconds=900, node_loss_timeout_seconds=60)
    running = derive_status(
        None, _observe(-30, (GANG[0], PodObservation("demo-worker-0", "Running", True))), thresholds
    )
    lost = derive_status(running, _observe(5, GANG), thresholds)
    condition = next(c for c in lost.conditions if c.type == "NodeLost")
    assert (condition.status, condition.reason) == ("True", "NodeStatusUnknown")
    assert condition.message == (
        f"node gpu-1 is not ready (NodeStatusUnknown) since {LOST_AT} with pod demo-worker-0; the operator "
        "deletes the training's pods at 2026-11-21T12:01:00Z (spec.nodeLossTimeoutSeconds 60) so that its "
        "job makes them again on the nodes left, every rank resuming from the last checkpoint"
    )
    assert ("Warning", "NodeStatusUnknown") in [(e.type, e.reason) for e in events(running, lost)]
    back = derive_status(
        lost, _observe(90, (GANG[0], PodObservation("demo-worker-0", "Pending"))), thresholds
    )
    cleared = next(c for c in back.conditions if c.type == "NodeLost")
    assert (cleared.status, cleared.reason) == ("False", "Cleared")


def test_with_no_timeout_the_condition_says_the_pods_wait_for_kubernetes() -> None:
    thresholds = Thresholds(stall_timeout_seconds=900, node_loss_timeout_seconds=0)
    status = derive_status(None, _observe(5, GANG), thresholds)
    message = next(c.message for c in status.conditions if c.type == "NodeLost")
    assert message.endswith("spec.nodeLossTimeoutSeconds is 0, so the pods wait for Kubernetes (the node's "
                            "return, or an eviction a dead kubelet never completes)")  # fmt: skip


class _Cluster:
    """The pods of one training, and its nodes, as a reader's Kube sees them."""

    def __init__(self, pods: list[dict[str, Any]], nodes: dict[str, dict[str, Any] | None]) -> None:
        self.pods = pods
        self.nodes = nodes
        self.node_reads: list[str] = []
        self.in_cluster = True

    def list_training_pods(self, namespace: str) -> list[dict[str, Any]]:
        return self.pods

    def get_node(self, name: str) -> dict[str, Any] | None:
        self.node_reads.append(name)
        return self.nodes[name]


def test_the_reader_reads_each_suspect_node_once_in_a_while_and_marks_its_pods() -> None:
    cluster = _Cluster(
        [pod("demo-master-0", node="gpu-0", ready=True), pod("demo-worker-0", node="gpu-1"),
         pod("demo-worker-1", node="gpu-1"), pod("demo-worker-2", node="gpu-2")],
        {"gpu-1": node("Unknown"), "gpu-2": node("True")},
    )  # fmt: skip
    reader = PodReader(
        cluster,  # type: ignore[arg-type]
        OperatorSettings(scrape_timeout_seconds=0.2, scrape_via="pod-ip"),
        OperatorMetrics(),
    )
    try:
        observed = (reader.observe({"ns": ["demo"]})["ns"] or {})["demo"] or ()
        reader.observe({"ns": ["demo"]})
    finally:
        reader.close()
    assert {p.name: p.node_lost for p in observed} == {
        "demo-master-0": None, "demo-worker-0": LOST, "demo-worker-1": LOST, "demo-worker-2": None}  # fmt: skip
    assert sorted(cluster.node_reads) == [
        "gpu-1",
        "gpu-2",
    ]  # the ready pod's node never; each once in two ticks


def _toy_pod(name: str, node: str, ready: bool) -> dict[str, Any]:
    made = pod(name, node=node, ready=ready)
    made["metadata"]["namespace"] = "default"
    made["metadata"]["labels"] = {"gpuop.io/gputraining": "t"}
    return made


def test_the_reconcile_deletes_the_gang_at_the_timeout_by_its_clock_and_never_for_an_ended_job(
    toy: ToyJobApi,
) -> None:
    """Lost at 10:00:00 with a 60 s timeout: the tick at 10:00:30 says NodeLost and deletes
    nothing; the key's own clock (no tick) deletes the lost node's pod at once and the other with
    its grace at 10:01:00, with one GangRestarted event; a second reconcile deletes nothing more.
    A job that has ended is never restarted, and its lost pods set no clock."""
    store = Store()
    start = datetime(2026, 11, 23, 10, tzinfo=UTC)
    now = [start]
    body = minimal()
    body["metadata"] |= {"name": "t", "namespace": "default", "uid": "u-1", "generation": 1}
    store.trainings[("default", "t")] = store._stamp(body)
    store.pods = [_toy_pod("t-0", "gpu-0", True), _toy_pod("t-1", "gpu-1", False)]
    store.nodes = {"gpu-0": node("True"), "gpu-1": node("Unknown", since="2026-11-23T10:00:00Z")}
    reconciler = Reconciler(
        store,  # type: ignore[arg-type]
        OperatorSettings(scrape_timeout_seconds=0.2),
        clock=lambda: now[0],
        timer=lambda: now[0].timestamp(),
    )
    key = ("default", "t")
    try:
        reconciler.training_event("ADDED", store.get_training(*key) or {})
        reconciler.run_pending()
        job = store.job()
        job["status"] = {"state": "Running", "began": "2026-11-23T09:00:00Z"}
        reconciler.job_event("MODIFIED", store._stamp(job))
        reconciler.run_pending()
        now[0] = start + timedelta(seconds=30)
        reconciler.tick()
        reconciler.run_pending()
        lost = next(c for c in store.trainings[key]["status"]["conditions"] if c["type"] == "NodeLost")
        assert (lost["status"], lost["reason"]) == ("True", "NodeStatusUnknown")
        wait_for(
            "the NodeLost event", lambda: "NodeStatusUnknown" in store.events
        )  # posted off the reconcile
        assert store.deleted_pods == []
        now[0] = start + timedelta(seconds=60)
        assert reconciler.run_pending() == 1  # its clock, no tick
        assert store.deleted_pods == [("t-1", 0), ("t-0", None)]
        wait_for("the GangRestarted event", lambda: "GangRestarted" in store.events)
        reconciler.training_event("MODIFIED", store.get_training(*key) or {})
        reconciler.job_event("MODIFIED", store._stamp(store.job()))
        reconciler.run_pending()
        assert store.deleted_pods == [("t-1", 0), ("t-0", None)]  # not again before the next listing
        assert store.events.count("GangRestarted") == 1
        # The lost pod listed again (a finalizer holds it) beside the new master: not deleted again.
        replacement = _toy_pod("t-0", "gpu-0", True)
        replacement["metadata"]["uid"] = "uid-t-0-again"
        store.pods = [replacement, _toy_pod("t-1", "gpu-1", False)]
        reconciler.tick()
        reconciler.run_pending()
        assert store.deleted_pods == [("t-1", 0), ("t-0", None)]

        # Another node lost, and the job ends before its timeout: nothing deleted, no clock left.
        store.pods = [_toy_pod("t-0", "gpu-2", False)]
        store.nodes["gpu-2"] = node("Unknown", since="2026-11-23T10:01:00Z")
        reconciler.tick()
        reconciler.run_pending()
        job = store.job()
        job["status"] = {"state": "Done", "began": "2026-11-23T09:00:00Z", "since": "2026-11-23T10:01:05Z"}
        reconciler.job_event("MODIFIED", store._stamp(job))
        reconciler.run_pending()
        assert store.trainings[key]["status"]["phase"] == "Succeeded"
        now[0] = start + timedelta(minutes=10)
        assert reconciler.run_pending() == 0
        assert store.deleted_pods == [("t-1", 0), ("t-0", None)]
    finally:
        reconciler.close()
