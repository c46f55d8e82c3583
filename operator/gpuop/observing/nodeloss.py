"""A training pod whose node is lost: what it is, when the gang is started again, and the words
for it. Pure.

A node that dies (a GPU's Xid error, a preempted spot VM, a kernel panic) stops posting its
status; about 40 s later the node controller says it is not Ready and marks its pods not ready.
Kubernetes then waits 5 minutes before evicting them, and the eviction never completes: a dead
kubelet never confirms, so each pod stays Terminating, and its job's controller cannot make a
pod of that name again. The surviving ranks meanwhile wait in a collective for a peer that is
gone (10 minutes, gputrain's timeout) or in a rendezvous it never joins, holding their GPUs.

So the operator gives up on such a pod itself, ``spec.nodeLossTimeoutSeconds`` after its node
stopped being Ready: it deletes the pods on the lost node at once (grace 0: no kubelet will run
a graceful stop) and the gang's other pods as a preemption would, and the job's controller makes
every pod again on the nodes that are left, where each rank resumes from the last checkpoint.
The cost of the short default: a node cut off by a network partition, not dead, may run the old
pod until its kubelet is back and sees it deleted, beside the new one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from gpuop.api.status import TIME_FORMAT, parse_time
from gpuop.observing.records import NodeLoss, PodObservation

# The reason a node is lost when its Node object is gone (deleted by a cloud's autoscaler, or
# by hand): nothing can bring it back, so its pods are given up on at once.
NODE_DELETED: Final = "NodeDeleted"
# The node controller's reason when a node's kubelet stopped posting its status.
UNREACHABLE: Final = "NodeStatusUnknown"


def suspect_node(pod: Mapping[str, Any]) -> str | None:
    """The node of a pod that may have been lost with it, so that its Node is worth reading:
    one bound to a node and either not ready (the node controller marks a lost node's pods so)
    or being deleted (an eviction that waits on a kubelet). A ready pod's node is not read."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    node = spec.get("nodeName")
    if not isinstance(node, str) or not node or status.get("phase") in ("Succeeded", "Failed"):
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()
    )
    deleting = bool((pod.get("metadata") or {}).get("deletionTimestamp"))
    return node if deleting or not ready else None


def node_loss(name: str, node: Mapping[str, Any] | None) -> NodeLoss | None:
    """Whether the node ``name`` is lost, from its Node object (None: there is none): its Ready
    condition is not True (Unknown: its kubelet stopped posting; False: it says it cannot run
    pods), and since when."""
    if node is None:
        return NodeLoss(node=name, reason=NODE_DELETED, since=None)
    conditions = (node.get("status") or {}).get("conditions") or ()
    ready = next((c for c in conditions if isinstance(c, Mapping) and c.get("type") == "Ready"), None)
    if ready is None or ready.get("status") == "True":
        return None
    since = ready.get("lastTransitionTime")
    reason = ready.get("reason")
    return NodeLoss(
        node=name,
        reason=reason if isinstance(reason, str) and reason else "NodeNotReady",
        since=since if isinstance(since, str) else None,
    )


def lost_pods(pods: Sequence[PodObservation]) -> tuple[PodObservation, ...]:
    """The pods on a lost node, by name."""
    return tuple(sorted((p for p in pods if p.node_lost is not None), key=lambda p: p.name))


def gang(
    pods: Sequence[PodObservation], job_created_at: str | None, deleted: frozenset[str]
) -> tuple[PodObservation, ...]:
    """The pods a restart is judged on and acts on: the job's own (a pod of an older job of the
    name, deleted and applied again, is older than the job) and not deleted for a lost node
    already (:attr:`Tracked.deleted_pods`)."""
    return tuple(
        p
        for p in pods
        if p.uid not in deleted and not (p.created_at and job_created_at and p.created_at < job_created_at)
    )


