"""``kubectl apply -f examples/kind-cpu.yaml`` to Succeeded through the real training-operator,
and what a platform team does to a running training: kill a trainer, suspend it, delete it.

Assertions read what a user reads: ``kubectl get gtr -o json`` (polled into a timeline while
the test acts), the PyTorchJob, pods and Services with kubectl, and events. Below the API the
tests touch only the trainer process they SIGKILL (found in its container's cgroup, as the
kernel's OOM killer would pick it), and read what a user could read on a node: its containers'
logs and the checkpoints on a training's claim.
"""

from __future__ import annotations

import fnmatch
import http.client
import json
import os
import re
import signal
import socket
import ssl
import textwrap
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuop.api.identity import REPORT_MOUNT, REPORT_PATH
from gpuop.api.spec import parse
from gpuop.backends.pytorchjob import PYTORCHJOB
from gpuop.backends.registry import JobApi
from gpuop.backends.trainjob import TRAINJOB
from support.chain import NAMESPACE, Claims, InClusterOperator, Nodes
from support.controllers import kueue, trainerv2
from support.controllers.webhooked import WebhookedController
from support.images import trainer
from support.paths import ROOT
from support.plane.cluster import Api
from support.plane.controlplane import ControlPlane
from support.training import hold_env, release, wait_held
from support.waiting import wait_for

KIND_CPU = ROOT / "examples" / "kind-cpu.yaml"
KIND_CPU_ELASTIC = ROOT / "examples" / "kind-cpu-elastic.yaml"
# Where a training's checkpoint claim is mounted (spec.checkpoint.path's default).
CHECKPOINTS = "/checkpoints"
# The kind example's digits on 2 workers of batch 32 are 23 steps an epoch: by step 50, in the
# third epoch, two epoch-end checkpoints are written.
HOLD_AT_STEP = 50


