"""``backend: job`` on the real nodes: the kind example on a plain Indexed Job to Succeeded (its
rendezvous at worker 0's name under the headless Service, through the chain's CoreDNS), a
worker SIGKILLed mid-run and the whole gang resuming from its checkpoint, and a suspend held
past the stall timeout, resumed from the checkpoint. Only Kubernetes' own controllers run
these jobs (the Job controller of the plane's controller-manager); Kueue's queueing of a Job is
in test_kueue.py, and auto's choice of a Job where no Kubeflow is served in
tests/controlplane/test_job_backend.py.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from gputrain.contract import complete_checkpoint_step
from support import chain
from support.chain import Claims, InClusterOperator
from support.node.pool import Pool
from support.plane.controlplane import ControlPlane
from support.waiting import wait_for


def _job_pods(plane: ControlPlane, name: str) -> list[dict[str, Any]]:
    """The Job's pods, by the labels the Job controller puts on them, in index order."""
    out = plane.kubectl("get", "pods", "-n", chain.NAMESPACE, "-l", f"batch.kubernetes.io/job-name={name}",
                        "-o", "json").stdout  # fmt: skip
    pods: list[dict[str, Any]] = json.loads(out)["items"]
    return sorted(pods, key=lambda p: p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"])


def _claim_steps(gate: chain.Gate, name: str) -> list[int]:
    """The steps of the training's complete checkpoints on its claim, as this host sees it."""
    found = (complete_checkpoint_step(p.name) for p in (gate.folder / name).glob("step-*"))
    return sorted(step for step in found if step is not None)


def _restarts(pod: dict[str, Any]) -> int:
    return int(((pod.get("status") or {}).get("containerStatuses") or [{}])[0].get("restartCount", 0))


def test_the_kind_cpu_example_trains_to_succeeded_on_a_plain_job(
    plane: ControlPlane,
    nodes: Pool,
    operator: InClusterOperator,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    spec = chain.variant(tmp_path, "kind-cpu-job", backend="job")
    timelines.append(timeline := chain.Timeline(plane, "kind-cpu-job"))
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(spec))
    chain.wait_finished(plane, "kind-cpu-job")
    status = chain.get(plane, "gtr", "kind-cpu-job")["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert (status["backend"], status["job"]["kind"]) == ("job", "Job")
    job = chain.get(plane, "job", "kind-cpu-job")
    assert job is not None
    assert {c["type"] for c in job["status"]["conditions"] if c["status"] == "True"} >= {"Complete"}
    assert job["status"]["succeeded"] == 2
    pods = _job_pods(plane, "kind-cpu-job")
    # Each rank's host under the headless Service; rank 0's name was the rendezvous.
    assert [(p["spec"]["hostname"], p["spec"]["subdomain"]) for p in pods] == [
        ("kind-cpu-job-0", "kind-cpu-job"),
        ("kind-cpu-job-1", "kind-cpu-job"),
    ]
    assert len({p["spec"]["nodeName"] for p in pods}) == 2  # one a node: the rendezvous crossed the network
    assert status["progress"]["percent"] == 100
    assert status["progress"]["accuracy"] > 0.9
    running = [s for s in timeline.seen if s.get("phase") == "Running"]
    assert running, timeline.phases()
    assert any(s.get("workers", {}).get("ready") == 2 for s in running), running[-1]
    assert "Stalled" not in timeline.conditions()
    plane.kubectl("delete", "gtr", "kind-cpu-job", "-n", chain.NAMESPACE, "--wait=true")
    wait_for("kind-cpu-job's children gone", lambda: chain.get(plane, "job", "kind-cpu-job") is None
             and chain.get(plane, "service", "kind-cpu-job") is None
             and not _job_pods(plane, "kind-cpu-job"), timeout=90)  # fmt: skip


def _held_training(
    plane: ControlPlane, claims: Claims, tmp_path: Path, timelines: list[chain.Timeline], name: str
) -> tuple[chain.Gate, chain.Timeline]:
    """The long kind example on a Job, its checkpoints on a claim, its stall timeout shorter
    than the pauses the tests make (a stall clock that ran through one would raise Stalled), once
    both ranks wait at the gate."""
    gate = chain.gate(claims, f"{name}-checkpoints")
    fields = {"backend": "job", "stallTimeoutSeconds": chain.PAUSE_STALL_SECONDS}
    timelines.append(timeline := chain.start_long_training(plane, name, tmp_path, gate, **fields))
    gate.wait_held(lambda: not {"Succeeded", "Failed"} & set(timeline.phases()))
    return gate, timeline


def test_a_killed_worker_restarts_the_whole_gang_from_its_checkpoint(
    plane: ControlPlane,
    nodes: Pool,
    claims: Claims,
    operator: InClusterOperator,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    """SIGKILL rank 1's trainer mid-run (as the OOM killer would): its container restarts in
    place, rank 0 loses its peer and restarts too, and both resume from the newest checkpoint on
    the shared claim to Succeeded, never Stalled. No Job controller is told: the pods' restart
    policy and torchrun's rendezvous make the gang."""
    name = "gang"
    gate, timeline = _held_training(plane, claims, tmp_path, timelines, name)
    saved = _claim_steps(gate, name)
    assert saved, "no checkpoint before the kill"
    killed = _job_pods(plane, name)[1]["metadata"]["name"]
    pid = wait_for("rank 1's trainer process", lambda: chain.trainer_pid(plane, nodes, killed), timeout=10)
    os.kill(pid, signal.SIGKILL)
    gate.release()
    wait_for("both ranks restarted", lambda: [_restarts(p) >= 1 for p in _job_pods(plane, name)] == [True, True],
             timeout=90)  # fmt: skip
    chain.wait_finished(plane, name)
    assert chain.phase(plane, name) == "Succeeded", timeline.phases()
    resumed = chain.resumed_steps(plane, nodes, f"{name}-0-*")
    assert resumed, "rank 0 started over"
    assert resumed[0] >= saved[-1], (resumed, saved)
    assert [p["metadata"]["name"] for p in _job_pods(plane, name)][1] == killed  # restarted in its pod
    assert "Stalled" not in timeline.conditions()
    assert "Failed" not in timeline.caught_up("Succeeded")


def test_suspended_past_its_stall_timeout_it_resumes_from_the_checkpoint(
    plane: ControlPlane,
    nodes: Pool,
    claims: Claims,
    operator: InClusterOperator,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    """A suspend: the Job controller deletes the pods (SIGTERM: each trainer saves in its grace
    period); held longer than the stall timeout, the training is Suspended and never Stalled;
    resumed, the Job's new pods go on from the checkpoint to Succeeded."""
    name = "paused-job"
    gate, timeline = _held_training(plane, claims, tmp_path, timelines, name)
    suspend = '{"spec":{"runPolicy":{"suspend":%s}}}'
    plane.kubectl("patch", "gtr", name, "-n", chain.NAMESPACE, "--type=merge", "-p", suspend % "true")
    wait_for(f"{name} Suspended", lambda: chain.phase(plane, name) == "Suspended", timeout=60, every=0.5)
    assert chain.get(plane, "job", name)["spec"]["suspend"] is True
    wait_for("its pods gone", lambda: not _job_pods(plane, name), timeout=60)
    gone_at = time.monotonic()
    saved = max(_claim_steps(gate, name))
    gate.release()
    chain.hold_pause(plane, name, gone_at)
    assert chain.phase(plane, name) == "Suspended"
    plane.kubectl("patch", "gtr", name, "-n", chain.NAMESPACE, "--type=merge", "-p", suspend % "false")
    chain.wait_finished(plane, name)
    assert chain.phase(plane, name) == "Succeeded", timeline.phases()
    resumed = chain.resumed_steps(plane, nodes, f"{name}-0-*")
    assert resumed, "the resumed training started over"
    assert resumed[-1] >= saved, (resumed, saved)
    phases = timeline.caught_up("Succeeded")
    assert phases.index("Suspended") < len(phases) - 1
    assert "Stalled" not in timeline.conditions()
