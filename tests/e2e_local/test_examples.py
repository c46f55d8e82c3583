"""``kubectl apply -f examples/kind-cpu.yaml`` to Succeeded through the real training-operator
and, with ``backend: trainjob``, through Trainer v2 and JobSet; the elastic example; and what a
platform team does to a running training: kill a trainer, suspend it, delete it.

Assertions read what a user reads: ``kubectl get gtr -o json`` (polled into a timeline while
the test acts), the jobs, pods and Services with kubectl, and events. Below the API the tests
touch only the trainer process they SIGKILL (found in its container's cgroup, as the kernel's
OOM killer would pick it), and read what a user could read on a node: its containers' logs and
the checkpoints on a training's claim (support.chain).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import yaml

from gpuop.backends.pytorchjob import PYTORCHJOB
from gpuop.backends.trainjob import TRAINJOB
from support import chain, datasets
from support.chain import Claims, InClusterOperator
from support.controllers.webhooked import WebhookedController
from support.node.pool import Pool
from support.objectstore import S3Server
from support.plane.cluster import Api
from support.plane.controlplane import ControlPlane
from support.waiting import wait_for


def test_the_kind_cpu_example_trains_to_succeeded_through_the_real_training_operator(
    plane: ControlPlane,
    api: Api,
    nodes: Pool,
    kubeflow: WebhookedController,
    operator: InClusterOperator,
    timelines: list[chain.Timeline],
) -> None:
    timelines.append(timeline := chain.Timeline(plane, "kind-cpu"))
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(chain.KIND_CPU))
    chain.wait_finished(plane, "kind-cpu", timeout=180)
    gtr = chain.get(plane, "gtr", "kind-cpu")
    assert gtr is not None
    status = gtr["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    # The PyTorchJob's status is the real training-operator's, and so are the pods and Services.
    job = chain.get(plane, "pytorchjob", "kind-cpu")
    assert job is not None
    assert {c["type"] for c in job["status"]["conditions"] if c["status"] == "True"} >= {
        "Created",
        "Succeeded",
    }
    assert job["status"]["replicaStatuses"]["Master"]["succeeded"] == 1
    selector = "training.kubeflow.org/job-name=kind-cpu"
    # The master's pod and Service outlive the job. The worker's may not: the master's success
    # ends the job, and cleanPodPolicy Running (the default) has the training-operator delete a
    # worker still running then, its Service with it (seen in a clean-clone run); both Services
    # were made, as its events say below.
    services = chain.names(plane, "services", selector)
    assert "service/kind-cpu-master-0" in services
    assert set(services) <= {"service/kind-cpu-master-0", "service/kind-cpu-worker-0"}
    missing = chain.controller_env_missing(plane, PYTORCHJOB, chain.KIND_CPU, selector)
    assert "pod/kind-cpu-master-0" in missing
    assert set(missing) <= {"pod/kind-cpu-master-0", "pod/kind-cpu-worker-0"}
    assert missing == {p: set() for p in missing}
    # The final figures (the trainer's termination message); no GPU, no GPU hours.
    assert status["progress"]["accuracy"] > 0.9
    assert status["progress"]["percent"] == 100
    assert status["gpuHours"] == 0
    # While it trained, the status had its workers and progress from the pods' metrics.
    running = [s for s in timeline.seen if s.get("phase") == "Running"]
    assert running, timeline.phases()
    assert any(s.get("workers", {}).get("ready") == 2 for s in running), running[-1]
    assert "Stalled" not in timeline.conditions()
    # The training-operator's: both pods and both Services.
    assert chain.made_by_training_operator(plane, "kind-cpu") == sorted(
        f"Created {kind}: kind-cpu-{replica}-0"
        for kind in ("pod", "service")
        for replica in ("master", "worker")
    )
    # Deleting the GpuTraining takes the PyTorchJob, its pods and Services with it.
    plane.kubectl("delete", "gtr", "kind-cpu", "-n", chain.NAMESPACE, "--wait=true")
    wait_for(
        "kind-cpu's children gone", lambda: chain.children_gone(plane, "kind-cpu"), timeout=60, every=0.5
    )


def test_the_real_webhook_refuses_what_the_training_operator_refuses(
    plane: ControlPlane, kubeflow: WebhookedController
) -> None:
    """A name the API server takes but Kubeflow's webhook does not (DNS-1035: no leading digit)."""
    job = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "1-starts-with-a-digit"},
           "spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": {"spec": {"containers": [
               {"name": "pytorch", "image": "x", "command": ["true"]}]}}}}}}  # fmt: skip
    refused = plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", "-", input=json.dumps(job), check=False)
    assert refused.returncode != 0
    assert 'admission webhook "validator.pytorchjob.training-operator.kubeflow.org" denied' in refused.stderr