def _get(plane: ControlPlane, kind: str, name: str) -> dict[str, Any] | None:
    result = plane.kubectl("get", kind, name, "-n", NAMESPACE, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def _names(plane: ControlPlane, kind: str, selector: str) -> list[str]:
    out = plane.kubectl("get", kind, "-n", NAMESPACE, "-l", selector, "-o", "name").stdout
    return sorted(out.split())


def _controller_env_missing(
    plane: ControlPlane, api: JobApi, example: Path, pods: list[str]
) -> dict[str, frozenset[str]]:
    """Per pod, what of ``api.controller_env`` (the variables a spec's $(VAR) may name,
    tests/unit/test_backend_env.py) its controller did not put in the trainer container."""
    wanted = api.controller_env(parse(yaml.safe_load(example.read_text())).spec)
    missing: dict[str, frozenset[str]] = {}
    for pod in pods:
        found = json.loads(plane.kubectl("get", pod, "-n", NAMESPACE, "-o", "json").stdout)
        missing[pod] = wanted - {e["name"] for e in found["spec"]["containers"][0].get("env") or []}
    return missing


class Timeline:
    """``kubectl get gtr NAME -o json`` every half second, in a thread, until closed."""

    def __init__(self, plane: ControlPlane, name: str) -> None:
        self.plane, self.name = plane, name
        self.seen: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            found = _get(self.plane, "gtr", self.name)
            if found is not None:
                self.seen.append(found.get("status", {}))

    def phases(self) -> list[str]:
        """The phases in order, repeats collapsed."""
        out: list[str] = []
        for status in self.seen:
            if status.get("phase") and (not out or out[-1] != status["phase"]):
                out.append(status["phase"])
        return out

    def caught_up(self, phase: str, timeout: float = 10.0) -> list[str]:
        """:meth:`phases` once the sampler has recorded ``phase`` last: it polls every half second
        (a kubectl call each), so it can lag a phase that a direct read has just seen."""
        wait_for(f"the timeline to record {phase}", lambda: self.phases()[-1:] == [phase], timeout=timeout)
        return self.phases()

    def conditions(self) -> set[str]:
        return {c["type"] for s in self.seen for c in s.get("conditions", []) if c["status"] == "True"}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture(scope="module", autouse=True)
def namespace(plane: ControlPlane) -> str:
    plane.kubectl("create", "namespace", NAMESPACE)
    return NAMESPACE


@pytest.fixture
def timelines(plane: ControlPlane) -> Iterator[list[Timeline]]:
    """The test's timelines; after it, each training it watched is deleted, pods and all: the
    two nodes have two CPUs each (this machine's), so a training a failed test left running
    would keep the next test's pods Pending."""
    made: list[Timeline] = []
    yield made
    for timeline in made:
        timeline.close()
    for timeline in made:
        plane.kubectl("delete", "gtr", timeline.name, "-n", NAMESPACE, "--ignore-not-found", "--wait=false")
    for timeline in made:
        plane.kubectl("wait", "--for=delete", "pods", "-l", f"gpuop.io/gputraining={timeline.name}",
                      "-n", NAMESPACE, "--timeout=90s", check=False)  # fmt: skip


def _variant(tmp: Path, name: str, source: Path = KIND_CPU, **spec: Any) -> Path:
    """The example under another name with some spec fields replaced (a longer run, a PVC)."""
    doc = yaml.safe_load(source.read_text())
    doc["metadata"]["name"] = name
    for key, value in spec.items():
        doc["spec"][key] = {**doc["spec"].get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@dataclass(frozen=True)
class Gate:
    """The trainer gate of support.training (trainer_hold) in a training's pods: each rank waits
    at HOLD_AT_STEP until :meth:`release` or a stop signal (SIGTERM, as pods are deleted). So
    the test kills, suspends or preempts a run that cannot have finished meanwhile, however
    slowly it got there: a free 40-epoch run is some 15 s of training here.

    spec.env refuses GPUTRAIN_* (the operator's names): PYTHONPATH brings in a sitecustomize
    on the training's checkpoint claim that sets the gate's variables and runs the gate."""

    claim: str
    folder: Path  # the claim's folder as this host sees it: the checkpoints, the gate
    env: list[dict[str, str]]  # for spec.env

    @property
    def directory(self) -> Path:
        return self.folder / "hold"

    def wait_held(self, alive: Callable[[], bool]) -> int:
        """The step both ranks wait at, once they do."""
        return wait_held(self.directory, 2, alive, timeout=240)

    def release(self) -> None:
        release(self.directory)


def _gate(claims: Claims, claim: str) -> Gate:
    """``claim``, made for a training's checkpoints, with a gate on it: the claim's folder is
    shared by its pods wherever they run and seen by this host."""
    shared = claims.make(NAMESPACE, claim)
    site = shared / "hold-site"
    site.mkdir(parents=True, exist_ok=True)
    # Made here, writable by all: the trainers run as the pod's user, and a release before they
    # get there makes it too (as root, closed to them otherwise).
    (shared / "hold").mkdir(parents=True, exist_ok=True)
    (shared / "hold").chmod(0o777)
    variables = hold_env(Path(CHECKPOINTS) / "hold", HOLD_AT_STEP)
    del variables["PYTHONPATH"]  # this host's; the pods get theirs from spec.env
    # The gate itself is in the trainer image, where pace_env's hooks are.
    (site / "sitecustomize.py").write_text(textwrap.dedent(f"""\
        import importlib.util
        import os
        import sys

        os.environ.update({variables!r})
        _spec = importlib.util.spec_from_file_location("trainer_hold", "{trainer.TEST_SITE}/sitecustomize.py")
        _gate = importlib.util.module_from_spec(_spec)
        sys.modules[_spec.name] = _gate
        _spec.loader.exec_module(_gate)
        """))  # fmt: skip
    return Gate(claim, shared, [{"name": "PYTHONPATH", "value": f"{CHECKPOINTS}/hold-site"}])


def _start_long_training(plane: ControlPlane, name: str, tmp: Path, gate: Gate) -> Timeline:
    """The kind example for 40 epochs (about 15 s of training here), its checkpoints on the
    gate's claim so that they outlive its pods, held at HOLD_AT_STEP by ``gate``; applied, with
    a timeline of its status."""
    spec = _variant(
        tmp, name, training={"epochs": 40}, checkpoint={"volume": {"claimName": gate.claim}}, env=gate.env
    )
    timeline = Timeline(plane, name)
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(spec))
    return timeline


def _phase(plane: ControlPlane, name: str) -> str | None:
    found = _get(plane, "gtr", name)
    return found.get("status", {}).get("phase") if found else None


def _pods_named(plane: ControlPlane, pattern: str) -> list[dict[str, Any]]:
    """The namespace's pods whose names match ``pattern`` (JobSet's Jobs name each attempt's
    pod anew)."""
    listed = json.loads(plane.kubectl("get", "pods", "-n", NAMESPACE, "-o", "json").stdout)["items"]
    return [p for p in listed if fnmatch.fnmatchcase(p["metadata"]["name"], pattern)]


def _trainer_pid(plane: ControlPlane, nodes: Nodes, pod: str) -> int | None:
    """The gputrain process torchrun started in the pod's trainer container (not torchrun
    itself), from the container's cgroup on its node."""
    found = _get(plane, "pod", pod)
    if found is None or not found["spec"].get("nodeName"):
        return None
    for pid in nodes.of(found).container_pids(found, found["spec"]["containers"][0]["name"]):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"gputrain" in argv and not any(a.endswith(b"torchrun") for a in argv):
            return pid
    return None


def _logs(plane: ControlPlane, nodes: Nodes, pattern: str) -> str:
    """Every attempt of the trainer containers of the pods ``pattern`` names, as their nodes'
    kubelets wrote them (a deleted pod's logs go with it)."""
    return "".join(
        nodes.of(pod).log_of(pod, container["name"])
        for pod in _pods_named(plane, pattern)
        for container in pod["spec"]["containers"]
    )


def _resumed_steps(plane: ControlPlane, nodes: Nodes, pod: str) -> list[int]:
    """The steps the trainer said it resumed from, in every attempt of the pod's containers."""
    steps = []
    for line in _logs(plane, nodes, pod).splitlines():
        if " resumed from " in line:
            steps.append(int(line.rsplit("step ", 1)[1].split()[0].rstrip(",")))
    return steps


CHECKPOINT_FILE = re.compile(r"step-(\d+)\.pt")


def _checkpointed_steps(gate: Gate) -> list[int]:
    """The steps of the complete checkpoints on the training's claim, in the training's folder
    there (the trainer writes each under a temporary name and renames it: one with its final
    name is whole)."""
    return sorted(
        int(m[1]) for p in gate.folder.glob("*/step-*.pt") if (m := CHECKPOINT_FILE.fullmatch(p.name))
    )


def _children_gone(plane: ControlPlane, name: str) -> bool:
    selector = f"training.kubeflow.org/job-name={name}"
    return (_get(plane, "pytorchjob", name) is None and not _names(plane, "pods", selector)
            and not _names(plane, "services", selector))  # fmt: skip


def test_the_kind_cpu_example_trains_to_succeeded_through_the_real_training_operator(
    plane: ControlPlane,
    api: Api,
    nodes: Nodes,
    kubeflow: WebhookedController,
    operator: InClusterOperator,
    timelines: list[Timeline],
) -> None:
    timelines.append(timeline := Timeline(plane, "kind-cpu"))
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(KIND_CPU))
    wait_for("kind-cpu Succeeded", lambda: _phase(plane, "kind-cpu") in ("Succeeded", "Failed"), timeout=180,
             every=0.5)  # fmt: skip
    gtr = _get(plane, "gtr", "kind-cpu")
    assert gtr is not None
    status = gtr["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    # The PyTorchJob's status is the real training-operator's, and so are the pods and Services.
    job = _get(plane, "pytorchjob", "kind-cpu")
    assert job is not None
    assert {c["type"] for c in job["status"]["conditions"] if c["status"] == "True"} >= {
        "Created",
        "Succeeded",
    }
    assert job["status"]["replicaStatuses"]["Master"]["succeeded"] == 1
    selector = "training.kubeflow.org/job-name=kind-cpu"
    assert _names(plane, "services", selector) == ["service/kind-cpu-master-0", "service/kind-cpu-worker-0"]
    pods = _names(plane, "pods", selector)
    assert _controller_env_missing(plane, PYTORCHJOB, KIND_CPU, pods) == {p: set() for p in pods}
    # The final figures (the trainer's termination message); no GPU, no GPU hours.
    assert status["progress"]["accuracy"] > 0.9
    assert status["progress"]["percent"] == 100
    assert status["gpuHours"] == 0
    # While it trained, the status had its workers and progress from the pods' metrics.
    running = [s for s in timeline.seen if s.get("phase") == "Running"]
    assert running, timeline.phases()
    assert any(s.get("workers", {}).get("ready") == 2 for s in running), running[-1]
    assert "Stalled" not in timeline.conditions()
    events = plane.kubectl("get", "events", "-n", NAMESPACE, "--field-selector",
                           "involvedObject.name=kind-cpu", "-o", "json").stdout  # fmt: skip
    reasons = {e["reason"] for e in json.loads(events)["items"]}
    assert "SuccessfulCreatePod" in reasons  # the training-operator's
    # Deleting the GpuTraining takes the PyTorchJob, its pods and Services with it.
    plane.kubectl("delete", "gtr", "kind-cpu", "-n", NAMESPACE, "--wait=true")
    wait_for("kind-cpu's children gone", lambda: _children_gone(plane, "kind-cpu"), timeout=60, every=0.5)


def test_the_real_webhook_refuses_what_the_training_operator_refuses(
    plane: ControlPlane, kubeflow: WebhookedController
) -> None:
    """A name the API server takes but Kubeflow's webhook does not (DNS-1035: no leading digit)."""
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "1-starts-with-a-digit"},
           "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": {"spec": {"containers": [
               {"name": "pytorch", "image": "x", "command": ["true"]}]}}}}}}  # fmt: skip
    refused = plane.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(job), check=False)
    assert refused.returncode != 0
    assert 'admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied' in refused.stderr


