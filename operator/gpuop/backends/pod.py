"""The trainer pod every backend renders: container, env, resources, volumes, placement,
security, metadata. Pure, small functions.

Nothing here talks to a cluster or reads the clock: the same GpuTraining always renders the
same pod, byte for byte, which is what makes golden-file tests and idempotent
create-or-adopt possible. The env part (:func:`trainer_env`) is also what the local run
mode gives torchrun on a laptop. Each backend (:mod:`gpuop.backends.pytorchjob`,
:mod:`gpuop.backends.trainjob`, :mod:`gpuop.backends.job`) wraps this pod in its own job. NCCL's
settings and /dev/shm's size are :mod:`gpuop.backends.nccl`'s, the wiring to the report
endpoint :mod:`gpuop.backends.reportwiring`'s.
"""

from __future__ import annotations

from typing import Any, Final

from gpuop._kits.quantity import format_bytes, parse_quantity
from gpuop.api.fixed import fixed_spec_record
from gpuop.api.identity import (
    API_VERSION,
    CREATED_FROM_ANNOTATION,
    DEFAULT_CONTAINER_ANNOTATION,
    EFA_RESOURCE,
    FETCH_CONTAINER,
    GPU_RESOURCE,
    KIND,
    KUEUE_QUEUE_LABEL,
    TRAINING_LABEL,
    report_ca_config_map,
)
from gpuop.api.podspec import Toleration
from gpuop.api.runspec import VolumeSource
from gpuop.api.spec import GpuTraining, GpuTrainingSpec, dataset_secret, store_secret
from gpuop.backends import nccl
from gpuop.backends.reportwiring import ReportEndpoint, TrainingReports, report_env, report_volume
from gputrain.contract import (
    METRICS_PORT,
    TERMINATION_LOG,
    TrainerSettings,
)

GPU_PRODUCT_LABEL: Final = "nvidia.com/gpu.product"
_CREATED_FROM_MAX_BYTES: Final = 64 * 1024
DATA_VOLUME: Final = "data"  # the dataset's volume: its claim, or the dataset step's cache


def report_ca_object(training: GpuTraining, endpoint: ReportEndpoint) -> dict[str, Any]:
    """The ConfigMap that carries the endpoint's CA into the training's namespace (a pod can
    mount nothing from the operator's), owned by the training so it goes with it."""
    metadata = object_metadata(training, labels(training.name))
    metadata["name"] = report_ca_config_map(training.name)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata,
        "data": {"ca.crt": endpoint.ca_pem},
    }


def trainer_settings(name: str, spec: GpuTrainingSpec) -> TrainerSettings:
    """The contract values the trainer reads, from the spec.

    Checkpoints and outputs go to a directory named after the job, so several jobs can share
    one volume, and a job re-created under the same name resumes from its checkpoints.
    """
    dataset = spec.dataset
    return TrainerSettings(
        job_name=name,
        model=spec.model.name,
        # A custom command may train without a built-in dataset; the setting is then moot.
        dataset=dataset.name if dataset is not None else "synthetic",
        data_dir=dataset.path if dataset is not None else "/data",
        epochs=spec.training.epochs,
        batch_size=spec.training.batch_size,
        learning_rate=spec.training.learning_rate,
        precision=spec.training.precision,
        grad_accum_steps=spec.training.gradient_accumulation_steps,
        seed=spec.training.seed,
        max_grad_norm=spec.training.max_grad_norm,
        channels_last=spec.training.channels_last,
        compile=spec.training.compile,
        loader_workers=dataset.loader_workers if dataset is not None else 0,
        log_every_steps=spec.training.log_every_steps,
        checkpoint_dir=f"{(spec.checkpoint.uri or spec.checkpoint.path).rstrip('/')}/{name}",
        checkpoint_every_steps=spec.checkpoint.every_steps,
        checkpoint_keep=spec.checkpoint.keep,
        output_dir=f"{spec.output.path.rstrip('/')}/{name}",
        output_uri=f"{spec.output.uri.rstrip('/')}/{name}" if spec.output.uri is not None else "",
        backend=spec.distributed_backend,
        metrics_port=METRICS_PORT,
    )