def grace_for(pod: PodObservation) -> int | None:
    """The grace a pod of a restarted gang is deleted with: 0 where no kubelet will confirm a
    graceful stop (its node stopped posting, or is gone), else its own (a node that says it is
    not ready still runs its kubelet, and the trainer may save a checkpoint on SIGTERM)."""
    loss = pod.node_lost
    return 0 if loss is not None and loss.reason in (NODE_DELETED, UNREACHABLE) else None


def restart_at(pods: Sequence[PodObservation], timeout_seconds: int, now: datetime) -> datetime | None:
    """When the gang is started again for its pods on lost nodes: the earliest loss plus the
    timeout (a Node that is gone: now); None when no pod is lost, the timeout is 0 (never: the
    pods wait for Kubernetes), or the loss has no time."""
    lost = lost_pods(pods)
    if not lost or timeout_seconds <= 0:
        return None
    moments = []
    for pod in lost:
        assert pod.node_lost is not None
        loss = pod.node_lost
        if loss.reason == NODE_DELETED:  # nothing will bring it back
            moments.append(now)
        elif loss.since is not None:  # without the time it left Ready, it cannot be timed
            moments.append(parse_time(loss.since).replace(tzinfo=UTC) + timedelta(seconds=timeout_seconds))
    return min(moments, default=None)


def _names(names: Sequence[str]) -> str:
    """Up to three names, then how many more: a message has a bound, a gang may not."""
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _pods(names: Sequence[str]) -> str:
    return f"pod{'s' if len(names) > 1 else ''} {_names(names)}"


def restart_words(kind: str, lost: Sequence[PodObservation], others: Sequence[str]) -> str:
    """The GangRestarted event's message: the lost nodes, the pods deleted at once (``lost``)
    and those deleted with their grace period (``others``)."""
    nodes = sorted({p.node_lost.node for p in lost if p.node_lost is not None})
    now = [p.name for p in lost if grace_for(p) == 0]
    graceful = [p.name for p in lost if grace_for(p) != 0] + list(others)
    parts = ([f"{_pods(now)} at once"] if now else []) + (
        [f"{_pods(graceful)} with {'their' if len(graceful) > 1 else 'its'} grace period"] if graceful else []
    )
    which = f"node{'s' if len(nodes) > 1 else ''} {_names(nodes)}"
    return (
        f"{which} lost: the operator deleted {' and '.join(parts)}, "
        f"so that the {kind}'s controller makes the gang again on the nodes left"
    )


def lost_words(pods: Sequence[PodObservation], timeout_seconds: int, now: datetime) -> tuple[str, str] | None:
    """The NodeLost condition's (reason, message) while a pod is on a lost node: which nodes,
    since when, which pods, and what happens next."""
    lost = lost_pods(pods)
    if not lost:
        return None
    by_node: dict[str, list[str]] = {}
    losses: dict[str, NodeLoss] = {}
    for pod in lost:
        assert pod.node_lost is not None
        by_node.setdefault(pod.node_lost.node, []).append(pod.name)
        losses[pod.node_lost.node] = pod.node_lost
    said = []
    for node, names in sorted(by_node.items()):
        loss = losses[node]
        state = "is gone" if loss.reason == NODE_DELETED else f"is not ready ({loss.reason})"
        since = f" since {loss.since}" if loss.since else ""
        said.append(f"node {node} {state}{since} with {_pods(names)}")
    due = restart_at(pods, timeout_seconds, now)
    if due is None:
        after = (
            "spec.nodeLossTimeoutSeconds is 0, so the pods wait for Kubernetes (the node's return, "
            "or an eviction a dead kubelet never completes)"
        )
    else:
        after = (
            f"the operator deletes the training's pods at {due.strftime(TIME_FORMAT)} "
            f"(spec.nodeLossTimeoutSeconds {timeout_seconds}) so that its job makes them again on "
            "the nodes left, every rank resuming from the last checkpoint"
        )
    reason = next(iter(losses.values())).reason if len(losses) == 1 else "NodesLost"
    return reason, f"{'; '.join(said)}; {after}"