def test_progress_then_a_killed_trainer_resumes_from_its_checkpoint(
    plane: ControlPlane,
    nodes: Nodes,
    claims: Claims,
    operator: InClusterOperator,
    timelines: list[Timeline],
    tmp_path: Path,
) -> None:
    """SIGKILL the master's trainer mid-run: its container restarts in place, training goes on
    from the newest checkpoint on the claim, and the status never says Stalled."""
    name = "killed"
    gate = _gate(claims, f"{name}-checkpoints")
    timelines.append(timeline := _start_long_training(plane, name, tmp_path, gate))
    pod = f"{name}-master-0"
    held = gate.wait_held(lambda: not {"Succeeded", "Failed"} & set(timeline.phases()))
    # While it waits there, the status has that step, every figure there.
    progress = wait_for("the held step in the status", lambda: next(
        (s["progress"] for s in reversed(timeline.seen) if s.get("progress", {}).get("step") == held), None),
        timeout=60)  # fmt: skip
    assert {"step", "totalSteps", "percent", "loss", "samplesPerSecond", "eta"} <= set(progress), progress
    assert len(_checkpointed_steps(gate)) >= 2  # one past the first epoch: not the start
    pid = wait_for("the trainer process", lambda: _trainer_pid(plane, nodes, pod), timeout=10)
    before_kill = max(_checkpointed_steps(gate))
    os.kill(pid, signal.SIGKILL)
    # The other rank goes on, finds its peer gone and restarts too, as it would have unheld.
    gate.release()
    wait_for("the container restarted", lambda: (_get(plane, "pod", pod) or {}).get("status", {}).get(
        "containerStatuses", [{}])[0].get("restartCount", 0) >= 1, timeout=60)  # fmt: skip
    wait_for(
        f"{name} Succeeded", lambda: _phase(plane, name) in ("Succeeded", "Failed"), timeout=240, every=0.5
    )
    assert _phase(plane, name) == "Succeeded", timeline.phases()
    resumed = _resumed_steps(plane, nodes, pod)
    assert resumed, "the restarted trainer did not resume"
    assert resumed[0] >= before_kill, (resumed, before_kill)
    assert "Stalled" not in timeline.conditions()
    phases = timeline.caught_up("Succeeded")
    assert phases[-1] == "Succeeded"
    assert "Failed" not in phases
    # Kubeflow keeps the job Running through an in-place restart; ours says Restarting until
    # the trainer advances again, then Running.
    assert "Restarting" in phases, phases
    assert phases[phases.index("Restarting") + 1] == "Running", phases
    # Progress advanced while it trained: scrapes with different steps while Running.
    steps = {
        s["progress"]["step"]
        for s in timeline.seen
        if s.get("phase") == "Running" and s.get("progress", {}).get("step")
    }
    assert len(steps) >= 2, steps


