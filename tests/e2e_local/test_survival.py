"""Two operator replicas on a real node, the leader killed mid-run as a dead machine would kill it:
the standby takes the Lease, and the training's reports, status transitions and job are neither
lost nor done twice.

Last of the chain's modules (by name): the package's operator pod is the one it kills.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from support import chain
from support.chain import Claims
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
    accepted_before = _accepted(plane, leader)
    assert _accepted(plane, standby) == 0  # no report ever reached the standby
    assert accepted_before >= 1, accepted_before  # a report every 5 s at most (gpureport's throttle)

    # Dead as a lost machine leaves it: every process of its container SIGKILLed (no Lease
    # given up, no label taken off), and the pod force-deleted so the container is not restarted.
    placed = next(p for p in operator_pods(api) if p["metadata"]["name"] == leader)
    for pid in nodes.of(placed).container_pids(placed, "operator"):
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
    said = plane.kubectl("logs", "-n", RELEASE_NAMESPACE, standby).stdout
    assert "Traceback" not in said, said[-3000:]
    print(
        f"reports accepted: {accepted_before:.0f} by the leader before its death, {accepted_after:.0f} by the standby after"
    )
    assert accepted_after >= 1
