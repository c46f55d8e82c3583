"""Rendering: every PyTorchJob is one a Kubeflow v1.9 cluster accepts, and says what we mean."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuop._kits.quantity import GI, MI
from gpuop.api.fixed import fixed_spec
from gpuop.api.identity import CREATED_FROM_ANNOTATION, DEFAULT_TRAINER_IMAGE
from gpuop.api.spec import parse
from gpuop.backends.nccl import shm_size_bytes
from gpuop.backends.pod import kubeflow_backoff_limit, trainer_settings
from gpuop.backends.pytorchjob import render_pytorchjob
from gpuop.backends.registry import render_job
from gputrain.contract import METRICS_PORT, TrainerSettings
from support.paths import ROOT
from support.schemas.kubeflow import all_errors
from support.specs import EXAMPLES, load_example, minimal

GOLDEN = ROOT / "tests" / "golden"
UID = "9b2f4c1e-0d7a-4a8e-9a51-3f0c6a2b7d10"


def render(body: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    return render_pytorchjob(parse(body), **kwargs)


def containers(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [r["template"]["spec"]["containers"][0] for r in job["spec"]["pytorchReplicaSpecs"].values()]


def pods(job: dict[str, Any]) -> list[dict[str, Any]]:
    return [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_match_their_golden_files(example: Path) -> None:
    body = load_example(example)
    body["metadata"] |= {"namespace": "ml", "uid": UID}
    rendered = yaml.safe_dump(render(body), sort_keys=False)
    golden = GOLDEN / example.name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(rendered)
    assert golden.read_text() == rendered, (
        f"{golden} differs; UPDATE_GOLDEN=1 pytest rewrites it, then review"
    )


# Spec variants, each rendered and checked like a cluster would check it.
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("minimal", minimal()),
    ("single cpu pod", minimal(gpusPerWorker=0, workers=1)),
    ("cpu with threads", minimal(gpusPerWorker=0, workers=3, resources={"cpu": "2500m", "memory": "4Gi"})),
    ("8 gpus x 4 pods", minimal(workers=4, gpusPerWorker=8, gpuType="NVIDIA-H100-80GB-HBM3")),
    ("elastic", minimal(workers=2, gpusPerWorker=2, elastic={"minWorkers": 1, "maxWorkers": 3})),
    ("elastic single", minimal(workers=1, elastic={"maxWorkers": 2})),
    ("custom command", minimal(dataset=None, command=["python", "-u", "/app/train.py"], args=["--fast"])),
    ("custom command no args", minimal(dataset=None, command=["/app/run.sh"], image="example.com/me/run:1")),
    (
        "volumes with subpaths",
        minimal(
            dataset={
                "name": "imagefolder",
                "path": "/datasets/imagenet",
                "volume": {"claimName": "data", "subPath": "in1k"},
            },
            checkpoint={"volume": {"claimName": "ckpt"}, "path": "/ckpt"},
            output={"volume": {"claimName": "out", "subPath": "runs"}},
        ),
    ),
    (
        "scheduling",
        minimal(
            workers=3,
            scheduling={
                "queueName": "team-a",
                "priorityClassName": "high",
                "gang": True,
                "schedulerName": "volcano",
                "nodeSelector": {"pool": "a100"},
                "tolerations": [
                    {"key": "spot", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
                    {"key": "team", "value": "a", "effect": "NoSchedule"},
                ],
            },
        ),
    ),
    (
        "run policy",
        minimal(
            runPolicy={
                "backoffLimit": 0,
                "activeDeadlineSeconds": 60,
                "ttlSecondsAfterFinished": 0,
                "suspend": True,
                "cleanPodPolicy": "All",
            }
        ),
    ),
    ("nccl gke", minimal(workers=2, nccl={"profile": "gke", "debug": "INFO"})),
    ("nccl aks", minimal(workers=2, nccl={"profile": "aks-infiniband", "env": {"NCCL_IB_HCA": "mlx5"}})),
    ("nccl efa", minimal(workers=2, gpusPerWorker=8, nccl={"profile": "eks-efa", "efaDevices": 32})),
    (
        "env and pod metadata",
        minimal(
            env=[
                {"name": "WANDB_PROJECT", "value": "p"},
                {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "k"}}},
            ],
            podMetadata={"labels": {"team": "vision"}, "annotations": {"sidecar.istio.io/inject": "false"}},
            serviceAccountName="trainer",
            imagePullSecrets=["regcred"],
        ),
    ),
    ("max values", minimal(workers=1024, gpusPerWorker=16, training={"batchSize": 65536, "epochs": 100000})),
]


@pytest.mark.parametrize(("body"), [v[1] for v in VARIANTS], ids=[v[0] for v in VARIANTS])
def test_variants_are_valid_pytorchjobs(body: dict[str, Any]) -> None:
    body["metadata"]["uid"] = UID
    assert all_errors(render(body)) == []


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_valid_pytorchjobs(example: Path) -> None:
    assert all_errors(render(load_example(example))) == []


def test_rendering_is_deterministic_and_shares_no_objects() -> None:
    body = minimal(workers=3)
    first, second = render(body), render(copy.deepcopy(body))
    assert first == second
    master, worker = (r["template"] for r in first["spec"]["pytorchReplicaSpecs"].values())
    assert master == worker
    assert master is not worker  # YAML would otherwise print anchors, and edits would leak
    assert "&id" not in yaml.safe_dump(first)


def test_gpu_job_shape() -> None:
    job = render(minimal(workers=3, gpusPerWorker=4, gpuType="NVIDIA-A100-SXM4-80GB"))
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)
    assert job["spec"]["nprocPerNode"] == "4"
    for pod in pods(job):
        container = pod["containers"][0]
        assert container["name"] == "pytorch"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert container["command"] == ["torchrun"]
        assert container["args"] == [
            "--nproc-per-node=4",
            "--master-addr=$(MASTER_ADDR)",
            "--master-port=$(MASTER_PORT)",
            "-m",
            "gputrain",
        ]
        assert env_of(container)["GPUTRAIN_BACKEND"] == "nccl"
        assert {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"} in container["ports"]
        assert {"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"} in container["ports"]


def test_one_worker_is_a_master_alone() -> None:
    assert list(render(minimal(workers=1))["spec"]["pytorchReplicaSpecs"]) == ["Master"]


def test_cpu_job_uses_gloo_and_asks_for_no_gpu() -> None:
    job = render(minimal(workers=2, gpusPerWorker=0, resources={"cpu": "2500m", "memory": "4Gi"}))
    assert job["spec"]["nprocPerNode"] == "1"
    for pod in pods(job):
        container = pod["containers"][0]
        env = env_of(container)
        assert env["GPUTRAIN_BACKEND"] == "gloo"
        assert env["OMP_NUM_THREADS"] == "2"  # torchrun would otherwise pin a CPU trainer to 1
        assert not any(name.startswith(("NCCL_", "FI_")) for name in env)
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
        assert "tolerations" not in pod
        assert "nodeSelector" not in pod
        assert container["resources"] == {
            "requests": {"cpu": "2500m", "memory": "4Gi"},
            "limits": {"memory": "4Gi"},
        }


def test_users_omp_threads_win() -> None:
    body = minimal(gpusPerWorker=0, resources={"cpu": "4"}, env=[{"name": "OMP_NUM_THREADS", "value": "3"}])
    names = [e["name"] for e in containers(render(body))[0]["env"]]
    assert names.count("OMP_NUM_THREADS") == 1
    assert env_of(containers(render(body))[0])["OMP_NUM_THREADS"] == "3"


def test_elastic_job_is_worker_only_with_c10d_rendezvous() -> None:
    job = render(
        minimal(workers=2, gpusPerWorker=2, elastic={"minWorkers": 1, "maxWorkers": 4, "maxRestarts": 7})
    )
    assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    assert job["spec"]["elasticPolicy"] == {
        "minReplicas": 1,
        "maxReplicas": 4,
        "maxRestarts": 7,
        "rdzvBackend": "c10d",
    }
    container = containers(job)[0]
    # The training-operator gives elastic pods PET_RDZV_ENDPOINT and PET_NNODES, not MASTER_ADDR.
    assert container["args"] == ["--nproc-per-node=2", "-m", "gputrain"]
    assert env_of(container)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"shmSize": "3Gi"}, 3 * GI),
        # MNIST samples are small: the floor wins.
        ({}, 512 * MI),
        # 8 loader workers x prefetch 2 x batch 256 x 3x224x224 floats x 2 headroom + NCCL 64Mi,
        # per process; 2 GPUs; rounded up to 256Mi.
        (
            {
                "gpusPerWorker": 2,
                "dataset": {"name": "imagefolder", "loaderWorkers": 8},
                "training": {"batchSize": 256},
            },
            -(-(2 * (8 * 2 * 256 * 602112 * 2 + 64 * MI)) // (256 * MI)) * 256 * MI,
        ),
        # ...but never more than half the memory limit.
        (
            {
                "gpusPerWorker": 2,
                "dataset": {"name": "imagefolder", "loaderWorkers": 8},
                "training": {"batchSize": 256},
                "resources": {"memory": "6Gi"},
            },
            3 * GI,
        ),
        ({"gpusPerWorker": 0, "dataset": {"name": "digits", "loaderWorkers": 0}}, 512 * MI),
    ],
    ids=["explicit", "floor", "computed", "capped by memory", "cpu digits"],
)
def test_shm_size(fields: dict[str, Any], expected: int) -> None:
    assert shm_size_bytes(parse(minimal(**fields)).spec) == expected


def test_shm_is_a_memory_backed_emptydir_at_dev_shm() -> None:
    pod = pods(render(minimal(shmSize="3Gi")))[0]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "3Gi"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]


def test_volumes_and_mounts() -> None:
    body = minimal(
        dataset={"name": "cifar10", "path": "/data/c10", "volume": {"claimName": "datasets"}},
        checkpoint={"volume": {"claimName": "ckpt", "subPath": "team"}},
    )
    pod = pods(render(body))[0]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "datasets", "readOnly": True}
    assert mounts["data"] == {"name": "data", "mountPath": "/data/c10", "readOnly": True}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    assert mounts["checkpoints"] == {"name": "checkpoints", "mountPath": "/checkpoints", "subPath": "team"}
    assert volumes["output"] == {"name": "output", "emptyDir": {}}


def test_pods_are_restricted() -> None:
    """Pod Security Standards 'restricted': non-root, no escalation, drop ALL, RuntimeDefault."""
    for pod in pods(render(minimal(workers=2))):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        context = pod["containers"][0]["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}


def test_a_custom_image_runs_as_its_own_user() -> None:
    """spec.securityContext: the UID/GIDs of an image built for another user, still non-root."""
    body = minimal(workers=2, securityContext={"runAsUser": 1001, "runAsGroup": 0, "fsGroup": 2000})
    expected = {"runAsNonRoot": True, "runAsUser": 1001, "runAsGroup": 0, "fsGroup": 2000,
                "seccompProfile": {"type": "RuntimeDefault"}}  # fmt: skip

    def pod_contexts(node: Any) -> list[Any]:
        if isinstance(node, dict):
            here = [node["securityContext"]] if "containers" in node else []
            return here + [c for v in node.values() for c in pod_contexts(v)]
        return [c for v in node for c in pod_contexts(v)] if isinstance(node, list) else []

    for objects in ([render(body)], render_job(parse(body), "trainjob", default_image="t")):
        contexts = pod_contexts(objects)
        assert contexts
        assert all(c == expected for c in contexts)
    assert parse(minimal()).spec.security_context.run_as_user == 1000  # the stock images' user


def test_extended_resources_reach_every_pod_on_both_backends() -> None:
    """The InfiniBand device (and any device plugin's): requested as a limit, beside the GPUs."""
    body = minimal(workers=2, gpusPerWorker=8, nccl={"profile": "aks-infiniband"},
                   resources={"extended": [{"name": "rdma/rdma_shared_device_a", "count": 1}]})  # fmt: skip
    for container in containers(render(body)):
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "rdma/rdma_shared_device_a": 1}
    runtime, _job = render_job(parse(body), "trainjob", default_image="t")
    assert "rdma/rdma_shared_device_a" in json.dumps(_job) or "rdma/rdma_shared_device_a" in json.dumps(
        runtime
    )