def test_suspended_mid_run_its_pods_go_and_it_resumes_from_the_checkpoint(
    plane: ControlPlane,
    nodes: Nodes,
    claims: Claims,
    operator: InClusterOperator,
    timelines: list[Timeline],
    tmp_path: Path,
) -> None:
    name = "paused"
    gate = _gate(claims, f"{name}-checkpoints")
    timelines.append(timeline := _start_long_training(plane, name, tmp_path, gate))
    pod = f"{name}-master-0"
    gate.wait_held(lambda: not {"Succeeded", "Failed"} & set(timeline.phases()))
    assert len(_checkpointed_steps(gate)) >= 2  # one past the first epoch: not the start
    plane.kubectl(
        "patch", "gtr", name, "-n", NAMESPACE, "--type=merge", "-p", '{"spec":{"runPolicy":{"suspend":true}}}'
    )
    wait_for(f"{name} Suspended", lambda: _phase(plane, name) == "Suspended", timeout=60, every=0.5)
    wait_for(
        "its pods gone",
        lambda: not _names(plane, "pods", f"training.kubeflow.org/job-name={name}"),
        timeout=60,
    )
    saved = max(_checkpointed_steps(gate))
    gate.release()  # the resumed pods' trainers train on (SIGTERM let the deleted ones go)
    plane.kubectl(
        "patch",
        "gtr",
        name,
        "-n",
        NAMESPACE,
        "--type=merge",
        "-p",
        '{"spec":{"runPolicy":{"suspend":false}}}',
    )
    wait_for(
        f"{name} Succeeded", lambda: _phase(plane, name) in ("Succeeded", "Failed"), timeout=240, every=0.5
    )
    assert _phase(plane, name) == "Succeeded", timeline.phases()
    resumed = _resumed_steps(plane, nodes, pod)
    assert resumed, "the resumed training started over"
    assert resumed[-1] >= saved, (resumed, saved)
    phases = timeline.caught_up("Succeeded")
    assert phases.index("Suspended") < len(phases) - 1
    assert "Stalled" not in timeline.conditions()


