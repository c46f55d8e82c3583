"""Rendering for Kubeflow Trainer v2: every TrainJob and TrainingRuntime is one a v2.3.0 cluster
accepts, and carries what the PyTorchJob path guarantees."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuop._kits.schema import SpecError
from gpuop.api.fixed import fixed_spec_changes
from gpuop.api.spec import parse
from gpuop.backends import pod as render
from gpuop.backends.pytorchjob import render_pytorchjob
from gpuop.backends.registry import gaps
from gpuop.backends.trainjob import render_runtime, render_trainjob
from gputrain.contract import METRICS_PORT, TERMINATION_LOG
from support.paths import REFERENCE, ROOT
from support.schemas.kubeflow import merged_pod_template, trainjob_errors
from support.specs import EXAMPLES, load_example, minimal

GOLDEN = ROOT / "tests" / "golden" / "trainjob"
UID = "9b2f4c1e-0d7a-4a8e-9a51-3f0c6a2b7d10"
# Examples that use what a TrainJob cannot carry, and the field each is refused for.
REFUSED = {
    "cifar10-resnet-elastic.yaml": "spec.elastic",
    "kind-cpu-elastic.yaml": "spec.elastic",
    "mnist.yaml": "spec.runPolicy.ttlSecondsAfterFinished",
}
RENDERED = [p for p in EXAMPLES if p.name not in REFUSED]


def both(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    training = parse(body)
    return render_trainjob(training), render_runtime(training)


def node_pod(body: dict[str, Any]) -> dict[str, Any]:
    job, runtime = both(body)
    return merged_pod_template(job, runtime)["spec"]


def env_of(job: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in job["spec"]["trainer"]["env"]}


@pytest.mark.parametrize("example", RENDERED, ids=[p.name for p in RENDERED])
def test_examples_match_their_golden_files(example: Path) -> None:
    body = load_example(example)
    body["metadata"] |= {"namespace": "ml", "uid": UID}
    rendered = yaml.safe_dump_all(reversed(both(body)), sort_keys=False)
    golden = GOLDEN / example.name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(rendered)
    assert golden.read_text() == rendered, (
        f"{golden} differs; UPDATE_GOLDEN=1 pytest rewrites it, then review"
    )


@pytest.mark.parametrize("example", RENDERED, ids=[p.name for p in RENDERED])
def test_examples_are_valid_on_trainer_v2(example: Path) -> None:
    body = load_example(example)
    body["metadata"] |= {"namespace": "ml", "uid": UID}
    assert trainjob_errors(*both(body)) == []


@pytest.mark.parametrize(("example", "field"), sorted(REFUSED.items()))
def test_examples_trainer_v2_cannot_run_are_refused_naming_the_field(example: str, field: str) -> None:
    training = parse(load_example(EXAMPLES[[p.name for p in EXAMPLES].index(example)]))
    assert field in gaps(training.spec)["trainjob"]
    with pytest.raises(SpecError) as refused:
        render_trainjob(training)
    assert str(refused.value).startswith(f"{field}: cannot be used with backend trainjob: ")
    assert "\n" not in str(refused.value).split(";")[0]


VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("minimal", minimal()),
    ("single cpu pod", minimal(gpusPerWorker=0, workers=1)),
    ("cpu with threads", minimal(gpusPerWorker=0, workers=3, resources={"cpu": "2500m", "memory": "4Gi"})),
    ("8 gpus x 4 pods", minimal(workers=4, gpusPerWorker=8, gpuType="NVIDIA-H100-80GB-HBM3")),
    ("custom command", minimal(dataset=None, command=["python", "-u", "/app/train.py"], args=["--fast"])),
    (
        "volumes with subpaths",
        minimal(
            dataset={"name": "imagefolder", "path": "/d", "volume": {"claimName": "data", "subPath": "in1k"}},
            checkpoint={"volume": {"claimName": "ckpt"}, "path": "/ckpt"},
        ),
    ),
    (
        "scheduling",
        minimal(
            workers=3,
            scheduling={
                "queueName": "team-a",
                "priorityClassName": "high",
                "schedulerName": "volcano",
                "nodeSelector": {"pool": "a100"},
                "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoExecute"}],
            },
        ),
    ),
    ("run policy", minimal(runPolicy={"backoffLimit": 0, "activeDeadlineSeconds": 60, "suspend": True})),
    ("nccl aks", minimal(workers=2, nccl={"profile": "aks-infiniband", "env": {"NCCL_IB_HCA": "mlx5"}})),
    ("nccl efa", minimal(workers=2, gpusPerWorker=8, nccl={"profile": "eks-efa", "efaDevices": 32})),
    (
        "env and pod metadata",
        minimal(
            env=[{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "k"}}}],
            podMetadata={"labels": {"team": "vision"}, "annotations": {"a": "b"}},
            serviceAccountName="trainer",
            imagePullSecrets=["regcred"],
        ),
    ),
    ("max values", minimal(workers=1024, gpusPerWorker=16, training={"batchSize": 65536, "epochs": 100000})),
]


@pytest.mark.parametrize("body", [v[1] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_variants_are_valid_on_trainer_v2(body: dict[str, Any]) -> None:
    body["metadata"] |= {"namespace": "ml", "uid": UID}
    assert trainjob_errors(*both(body)) == []


def test_the_pod_is_the_pytorchjobs_but_for_name_ports_launch_and_restart_policy() -> None:
    """One pod template for both backends: the guarantees (GPU limits, shm, env contract, NCCL,
    security, volumes, placement, termination message) come from the same functions."""
    body = minimal(
        workers=2,
        gpusPerWorker=8,
        gpuType="NVIDIA-H100-80GB-HBM3",
        nccl={"profile": "aks-infiniband"},
        checkpoint={"volume": {"claimName": "ckpt"}},
        scheduling={"priorityClassName": "high", "schedulerName": "volcano"},
    )
    v1 = render_pytorchjob(parse(body))["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    v2 = merged_pod_template(*both(body))
    assert v2["metadata"]["labels"] == v1["metadata"]["labels"]
    pod1, pod2 = dict(v1["spec"]), dict(v2["spec"])
    assert pod2.pop("restartPolicy") == "OnFailure"
    c1, c2 = pod1.pop("containers")[0], pod2.pop("containers")[0]
    assert pod1 == pod2
    assert (c1.pop("name"), c2.pop("name")) == ("pytorch", "node")
    assert [p["containerPort"] for p in c2.pop("ports")] == [METRICS_PORT]  # Trainer adds 29500
    c1.pop("ports")
    assert c1.pop("args")[-2:] == c2.pop("args") == ["-m", "gputrain"]
    assert c1 == c2
    assert c2["resources"]["limits"][render.GPU_RESOURCE] == 8
    assert c2["terminationMessagePath"] == TERMINATION_LOG
    assert c2["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_scheduler_name_reaches_the_pods_through_the_runtime_and_only_when_set() -> None:
    """A TrainJob's pods take their spec from the runtime's pod template alone (its trainer
    overrides only the container)."""
    assert "schedulerName" not in node_pod(minimal())
    job, runtime = both(minimal(scheduling={"schedulerName": "volcano"}))
    assert "schedulerName" not in str(job["spec"])  # the record in its annotations names it
    assert merged_pod_template(job, runtime)["spec"]["schedulerName"] == "volcano"


def test_trainer_carries_what_kubeflow_shows_and_trainer_v2_sets_the_rendezvous() -> None:
    job, runtime = both(minimal(workers=3, gpusPerWorker=4))
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (3, 4)
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 3, "torch": {}}
    assert trainer["command"] == ["torchrun"]
    assert not any(name.startswith(("PET_", "MASTER_")) for name in env_of(job))
    assert "$(MASTER_ADDR)" not in str(job) + str(runtime)


def test_cpu_job_asks_for_one_process_per_pod_not_one_per_core() -> None:
    job, _ = both(minimal(gpusPerWorker=0, resources={"cpu": "8"}))
    assert job["spec"]["trainer"]["numProcPerNode"] == 1
    assert env_of(job)["GPUTRAIN_BACKEND"] == "gloo"
    assert env_of(job)["OMP_NUM_THREADS"] == "8"


def test_runtime_and_job_are_owned_named_and_labelled_like_the_pytorchjob() -> None:
    body = minimal(scheduling={"queueName": "team-a"})
    body["metadata"] |= {"namespace": "ml", "uid": UID}
    job, runtime = both(body)
    pytorchjob = render_pytorchjob(parse(body))
    record = render.CREATED_FROM_ANNOTATION
    assert {**job["metadata"], "annotations": {}} == {**pytorchjob["metadata"], "annotations": {}}
    # The record holds runPolicy but suspend: fixed on a TrainJob, mutable on a PyTorchJob.
    assert fixed_spec_changes(job["metadata"]["annotations"][record], parse(body).spec) == ()
    later = parse(minimal(scheduling={"queueName": "team-a"}, runPolicy={"backoffLimit": 5, "suspend": True}))
    assert fixed_spec_changes(job["metadata"]["annotations"][record], later.spec) == (
        "spec.runPolicy.backoffLimit (unset -> 5)",
    )
    assert job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": runtime["metadata"]["name"],
    }
    assert runtime["metadata"]["ownerReferences"] == pytorchjob["metadata"]["ownerReferences"]
    assert runtime["metadata"]["namespace"] == "ml"
    assert render.KUEUE_QUEUE_LABEL not in runtime["metadata"]["labels"]  # Kueue queues the TrainJob
    assert job["spec"]["suspend"] is True  # made suspended for Kueue to admit


def test_run_policy_maps_to_the_job_and_the_trainjob() -> None:
    job, runtime = both(minimal(workers=4, runPolicy={"backoffLimit": 2, "activeDeadlineSeconds": 600}))
    rjob = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert rjob["backoffLimit"] == render.kubeflow_backoff_limit(2, 4) == 9
    assert job["spec"]["activeDeadlineSeconds"] == 600
    job, runtime = both(minimal())
    assert "backoffLimit" not in runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert "activeDeadlineSeconds" not in job["spec"]


def test_the_runtime_has_the_stock_torch_runtimes_shape() -> None:
    """Names Trainer's torch plugin and webhook look for, as in its own torch-distributed."""
    stock = yaml.safe_load((REFERENCE / "runtime_torch_distributed.yaml").read_text())
    _, runtime = both(minimal())
    assert runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    assert stock["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    ours, theirs = (r["spec"]["template"]["spec"]["replicatedJobs"][0] for r in (runtime, stock))
    assert ours["name"] == theirs["name"] == "node"
    assert ours["template"]["metadata"] == theirs["template"]["metadata"]
    names = [c["name"] for c in ours["template"]["spec"]["template"]["spec"]["containers"]]
    assert names == [c["name"] for c in theirs["template"]["spec"]["template"]["spec"]["containers"]]


def test_sized_shm_and_volumes_reach_the_node_pod() -> None:
    pod = node_pod(minimal(checkpoint={"volume": {"claimName": "ckpt"}}, shmSize="2Gi"))
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["dshm"] == "/dev/shm"
