"""The code people actually train, in their own image with their own command: a Hugging Face
``Trainer`` (no code of ours; Transformers reports by itself where the operator's Kubeflow
variables lead) and a hand-written DDP loop on ``gpureport``, on either backend, reporting over
HTTPS with the pod's projected token to the operator's Service; and, with Trainer v2's own
progress server switched on, exactly one receiver, ours.
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuop.api.identity import REPORT_MOUNT, REPORT_PATH
from support import chain
from support.chain import Claims, InClusterOperator
from support.controllers import trainerv2
from support.controllers.webhooked import WebhookedController
from support.plane.cluster import Api
from support.plane.controlplane import ControlPlane
from support.training import put_hooks
from support.waiting import wait_for

# -- the code people actually train: their own command, reporting by Kubeflow's protocol ---------

# Each program as the spec's own command, 12 steps in all on two workers; in the own-code image
# they are where a team's Dockerfile would COPY them (examples/hf-trainer, examples/plain-loop).
PROGRAMS = {
    # A real transformers.Trainer (a tiny GPT-2 from a config, data it makes), no code of ours:
    # Transformers finds Kubeflow's variables the operator rendered and reports by itself.
    "hf": [
        "/workspace/hf-trainer/train.py",
        "--samples",
        "96",
        "--epochs",
        "1",
        "--batch-size",
        "4",
        "--output-dir",
        "/tmp/hf-out",
    ],
    # A hand-written DDP loop with one gpureport.report() call a step, saving a checkpoint every
    # 4 steps and saying so with gpureport.checkpointed() (status.checkpoint, issue 27).
    "loop": [
        "/workspace/plain-loop/train.py",
        "--steps",
        "12",
        "--checkpoint-dir",
        "/tmp/loop-ckpt",
        "--checkpoint-every",
        "4",
    ],
}


def _train_own_code(
    plane: ControlPlane,
    claims: Claims,
    program: str,
    backend: str,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> tuple[str, list[dict[str, Any]]]:
    """The user's program under plain torchrun (both Kubeflow APIs set PET_NNODES, PET_NODE_RANK,
    PET_MASTER_ADDR/PORT), reporting with the projected token to the operator's endpoint:
    status moves while it runs and ends at 100. The training's name and its pods, still there."""
    name = f"{program}-{backend}"
    # The pacing hooks come on a claim (no image carries them), mounted as the training's output.
    hooks = put_hooks(claims.make(chain.NAMESPACE, f"{name}-hooks"))
    # 12 steps of at least 1.5 s: long enough by construction for clients that report at most
    # every 5 s to be seen reporting while they run (support.training.pace_env's hooks).
    timeline = chain.paced_own_code(plane, name, tmp_path, hooks, 1.5, command=["torchrun"],
                                    args=PROGRAMS[program], backend=backend, workers=2, gpusPerWorker=0,
                                    resources={"cpu": "1", "memory": "2Gi"})  # fmt: skip
    timelines.append(timeline)
    wait_for(f"{name}'s two pods", lambda: len(chain.pods_of(plane, name)) == 2, timeout=120, every=0.5)
    pods = chain.pods_of(plane, name)
    chain.wait_finished(plane, name, timeout=300)
    status = chain.get(plane, "gtr", name)["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    progress = status["progress"]
    assert progress["source"] == "TrainerStatus", progress
    assert progress["percent"] == 100
    assert progress["totalSteps"] == 12  # HF: 96 samples / (batch 4 x 2 workers), one epoch
    assert progress["loss"] > 0
    # Rank 0 alone reports, from the pod that runs it (the Master, or JobSet's first node).
    names = [p["metadata"]["name"] for p in pods]
    rank0 = next(n for n in names if n.startswith((f"{name}-master-0", f"{name}-node-0-0")))
    assert progress["reportedBy"] == rank0, (progress, names)
    # While it ran, steps and percent moved in status, with a loss.
    running = [s["progress"] for s in timeline.seen if s.get("phase") == "Running" and s.get("progress")]
    steps = sorted({p["step"] for p in running if p.get("step")})
    assert len(steps) >= 2, running[-3:]
    assert any(p.get("loss") for p in running), running[-3:]
    assert any(0 < p.get("percent", 0) < 100 for p in running), running[-3:]
    assert "Stalled" not in timeline.conditions()
    if program == "loop":
        _said_its_checkpoints(plane, name, status, timeline)
    # The token the pods reported with was minted for this training's audience, bound to the pod.
    volume = next(v for v in pods[0]["spec"]["volumes"] if v["name"] == "gpuop-reports")
    token = volume["projected"]["sources"][0]["serviceAccountToken"]
    assert token["audience"] == f"gpuop.io/reports/{chain.NAMESPACE}/{name}"
    return name, pods


def _said_its_checkpoints(
    plane: ControlPlane, name: str, status: dict[str, Any], timeline: chain.Timeline
) -> None:
    """The loop's checkpoints (steps 4, 8, 12) reached status.checkpoint as each was written, the
    last one stays, and `kubectl get -o wide` shows its age."""
    assert status["checkpoint"]["step"] == 12, status
    assert status["checkpoint"]["uri"] == "/tmp/loop-ckpt/step-000012.pt"
    moving = sorted({s["checkpoint"]["step"] for s in timeline.seen
                     if s.get("phase") == "Running" and s.get("checkpoint")})  # fmt: skip
    assert len(moving) >= 2, moving
    assert set(moving) <= {4, 8, 12}, moving
    header, line = plane.kubectl("get", "gtr", name, "-n", chain.NAMESPACE, "-o", "wide").stdout.splitlines()
    assert header.split()[-1] == "CHECKPOINT", header
    assert re.fullmatch(r"\d+s|\d+m\d*s?", line.split()[-1]), line  # an age, not a timestamp


def _delete_training(plane: ControlPlane, name: str) -> None:
    plane.kubectl("delete", "gtr", name, "-n", chain.NAMESPACE, "--wait=true")
    wait_for(f"{name}'s pods gone", lambda: not chain.pods_of(plane, name), timeout=90)


# Each program on one backend, each backend with one program: what differs between backends is
# how the variables reach the pods, which either program shows; the Hugging Face Trainer on
# Trainer v2 runs in the progress-gate test below. The full product would cost two more
# trainings (about 95 s on 2 cores) for no path that these three leave untried.
@pytest.mark.usefixtures("nodes", "kubeflow", "trainer_v2", "operator")
@pytest.mark.parametrize(("program", "backend"), [("hf", "pytorchjob"), ("loop", "trainjob")])
def test_the_code_people_train_reports_progress_into_status_on_either_backend(
    plane: ControlPlane,
    claims: Claims,
    program: str,
    backend: str,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    """Their own programs, no code of ours in the HF one: see :func:`_train_own_code`."""
    name, _ = _train_own_code(plane, claims, program, backend, timelines, tmp_path)
    _delete_training(plane, name)


class _NamedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a port of this host, the certificate verified for ``name`` with ``ca``."""

    def __init__(self, port: int, name: str, ca: str) -> None:
        super().__init__("127.0.0.1", port, timeout=10)
        self.name, self.verifier = name, ssl.create_default_context(cadata=ca)

    def connect(self) -> None:
        plain = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self.verifier.wrap_socket(plain, server_hostname=self.name)


@pytest.fixture
def progress_gate_on(
    plane: ControlPlane, api: Api, trainer_v2: list[WebhookedController], tmp_path: Path
) -> Iterator[WebhookedController]:
    """Trainer restarted with its ``TrainJobStatus`` gate on (its own progress server up), for
    one test; then as it ships again."""
    shipped = next(c for c in trainer_v2 if c.spec is trainerv2.TRAINER)
    shipped.stop()
    gated = WebhookedController(
        trainerv2.TRAINER_WITH_PROGRESS_SERVER, plane, api, plane.advertise_address, tmp_path
    )
    try:
        gated.start()
        wait_for("Trainer's progress server", lambda: "Starting runtime status server" in gated.log.read_text(),
                 timeout=30)  # fmt: skip
        yield gated
    finally:
        gated.stop()
        shipped.start()


@pytest.mark.usefixtures("nodes", "kubeflow")
def test_with_trainers_own_progress_gate_on_the_code_reports_to_the_operator_alone(
    plane: ControlPlane,
    api: Api,
    operator: InClusterOperator,
    progress_gate_on: WebhookedController,
    claims: Claims,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    """Trainer's alpha ``TrainJobStatus`` gate injects the same three variables into every
    trainer container and serves its own receiver. One receiver is ours: the TrainJob's own
    ``env`` (the operator's variables) is applied after Trainer's plugins, so a Hugging Face
    Trainer, which reports by itself wherever the variables lead, reports to the operator.
    Trainer's server is up and takes a report sent to it (shown at the end), yet gets none from
    the training."""
    # Its server found the issuer as in its pod: by the kubernetes Service's name.
    assert progress_gate_on.proxy is not None
    assert progress_gate_on.proxy.routed >= 1
    name, pods = _train_own_code(plane, claims, "hf", "trainjob", timelines, tmp_path)
    # The gate did inject: Trainer's token volume and its CA ConfigMap are there, unused.
    assert "kubeflow-trainer-token" in {v["name"] for v in pods[0]["spec"]["volumes"]}
    assert chain.get(plane, "configmap", f"{name}-tls-config") is not None
    env = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}
    report_url = operator.report_url + REPORT_PATH.format(namespace=chain.NAMESPACE, name=name)
    assert env["KUBEFLOW_TRAINER_SERVER_URL"] == report_url, env
    assert env["KUBEFLOW_TRAINER_SERVER_TOKEN"].startswith(f"{REPORT_MOUNT}/"), env
    assert env["KUBEFLOW_TRAINER_SERVER_CA_CERT"].startswith(f"{REPORT_MOUNT}/"), env
    job = chain.get(plane, "trainjob", name)
    assert job is not None
    assert "trainerStatus" not in job["status"], job["status"]
    # Trainer's own receiver was there all along: a report sent to it, with a token of its
    # audience (its URL's path without /apis/) and its CA from the ConfigMap it made for the
    # pods, lands in the TrainJob.
    audience = f"trainer.kubeflow.org/v1alpha1/namespaces/{chain.NAMESPACE}/trainjobs/{name}/status"
    token = api.request("POST", f"/api/v1/namespaces/{chain.NAMESPACE}/serviceaccounts/default/token",
                        {"spec": {"audiences": [audience], "expirationSeconds": 600}})["status"]["token"]  # fmt: skip
    ca = chain.get(plane, "configmap", f"{name}-tls-config")["data"]["ca.crt"]
    body = json.dumps(
        {"trainerStatus": {"progressPercentage": 42, "lastUpdatedTime": "2026-11-24T00:00:00Z"}}
    )
    # Verified as a pod verifies it: by the name of Trainer's Service, on this host's port.
    connection = _NamedHTTPS(trainerv2.progress_server_port(progress_gate_on),
                             f"{trainerv2.TRAINER_SERVICE}.{trainerv2.TRAINER_NAMESPACE}.svc", ca)  # fmt: skip
    connection.request("POST", f"/apis/{audience}", body,
                       {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})  # fmt: skip
    reply = connection.getresponse()
    assert reply.status == 200, (reply.status, reply.read())
    job = chain.get(plane, "trainjob", name)
    assert job["status"]["trainerStatus"]["progressPercentage"] == 42, job["status"]
    _delete_training(plane, name)