def test_an_elastic_spec_rendezvous_through_the_worker_only_layout(
    plane: ControlPlane, nodes: Nodes, operator: InClusterOperator, timelines: list[Timeline]
) -> None:
    name = "kind-cpu-elastic"
    timelines.append(timeline := Timeline(plane, name))
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(KIND_CPU_ELASTIC))
    wait_for(
        f"{name} Succeeded", lambda: _phase(plane, name) in ("Succeeded", "Failed"), timeout=240, every=0.5
    )
    status = (_get(plane, "gtr", name) or {}).get("status", {})
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    pods = _names(plane, "pods", f"training.kubeflow.org/job-name={name}")
    assert pods == [f"pod/{name}-worker-0", f"pod/{name}-worker-1"]
    assert _controller_env_missing(plane, PYTORCHJOB, KIND_CPU_ELASTIC, pods) == {p: set() for p in pods}
    assert status["progress"]["accuracy"] > 0.9
    assert "Stalled" not in timeline.conditions()


def test_the_kind_cpu_example_trains_to_succeeded_on_trainer_v2(
    plane: ControlPlane,
    nodes: Nodes,
    trainer_v2: list[WebhookedController],
    operator: InClusterOperator,
    timelines: list[Timeline],
    tmp_path: Path,
) -> None:
    """The same example with ``backend: trainjob``, through the real Trainer v2.3.0 and JobSet
    v0.12.0 (controllers and webhooks): TrainingRuntime + TrainJob -> JobSet -> Job -> pods, with
    torchrun's rendezvous from Trainer's PET_* variables over JobSet's headless Service."""
    spec = _variant(tmp_path, "kind-cpu-v2", backend="trainjob")
    timelines.append(timeline := Timeline(plane, "kind-cpu-v2"))
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(spec))
    wait_for("kind-cpu-v2 finished", lambda: _phase(plane, "kind-cpu-v2") in ("Succeeded", "Failed"),
             timeout=240, every=0.5)  # fmt: skip
    status = _get(plane, "gtr", "kind-cpu-v2")["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert (status["backend"], status["trainJob"]) == ("trainjob", "kind-cpu-v2")
    # Trainer's own objects and status: the TrainJob Complete, its JobSet, the Job's pods.
    job = _get(plane, "trainjob", "kind-cpu-v2")
    assert job is not None
    assert {c["type"] for c in job["status"]["conditions"] if c["status"] == "True"} == {"Complete"}
    assert _get(plane, "jobset", "kind-cpu-v2") is not None
    pods = _names(plane, "pods", "jobset.sigs.k8s.io/jobset-name=kind-cpu-v2")
    assert len(pods) == 2, pods
    # The final figures came from the trainers' termination messages, as on the v1 path.
    assert status["progress"]["percent"] == 100
    assert status["progress"]["accuracy"] > 0.9
    running = [s for s in timeline.seen if s.get("phase") == "Running"]
    assert running, timeline.phases()
    assert any(s.get("progress", {}).get("step") for s in running), running[-1]  # scraped while running
    assert any(s.get("workers", {}).get("ready") == 2 for s in running), running[-1]
    # The pods are the restricted ones we render, with Trainer's rendezvous variables added.
    pod = json.loads(plane.kubectl("get", pods[0], "-n", NAMESPACE, "-o", "json").stdout)
    container = pod["spec"]["containers"][0]
    env = {e["name"] for e in container["env"]}
    assert "GPUTRAIN_JOB_NAME" in env
    assert _controller_env_missing(plane, TRAINJOB, spec, pods) == {p: set() for p in pods}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    assert {v["name"] for v in pod["spec"]["volumes"]} >= {"dshm", "checkpoints", "output"}
    plane.kubectl("delete", "gtr", "kind-cpu-v2", "-n", NAMESPACE, "--wait=true")
    wait_for("kind-cpu-v2's children gone", lambda: _get(plane, "trainjob", "kind-cpu-v2") is None
             and not _names(plane, "pods", "jobset.sigs.k8s.io/jobset-name=kind-cpu-v2"), timeout=90)  # fmt: skip


def _pods_of(plane: ControlPlane, name: str) -> list[dict[str, Any]]:
    out = plane.kubectl("get", "pods", "-n", NAMESPACE, "-l", f"gpuop.io/gputraining={name}",
                        "-o", "json").stdout  # fmt: skip
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


# What a queued training runs through: the nodes, both Kubeflow APIs, the real Kueue and the operator.
KUEUE_CHAIN = ("nodes", "kubeflow", "trainer_v2", "queueing", "operator")


@pytest.mark.usefixtures(*KUEUE_CHAIN)
@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob"])
def test_kueue_holds_the_second_training_queued_until_the_first_finishes(
    plane: ControlPlane, claims: Claims, timelines: list[Timeline], tmp_path: Path, backend: str
) -> None:
    """The real Kueue v0.16.2 with a ClusterQueue whose quota fits one kind-cpu training (2 pods
    of 1 CPU and 1 GiB): the first is admitted and runs; the second waits Queued, with Kueue's
    own reason, and no pod, until the first has finished; then it is admitted and runs. The
    operator never resumes a job Kueue holds. On either backend, through Kueue's own PyTorchJob
    and TrainJob integrations. Last in this module: Kueue's webhooks stay."""
    queue = f"team-{backend}"
    for obj in kueue.queues(queue, NAMESPACE, {"cpu": "2", "memory": "2Gi"}):
        plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
    first_name, second_name = f"q1-{backend}", f"q2-{backend}"
    queued = {"scheduling": {"queueName": queue}, "backend": backend}
    # The first waits at HOLD_AT_STEP until the second has been seen queued: it cannot have
    # finished (and given its quota back) meanwhile.
    gate = _gate(claims, f"{first_name}-checkpoints")
    first = _variant(tmp_path, first_name, training={"epochs": 25}, checkpoint={"volume": {"claimName": gate.claim}},
                     env=gate.env, **queued)  # fmt: skip
    second = _variant(tmp_path, second_name, **queued)
    timelines.append(first_timeline := Timeline(plane, first_name))
    timelines.append(second_timeline := Timeline(plane, second_name))
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(first))
    wait_for(f"{first_name} Running", lambda: _phase(plane, first_name) == "Running", timeout=120, every=0.5)
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(second))

    def kueues_reason() -> dict[str, Any] | None:
        status = (_get(plane, "gtr", second_name) or {}).get("status", {})
        found = [c for c in status.get("conditions", []) if c["type"] == "Queued" and c["status"] == "True"]
        pending = status.get("phase") == "Queued" and found and found[0]["reason"] == "Pending"
        return found[0] if pending else None

    condition = wait_for(f"{second_name} Queued with Kueue's reason", kueues_reason, timeout=60, every=0.5)
    assert "insufficient unused quota" in condition["message"], condition
    assert _phase(plane, first_name) == "Running"
    job = _get(plane, backend, second_name)
    assert job is not None
    assert (
        job["spec"]["runPolicy"]["suspend"] if backend == "pytorchjob" else job["spec"]["suspend"]
    ) is True
    assert _pods_of(plane, second_name) == []
    gate.release()

    wait_for(f"{first_name} finished", lambda: _phase(plane, first_name) in ("Succeeded", "Failed"),
             timeout=240, every=0.5)  # fmt: skip
    assert _phase(plane, first_name) == "Succeeded", first_timeline.phases()
    wait_for(f"{second_name} finished", lambda: _phase(plane, second_name) in ("Succeeded", "Failed"),
             timeout=240, every=0.5)  # fmt: skip
    assert _phase(plane, second_name) == "Succeeded", second_timeline.phases()
    # Its pods came after the first had finished: Kueue admitted it then, not the operator before.
    finished = (_get(plane, "gtr", first_name) or {})["status"]["completionTime"]
    started = min(p["metadata"]["creationTimestamp"] for p in _pods_of(plane, second_name))
    assert started >= finished, (started, finished)
    workloads = json.loads(
        plane.kubectl("get", "workloads.kueue.x-k8s.io", "-n", NAMESPACE, "-o", "json").stdout
    )
    admitted = {w["metadata"]["ownerReferences"][0]["name"]: w["status"].get("admission", {}).get("clusterQueue")
                for w in workloads["items"]}  # fmt: skip
    assert (admitted.get(first_name), admitted.get(second_name)) == (queue, queue), admitted
    phases = second_timeline.caught_up("Succeeded")
    assert phases[0] in ("Created", "Queued"), phases
    assert "Suspended" not in phases, phases
    assert "Failed" not in phases, phases
    assert phases.index("Queued") < phases.index("Running"), phases