def trainer_env(
    name: str, spec: GpuTrainingSpec, reports: TrainingReports | None = None
) -> list[dict[str, Any]]:
    """The container's environment, in a fixed order: contract, NCCL, reports, runtime, user."""
    env: dict[str, str] = dict(trainer_settings(name, spec).to_env())
    env.update(nccl.nccl_env(spec))
    if reports is not None:
        env.update(report_env(reports))
    user_names = {e.name for e in spec.env}
    if not spec.uses_gpus and spec.resources.cpu is not None and "OMP_NUM_THREADS" not in user_names:
        # torchrun sets OMP_NUM_THREADS=1 when unset, which starves a CPU (gloo) trainer.
        env["OMP_NUM_THREADS"] = str(max(1, int(parse_quantity(spec.resources.cpu))))
    if spec.elastic is not None:
        # After a restart the agent's shared TCPStore still holds the previous attempt's
        # keys and the new group fails to connect (pytorch/pytorch#135712).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return [env_var(k, v) for k, v in env.items()] + user_env(spec)


def env_var(name: str, value: str) -> dict[str, str]:
    """One variable of a container's env. An empty value is left out, which Kubernetes reads the
    same (the variable is set, to ""): its typed clients drop a value of "" when they send the
    object back, and the real Kueue, unsuspending a TrainJob so, was refused by Trainer as
    changing the TrainJob's immutable trainer."""
    return {"name": name, "value": value} if value else {"name": name}


def user_env(spec: GpuTrainingSpec) -> list[dict[str, Any]]:
    """spec.env as a container's env: the trainer's last (they win), and the dataset step's
    (a proxy, a region, a CA bundle the store needs)."""
    rendered: list[dict[str, Any]] = []
    for var in spec.env:
        if var.value_from is not None:
            source = var.value_from
            ref = source.secret_key_ref or source.config_map_key_ref
            assert ref is not None  # the spec model admits exactly one
            kind = "secretKeyRef" if source.secret_key_ref is not None else "configMapKeyRef"
            entry: dict[str, Any] = {"name": ref.name, "key": ref.key}
            if ref.optional:
                entry["optional"] = True
            rendered.append({"name": var.name, "valueFrom": {kind: entry}})
        else:
            rendered.append(env_var(var.name, var.value or ""))
    return rendered


def labels(name: str) -> dict[str, str]:
    """Labels on the PyTorchJob and its pods; the operator selects training pods by them."""
    return {
        "app.kubernetes.io/name": "gputraining",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": "gpu-training-operator",
        TRAINING_LABEL: name,
    }


def resources(spec: GpuTrainingSpec) -> dict[str, Any]:
    requests: dict[str, str] = {}
    limits: dict[str, str | int] = {}
    if spec.resources.cpu is not None:
        requests["cpu"] = str(spec.resources.cpu)
    if spec.resources.memory is not None:
        requests["memory"] = limits["memory"] = str(spec.resources.memory)
    if spec.uses_gpus:
        limits[GPU_RESOURCE] = spec.gpus_per_worker
    if spec.nccl.efa_devices > 0:
        limits[EFA_RESOURCE] = spec.nccl.efa_devices
    for device in spec.resources.extended:
        limits[device.name] = device.count  # extended resources: the request is the limit
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _claim(claim: VolumeSource, read_only: bool) -> dict[str, Any]:
    source: dict[str, Any] = {"claimName": claim.claim_name}
    if read_only:
        source["readOnly"] = True
    return {"persistentVolumeClaim": source}


def _mount(name: str, path: str, claim: VolumeSource | None, read_only: bool = False) -> dict[str, Any]:
    mount: dict[str, Any] = {"name": name, "mountPath": path}
    if claim is not None and claim.sub_path:
        mount["subPath"] = claim.sub_path
    if read_only:
        mount["readOnly"] = True
    return mount


