"""What GPU clusters do to a training, on the real nodes with two operator replicas:

* the leading operator pod killed mid-run as a dead machine would kill it: the standby takes the
  Lease, and the training's reports, status transitions and job are neither lost nor done twice;
* a whole node dead mid-run (its kubelet and every process of its pods SIGKILLed): the training
  says so, and its gang starts again on the other node from its checkpoint, without waiting the
  5 minutes of Kubernetes' eviction (which a dead kubelet never completes anyway); admitted by
  the real Kueue, it keeps that admission throughout (only its pods are made again, not its job).

Last of the chain's modules (by name): the package's operator pod is the one it kills.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from gputrain.contract import complete_checkpoint_step
from support import chain
from support.chain import Claims
from support.controllers import kueue
from support.node.node import Node
from support.node.pool import Pool
from support.plane.cluster import Api
from support.plane.controlplane import ControlPlane
from support.tools.helm import RELEASE_NAMESPACE
from support.training import put_hooks
from support.waiting import wait_for

from .conftest import lease_holder, operator_pods

LEADER_LABEL = "gpuop.io/leader"
# The plain loop reports every step; paced, long enough for the leader to die in the middle
# and the standby to take over (13 to 19 s) with steps left to report after.
STEPS, STEP_SECONDS = 40, 1.5
# The dead node's gang is deleted this long after the node controller says the node is not
# Ready (which it says about 40 s after the kubelet's last word); the stall timeout is above
# the whole gap without a step (about 90 s here), so that no Stalled is raised on the way.
NODE_LOSS_TIMEOUT, STALL_TIMEOUT = 10, 240


def _accepted(plane: ControlPlane, pod: str) -> float:
    """The progress reports this replica accepted, from its own /metrics (the pod proxy)."""
    text = plane.kubectl(
        "get", "--raw", f"/api/v1/namespaces/{RELEASE_NAMESPACE}/pods/{pod}:8080/proxy/metrics"
    ).stdout
    found = re.search(r'^gpuop_reports_total\{outcome="accepted"\} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@pytest.mark.usefixtures("kubeflow")
def test_a_killed_leader_is_replaced_and_no_report_transition_or_job_is_lost_or_done_twice(
    plane: ControlPlane,
    api: Api,
    nodes: Pool,
    claims: Claims,
    two_replicas: tuple[str, str],
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    leader, standby = two_replicas
    # Reports go to the leader alone: the report Service's one endpoint is the leader's pod.
    service = next(
        s for s in api.list("services", RELEASE_NAMESPACE) if s["metadata"]["name"].endswith("-reports")
    )
    assert service["spec"]["selector"][LEADER_LABEL] == "true", service["spec"]
    labelled = [p["metadata"]["name"] for p in operator_pods(api)
                if (p["metadata"].get("labels") or {}).get(LEADER_LABEL) == "true"]  # fmt: skip
    assert labelled == [leader], (labelled, leader)

    name = "survivor"
    hooks = put_hooks(claims.make(chain.NAMESPACE, f"{name}-hooks"))
    timeline = chain.paced_own_code(plane, name, tmp_path, hooks, STEP_SECONDS, command=["torchrun"],
                                    args=["/workspace/plain-loop/train.py", "--steps", str(STEPS)], workers=1,
                                    gpusPerWorker=0, resources={"cpu": "500m", "memory": "1Gi"})  # fmt: skip
    timelines.append(timeline)

    def step() -> int:
        found = chain.get(plane, "gtr", name) or {}
        return int(((found.get("status") or {}).get("progress") or {}).get("step") or 0)

    wait_for("a few steps reported", lambda: step() >= 5, timeout=180, every=0.5)
    job_uid = chain.get(plane, "pytorchjob", name)["metadata"]["uid"]  # type: ignore[index]
    assert _accepted(plane, standby) == 0  # no report ever reached the standby

    # Dead as a lost machine leaves it: every process of its container SIGKILLed (no Lease
    # given up, no label taken off), and the pod force-deleted so the container is not restarted.
    placed = next(p for p in operator_pods(api) if p["metadata"]["name"] == leader)
    pids = nodes.of(placed).container_pids(placed, "operator")
    # Read last, a moment before the kill: a report every 5 s at most (gpureport's throttle),
    # so at most one can reach the leader between the two.
    accepted_before = _accepted(plane, leader)
    assert accepted_before >= 1, accepted_before
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    killed, last_step = time.monotonic(), step()
    plane.kubectl(
        "delete", "pod", leader, "-n", RELEASE_NAMESPACE, "--grace-period=0", "--force", "--wait=false"
    )

    wait_for("the standby holding the Lease", lambda: lease_holder(api) == standby, timeout=60, every=0.2)
    took_lease = time.monotonic() - killed
    wait_for("the next status write", lambda: step() > last_step, timeout=60, every=0.2)
    took_status = time.monotonic() - killed
    print(
        f"leader SIGKILLed -> standby holds the Lease in {took_lease:.1f}s, next status write in {took_status:.1f}s"
    )
    # 15 s after the leader's last renewal as the standby's reads (every 2 s) saw it: 13 to 19 s
    # after the kill, which came within a round of that renewal.
    assert 13 <= took_lease <= 19 + 6, took_lease
    standby_pod = next(p for p in operator_pods(api) if p["metadata"]["name"] == standby)
    assert (standby_pod["metadata"].get("labels") or {}).get(LEADER_LABEL) == "true"

    chain.wait_finished(plane, name, timeout=300)
    final = chain.get(plane, "gtr", name)
    assert final is not None
    status = final["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert status["progress"]["step"] == STEPS, status["progress"]
    assert status["progress"]["percent"] == 100, status["progress"]
    # The job the leader made is the one that ran: adopted, not made again.
    events = json.loads(plane.kubectl("get", "events", "-n", chain.NAMESPACE, "--field-selector",
                                      f"involvedObject.name={name}", "-o", "json").stdout)["items"]  # fmt: skip
    reasons = [e["reason"] for e in events if e["involvedObject"]["kind"] == "GpuTraining"]
    assert reasons.count("PyTorchJobCreated") == 1, reasons
    # Each transition once: said by one replica or the other, never by both.
    for transition in ("Running", "Succeeded"):
        assert len([r for r in reasons if r.endswith(transition)]) == 1, reasons
    assert "Failed" not in timeline.phases()
    assert "Stalled" not in timeline.conditions()
    gone = chain.get(plane, "pytorchjob", name)
    assert gone is None or gone["metadata"]["uid"] == job_uid
    # Reports: every one the trainer sent after the takeover reached the new leader.
    accepted_after = _accepted(plane, standby)
    said = nodes.of(standby_pod).log_of(standby_pod, "operator")
    assert "Traceback" not in said, said[-3000:]
    # Every report the trainer had answered 200 was taken by a replica that writes status: the
    # trainer's count (the plain loop prints gpureport's) against the two replicas' counts.
    counted = re.search(
        r"progress reports: (\d+) delivered, (\d+) failed", chain.logs(plane, nodes, f"{name}-master-0")
    )
    assert counted is not None, "the plain loop's count of its reports"
    delivered, failed = int(counted.group(1)), int(counted.group(2))
    print(
        f"reports: {delivered} delivered by the trainer ({failed} failed and sent again), accepted "
        f"{accepted_before:.0f} by the leader before its death and {accepted_after:.0f} by the standby after"
    )
    assert accepted_after >= 1
    assert accepted_before + accepted_after <= delivered <= accepted_before + accepted_after + 1


def _condition(plane: ControlPlane, name: str, kind: str) -> dict[str, str] | None:
    found = chain.get(plane, "gtr", name) or {}
    return next((c for c in (found.get("status") or {}).get("conditions") or ()
                 if c["type"] == kind and c["status"] == "True"), None)  # fmt: skip


def _workload(plane: ControlPlane, name: str) -> dict[str, Any]:
    """Kueue's Workload for the training's job."""
    found = json.loads(
        plane.kubectl("get", "workloads.kueue.x-k8s.io", "-n", chain.NAMESPACE, "-o", "json").stdout
    )["items"]
    (workload,) = [w for w in found if w["metadata"]["ownerReferences"][0]["name"] == name]
    return workload


def _admitted_since(workload: dict[str, Any]) -> str | None:
    """When Kueue last admitted it (its Admitted condition's transition), None if it is not."""
    conditions = (workload.get("status") or {}).get("conditions") or ()
    return next(
        (c["lastTransitionTime"] for c in conditions if c["type"] == "Admitted" and c["status"] == "True"),
        None,
    )


@pytest.mark.usefixtures("kubeflow", "queueing")
def test_a_dead_node_is_said_at_once_and_its_gang_resumes_on_the_other_node_from_its_checkpoint(
    plane: ControlPlane,
    api: Api,
    nodes: Pool,
    claims: Claims,
    two_replicas: tuple[str, str],
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    # What must outlive either node is on both: an operator replica and CoreDNS on each.
    every_node = sorted(n.name for n in nodes.nodes)
    assert sorted(p["spec"]["nodeName"] for p in operator_pods(api)) == every_node
    dns = api.list("pods", "kube-system", selector="k8s-app=kube-dns")
    assert sorted(p["spec"]["nodeName"] for p in dns) == every_node

    name = "nodedeath"
    # A queue of its own (room for its two pods): admitted once, it keeps that admission.
    for obj in kueue.queues(name, chain.NAMESPACE, {"cpu": "4", "memory": "8Gi"}):
        plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
    gate = chain.gate(claims, f"{name}-checkpoints")
    timeline = chain.start_long_training(
        plane, name, tmp_path, gate, resources={"cpu": "500m", "memory": "1Gi"}, scheduling={"queueName": name},
        nodeLossTimeoutSeconds=NODE_LOSS_TIMEOUT, stallTimeoutSeconds=STALL_TIMEOUT,
    )  # fmt: skip
    timelines.append(timeline)
    held = gate.wait_held(lambda: not {"Succeeded", "Failed"} & set(timeline.phases()))
    workload = _workload(plane, name)
    admitted = _admitted_since(workload)
    assert admitted is not None, workload.get("status")
    saved = sorted(
        s for p in gate.folder.rglob("step-*") if (s := complete_checkpoint_step(p.name)) is not None
    )
    assert saved, "no checkpoint before the node's death"
    worker = f"{name}-worker-0"
    placed = chain.get(plane, "pod", worker)
    assert placed is not None
    victim: Node = nodes.of(placed)
    (survivor,) = [n for n in nodes.nodes if n is not victim]
    before = {p["metadata"]["uid"] for p in chain.pods_of(plane, name)}

    victim.die()
    died = time.monotonic()
    try:
        # The surviving rank trains on into a collective whose peer is gone, as it would unheld.
        gate.release()
        wait_for("the node controller saying the node is not Ready", lambda: not victim.ready(),
                 timeout=120, every=0.5)  # fmt: skip
        not_ready = time.monotonic() - died
        lost = wait_for(
            "NodeLost in status", lambda: _condition(plane, name, "NodeLost"), timeout=30, every=0.2
        )
        said = time.monotonic() - died
        assert lost["message"].startswith(f"node {victim.name} is not ready (NodeStatusUnknown) since "), lost
        assert f"pod {worker}" in lost["message"], lost

        def again_on_survivor() -> bool:
            pods = chain.pods_of(plane, name)
            return len(pods) == 2 and all(
                p["metadata"]["uid"] not in before and p["spec"].get("nodeName") == survivor.name
                and p["status"].get("phase") == "Running" for p in pods
            )  # fmt: skip

        wait_for("the dead gang's pods gone", lambda: not before & {p["metadata"]["uid"] for p in chain.pods_of(plane, name)},
                 timeout=180, every=0.5)  # fmt: skip
        gone = time.monotonic() - died
        wait_for("the gang Running again on the other node", again_on_survivor, timeout=180, every=0.5)
        running = time.monotonic() - died
        master = f"{name}-master-0"
        resumed = wait_for("the new master resumed from the checkpoint",
                           lambda: chain.resumed_steps(plane, nodes, master), timeout=120, every=0.5)  # fmt: skip

        def stepped() -> bool:
            found = chain.get(plane, "gtr", name) or {}
            progress = (found.get("status") or {}).get("progress") or {}
            return int(progress.get("step") or 0) > resumed[0]

        wait_for("a step past the checkpoint in status", stepped, timeout=120, every=0.2)
        first_step = time.monotonic() - died
        # Kueue's admission held through it all: the same Workload, admitted once, never evicted.
        kept = _workload(plane, name)
        assert kept["metadata"]["uid"] == workload["metadata"]["uid"], kept["metadata"]
        assert _admitted_since(kept) == admitted, kept.get("status")
        evicted = [c for c in kept["status"].get("conditions", ())
                   if c["type"] in ("Evicted", "Preempted") and c["status"] == "True"]  # fmt: skip
        assert not evicted, kept["status"]
    finally:
        victim.revive()
    print(
        f"node {victim.name} killed -> not Ready {not_ready:.1f}s, NodeLost in status {said:.1f}s, "
        f"its gang's pods gone {gone:.1f}s, made again and Running on {survivor.name} {running:.1f}s, first step past checkpoint {resumed[0]} in status "
        f"{first_step:.1f}s (held at step {held}; nodeLossTimeoutSeconds {NODE_LOSS_TIMEOUT})"
    )
    # Said at once: within a status write of the node controller's word.
    assert said - not_ready <= 10, (said, not_ready)
    # Not before its timeout: the node controller's word, then NODE_LOSS_TIMEOUT.
    assert running >= not_ready + NODE_LOSS_TIMEOUT - 1, (running, not_ready)
    assert resumed[0] == saved[-1] or resumed[0] in saved, (resumed, saved)

    chain.wait_finished(plane, name, timeout=300)
    final = chain.get(plane, "gtr", name)
    assert final is not None
    assert final["status"]["phase"] == "Succeeded", json.dumps(final["status"], indent=1)
    events = [e for e in api.list("events", chain.NAMESPACE) if e["involvedObject"]["name"] == name]
    restarted = [e["message"] for e in events if e["reason"] == "GangRestarted"]
    assert len(restarted) == 1, restarted
    assert victim.name in restarted[0], restarted
    phases = timeline.caught_up("Succeeded")
    assert "Failed" not in phases
    assert "Restarting" in phases, phases
    assert not {"Queued", "Suspended"} & set(phases[phases.index("Running") :]), phases
    assert not {"Stalled", "Underutilized"} & timeline.conditions(), timeline.conditions()
    # The job the operator made is the one that ran on: its pods made again, not the job.
    reasons = [e["reason"] for e in events if e["involvedObject"]["kind"] == "GpuTraining"]
    assert reasons.count("PyTorchJobCreated") == 1, reasons