def _rank0_pod(name: str, backend: str) -> str:
    """The rank-0 pod's name, as a pattern for :func:`_logs`: Kubeflow v1 names it
    once; JobSet's Job gives each attempt a new random suffix."""
    return f"{name}-master-0" if backend == "pytorchjob" else f"{name}-node-0-0-*"


@pytest.mark.usefixtures(*KUEUE_CHAIN)
@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob"])
def test_kueue_preempts_a_lower_priority_training_and_the_operator_lets_it_wait_and_resume(
    plane: ControlPlane, nodes: Nodes, claims: Claims, timelines: list[Timeline], tmp_path: Path, backend: str
) -> None:
    """The real Kueue preempting: a ClusterQueue that fits one training and preempts lower
    priorities (`withinClusterQueue: LowerPriority`, priorities from the pods' PriorityClass,
    as Kueue reads them). A low-priority training runs and checkpoints; a high-priority one
    arrives; Kueue evicts the low one and suspends its job. The operator shows it Queued with
    Kueue's reason (Preempted), never resumes it, and once the high one has finished and Kueue
    admits the low one again, it resumes from its checkpoint to Succeeded."""
    queue = f"preempting-{backend}"
    for obj in kueue.queues(queue, NAMESPACE, {"cpu": "2", "memory": "2Gi"},
                            preemption={"withinClusterQueue": "LowerPriority"}):  # fmt: skip
        plane.kubectl("apply", "-f", "-", input=json.dumps(obj))
    for priority_class, value in (("e2e-low", 100), ("e2e-high", 1000)):
        plane.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
            "metadata": {"name": priority_class}, "value": value}))  # fmt: skip
    low, high = f"low-{backend}", f"high-{backend}"
    gate = _gate(
        claims, f"{low}-checkpoints"
    )  # the low one waits at HOLD_AT_STEP: still running when preempted
    low_spec = _variant(tmp_path, low, training={"epochs": 40}, checkpoint={"volume": {"claimName": gate.claim}},
                        scheduling={"queueName": queue, "priorityClassName": "e2e-low"}, backend=backend,
                        env=gate.env)  # fmt: skip
    high_spec = _variant(tmp_path, high, scheduling={"queueName": queue, "priorityClassName": "e2e-high"},
                         backend=backend)  # fmt: skip
    timelines.append(low_timeline := Timeline(plane, low))
    timelines.append(high_timeline := Timeline(plane, high))
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(low_spec))
    rank0 = _rank0_pod(low, backend)
    gate.wait_held(lambda: not {"Succeeded", "Failed"} & set(low_timeline.phases()))
    assert len(_checkpointed_steps(gate)) >= 2  # one past the first epoch: not the start
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(high_spec))

    def preempted() -> dict[str, Any] | None:
        status = (_get(plane, "gtr", low) or {}).get("status", {})
        found = [c for c in status.get("conditions", []) if c["type"] == "Queued" and c["status"] == "True"]
        return found[0] if status.get("phase") == "Queued" and found else None

    condition = wait_for(f"{low} Queued after Kueue's preemption", preempted, timeout=90, every=0.5)
    assert condition["reason"] == "Preempted", condition
    assert "Preempted to accommodate" in condition["message"], condition
    job = _get(plane, backend, low)
    assert job is not None
    assert (
        job["spec"]["runPolicy"]["suspend"] if backend == "pytorchjob" else job["spec"]["suspend"]
    ) is True
    wait_for(f"{low}'s pods gone", lambda: not _pods_of(plane, low), timeout=90)
    saved = max(_checkpointed_steps(gate))
    gate.release()  # for its pods when Kueue admits it again (SIGTERM let the evicted ones go)

    wait_for(
        f"{high} finished", lambda: _phase(plane, high) in ("Succeeded", "Failed"), timeout=240, every=0.5
    )
    assert _phase(plane, high) == "Succeeded", high_timeline.phases()
    wait_for(f"{low} finished", lambda: _phase(plane, low) in ("Succeeded", "Failed"), timeout=300, every=0.5)
    assert _phase(plane, low) == "Succeeded", low_timeline.phases()
    resumed = _resumed_steps(plane, nodes, rank0)
    assert resumed, "the preempted training started over"
    assert resumed[-1] >= saved, (resumed, saved)
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
    # A hand-written DDP loop with one gpureport.report() call a step.
    "loop": ["/workspace/plain-loop/train.py", "--steps", "12"],
}