def test_infiniband_adds_only_ipc_lock() -> None:
    context = containers(render(minimal(nccl={"profile": "aks-infiniband"})))[0]["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}


def test_env_carries_the_contract_exactly() -> None:
    """The trainer reads back, field for field, what the spec says."""
    training = parse(minimal(training={"epochs": 3, "batchSize": 16, "precision": "fp16", "compile": True}))
    # As the container sees it: a variable with no value is set, to "".
    env = {
        e["name"]: e.get("value", "")
        for e in containers(render_pytorchjob(training))[0]["env"]
        if "valueFrom" not in e
    }
    settings = TrainerSettings.from_env(env)
    assert settings == trainer_settings("demo", training.spec)
    assert (settings.epochs, settings.batch_size, settings.precision, settings.compile) == (
        3,
        16,
        "fp16",
        True,
    )
    assert settings.checkpoint_dir == "/checkpoints/demo"


def test_nccl_profile_then_debug_then_user_overrides() -> None:
    body = minimal(
        nccl={"profile": "gke", "debug": "WARN", "env": {"NCCL_SOCKET_IFNAME": "eth1", "NCCL_ALGO": "Ring"}}
    )
    env = env_of(containers(render(body))[0])
    assert env["NCCL_SOCKET_IFNAME"] == "eth1"
    assert env["NCCL_IB_DISABLE"] == "1"
    assert env["NCCL_DEBUG"] == "WARN"
    assert env["NCCL_ALGO"] == "Ring"


def test_efa_devices_are_requested() -> None:
    container = containers(render(minimal(nccl={"profile": "eks-efa", "efaDevices": 4})))[0]
    assert container["resources"]["limits"]["vpc.amazonaws.com/efa"] == 4
    assert env_of(container)["FI_PROVIDER"] == "efa"


def test_user_env_follows_ours_with_secret_refs() -> None:
    body = minimal(env=[{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}])
    env = containers(render(body))[0]["env"]
    assert env[-1] == {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}


def test_custom_command_and_image() -> None:
    body = minimal(
        dataset=None, image="example.com/me/train:2", command=["python", "/app/t.py"], args=["--lr=1"]
    )
    job = render(body, default_image="ignored:1")
    container = containers(job)[0]
    assert (container["image"], container["command"], container["args"]) == (
        "example.com/me/train:2",
        ["python", "/app/t.py"],
        ["--lr=1"],
    )
    assert job["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] == "OnFailure"


def test_default_image_is_the_operators() -> None:
    assert containers(render(minimal()))[0]["image"] == DEFAULT_TRAINER_IMAGE
    assert containers(render(minimal(), default_image="reg.local/t:9"))[0]["image"] == "reg.local/t:9"


def test_owner_reference_only_with_a_uid() -> None:
    assert "ownerReferences" not in render(minimal())["metadata"]
    body = minimal()
    body["metadata"]["uid"] = UID
    assert render(body)["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "gpuop.io/v1alpha1",
            "kind": "GpuTraining",
            "name": "demo",
            "uid": UID,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def test_labels_and_queue() -> None:
    job = render(
        minimal(workers=3, scheduling={"queueName": "team-a", "gang": True, "priorityClassName": "hi"})
    )
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["metadata"]["labels"]["gpuop.io/gputraining"] == "demo"
    assert job["spec"]["runPolicy"]["schedulingPolicy"] == {
        "minAvailable": 3,
        "queue": "team-a",
        "priorityClass": "hi",
    }
    for pod_template in (r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values()):
        assert pod_template["metadata"]["labels"]["gpuop.io/gputraining"] == "demo"


def test_scheduler_name_is_on_every_replica_and_left_out_unless_set() -> None:
    """Left out, a gang-scheduling training-operator writes its gang scheduler's name into the
    pods (and any other scheduler's name would make it keep that one): so nothing by default."""
    assert not any("schedulerName" in p for p in pods(render(minimal(workers=3, scheduling={"gang": True}))))
    job = render(minimal(workers=3, scheduling={"gang": True, "schedulerName": "volcano"}))
    assert [p["schedulerName"] for p in pods(job)] == ["volcano", "volcano"]  # Master and Worker
    assert job["spec"]["runPolicy"]["schedulingPolicy"] == {"minAvailable": 3}
    elastic = render(
        minimal(workers=2, elastic={"maxWorkers": 3}, scheduling={"schedulerName": "my-scheduler"})
    )
    assert [p["schedulerName"] for p in pods(elastic)] == ["my-scheduler"]  # Worker only


def test_user_pod_labels_cannot_replace_ours() -> None:
    body = minimal(podMetadata={"labels": {"gpuop.io/gputraining": "other", "team": "a"}})
    labels = render(body)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"]
    assert labels["gpuop.io/gputraining"] == "demo"
    assert labels["team"] == "a"


def test_the_job_records_what_it_was_created_from_within_the_annotation_budget() -> None:
    job = render(minimal(workers=3))
    record = json.loads(job["metadata"]["annotations"][CREATED_FROM_ANNOTATION])
    assert record == fixed_spec(parse(minimal(workers=3)).spec)
    assert "runPolicy" not in record  # mutable: patched onto the job, not fixed at creation
    huge = minimal(env=[{"name": f"BIG_{i}", "value": "x" * 30000} for i in range(3)])
    assert "annotations" not in render(huge)["metadata"]  # over 64 KiB: no record, the job still fits


def test_backoff_limit_counts_restarts_of_the_training_not_of_containers() -> None:
    """Kubeflow fails a job once the restartCounts of its running pods add up to backoffLimit,
    and one DDP failure restarts every pod: N restarts of a W-pod training need N*W + 1."""
    table = [(0, 2, 1), (1, 1, 2), (2, 2, 5), (3, 4, 13)]
    for restarts, pods, limit in table:
        assert kubeflow_backoff_limit(restarts, pods) == limit
    job = render_pytorchjob(parse(minimal(workers=3, runPolicy={"backoffLimit": 2})))
    assert job["spec"]["runPolicy"]["backoffLimit"] == 7


def test_checkpoints_in_a_bucket_mount_nothing_and_take_the_secret_as_the_environment() -> None:
    body = minimal(workers=2, checkpoint={"uri": "s3://team-ckpt/runs/", "secretName": "s3-creds"})
    for pod in pods(render(body)):
        container = pod["containers"][0]
        assert env_of(container)["GPUTRAIN_CHECKPOINT_DIR"] == "s3://team-ckpt/runs/demo"
        assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
        assert "checkpoints" not in {v["name"] for v in pod["volumes"]}
        assert "checkpoints" not in {m["name"] for m in container["volumeMounts"]}
    # Workload identity: no Secret named, nothing taken from one.
    for pod in pods(render(minimal(checkpoint={"uri": "gs://team-ckpt"}))):
        assert "envFrom" not in pod["containers"][0]
        assert env_of(pod["containers"][0])["GPUTRAIN_CHECKPOINT_DIR"] == "gs://team-ckpt/demo"


def test_outputs_to_a_bucket_keep_their_volume_and_name_the_upload_and_its_secret() -> None:
    body = minimal(
        output={"uri": "s3://team-models/runs", "secretName": "s3-creds", "volume": {"claimName": "out"}}
    )
    for pod in pods(render(body)):
        container = pod["containers"][0]
        env = env_of(container)
        assert (env["GPUTRAIN_OUTPUT_URI"], env["GPUTRAIN_OUTPUT_DIR"]) == (
            "s3://team-models/runs/demo",
            "/output/demo",
        )
        assert container["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
        assert "output" in {m["name"] for m in container["volumeMounts"]}
    # One Secret named twice is taken once; no uri, nothing to upload.
    both = minimal(checkpoint={"uri": "s3://bkt/c", "secretName": "s3-creds"},
                   output={"uri": "s3://bkt/m", "secretName": "s3-creds"})  # fmt: skip
    assert [p["containers"][0]["envFrom"] for p in pods(render(both))] == [
        [{"secretRef": {"name": "s3-creds"}}]
    ]
    # Set, to "", with no value (Kubernetes' typed clients drop a value of "": Kueue's update
    # of a TrainJob that had one was refused as changing its trainer).
    assert {"name": "GPUTRAIN_OUTPUT_URI"} in pods(render(minimal()))[0]["containers"][0]["env"]


def test_a_dataset_in_a_bucket_is_copied_by_an_init_step_into_a_cache_the_trainer_reads_only() -> None:
    """spec.dataset.uri: the dataset step (gputrain.fetch) in each pod, before the trainer, with
    the trainer's CPU and memory but no GPU, the dataset's Secret (the trainer gets none of it:
    a read-only key of another account must not become its checkpoint credentials), and the cache
    read-write for it; the trainer mounts the cache read-only. A claim is the cache when given,
    else an emptyDir."""
    body = minimal(gpusPerWorker=8, resources={"cpu": "8", "memory": "64Gi"},
                   dataset={"name": "imagefolder", "uri": "s3://team-data/imagenet", "secretName": "data-creds",
                            "volume": {"claimName": "imagenet-cache"}})  # fmt: skip
    for pod in pods(render(body, default_image="registry.example/gpuop/trainer:1")):
        [fetch] = pod["initContainers"]
        assert fetch["name"] == "fetch-dataset"
        assert fetch["command"] == ["python3", "-m", "gputrain.fetch"]
        assert fetch["args"] == ["s3://team-data/imagenet", "/data"]
        assert fetch["image"] == "registry.example/gpuop/trainer:1"
        assert fetch["resources"] == {
            "requests": {"cpu": "8", "memory": "64Gi"},
            "limits": {"memory": "64Gi"},
        }
        assert fetch["envFrom"] == [{"secretRef": {"name": "data-creds"}}]
        assert fetch["volumeMounts"] == [{"name": "data", "mountPath": "/data"}]
        trainer = pod["containers"][0]
        assert {"name": "data", "mountPath": "/data", "readOnly": True} in trainer["volumeMounts"]
        assert "envFrom" not in trainer
        assert {"name": "data", "persistentVolumeClaim": {"claimName": "imagenet-cache"}} in pod["volumes"]
    # No claim: an emptyDir; a custom command's step runs in the operator's trainer image.
    custom = minimal(image="team/own:1", command=["python", "train.py"],
                     dataset={"name": "imagefolder", "uri": "gs://team-data/x"})  # fmt: skip
    [pod] = pods(render(custom, default_image="registry.example/gpuop/trainer:1"))[:1]
    assert pod["initContainers"][0]["image"] == "registry.example/gpuop/trainer:1"
    assert "envFrom" not in pod["initContainers"][0]
    assert {"name": "data", "emptyDir": {}} in pod["volumes"]
    assert "initContainers" not in pods(render(minimal()))[0]
    # No Secret of its own: the trainer's (checkpoint's), for one store.
    shared = minimal(checkpoint={"uri": "s3://bkt/ckpt", "secretName": "s3-creds"},
                     dataset={"name": "imagefolder", "uri": "s3://bkt/data"})  # fmt: skip
    [pod] = pods(render(shared))[:1]
    assert (
        pod["initContainers"][0]["envFrom"]
        == pod["containers"][0]["envFrom"]
        == [{"secretRef": {"name": "s3-creds"}}]
    )
