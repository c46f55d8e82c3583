"""The real Kueue v0.16.2 (controller and webhooks) in front of every backend: a second
training held Queued until the first has finished (on Trainer v2's TrainJob and on a plain
Job), and a lower-priority one preempted, left waiting and resumed from its checkpoint (on the
PyTorchJob). Each of Kueue's three job integrations is met once, by the scenario that stops and
starts that backend's job the most; the operator's side of all is the same code, whose
backend-specific parts (suspend, conditions) the unit and control-plane suites cover for each. Kueue runs for a
module that asks for it (its ``queueing`` fixture), so its webhooks see no other module's jobs.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

import pytest

from support import chain
from support.chain import Claims, InClusterOperator
from support.controllers import kueue
from support.node.pool import Pool
from support.objectstore import S3Server
from support.plane.controlplane import ControlPlane
from support.waiting import wait_for

# What a queued training runs through: the nodes, both Kubeflow APIs, the real Kueue and the operator.
KUEUE_CHAIN = ("nodes", "kubeflow", "trainer_v2", "queueing", "operator")


@pytest.mark.usefixtures(*KUEUE_CHAIN)
@pytest.mark.parametrize("backend", ["trainjob", "job"])
def test_kueue_holds_the_second_training_queued_until_the_first_finishes(
    plane: ControlPlane, claims: Claims, timelines: list[chain.Timeline], tmp_path: Path, backend: str
) -> None:
    """The real Kueue v0.16.2 with a ClusterQueue whose quota fits one kind-cpu training (2 pods
    of 1 CPU and 1 GiB): the first is admitted and runs; the second waits Queued, with Kueue's
    own reason, and no pod, until the first has finished; then it is admitted and runs. The
    operator never resumes a job Kueue holds. Through Kueue's own TrainJob and batch/v1 Job
    integrations."""
    queue = f"team-{backend}"
    for obj in kueue.queues(queue, chain.NAMESPACE, {"cpu": "2", "memory": "2Gi"}):
        plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
    first_name, second_name = f"q1-{backend}", f"q2-{backend}"
    queued = {"scheduling": {"queueName": queue}, "backend": backend}
    # The first waits at chain.HOLD_AT_STEP until the second has been seen queued: it cannot have
    # finished (and given its quota back) meanwhile.
    gate = chain.gate(claims, f"{first_name}-checkpoints")
    first = chain.variant(tmp_path, first_name, training={"epochs": 25}, checkpoint={"volume": {"claimName": gate.claim}},
                     env=gate.env, **queued)  # fmt: skip
    second = chain.variant(tmp_path, second_name, **queued)
    timelines.append(first_timeline := chain.Timeline(plane, first_name))
    timelines.append(second_timeline := chain.Timeline(plane, second_name))
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(first))
    wait_for(
        f"{first_name} Running", lambda: chain.phase(plane, first_name) == "Running", timeout=120, every=0.5
    )
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(second))

    def kueues_reason() -> dict[str, Any] | None:
        status = (chain.get(plane, "gtr", second_name) or {}).get("status", {})
        found = [c for c in status.get("conditions", []) if c["type"] == "Queued" and c["status"] == "True"]
        pending = status.get("phase") == "Queued" and found and found[0]["reason"] == "Pending"
        return found[0] if pending else None

    condition = wait_for(f"{second_name} Queued with Kueue's reason", kueues_reason, timeout=60, every=0.5)
    assert "insufficient unused quota" in condition["message"], condition
    assert chain.phase(plane, first_name) == "Running"
    job = chain.get(plane, backend, second_name)
    assert job is not None
    assert (
        job["spec"]["runPolicy"]["suspend"] if backend == "pytorchjob" else job["spec"]["suspend"]
    ) is True
    assert chain.pods_of(plane, second_name) == []
    gate.release()

    chain.wait_finished(plane, first_name)
    assert chain.phase(plane, first_name) == "Succeeded", first_timeline.phases()
    chain.wait_finished(plane, second_name)
    assert chain.phase(plane, second_name) == "Succeeded", second_timeline.phases()
    # Its pods came after the first had finished: Kueue admitted it then, not the operator before.
    finished = (chain.get(plane, "gtr", first_name) or {})["status"]["completionTime"]
    started = min(p["metadata"]["creationTimestamp"] for p in chain.pods_of(plane, second_name))
    assert started >= finished, (started, finished)
    workloads = json.loads(
        plane.kubectl("get", "workloads.kueue.x-k8s.io", "-n", chain.NAMESPACE, "-o", "json").stdout
    )
    admitted = {w["metadata"]["ownerReferences"][0]["name"]: w["status"].get("admission", {}).get("clusterQueue")
                for w in workloads["items"]}  # fmt: skip
    assert (admitted.get(first_name), admitted.get(second_name)) == (queue, queue), admitted
    phases = second_timeline.caught_up("Succeeded")
    assert phases[0] in ("Created", "Queued"), phases
    assert "Suspended" not in phases, phases
    assert "Failed" not in phases, phases
    assert phases.index("Queued") < phases.index("Running"), phases


@pytest.mark.usefixtures(*KUEUE_CHAIN)
@pytest.mark.parametrize("backend", ["pytorchjob"])
def test_kueue_preempts_a_lower_priority_training_and_the_operator_lets_it_wait_and_resume(
    plane: ControlPlane,
    nodes: Pool,
    claims: Claims,
    s3: S3Server,
    operator: InClusterOperator,
    timelines: list[chain.Timeline],
    tmp_path: Path,
    backend: str,
) -> None:
    """The real Kueue preempting: a ClusterQueue that fits one training and preempts lower
    priorities (`withinClusterQueue: LowerPriority`, priorities from the pods' PriorityClass,
    as Kueue reads them). A low-priority training runs and checkpoints to a bucket of the real
    S3 store; a high-priority one arrives; Kueue evicts the low one and suspends its job. The
    operator shows it Queued with Kueue's reason (Preempted), never resumes it, and keeps its
    last checkpoint in status; once the high one has finished and Kueue admits the low one
    again, its new pods resume from the bucket to Succeeded. The high one is held until the low
    one has waited longer than its stall timeout, and the low one is never Stalled: the clock
    stops while Kueue holds it."""
    queue = f"preempting-{backend}"
    for obj in kueue.queues(queue, chain.NAMESPACE, {"cpu": "2", "memory": "2Gi"},
                            preemption={"withinClusterQueue": "LowerPriority"}):  # fmt: skip
        plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
    for priority_class, value in (("e2e-low", 100), ("e2e-high", 1000)):
        plane.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": priority_class}, "value": value}))  # fmt: skip
    low, high = f"low-{backend}", f"high-{backend}"
    # The low one waits at chain.HOLD_AT_STEP: still running when preempted.
    gate = chain.gate(claims, f"{low}-outputs", mount=chain.OUTPUTS)
    low_spec = chain.variant(tmp_path, low, training={"epochs": 40}, **chain.in_bucket(plane, s3, gate),
                        scheduling={"queueName": queue, "priorityClassName": "e2e-low"}, backend=backend,
                        env=gate.env, stallTimeoutSeconds=chain.PAUSE_STALL_SECONDS)  # fmt: skip
    # The high one waits at its own gate until the low one's pause has outlasted that timeout.
    high_gate = chain.gate(claims, f"{high}-checkpoints")
    high_spec = chain.variant(tmp_path, high, scheduling={"queueName": queue, "priorityClassName": "e2e-high"},
                         backend=backend, checkpoint={"volume": {"claimName": high_gate.claim}},
                         env=high_gate.env)  # fmt: skip
    timelines.append(low_timeline := chain.Timeline(plane, low))
    timelines.append(high_timeline := chain.Timeline(plane, high))
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(low_spec))
    rank0 = chain.rank0_pod(low, backend)
    gate.wait_held(lambda: not {"Succeeded", "Failed"} & set(low_timeline.phases()))
    assert len(chain.bucket_steps(s3, low)) >= 2  # one past the first epoch: not the start
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(high_spec))

    def preempted() -> dict[str, Any] | None:
        status = (chain.get(plane, "gtr", low) or {}).get("status", {})
        found = [c for c in status.get("conditions", []) if c["type"] == "Queued" and c["status"] == "True"]
        return found[0] if status.get("phase") == "Queued" and found else None

    condition = wait_for(f"{low} Queued after Kueue's preemption", preempted, timeout=90, every=0.5)
    assert condition["reason"] == "Preempted", condition
    assert "Preempted to accommodate" in condition["message"], condition
    job = chain.get(plane, backend, low)
    assert job is not None
    assert (
        job["spec"]["runPolicy"]["suspend"] if backend == "pytorchjob" else job["spec"]["suspend"]
    ) is True
    # Its trainer's log as its pods go (it goes with them), for what a failure below says.
    trainer_log = [""]

    def gone() -> bool:
        with contextlib.suppress(Exception):
            trainer_log[0] = chain.logs(plane, nodes, rank0) or trainer_log[0]
        return not chain.pods_of(plane, low)

    wait_for(f"{low}'s pods gone", gone, timeout=90)
    gone_at = time.monotonic()  # the last moment its trainers could report before the resume
    saved = max(chain.bucket_steps(s3, low))
    # While it waits, evicted, status says how fresh its last checkpoint is: the newest one saved
    # (the one its SIGTERM'd trainer wrote, when its save beat the grace period).
    seen: list[Any] = []
    try:
        said = wait_for("status.checkpoint at the last save", lambda: (c := (chain.get(plane, "gtr", low) or {}).get(
            "status", {}).get("checkpoint")) and (seen.append(c) or c["step"] == saved) and c, timeout=30)  # fmt: skip
    except AssertionError as exc:
        held = s3.names(chain.BUCKET, f"{chain.BUCKET_PREFIX}/{low}")
        said_lines = [
            line for line in trainer_log[0].splitlines() if "checkpoint" in line or "stopped" in line
        ]
        operator_lines = [
            line for line in operator.log(plane).splitlines() if low in line or line.startswith("(no log")
        ][-10:]
        raise AssertionError(
            f"{exc}: status said {seen[-1:]}, the bucket holds {held}; its trainer said "
            f"{said_lines[-6:]}; the operator said {operator_lines}"
        ) from None
    assert said["uri"].startswith(f"s3://{chain.BUCKET}/{chain.BUCKET_PREFIX}/{low}/"), said
    gate.release()  # for its pods when Kueue admits it again (SIGTERM let the evicted ones go)
    chain.hold_pause(plane, low, gone_at)
    assert chain.phase(plane, low) == "Queued", low_timeline.phases()
    high_gate.release()

    try:
        chain.wait_finished(plane, high)
    except AssertionError as exc:
        last = high_timeline.seen[-1] if high_timeline.seen else {}
        raise AssertionError(
            f"{exc}: its phases {high_timeline.phases()}, its last status's message "
            f"{last.get('message')!r}; {low}'s phases {low_timeline.phases()}"
        ) from None
    assert chain.phase(plane, high) == "Succeeded", high_timeline.phases()
    # The scheduler placed the high one's pods without evicting the operator's (the chart's
    # PriorityClass is above every training's): evicted, it lost the reports in flight.
    now = json.loads(plane.kubectl("get", "pod", "-n", chain.RELEASE_NAMESPACE, "-l",
                                   "app.kubernetes.io/name=gpu-training-operator", "-o", "json").stdout)["items"]  # fmt: skip
    assert [(p["metadata"]["uid"], p["metadata"].get("deletionTimestamp")) for p in now] == [
        (operator.pod["metadata"]["uid"], None)
    ], "the operator's pod was replaced while the high training ran"
    chain.wait_finished(plane, low, timeout=300)
    assert chain.phase(plane, low) == "Succeeded", low_timeline.phases()
    resumed = chain.resumed_steps(plane, nodes, rank0)
    assert resumed, "the preempted training started over"
    assert resumed[-1] >= saved, (resumed, saved)
    assert f"resumed from s3://{chain.BUCKET}/{chain.BUCKET_PREFIX}/{low}/" in chain.logs(plane, nodes, rank0)
    # The operator never fought Kueue: Running, then Queued while evicted, then Running again.
    phases = low_timeline.caught_up("Succeeded")
    assert "Suspended" not in phases, phases
    assert "Failed" not in phases, phases
    first_queued_after_running = phases.index("Queued", phases.index("Running"))
    assert "Running" in phases[first_queued_after_running:], phases
    assert "Stalled" not in low_timeline.conditions()
    high_phases = high_timeline.caught_up("Succeeded")
    assert "Suspended" not in high_phases, high_phases
    assert "Failed" not in high_phases, high_phases


@pytest.mark.usefixtures(*KUEUE_CHAIN)
def test_under_kueue_a_store_that_refuses_deactivates_the_workload_and_kueue_lets_the_gpus_go(
    plane: ControlPlane, s3: S3Server, timelines: list[chain.Timeline], tmp_path: Path
) -> None:
    """Wrong credentials for a queued training's checkpoints: its trainer says no restart mends
    it, and suspending the job would not stop it (the real Kueue resumes an admitted job), so
    the operator sets its Workload inactive; the real Kueue evicts it and suspends the job, its
    pods go, its quota is free for the next, and the training is Failed with the trainer's line."""
    queue = "refusing"
    for obj in kueue.queues(queue, chain.NAMESPACE, {"cpu": "2", "memory": "2Gi"}):
        plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
    wrong = s3.secret("wrong-credentials")
    wrong["stringData"]["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", "-", input=json.dumps(wrong))
    name = "refused-queued"
    uri = f"s3://{chain.BUCKET}/{chain.BUCKET_PREFIX}"
    spec = chain.variant(tmp_path, name, scheduling={"queueName": queue},
                         checkpoint={"uri": uri, "secretName": "wrong-credentials"})  # fmt: skip
    timelines.append(timeline := chain.Timeline(plane, name))
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(spec))
    chain.wait_finished(plane, name, timeout=180)
    status = (chain.get(plane, "gtr", name) or {})["status"]
    assert status["phase"] == "Failed", timeline.phases()
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "CheckpointStorageFailed", failed
    assert f"{uri}/{name}: list failed: access denied" in failed["message"], failed
    stopped = next(c for c in status["conditions"] if c["type"] == "JobStopped")
    assert "deactivated its Kueue Workload" in stopped["message"], stopped
    workloads = json.loads(
        plane.kubectl("get", "workloads.kueue.x-k8s.io", "-n", chain.NAMESPACE, "-o", "json").stdout
    )["items"]
    (workload,) = [w for w in workloads if w["metadata"]["ownerReferences"][0]["name"] == name]
    assert workload["spec"]["active"] is False
    # Kueue's own doing: evicted as deactivated, the job suspended, the pods gone.
    wait_for(f"{name}'s job suspended by Kueue",
             lambda: (chain.get(plane, "pytorchjob", name) or {}).get("spec", {}).get("runPolicy", {}).get("suspend"),
             timeout=60)  # fmt: skip
    # Well within the pods' grace period (120 s), as in test_examples' refusal test.
    wait_for(f"{name}'s pods gone", lambda: chain.pods_of(plane, name) == [], timeout=60)
    time.sleep(5)  # Kueue admits it no more: no pod comes back
    assert chain.pods_of(plane, name) == []
    assert chain.phase(plane, name) == "Failed"
    plane.kubectl("delete", "gtr", name, "-n", chain.NAMESPACE, "--wait=true")