def _train_own_code(
    plane: ControlPlane, program: str, backend: str, timelines: list[Timeline], tmp_path: Path
) -> tuple[str, list[dict[str, Any]]]:
    """The user's program under plain torchrun (both Kubeflow APIs set PET_NNODES, PET_NODE_RANK,
    PET_MASTER_ADDR/PORT), reporting with the projected token to the operator's endpoint:
    status moves while it runs and ends at 100. The training's name and its pods, still there."""
    name = f"{program}-{backend}"
    spec = {
        "image": trainer.OWN_CODE_NAME,  # a stand-in for a team's image: Transformers and the examples
        "command": ["torchrun"],
        "args": PROGRAMS[program],
        "backend": backend,
        "workers": 2,
        "gpusPerWorker": 0,
        "resources": {"cpu": "1", "memory": "2Gi"},
        # 12 steps of at least 1.5 s: long enough by construction for clients that report at
        # most every 5 s to be seen reporting while they run (support.training.pace_env, whose
        # hooks the image has at TEST_SITE).
        "env": [
            {"name": "PYTHONPATH", "value": trainer.TEST_SITE},
            {"name": "GPUOP_TEST_STEP_SECONDS", "value": "1.5"},
        ],
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "gpuop.io/v1alpha1", "kind": "GpuTraining",
                                    "metadata": {"name": name}, "spec": spec}))  # fmt: skip
    timelines.append(timeline := Timeline(plane, name))
    plane.kubectl("apply", "-n", NAMESPACE, "-f", str(path))
    wait_for(f"{name}'s two pods", lambda: len(_pods_of(plane, name)) == 2, timeout=120, every=0.5)
    pods = _pods_of(plane, name)
    wait_for(
        f"{name} finished", lambda: _phase(plane, name) in ("Succeeded", "Failed"), timeout=300, every=0.5
    )
    status = _get(plane, "gtr", name)["status"]
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
    # The token the pods reported with was minted for this training's audience, bound to the pod.
    volume = next(v for v in pods[0]["spec"]["volumes"] if v["name"] == "gpuop-reports")
    token = volume["projected"]["sources"][0]["serviceAccountToken"]
    assert token["audience"] == f"gpuop.io/reports/{NAMESPACE}/{name}"
    return name, pods