def test_progress_then_a_killed_trainer_resumes_from_its_checkpoint_in_the_bucket(
    plane: ControlPlane,
    nodes: Pool,
    claims: Claims,
    s3: S3Server,
    operator: InClusterOperator,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    """Its data, checkpoints and model in a bucket of the real S3 store (spec.dataset.uri,
    checkpoint.uri, output.uri; the credentials in a Secret): each pod copies the dataset first
    (FetchingDataset meanwhile); SIGKILL the master's trainer mid-run, and its container,
    restarted in place with no checkpoint on any disk, goes on from the newest one in the bucket;
    status.checkpoint follows each save, the status never says Stalled, and the trained model
    lands in the bucket."""
    name = "killed"
    gate = chain.gate(claims, f"{name}-outputs", mount=chain.OUTPUTS)
    # Its data in the bucket too (spec.dataset.uri): MNIST's files, copied by each pod's dataset
    # step, one object every 1.5 s (the test hook the gate's site loads), so the operator sees it copying.
    s3.put(chain.BUCKET, {f"{chain.DATA_PREFIX}/{n}": data for n, data in datasets.mnist_files().items()})
    fields = chain.in_bucket(plane, s3, gate)
    fields["dataset"] = {"name": "mnist", "uri": f"s3://{chain.BUCKET}/{chain.DATA_PREFIX}",
                         "secretName": chain.STORE_SECRET}  # fmt: skip
    fields["env"] = [{"name": "PYTHONPATH", "value": f"{chain.OUTPUTS}/hold-site"},
                     {"name": "GPUOP_TEST_FETCH_SECONDS", "value": "1.5"}]  # fmt: skip
    timelines.append(timeline := chain.start_long_training(plane, name, tmp_path, gate, **fields))
    pod = f"{name}-master-0"
    held = gate.wait_held(lambda: not {"Succeeded", "Failed"} & set(timeline.phases()))
    # The dataset step ran first, copying the four files, and status said so meanwhile.
    assert "FetchingDataset" in timeline.conditions()
    placed = chain.get(plane, "pod", pod)
    assert placed is not None
    copied = nodes.of(placed).log_of(placed, "fetch-dataset")
    assert "fetched 4 objects (4 copied" in copied, copied
    # While it waits there, the status has that step, every figure there.
    progress = wait_for("the held step in the status", lambda: next(
        (s["progress"] for s in reversed(timeline.seen) if s.get("progress", {}).get("step") == held), None),
        timeout=60)  # fmt: skip
    assert {"step", "totalSteps", "percent", "loss", "samplesPerSecond", "eta"} <= set(progress), progress
    in_bucket = chain.bucket_steps(s3, name)
    assert len(in_bucket) >= 2, in_bucket  # one past the first epoch: not the start
    assert not any(gate.folder.glob("*/step-*")), "a checkpoint on a disk"
    # status.checkpoint names the newest one in the bucket, and moved with each save.
    said = wait_for("status.checkpoint at the newest save", lambda: next(
        (c for s in reversed(timeline.seen) if (c := s.get("checkpoint")) and c["step"] == in_bucket[-1]), None),
        timeout=30)  # fmt: skip
    assert said["uri"].startswith(f"s3://{chain.BUCKET}/{chain.BUCKET_PREFIX}/{name}/step-"), said
    assert len({s["checkpoint"]["step"] for s in timeline.seen if s.get("checkpoint")}) >= 2
    pid = wait_for("the trainer process", lambda: chain.trainer_pid(plane, nodes, pod), timeout=10)
    before_kill = max(chain.bucket_steps(s3, name))
    os.kill(pid, signal.SIGKILL)
    # The other rank goes on, finds its peer gone and restarts too, as it would have unheld.
    gate.release()
    wait_for("the container restarted", lambda: (chain.get(plane, "pod", pod) or {}).get("status", {}).get(
        "containerStatuses", [{}])[0].get("restartCount", 0) >= 1, timeout=60)  # fmt: skip
    chain.wait_finished(plane, name)
    assert chain.phase(plane, name) == "Succeeded", timeline.phases()
    resumed = chain.resumed_steps(plane, nodes, pod)
    assert resumed, "the restarted trainer did not resume"
    assert resumed[0] >= before_kill, (resumed, before_kill)
    assert f"resumed from s3://{chain.BUCKET}/{chain.BUCKET_PREFIX}/{name}/" in chain.logs(plane, nodes, pod)
    final = chain.get(plane, "gtr", name)
    assert final is not None
    assert final["status"]["checkpoint"]["step"] == max(chain.bucket_steps(s3, name)), final["status"]
    # spec.output.uri: the model, history and result went to the store when it ended.
    assert s3.names(chain.BUCKET, f"{chain.OUTPUT_PREFIX}/{name}") == [
        "metrics.jsonl",
        "model.pt",
        "result.json",
    ]
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


def _restarts(pods: list[dict[str, Any]]) -> int:
    """The most any container of these pods (the dataset step's included) has restarted."""
    statuses = (c for p in pods for key in ("initContainerStatuses", "containerStatuses")
                for c in p.get("status", {}).get(key) or ())  # fmt: skip
    return max((c.get("restartCount", 0) for c in statuses), default=0)


def test_a_store_that_refuses_stops_the_training_at_once_with_its_line_on_either_backend(
    plane: ControlPlane,
    nodes: Pool,
    s3: S3Server,
    trainer_v2: list[WebhookedController],
    operator: InClusterOperator,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    """Wrong credentials in the Secret (a PyTorchJob's checkpoints) and a bucket that does not
    exist (a TrainJob's dataset step), with no backoff limit, which left to Kubeflow means
    restarting forever: each ends with its own line and says no restart mends it; the operator
    suspends the job, the real controllers delete its pods, and the training is Failed with that
    line within a restart, and stays so."""
    wrong = s3.secret("wrong-credentials")
    wrong["stringData"]["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", "-", input=json.dumps(wrong))
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", "-", input=json.dumps(s3.secret(chain.STORE_SECRET)))
    checkpoints = f"s3://{chain.BUCKET}/{chain.BUCKET_PREFIX}"
    cases = {
        "refused-pytorchjob": ("pytorchjob", "CheckpointStorageFailed", f"{checkpoints}/refused-pytorchjob: list "
                               "failed: access denied", {"checkpoint": {"uri": checkpoints, "secretName": "wrong-credentials"}}),
        "refused-trainjob": ("trainjob", "DatasetFetchFailed", "s3://no-such-bucket/mnist: list failed: the bucket "
                             "does not exist", {"dataset": {"name": "mnist", "uri": "s3://no-such-bucket/mnist",
                                                            "secretName": chain.STORE_SECRET}}),
    }  # fmt: skip
    for name, (backend, _, _, fields) in cases.items():
        path = chain.variant(tmp_path, name, backend=backend, **fields)
        doc = yaml.safe_load(path.read_text())
        del doc["spec"]["runPolicy"]["backoffLimit"]  # Kubeflow's default: no limit
        path.write_text(yaml.safe_dump(doc))
        timelines.append(chain.Timeline(plane, name))
        plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(path))
    restarts = dict.fromkeys(cases, 0)

    def failed(name: str) -> bool:
        restarts[name] = max(restarts[name], _restarts(chain.pods_of(plane, name)))
        return chain.phase(plane, name) == "Failed"

    for name, (backend, reason, line, _) in cases.items():
        wait_for(f"{name} Failed", lambda n=name: failed(n), timeout=180, every=0.5)
        status = (chain.get(plane, "gtr", name) or {})["status"]
        condition = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert condition["reason"] == reason, status
        assert line in condition["message"], condition
        assert any(c["type"] == "JobStopped" and c["status"] == "True" for c in status["conditions"]), status
        job = chain.get(plane, backend, name)
        assert job is not None
        assert (
            job["spec"]["runPolicy"]["suspend"] if backend == "pytorchjob" else job["spec"]["suspend"]
        ) is True
        try:
            # Well within the pods' grace period (120 s): one whose torchrun waits in its
            # rendezvous stops at the SIGTERM (it is not PID 1; tests/node's no-handler test).
            # Seen: 0-2 s; before the pods shared their process namespace, over 90 s.
            stopped_at = time.monotonic()
            wait_for(f"{name}'s pods gone", lambda n=name: chain.pods_of(plane, n) == [], timeout=60)
            print(f"{name}: its pods gone {time.monotonic() - stopped_at:.0f} s after it was Failed")
        except AssertionError as exc:
            left = [(p["metadata"]["name"], p["metadata"].get("deletionTimestamp"), p["status"].get("phase"),
                     [(c["name"], c.get("state"), c.get("restartCount")) for c in p["status"].get("containerStatuses") or ()])
                    for p in chain.pods_of(plane, name)]  # fmt: skip
            raise AssertionError(f"{exc}: {left}; the job {job.get('status')}") from None
    print(f"most restarts of a container before the stop: {restarts}")
    assert all(count <= 2 for count in restarts.values()), restarts  # not a crash loop
    for name in cases:
        assert chain.phase(plane, name) == "Failed"
        assert chain.pods_of(plane, name) == []
        plane.kubectl("delete", "gtr", name, "-n", chain.NAMESPACE, "--wait=true")


def test_suspended_mid_run_its_pods_go_and_it_resumes_from_the_checkpoint_in_the_bucket(
    plane: ControlPlane,
    nodes: Pool,
    claims: Claims,
    s3: S3Server,
    operator: InClusterOperator,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    """SIGTERM mid-run (a suspend deletes the pods, as a drain or a preemption does): each
    trainer saves to the bucket within its grace period, and the new pods, with nothing on any
    disk, resume from it to Succeeded. Suspended for longer than its stall timeout, it is never
    Stalled: the clock stops with the pause."""
    name = "paused"
    gate = chain.gate(claims, f"{name}-outputs", mount=chain.OUTPUTS)
    fields = {**chain.in_bucket(plane, s3, gate), "stallTimeoutSeconds": chain.PAUSE_STALL_SECONDS}
    timelines.append(timeline := chain.start_long_training(plane, name, tmp_path, gate, **fields))
    pod = f"{name}-master-0"
    gate.wait_held(lambda: not {"Succeeded", "Failed"} & set(timeline.phases()))
    assert len(chain.bucket_steps(s3, name)) >= 2  # one past the first epoch: not the start
    plane.kubectl(
        "patch",
        "gtr",
        name,
        "-n",
        chain.NAMESPACE,
        "--type=merge",
        "-p",
        '{"spec":{"runPolicy":{"suspend":true}}}',
    )
    wait_for(f"{name} Suspended", lambda: chain.phase(plane, name) == "Suspended", timeout=60, every=0.5)
    wait_for(
        "its pods gone",
        lambda: not chain.names(plane, "pods", f"training.kubeflow.org/job-name={name}"),
        timeout=60,
    )
    gone_at = time.monotonic()  # the last moment its trainers could report before the resume
    saved = max(chain.bucket_steps(s3, name))
    gate.release()  # the resumed pods' trainers train on (SIGTERM let the deleted ones go)
    chain.hold_pause(plane, name, gone_at)
    assert chain.phase(plane, name) == "Suspended"
    plane.kubectl(
        "patch",
        "gtr",
        name,
        "-n",
        chain.NAMESPACE,
        "--type=merge",
        "-p",
        '{"spec":{"runPolicy":{"suspend":false}}}',
    )
    chain.wait_finished(plane, name)
    assert chain.phase(plane, name) == "Succeeded", timeline.phases()
    resumed = chain.resumed_steps(plane, nodes, pod)
    assert resumed, "the resumed training started over"
    assert resumed[-1] >= saved, (resumed, saved)
    assert f"resumed from s3://{chain.BUCKET}/{chain.BUCKET_PREFIX}/{name}/" in chain.logs(plane, nodes, pod)
    assert not any(gate.folder.glob("*/step-*")), "a checkpoint on a disk"
    phases = timeline.caught_up("Succeeded")
    assert phases.index("Suspended") < len(phases) - 1
    assert "Stalled" not in timeline.conditions()


def test_an_elastic_spec_rendezvous_through_the_worker_only_layout(
    plane: ControlPlane, nodes: Pool, operator: InClusterOperator, timelines: list[chain.Timeline]
) -> None:
    name = "kind-cpu-elastic"
    timelines.append(timeline := chain.Timeline(plane, name))
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(chain.KIND_CPU_ELASTIC))
    chain.wait_finished(plane, name)
    status = (chain.get(plane, "gtr", name) or {}).get("status", {})
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    # Both workers were made; one still running when the job ended is gone (cleanPodPolicy
    # Running), so the pods left are checked for the controller's variables.
    made = [m for m in chain.made_by_training_operator(plane, name) if m.startswith("Created pod:")]
    assert made == [f"Created pod: {name}-worker-{i}" for i in (0, 1)]
    missing = chain.controller_env_missing(
        plane, PYTORCHJOB, chain.KIND_CPU_ELASTIC, f"training.kubeflow.org/job-name={name}"
    )
    assert missing
    assert set(missing) <= {f"pod/{name}-worker-0", f"pod/{name}-worker-1"}
    assert missing == {p: set() for p in missing}
    assert status["progress"]["accuracy"] > 0.9
    assert "Stalled" not in timeline.conditions()


def test_the_kind_cpu_example_trains_to_succeeded_on_trainer_v2(
    plane: ControlPlane,
    nodes: Pool,
    trainer_v2: list[WebhookedController],
    operator: InClusterOperator,
    timelines: list[chain.Timeline],
    tmp_path: Path,
) -> None:
    """The same example with ``backend: trainjob``, through the real Trainer v2.3.0 and JobSet
    v0.12.0 (controllers and webhooks): TrainingRuntime + TrainJob -> JobSet -> Job -> pods, with
    torchrun's rendezvous from Trainer's PET_* variables over JobSet's headless Service."""
    spec = chain.variant(tmp_path, "kind-cpu-v2", backend="trainjob")
    timelines.append(timeline := chain.Timeline(plane, "kind-cpu-v2"))
    plane.kubectl("apply", "-n", chain.NAMESPACE, "-f", str(spec))
    chain.wait_finished(plane, "kind-cpu-v2")
    status = chain.get(plane, "gtr", "kind-cpu-v2")["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=1)
    assert (status["backend"], status["trainJob"]) == ("trainjob", "kind-cpu-v2")
    # Trainer's own objects and status: the TrainJob Complete, its JobSet, the Job's pods.
    job = chain.get(plane, "trainjob", "kind-cpu-v2")
    assert job is not None
    assert {c["type"] for c in job["status"]["conditions"] if c["status"] == "True"} == {"Complete"}
    assert chain.get(plane, "jobset", "kind-cpu-v2") is not None
    pods = chain.names(plane, "pods", "jobset.sigs.k8s.io/jobset-name=kind-cpu-v2")
    assert len(pods) == 2, pods
    # The final figures came from the trainers' termination messages, as on the v1 path.
    assert status["progress"]["percent"] == 100
    assert status["progress"]["accuracy"] > 0.9
    running = [s for s in timeline.seen if s.get("phase") == "Running"]
    assert running, timeline.phases()
    assert any(s.get("progress", {}).get("step") for s in running), running[-1]  # scraped while running
    assert any(s.get("workers", {}).get("ready") == 2 for s in running), running[-1]
    # The pods are the restricted ones we render, with Trainer's rendezvous variables added.
    pod = json.loads(plane.kubectl("get", pods[0], "-n", chain.NAMESPACE, "-o", "json").stdout)
    container = pod["spec"]["containers"][0]
    env = {e["name"] for e in container["env"]}
    assert "GPUTRAIN_JOB_NAME" in env
    missing = chain.controller_env_missing(
        plane, TRAINJOB, spec, "jobset.sigs.k8s.io/jobset-name=kind-cpu-v2"
    )
    assert missing == {p: set() for p in pods}
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    assert {v["name"] for v in pod["spec"]["volumes"]} >= {"dshm", "checkpoints", "output"}
    plane.kubectl("delete", "gtr", "kind-cpu-v2", "-n", chain.NAMESPACE, "--wait=true")
    wait_for("kind-cpu-v2's children gone", lambda: chain.get(plane, "trainjob", "kind-cpu-v2") is None
             and not chain.names(plane, "pods", "jobset.sigs.k8s.io/jobset-name=kind-cpu-v2"), timeout=90)  # fmt: skip