def volumes(spec: GpuTrainingSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Volumes and the container's mounts: shm, checkpoints, output, and the dataset."""
    shm = format_bytes(nccl.shm_size_bytes(spec))
    pod_volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    places = [("output", spec.output.volume, spec.output.path)]
    if spec.checkpoint.uri is None:  # else they go to the bucket: nothing to mount
        places.insert(0, ("checkpoints", spec.checkpoint.volume, spec.checkpoint.path))
    for name, claim, path in places:
        pod_volumes.append({"name": name, **(_claim(claim, False) if claim else {"emptyDir": {}})})
        mounts.append(_mount(name, path, claim))
    dataset = spec.dataset
    if dataset is not None and dataset.uri is not None:
        # The copy's cache: the claim, read-write for the fetch step (it writes there first), or
        # an emptyDir; the trainer reads it only.
        cache = _claim(dataset.volume, False) if dataset.volume is not None else {"emptyDir": {}}
        pod_volumes.append({"name": DATA_VOLUME, **cache})
        mounts.append(_mount(DATA_VOLUME, dataset.path, dataset.volume, read_only=True))
    elif dataset is not None and dataset.volume is not None:
        pod_volumes.append({"name": DATA_VOLUME, **_claim(dataset.volume, True)})
        mounts.append(_mount(DATA_VOLUME, dataset.path, dataset.volume, read_only=True))
    return pod_volumes, mounts


def fetch_container(spec: GpuTrainingSpec, image: str) -> dict[str, Any] | None:
    """The dataset step (gputrain.fetch): spec.dataset.uri copied into dataset.path before the
    trainer starts, with the trainer's CPU and memory (no GPU limit: it uses none; the pod holds
    its GPUs meanwhile all the same) and the dataset's credentials. None without a dataset uri."""
    dataset = spec.dataset
    if dataset is None or dataset.uri is None:
        return None
    requests = resources(spec).get("requests", {})
    limits = {k: v for k, v in resources(spec).get("limits", {}).items() if k == "memory"}
    container: dict[str, Any] = {
        "name": FETCH_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", "gputrain.fetch"],
        "args": [dataset.uri, dataset.path],
        "resources": {k: v for k, v in (("requests", requests), ("limits", limits)) if v},
        "volumeMounts": [_mount(DATA_VOLUME, dataset.path, dataset.volume)],
        "securityContext": container_security_context(spec),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if spec.env:
        container["env"] = user_env(spec)
    if (secret := dataset_secret(spec)) is not None:
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    return container


def _toleration(t: Toleration) -> dict[str, Any]:
    out: dict[str, Any] = {"operator": t.operator}
    if t.key is not None:
        out["key"] = t.key
    if t.value is not None:
        out["value"] = t.value
    if t.effect is not None:
        out["effect"] = t.effect
    if t.toleration_seconds is not None:
        out["tolerationSeconds"] = t.toleration_seconds
    return out


def container_security_context(spec: GpuTrainingSpec) -> dict[str, Any]:
    """The trainer container's: no privilege escalation, no capabilities (IPC_LOCK for RDMA)."""
    capabilities: dict[str, Any] = {"drop": ["ALL"]}
    if spec.nccl.profile == "aks-infiniband" and spec.uses_gpus:
        # RDMA pins (locks) buffer memory; without IPC_LOCK, ibv_reg_mr fails.
        capabilities["add"] = ["IPC_LOCK"]
    return {"allowPrivilegeEscalation": False, "capabilities": capabilities, "runAsNonRoot": True}


def pod_security_context(spec: GpuTrainingSpec) -> dict[str, Any]:
    """The pod's: Kubernetes' restricted profile, as the spec's non-root user."""
    identity = spec.security_context
    return {
        "runAsNonRoot": True,
        "runAsUser": identity.run_as_user,
        "runAsGroup": identity.run_as_group,
        "fsGroup": identity.fs_group,  # so the checkpoint and output volumes are writable
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def placement(spec: GpuTrainingSpec) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """The pods' nodeSelector and tolerations: the user's, plus what GPUs need."""
    node_selector = dict(spec.scheduling.node_selector)
    tolerations = [_toleration(t) for t in spec.scheduling.tolerations]
    if spec.uses_gpus:
        if spec.gpu_type is not None:
            node_selector[GPU_PRODUCT_LABEL] = spec.gpu_type
        # GPU node pools on EKS, GKE and AKS taint their nodes with nvidia.com/gpu.
        tolerations.insert(0, {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return node_selector, tolerations


def pod_metadata(name: str, spec: GpuTrainingSpec) -> dict[str, Any]:
    """The pods' labels and annotations: the user's, and ours, which win."""
    metadata: dict[str, Any] = {"labels": {**spec.pod_metadata.labels, **labels(name)}}
    if spec.pod_metadata.annotations:
        metadata["annotations"] = dict(spec.pod_metadata.annotations)
    return metadata


def fetch_image(spec: GpuTrainingSpec, default_image: str) -> str:
    """The dataset step's image: the trainer's when it is ours (spec.image is then a build of
    it), else the operator's trainer image, which has gputrain (a user's image may not)."""
    return spec.image or default_image if spec.command is None else default_image


def trainer_container(
    name: str,
    spec: GpuTrainingSpec,
    image: str,
    *,
    container_name: str,
    launch: tuple[list[str], list[str] | None],
    ports: list[dict[str, Any]],
    reports: TrainingReports | None = None,
) -> dict[str, Any]:
    """The training container, either backend: each names it and launches torchrun its way."""
    command, args = launch
    container: dict[str, Any] = {
        "name": container_name,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
    }
    if args is not None:
        container["args"] = args
    container.update(
        {
            "env": trainer_env(name, spec, reports),
            "ports": ports,
            "resources": resources(spec),
            "volumeMounts": volumes(spec)[1] + ([report_volume(reports)[1]] if reports is not None else []),
            "securityContext": container_security_context(spec),
            "terminationMessagePath": TERMINATION_LOG,
            # A trainer that dies before writing its result still leaves its last log lines.
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }
    )
    if (secret := store_secret(spec)) is not None:
        # The store's credentials, under the names the cloud SDKs read (spec.checkpoint, spec.output).
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    return container


def torchrun_launch(spec: GpuTrainingSpec) -> tuple[list[str], list[str] | None]:
    """Command and args of the training container where the job's pods meet at a master (a
    PyTorchJob's, a Job's) or, elastic, at a c10d rendezvous; the spec's own command as it is.
    torchrun reads the node count and rank from PET_NNODES and PET_NODE_RANK; the address is
    given as MASTER_ADDR/MASTER_PORT, which Kubernetes expands from the container's env."""
    if spec.command is not None:
        return list(spec.command), list(spec.args) if spec.args is not None else None
    args = [f"--nproc-per-node={spec.processes_per_worker}"]
    if spec.elastic is None:
        args += ["--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)"]
    args += ["-m", "gputrain"]
    return ["torchrun"], args


def pod_template(
    name: str,
    spec: GpuTrainingSpec,
    container: dict[str, Any],
    reports: TrainingReports | None = None,
    *,
    fetch_image: str,
) -> dict[str, Any]:
    """The pod template around the training container, either backend; ``fetch_image`` runs the
    dataset step, where there is one."""
    node_selector, tolerations = placement(spec)
    pod: dict[str, Any] = {
        "securityContext": pod_security_context(spec),
        # The trainer never calls the Kubernetes API.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.termination_grace_period_seconds,
        # The pod's pause process is PID 1, not torchrun. The kernel drops a signal to a PID
        # namespace's init that set no handler, and torchrun sets its SIGTERM handler only once
        # it starts its workers: as PID 1, a torchrun still in its rendezvous (a peer gone or
        # not yet up) ignored the SIGTERM of a suspend, an eviction or a preemption and held the
        # pod, and its GPUs, the whole grace period until SIGKILL. Shared, it stops at once.
        # (The pause process also reaps DataLoader workers' orphans.) The cost: the pod's
        # containers see each other's processes, and ours are the trainer and the dataset step.
        "shareProcessNamespace": True,
    }
    if spec.service_account_name is not None:
        pod["serviceAccountName"] = spec.service_account_name
    if spec.scheduling.priority_class_name is not None:
        pod["priorityClassName"] = spec.scheduling.priority_class_name
    if spec.scheduling.scheduler_name is not None:
        # Left out, a gang-scheduling training-operator writes its own scheduler's name here.
        pod["schedulerName"] = spec.scheduling.scheduler_name
    if node_selector:
        pod["nodeSelector"] = node_selector
    if tolerations:
        pod["tolerations"] = tolerations
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    if (fetch := fetch_container(spec, fetch_image)) is not None:
        pod["initContainers"] = [fetch]
    pod["containers"] = [container]
    pod["volumes"] = volumes(spec)[0] + ([report_volume(reports)[0]] if reports is not None else [])
    metadata = pod_metadata(name, spec)
    # The trainer's name, for observe and for `kubectl logs`: each backend names it its own way.
    annotations = {**metadata.get("annotations", {}), DEFAULT_CONTAINER_ANNOTATION: container["name"]}
    metadata["annotations"] = annotations
    return {"metadata": metadata, "spec": pod}


def kubeflow_backoff_limit(restarts: int, pods: int) -> int:
    """Kubeflow's backoffLimit for ``restarts`` restarts of the training.

    The training-operator sums the restartCount of every container of every running pod and
    fails the job once that sum reaches its backoffLimit (pkg/core/job.go, PastBackoffLimit).
    One failure of a DDP job restarts every pod's container (a rank that dies takes its
    peers' collectives with it), so it costs ``pods``, and reaching the limit is already
    failure: ``restarts`` restarts need ``restarts * pods + 1``. Found on the real
    training-operator: the kind example's ``backoffLimit: 2`` failed on its first restart.
    """
    return restarts * pods + 1


def job_suspended(spec: GpuTrainingSpec) -> bool:
    """Whether the job is made suspended.

    With a Kueue queue it always is, and Kueue resumes it on admission (its webhook would
    suspend it anyway, and without the webhook an unsuspended job would start outside its
    quota); from then on suspend is Kueue's (gpuop.controller.reconciler never patches it).
    """
    return True if spec.scheduling.queue_name is not None else spec.run_policy.suspend


def owner_reference(training: GpuTraining) -> dict[str, Any] | None:
    """The PyTorchJob's owner reference, so deleting the GpuTraining garbage-collects it."""
    if training.uid is None:
        return None
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": training.name,
        "uid": training.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_metadata(
    training: GpuTraining, object_labels: dict[str, str], annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    """The metadata of an object made for a training: its name and namespace, owned by it."""
    metadata: dict[str, Any] = {"name": training.name}
    if training.namespace is not None:
        metadata["namespace"] = training.namespace
    metadata["labels"] = object_labels
    if annotations:
        metadata["annotations"] = annotations
    owner = owner_reference(training)
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return metadata


def job_metadata(training: GpuTraining, mutable_fields: tuple[str, ...]) -> dict[str, Any]:
    """A job's metadata, any kind: our labels, Kueue's queue, the owner, and the record of the
    spec it is made from (all but ``mutable_fields``, what may change on it once made)."""
    spec = training.spec
    job_labels = labels(training.name)
    if spec.scheduling.queue_name is not None:
        job_labels[KUEUE_QUEUE_LABEL] = spec.scheduling.queue_name
    created_from = fixed_spec_record(spec, mutable_fields)
    # Annotations share a 256 KiB budget; a spec with huge env values goes without the record
    # (and without the SpecNotApplied check) rather than fail to create its job.
    record = {CREATED_FROM_ANNOTATION: created_from} if len(created_from) <= _CREATED_FROM_MAX_BYTES else None
    return object_metadata(training, job_labels, record)