def _delete_training(plane: ControlPlane, name: str) -> None:
    plane.kubectl("delete", "gtr", name, "-n", NAMESPACE, "--wait=true")
    wait_for(f"{name}'s pods gone", lambda: not _pods_of(plane, name), timeout=90)


@pytest.mark.usefixtures("nodes", "kubeflow", "trainer_v2", "operator")
@pytest.mark.parametrize("backend", ["pytorchjob", "trainjob"])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_the_code_people_train_reports_progress_into_status_on_either_backend(
    plane: ControlPlane, program: str, backend: str, timelines: list[Timeline], tmp_path: Path
) -> None:
    """Their own programs, no code of ours in the HF one: see :func:`_train_own_code`."""
    name, _ = _train_own_code(plane, program, backend, timelines, tmp_path)
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
    timelines: list[Timeline],
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
    name, pods = _train_own_code(plane, "hf", "trainjob", timelines, tmp_path)
    # The gate did inject: Trainer's token volume and its CA ConfigMap are there, unused.
    assert "kubeflow-trainer-token" in {v["name"] for v in pods[0]["spec"]["volumes"]}
    assert _get(plane, "configmap", f"{name}-tls-config") is not None
    env = {e["name"]: e.get("value") for e in pods[0]["spec"]["containers"][0]["env"]}
    report_url = operator.report_url + REPORT_PATH.format(namespace=NAMESPACE, name=name)
    assert env["KUBEFLOW_TRAINER_SERVER_URL"] == report_url, env
    assert env["KUBEFLOW_TRAINER_SERVER_TOKEN"].startswith(f"{REPORT_MOUNT}/"), env
    assert env["KUBEFLOW_TRAINER_SERVER_CA_CERT"].startswith(f"{REPORT_MOUNT}/"), env
    job = _get(plane, "trainjob", name)
    assert job is not None
    assert "trainerStatus" not in job["status"], job["status"]
    # Trainer's own receiver was there all along: a report sent to it, with a token of its
    # audience (its URL's path without /apis/) and its CA from the ConfigMap it made for the
    # pods, lands in the TrainJob.
    audience = f"trainer.kubeflow.org/v1alpha1/namespaces/{NAMESPACE}/trainjobs/{name}/status"
    token = api.request("POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default/token",
                        {"spec": {"audiences": [audience], "expirationSeconds": 600}})["status"]["token"]  # fmt: skip
    ca = _get(plane, "configmap", f"{name}-tls-config")["data"]["ca.crt"]
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
    job = _get(plane, "trainjob", name)
    assert job["status"]["trainerStatus"]["progressPercentage"] == 42, job["status"]
    _delete_training(plane, name)
