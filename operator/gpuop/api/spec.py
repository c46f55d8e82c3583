"""The GpuTraining API: the spec model, the one place that knows defaults and rules.

``parse(body)`` turns a GpuTraining object (from a file or from the API server) into a
frozen, typed, defaulted :class:`GpuTraining`, or raises :class:`SpecError` listing every
problem as ``<field path>: <rule> (got <value>)``. The CRD in ``crds/`` is generated from
these classes (``gpuop crd``), so ``kubectl explain`` reads the same descriptions and the API
server applies the same defaults and CEL rules.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Final, Literal

from gpuop._kits import k8svalidation
from gpuop._kits.quantity import parse_quantity
from gpuop._kits.schema import (
    Problem,
    Quantity,
    Rule,
    SpecError,
    api_field,
    api_object,
    decode,
    encode,
    json_name,
    show,
)
from gpuop.api.identity import API_VERSION, EFA_RESOURCE, GPU_RESOURCE, KIND
from gputrain.contract import DatasetName, ModelName, Precision

# The PyTorchJob is named after the GpuTraining, and the training-operator names a Service
# per pod "<job>-worker-<index>": a DNS-1035 label of at most 63 characters. 48 leaves room
# for "-worker-" and a 7-digit index.
MAX_NAME_LENGTH: Final = 48
NAME_PATTERN: Final = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

# Environment variables the pod's launch depends on. The operator and the training-operator
# set these; a user value would silently break the rendezvous or the trainer's settings.
RESERVED_ENV_NAMES: Final = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
)
# What may change on a created GpuTraining: the operator patches these onto the running
# PyTorchJob (runPolicy) or reads them on every check (stallTimeoutSeconds). Anything else
# would need new pods, and the CRD's transition rules refuse the change.
MUTABLE_SPEC_FIELDS: Final = ("runPolicy", "stallTimeoutSeconds")
RESERVED_ENV_PREFIXES: Final = ("GPUTRAIN_", "PET_", "TORCHELASTIC_", "NCCL_")
NCCL_ENV_PATTERN: Final = r"^(NCCL|TORCH_NCCL|FI|UCX)_[A-Z0-9_]+$"
ENV_NAME_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_]*$"

Backend = Literal["auto", "pytorchjob", "trainjob"]
JobBackend = Literal["pytorchjob", "trainjob"]  # what auto resolves to
_K8S_NAME: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_K8S_NAME_HINT: Final = "a lowercase DNS name such as my-claim"


def _reserved_env_name(name: str) -> str | None:
    if name.startswith("NCCL_"):
        return f"{name} is an NCCL setting: put it in spec.nccl.env"
    if name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIXES):
        return f"{name} is set by the operator and cannot be overridden; remove it"
    return None


_RESERVED_ENV_CEL: Final = (
    "!(self in ["
    + ", ".join(f"'{n}'" for n in RESERVED_ENV_NAMES)
    + "]) && "
    + " && ".join(f"!self.startsWith('{p}')" for p in RESERVED_ENV_PREFIXES)
)


@api_object
class VolumeSource:
    """A PersistentVolumeClaim to mount."""

    claim_name: str = api_field(
        "Name of a PersistentVolumeClaim in the GpuTraining's namespace. For multi-worker jobs "
        "it must be ReadWriteMany (or ReadOnlyMany for datasets).",
        min_length=1,
        max_length=253,
        pattern=_K8S_NAME,
        pattern_hint=_K8S_NAME_HINT,
    )
    sub_path: str | None = api_field(
        "Path inside the volume to mount instead of its root.", default=None, max_length=1024
    )


@api_object
class ExtendedResource:
    """A device a device plugin advertises on the nodes, e.g. an RDMA device."""

    name: str = api_field(
        "Resource name, with its domain: rdma/rdma_shared_device_a (the NVIDIA network operator's "
        "RDMA shared device plugin, for InfiniBand), or what your device plugin advertises.",
        min_length=1,
        max_length=317,
    )
    count: int = api_field("How many per worker pod (requested and limited alike).", minimum=1, maximum=1024)


# Resources other fields own: their own field says how many, and render writes them.
OWNED_RESOURCES: Final = ("cpu", "memory", "ephemeral-storage", GPU_RESOURCE, EFA_RESOURCE)


@api_object
class Resources:
    """CPU and memory for each worker pod, besides its GPUs, and other devices it needs."""

    cpu: Quantity | None = api_field(
        'CPU request per worker pod, e.g. "8". No CPU limit is set: throttling a training '
        "process stalls every rank that waits for it in a collective.",
        default=None,
    )
    memory: Quantity | None = api_field(
        "Memory request and limit per worker pod, e.g. 32Gi. The memory-backed /dev/shm counts against it.",
        default=None,
    )
    extended: tuple[ExtendedResource, ...] = api_field(
        "Other devices per worker pod, by the name their device plugin gives them: the InfiniBand "
        "(RDMA) device of the aks-infiniband profile, for one. GPUs are gpusPerWorker and EFA "
        "devices nccl.efaDevices.",
        default=(),
        max_items=16,
        list_map_key="name",
    )


@api_object
class Model:
    """The network the built-in trainer trains."""

    name: ModelName = api_field(
        "Model architecture: cnn (a small conv net), resnet18 or resnet50 (torchvision, "
        "randomly initialised).",
        default="cnn",
    )


@api_object
class Dataset:
    """The data the built-in trainer reads."""

    name: DatasetName = api_field(
        "Dataset: mnist or cifar10 (their standard files under path), imagefolder "
        "(path/train/<class>/*.jpg and path/val/<class>/*.jpg), digits (scikit-learn's 8x8 "
        "digits, shipped in the image) or synthetic (random tensors, for benchmarks)."
    )
    path: str = api_field(
        "Directory the dataset is read from inside the container. Never downloaded: the files must be there.",
        default="/data",
        min_length=1,
        max_length=1024,
        pattern=r"^/",
        pattern_hint="an absolute path",
    )
    volume: VolumeSource | None = api_field(
        "PersistentVolumeClaim holding the dataset, mounted read-only at path.", default=None
    )
    loader_workers: int = api_field(
        "DataLoader worker processes per training process. Also sizes /dev/shm when shmSize is not given.",
        default=4,
        minimum=0,
        maximum=64,
    )


@api_object
class Training:
    """Optimisation settings for the built-in trainer."""

    epochs: int = api_field("Passes over the training set.", default=10, minimum=1, maximum=100000)
    batch_size: int = api_field(
        "Samples per training process (one per GPU) per micro-step. The global batch is "
        "batchSize x gradientAccumulationSteps x processes.",
        default=64,
        minimum=1,
        maximum=65536,
    )
    learning_rate: float = api_field(
        "Peak learning rate of AdamW.", default=0.001, minimum=0, exclusive_minimum=True, maximum=10
    )
    precision: Precision = api_field(
        "Numeric precision: bf16 (autocast, GPU or CPU), fp16 (autocast with loss scaling, GPU "
        "only) or fp32.",
        default="bf16",
    )
    gradient_accumulation_steps: int = api_field(
        "Micro-steps whose gradients are summed before each optimizer step.",
        default=1,
        minimum=1,
        maximum=1024,
    )
    seed: int = api_field(
        "Random seed for initialisation, shuffling and augmentation.",
        default=0,
        minimum=0,
        maximum=2**31 - 1,
    )
    max_grad_norm: float = api_field(
        "Gradients are clipped to this global L2 norm; 0 disables clipping.",
        default=1.0,
        minimum=0,
        maximum=1e6,
    )
    channels_last: bool = api_field(
        "Use the channels_last memory format (faster convolutions on tensor cores).",
        default=False,
    )
    compile: bool = api_field("Compile the model with torch.compile.", default=False)
    log_every_steps: int = api_field(
        "Steps between progress reports (metrics, logs). Loss is read from the GPU only then.",
        default=20,
        minimum=1,
        maximum=100000,
    )


@api_object
class Checkpoint:
    """Checkpointing. Without a volume, checkpoints go to an emptyDir: they survive container
    restarts within a pod, not the pod's deletion."""

    volume: VolumeSource | None = api_field(
        "PersistentVolumeClaim for checkpoints, mounted read-write at path.", default=None
    )
    path: str = api_field(
        "Directory for checkpoints inside the container.",
        default="/checkpoints",
        min_length=1,
        max_length=1024,
        pattern=r"^/",
        pattern_hint="an absolute path",
    )
    every_steps: int = api_field(
        "Optimizer steps between checkpoints; one is also written at the end of every epoch.",
        default=500,
        minimum=1,
        maximum=10**9,
    )
    keep: int = api_field("Checkpoints kept; older ones are deleted.", default=3, minimum=1, maximum=100)


@api_object
class Output:
    """Where the final model and result are written."""

    volume: VolumeSource | None = api_field(
        "PersistentVolumeClaim for the final model and result JSON, mounted read-write at path. "
        "Without one they go to an emptyDir and only the termination message outlives the pod.",
        default=None,
    )
    path: str = api_field(
        "Directory for outputs inside the container.",
        default="/output",
        min_length=1,
        max_length=1024,
        pattern=r"^/",
        pattern_hint="an absolute path",
    )


@api_object
class Elastic:
    """Elastic training with torchrun's c10d rendezvous: the job keeps running when workers
    come and go between minWorkers and maxWorkers, restarting the worker group each time."""

    min_workers: int = api_field("Fewest workers the job runs with.", default=1, minimum=1, maximum=1024)
    max_workers: int = api_field("Most workers the job runs with.", minimum=1, maximum=1024)
    max_restarts: int = api_field(
        "Worker-group restarts torchrun allows before the job fails.",
        default=3,
        minimum=0,
        maximum=1000,
    )

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.minWorkers <= self.maxWorkers",
            message="minWorkers must be <= maxWorkers",
            check=lambda e: (
                None
                if e.min_workers <= e.max_workers
                else f"must be >= minWorkers ({e.min_workers}) (got {e.max_workers})"
            ),
            field=".maxWorkers",
        ),
    )


@api_object
class RunPolicy:
    """How the PyTorchJob runs and is cleaned up (Kubeflow's runPolicy)."""

    backoff_limit: int | None = api_field(
        "Times the training may fail and restart before it is marked Failed (0: never restart). One "
        "failure restarts every pod's container, and Kubeflow counts container restarts over all pods, "
        "so the PyTorchJob gets workers x this + 1.",
        default=None,
        minimum=0,
        maximum=1000,
    )
    active_deadline_seconds: int | None = api_field(
        "Seconds the job may run before it is terminated.", default=None, minimum=1, maximum=2**31 - 1
    )
    ttl_seconds_after_finished: int | None = api_field(
        "Seconds after the job finishes before Kubeflow deletes the PyTorchJob and its pods. "
        "The GpuTraining keeps its status and result, and its job is never made again.",
        default=None,
        minimum=0,
        maximum=2**31 - 1,
    )
    suspend: bool = api_field(
        "Suspend the job: its pods are deleted and re-created on resume. With "
        "scheduling.queueName, Kueue suspends and resumes the job instead and this is ignored.",
        default=False,
    )
    clean_pod_policy: Literal["None", "Running", "All"] = api_field(
        "Pods deleted when the job finishes: None keeps them (logs stay readable), Running "
        "deletes those still running, All deletes every pod.",
        default="None",
    )


@api_object
class Toleration:
    """A Kubernetes toleration."""

    key: str | None = api_field(
        "Taint key; empty with operator Exists matches every taint.", default=None, max_length=317
    )
    operator: Literal["Exists", "Equal"] = api_field(
        "Exists matches any value; Equal matches value.", default="Equal"
    )
    value: str | None = api_field("Taint value, for operator Equal.", default=None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = api_field(
        "Taint effect to tolerate; empty tolerates all effects.", default=None
    )
    toleration_seconds: int | None = api_field(
        "For NoExecute: seconds the pod stays bound after the taint appears.", default=None, minimum=0
    )


@api_object
class Scheduling:
    """Where and how the worker pods are scheduled."""

    queue_name: str | None = api_field(
        "Queue to submit to: the Kueue LocalQueue (label kueue.x-k8s.io/queue-name) and the "
        "gang scheduler's queue. The job is made suspended and Kueue resumes it on admission; "
        "until then the phase is Queued, with Kueue's reason in the Queued condition.",
        default=None,
        max_length=253,
        pattern=_K8S_NAME,
        pattern_hint=_K8S_NAME_HINT,
    )
    priority_class_name: str | None = api_field(
        "PriorityClass of the worker pods.",
        default=None,
        max_length=253,
        pattern=_K8S_NAME,
        pattern_hint=_K8S_NAME_HINT,
    )
    node_selector: Mapping[str, str] = api_field(
        "Extra node labels the worker pods must land on.",
        default_factory=lambda: MappingProxyType({}),
        max_properties=64,
        item_max_length=63,
    )
    tolerations: tuple[Toleration, ...] = api_field(
        "Extra tolerations for the worker pods (the nvidia.com/gpu taint is tolerated "
        "automatically when GPUs are requested).",
        default=(),
        max_items=64,
    )
    gang: bool = api_field(
        "All-or-nothing scheduling: sets runPolicy.schedulingPolicy.minAvailable to the worker "
        "count, for Volcano or the scheduler-plugins coscheduler configured in the "
        "training-operator.",
        default=False,
    )


@api_object
class Nccl:
    """NCCL settings for multi-node GPU communication."""

    profile: Literal["none", "eks-efa", "gke", "aks-infiniband"] = api_field(
        "Tuned NCCL environment for a cloud network: eks-efa (AWS Elastic Fabric Adapter, "
        "with the aws-ofi-nccl plugin in the image), gke (standard GKE pod networking on "
        "eth0), aks-infiniband (AKS ND-series InfiniBand) or none.",
        default="none",
    )
    efa_devices: int = api_field(
        "vpc.amazonaws.com/efa devices per worker (profile eks-efa); 0 requests none.",
        default=0,
        minimum=0,
        maximum=32,
    )
    debug: Literal["", "VERSION", "WARN", "INFO", "TRACE"] = api_field(
        "NCCL_DEBUG level; empty leaves NCCL's default.", default=""
    )
    env: Mapping[str, str] = api_field(
        "Extra NCCL_*, TORCH_NCCL_*, FI_* or UCX_* variables; they override the profile's.",
        default_factory=lambda: MappingProxyType({}),
        max_properties=64,
        item_max_length=4096,
        rules=(
            Rule(
                cel=f"self.all(k, k.matches('{NCCL_ENV_PATTERN}'))",
                message="keys must be NCCL_*, TORCH_NCCL_*, FI_* or UCX_* variable names",
                check=lambda env: next(
                    (
                        f"{k} is not an NCCL_*, TORCH_NCCL_*, FI_* or UCX_* variable; put it in spec.env"
                        for k in env
                        if not k8svalidation.fullmatch(NCCL_ENV_PATTERN, k)
                    ),
                    None,
                ),
            ),
        ),
    )


@api_object
class KeyRef:
    """A key of a Secret or ConfigMap."""

    name: str = api_field(
        "Name of the Secret or ConfigMap.", max_length=253, pattern=_K8S_NAME, pattern_hint=_K8S_NAME_HINT
    )
    key: str = api_field("Key within it.", min_length=1, max_length=253)
    optional: bool = api_field("Start the pod even when the key is missing.", default=False)


@api_object
class EnvSource:
    """Where an environment variable's value comes from."""

    secret_key_ref: KeyRef | None = api_field("A key of a Secret in the namespace.", default=None)
    config_map_key_ref: KeyRef | None = api_field("A key of a ConfigMap in the namespace.", default=None)

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="has(self.secretKeyRef) != has(self.configMapKeyRef)",
            message="set exactly one of secretKeyRef and configMapKeyRef",
            check=lambda s: (
                None
                if (s.secret_key_ref is None) != (s.config_map_key_ref is None)
                else "set exactly one of secretKeyRef and configMapKeyRef"
            ),
        ),
    )


@api_object
class EnvVar:
    """An environment variable for the training container."""

    name: str = api_field(
        "Variable name. Names the operator sets (GPUTRAIN_*, PET_*, MASTER_ADDR, RANK, ...) "
        "are refused; NCCL_* belong in spec.nccl.env.",
        min_length=1,
        max_length=256,
        pattern=ENV_NAME_PATTERN,
        pattern_hint="a C identifier such as WANDB_PROJECT",
        rules=(
            Rule(
                cel=_RESERVED_ENV_CEL,
                message="this name is set by the operator; NCCL_* belong in spec.nccl.env",
                check=_reserved_env_name,
            ),
        ),
    )
    value: str | None = api_field("Literal value.", default=None, max_length=32768)
    value_from: EnvSource | None = api_field("Take the value from a Secret or ConfigMap key.", default=None)

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="has(self.value) != has(self.valueFrom)",
            message="set exactly one of value and valueFrom",
            check=lambda e: (
                None
                if (e.value is None) != (e.value_from is None)
                else "set exactly one of value and valueFrom"
            ),
        ),
    )


@api_object
class SecurityContext:
    """Who the trainer processes run as. Always non-root: the pods meet the restricted Pod
    Security profile whatever is set here."""

    run_as_user: int = api_field(
        "UID of the trainer container. The default is the stock trainer image's user; set your custom "
        "image's.",
        default=1000,
        minimum=1,
        maximum=2147483647,
    )
    run_as_group: int = api_field("Primary GID of the trainer container.", default=1000, minimum=0,
                                  maximum=2147483647)  # fmt: skip
    fs_group: int = api_field(
        "GID that owns the pods' volumes (the checkpoint and output claims), so the trainer can write them.",
        default=1000,
        minimum=0,
        maximum=2147483647,
    )


@api_object
class PodMetadata:
    """Labels and annotations added to every worker pod."""

    labels: Mapping[str, str] = api_field(
        "Extra pod labels.",
        default_factory=lambda: MappingProxyType({}),
        max_properties=64,
        item_max_length=63,
    )
    annotations: Mapping[str, str] = api_field(
        'Extra pod annotations, e.g. sidecar.istio.io/inject: "false".',
        default_factory=lambda: MappingProxyType({}),
        max_properties=64,
        item_max_length=65536,
    )


@dataclasses.dataclass(frozen=True)
class _TrainJobGap:
    """A spec field a Kubeflow Trainer v2 TrainJob cannot carry per job (v2.3.0)."""

    field: str  # relative to spec, as the CRD's fieldPath wants it
    cel: str  # true when the spec uses the field
    used: Callable[[GpuTrainingSpec], bool]
    why: str

    def rule(self) -> Rule:
        refusal = f"cannot be used with backend trainjob: {self.why}"
        return Rule(
            cel=f"self.backend != 'trainjob' || !({self.cel})",
            message=f"spec{self.field} {refusal}",
            check=lambda s: refusal if s.backend == "trainjob" and self.used(s) else None,
            field=self.field,
        )


# What neither a TrainJob nor the TrainingRuntime made for it can say (Trainer v2.3.0).
TRAINJOB_GAPS: Final = (
    _TrainJobGap(
        ".elastic", "has(self.elastic)", lambda s: s.elastic is not None,
        "Trainer v2 has no elastic PyTorch yet; use backend pytorchjob or drop elastic",
    ),
    _TrainJobGap(
        ".scheduling.gang", "self.scheduling.gang", lambda s: s.scheduling.gang,
        "Trainer v2 gangs pods through a podGroupPolicy plugin chosen per cluster; use backend "
        "pytorchjob, or Kueue (scheduling.queueName), which admits the job whole",
    ),
    _TrainJobGap(
        ".runPolicy.ttlSecondsAfterFinished", "has(self.runPolicy.ttlSecondsAfterFinished)",
        lambda s: s.run_policy.ttl_seconds_after_finished is not None,
        "a TrainJob has no time-to-live (its JobSet's would delete the pods, not the TrainJob); use "
        "backend pytorchjob or drop it",
    ),
    _TrainJobGap(
        ".runPolicy.cleanPodPolicy", "self.runPolicy.cleanPodPolicy != 'None'",
        lambda s: s.run_policy.clean_pod_policy != "None",
        "a TrainJob's Jobs keep their finished pods, as cleanPodPolicy None; use backend pytorchjob "
        "or drop it",
    ),
)  # fmt: skip


def trainjob_gaps(spec: GpuTrainingSpec) -> tuple[str, ...]:
    """The fields this spec uses that a TrainJob cannot carry, e.g. ``spec.elastic``."""
    return tuple(f"spec{gap.field}" for gap in TRAINJOB_GAPS if gap.used(spec))


def trainjob_problems(spec: GpuTrainingSpec) -> list[Problem]:
    """:func:`trainjob_gaps` with the reason and the fix, one line each."""
    return [
        Problem(f"spec{gap.field}", f"cannot be used with backend trainjob: {gap.why}")
        for gap in TRAINJOB_GAPS
        if gap.used(spec)
    ]


def _fp16_needs_gpus(s: GpuTrainingSpec) -> str | None:
    if s.training.precision == "fp16" and not s.uses_gpus:
        return "fp16 needs GPUs (gpusPerWorker >= 1); use bf16 or fp32 on CPU"
    return None


def _workers_within_elastic(s: GpuTrainingSpec) -> str | None:
    e = s.elastic
    if e is not None and not e.min_workers <= s.workers <= e.max_workers:
        bounds = f"{e.min_workers}..{e.max_workers}"
        return f"must be within elastic.minWorkers..maxWorkers ({bounds}) (got {s.workers})"
    return None


def _args_need_command(s: GpuTrainingSpec) -> str | None:
    if s.args is not None and s.command is None:
        return "needs spec.command: args are passed to your command (the built-in trainer takes none)"
    return None


def _needs_dataset(s: GpuTrainingSpec) -> str | None:
    if s.dataset is None and s.command is None:
        return "required unless spec.command runs your own training code"
    return None


def _shm_within_memory(s: GpuTrainingSpec) -> str | None:
    memory = s.resources.memory
    if s.shm_size is None or memory is None:
        return None
    if parse_quantity(s.shm_size) >= parse_quantity(memory):
        return (
            f"must be smaller than resources.memory ({memory}): /dev/shm is memory-backed and "
            f"counts against it (got {s.shm_size})"
        )
    return None


def _efa_needs_profile(s: GpuTrainingSpec) -> str | None:
    if s.nccl.efa_devices > 0 and s.nccl.profile != "eks-efa":
        return f'efaDevices needs profile eks-efa (got "{s.nccl.profile}")'
    return None


@api_object
class GpuTrainingSpec:
    """What to train, on how many GPUs, and how."""

    backend: Backend = api_field(
        "The Kubeflow API that runs the training: pytorchjob (the v1 training-operator's "
        "PyTorchJob), trainjob (Kubeflow Trainer v2's TrainJob, against the operator's "
        "ClusterTrainingRuntime), or auto: what the cluster serves, PyTorchJob when it serves "
        "both. Chosen once, when the job is made; status.backend says which and why.",
        default="auto",
    )
    image: str | None = api_field(
        "Container image of the trainer. Defaults to the operator's configured trainer image.",
        default=None,
        min_length=1,
        max_length=512,
    )
    command: tuple[str, ...] | None = api_field(
        "Command to run instead of the built-in trainer (torchrun -m gputrain), for your own "
        "training code in your own image. The GPUTRAIN_* settings are still in the environment.",
        default=None,
        max_items=64,
        item_max_length=32768,
    )
    args: tuple[str, ...] | None = api_field(
        "Arguments to command.", default=None, max_items=256, item_max_length=32768
    )
    security_context: SecurityContext = api_field(
        "The UID and GIDs the trainer runs as (runAsUser, runAsGroup, fsGroup; 1000 by default).",
        default_factory=SecurityContext,
    )
    workers: int = api_field(
        "Worker pods: one Master and workers-1 Worker pods (elastic jobs: workers Worker pods).",
        default=1,
        minimum=1,
        maximum=1024,
    )
    gpus_per_worker: int = api_field(
        "nvidia.com/gpu per worker pod; one training process per GPU. 0 runs on CPU with the "
        "gloo backend (kind, CI).",
        default=1,
        minimum=0,
        maximum=16,
    )
    gpu_type: str | None = api_field(
        "GPU product to require, matched against the node label nvidia.com/gpu.product set by "
        "NVIDIA's GPU feature discovery, e.g. NVIDIA-A100-SXM4-80GB.",
        default=None,
        max_length=63,
        pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$",
        pattern_hint="a node label value such as NVIDIA-H100-80GB-HBM3",
    )
    resources: Resources = api_field("CPU and memory per worker pod.", default_factory=Resources)
    shm_size: Quantity | None = api_field(
        "Size of the memory-backed /dev/shm. Computed from DataLoader workers, batch size and "
        "GPUs when absent (the container default of 64Mi breaks NCCL and DataLoader workers).",
        default=None,
    )
    model: Model = api_field("Model for the built-in trainer.", default_factory=Model)
    dataset: Dataset | None = api_field(
        "Dataset for the built-in trainer. Required unless command is set.", default=None
    )
    training: Training = api_field("Optimisation settings.", default_factory=Training)
    checkpoint: Checkpoint = api_field("Checkpointing.", default_factory=Checkpoint)
    output: Output = api_field("Final model and result.", default_factory=Output)
    elastic: Elastic | None = api_field(
        "Elastic training between minWorkers and maxWorkers. Absent: a fixed-size job.", default=None
    )
    run_policy: RunPolicy = api_field("Run and cleanup policy.", default_factory=RunPolicy)
    scheduling: Scheduling = api_field("Pod placement and queueing.", default_factory=Scheduling)
    nccl: Nccl = api_field("NCCL tuning.", default_factory=Nccl)
    env: tuple[EnvVar, ...] = api_field(
        "Extra environment variables for the training container.",
        default=(),
        max_items=128,
        list_map_key="name",
    )
    service_account_name: str | None = api_field(
        "ServiceAccount of the worker pods, e.g. one bound to cloud storage (IRSA, Workload Identity).",
        default=None,
        max_length=253,
        pattern=_K8S_NAME,
        pattern_hint=_K8S_NAME_HINT,
    )
    image_pull_secrets: tuple[str, ...] = api_field(
        "Names of Secrets for pulling the image.", default=(), max_items=16, item_max_length=253
    )
    pod_metadata: PodMetadata = api_field(
        "Labels and annotations for the worker pods.", default_factory=PodMetadata
    )
    termination_grace_period_seconds: int = api_field(
        "Seconds a worker has after SIGTERM (preemption, eviction) to write its checkpoint.",
        default=120,
        minimum=1,
        maximum=3600,
    )
    stall_timeout_seconds: int = api_field(
        "A running job whose step counter has not moved for this long gets the Stalled "
        "condition (NCCL hangs, dead data loaders). 0 disables the check.",
        default=900,
        minimum=0,
        maximum=604800,
    )

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="self.training.precision != 'fp16' || self.gpusPerWorker > 0",
            message="fp16 needs GPUs (gpusPerWorker >= 1); use bf16 or fp32 on CPU",
            check=_fp16_needs_gpus,
            field=".training.precision",
        ),
        Rule(
            cel="!has(self.elastic) || "
            "(self.elastic.minWorkers <= self.workers && self.workers <= self.elastic.maxWorkers)",
            message="workers must be within elastic.minWorkers..maxWorkers",
            check=_workers_within_elastic,
            field=".workers",
        ),
        Rule(
            cel="has(self.dataset) || has(self.command)",
            message="dataset is required unless command is set",
            check=_needs_dataset,
            field=".dataset",
        ),
        Rule(
            cel="!has(self.args) || has(self.command)",
            message="args needs command (the built-in trainer takes no args)",
            check=_args_need_command,
            field=".args",
        ),
        Rule(
            cel="self.nccl.efaDevices == 0 || self.nccl.profile == 'eks-efa'",
            message="nccl.efaDevices needs nccl.profile eks-efa",
            check=_efa_needs_profile,
            field=".nccl.efaDevices",
        ),
        Rule(
            # The Kubernetes quantity library is in the CRD CEL environment from 1.29 on.
            cel="!has(self.shmSize) || !has(self.resources.memory) || "
            "quantity(string(self.shmSize)).isLessThan(quantity(string(self.resources.memory)))",
            message="shmSize must be smaller than resources.memory: /dev/shm counts against it",
            check=_shm_within_memory,
            field=".shmSize",
        ),
        *(gap.rule() for gap in TRAINJOB_GAPS),
    )

    @property
    def uses_gpus(self) -> bool:
        """Whether the pods ask for GPUs (else CPU training with gloo)."""
        return self.gpus_per_worker > 0

    @property
    def total_gpus(self) -> int:
        """GPUs the whole job holds while it runs."""
        return self.workers * self.gpus_per_worker

    @property
    def processes_per_worker(self) -> int:
        """Training processes torchrun starts in each pod: one per GPU, one on CPU."""
        return max(1, self.gpus_per_worker)

    @property
    def distributed_backend(self) -> Literal["nccl", "gloo"]:
        """torch.distributed's backend: NCCL between GPUs, gloo on CPU."""
        return "nccl" if self.uses_gpus else "gloo"


@dataclasses.dataclass(frozen=True)
class GpuTraining:
    """A parsed GpuTraining: identity from metadata, and the defaulted spec."""

    name: str
    namespace: str | None
    uid: str | None
    generation: int | None
    spec: GpuTrainingSpec


def kubernetes_problems(spec: GpuTrainingSpec) -> list[Problem]:
    """What the API server would refuse at the job or its pods, though the CRD's schema admits
    it: names, label keys and values, paths and mount paths by Kubernetes' own rules
    (:mod:`gpuop._kits.k8svalidation`). Checked here so that it is one line now, not a failed pod."""
    found: list[Problem] = []

    def check(path: str, problem: str | None, value: str) -> None:
        if problem is not None:
            found.append(Problem(path, f"{problem} (got {show(value)})"))

    def at(field: str, key: str) -> str:
        return f"{field}[{key if len(key) <= 40 else key[:37] + '...'}]"

    for key, value in spec.pod_metadata.labels.items():
        check(at("spec.podMetadata.labels", key), k8svalidation.qualified_name(key), key)
        check(at("spec.podMetadata.labels", key), k8svalidation.label_value(value), value)
    for key in spec.pod_metadata.annotations:
        check(at("spec.podMetadata.annotations", key), k8svalidation.qualified_name(key), key)
    for key, value in spec.scheduling.node_selector.items():
        check(at("spec.scheduling.nodeSelector", key), k8svalidation.qualified_name(key), key)
        check(at("spec.scheduling.nodeSelector", key), k8svalidation.label_value(value), value)
    for index, toleration in enumerate(spec.scheduling.tolerations):
        where = f"spec.scheduling.tolerations[{index}]"
        if toleration.key:
            check(f"{where}.key", k8svalidation.qualified_name(toleration.key), toleration.key)
        if toleration.operator == "Exists" and toleration.value:
            found.append(
                Problem(f"{where}.value", "must be empty with operator Exists (which matches any value)")
            )
    for index, device in enumerate(spec.resources.extended):
        where = f"spec.resources.extended[{index}].name"
        if device.name in OWNED_RESOURCES or device.name.startswith("hugepages-"):
            found.append(Problem(where, f"{device.name} is set by its own field (gpusPerWorker, "
                                        "nccl.efaDevices, resources.cpu or memory), not here"))  # fmt: skip
        elif "/" not in device.name or device.name.split("/")[0].endswith("kubernetes.io"):
            found.append(Problem(where, "must be an extended resource: a domain other than kubernetes.io, "
                                        f"'/', a name (got {show(device.name)})"))  # fmt: skip
        else:
            check(where, k8svalidation.qualified_name(device.name), device.name)
    for index, secret in enumerate(spec.image_pull_secrets):
        check(f"spec.imagePullSecrets[{index}]", k8svalidation.subdomain(secret), secret)
    mounts: dict[str, str] = {"/dev/shm": "the shared-memory volume"}
    places = [("spec.checkpoint", spec.checkpoint.path, spec.checkpoint.volume),
              ("spec.output", spec.output.path, spec.output.volume)]  # fmt: skip
    if spec.dataset is not None:
        places.append(("spec.dataset", spec.dataset.path, spec.dataset.volume))
    for where, path, volume in places:
        check(f"{where}.path", k8svalidation.mount_path(path), path)
        if volume is not None and volume.sub_path is not None:
            check(f"{where}.volume.subPath", k8svalidation.sub_path(volume.sub_path), volume.sub_path)
        if where == "spec.dataset" and volume is None:
            continue  # read from the image: no volume is mounted there
        key = path.rstrip("/") or "/"
        if key in mounts:
            found.append(
                Problem(f"{where}.path", f"{path} is also {mounts[key]}; each needs a directory of its own")
            )
        mounts[key] = f"{where}.path"
    return found


def warnings(spec: GpuTrainingSpec) -> list[Problem]:
    """What is valid but likely not what the user wants: each a line `gpuop validate` and
    `gpuop render` print (the training still runs as written)."""
    found = []
    if spec.output.volume is None and spec.command is None:
        found.append(Problem("spec.output.volume", "not set: the trained model is written to an emptyDir and "
                             "lost with the pod (only the result in the termination message stays); set "
                             "output.volume.claimName to keep it"))  # fmt: skip
    return found


_TOP_LEVEL: Final = frozenset({"apiVersion", "kind", "metadata", "spec", "status"})


def parse(body: Mapping[str, Any]) -> GpuTraining:
    """A GpuTraining object as typed, defaulted values; raises :class:`SpecError`.

    Checks what the API server would (schema, defaults, CEL rules), and also refuses
    unknown fields, which the API server would silently prune: a typo such as ``trainng``
    must not quietly train with defaults. ``gpuop validate`` on a laptop and the operator in
    a cluster thus refuse the same objects with the same messages.
    """
    problems: list[Problem] = []
    if not isinstance(body, Mapping):
        raise SpecError([Problem("(document)", "must be a GpuTraining object (got a non-object)")])
    # The API server prunes unknown top-level fields; a file that has one meant something else.
    problems.extend(Problem(str(key), "unknown field") for key in body if key not in _TOP_LEVEL)
    for key, expected in (("apiVersion", API_VERSION), ("kind", KIND)):
        got = body.get(key)
        if got is None:
            problems.append(Problem(key, f"required: {expected}"))
        elif got != expected:
            problems.append(Problem(key, f'must be {expected} (got "{got}")'))
    if problems:  # another kind of object: its fields mean nothing here
        raise SpecError(problems)

    metadata = body.get("metadata")
    if not isinstance(metadata, Mapping):
        metadata = {}
    name = metadata.get("name")
    problems.extend(_check_name(name))
    spec: GpuTrainingSpec | None = None
    if body.get("spec") is None:
        problems.append(Problem("spec", "required"))
    else:
        try:
            spec = decode(GpuTrainingSpec, body["spec"], "spec")
        except SpecError as exc:
            problems.extend(exc.problems)
    if spec is not None:
        problems.extend(kubernetes_problems(spec))
    if problems or spec is None:
        raise SpecError(problems)
    namespace = metadata.get("namespace")
    uid = metadata.get("uid")
    generation = metadata.get("generation")
    return GpuTraining(
        name=str(name),
        namespace=namespace if isinstance(namespace, str) else None,
        uid=uid if isinstance(uid, str) else None,
        generation=generation if isinstance(generation, int) else None,
        spec=spec,
    )


def _name_problem(name: str) -> str | None:
    if len(name) > MAX_NAME_LENGTH:
        return (
            f"must be at most {MAX_NAME_LENGTH} characters (got {len(name)}): it names the "
            "PyTorchJob and its per-pod Services"
        )
    if not k8svalidation.fullmatch(NAME_PATTERN, name):
        return (
            "must be a DNS-1035 label: lowercase letters, digits and '-', starting with a "
            f"letter (got {show(name)})"
        )
    return None


# A root rule of the CRD, where CEL may read metadata.name; its check takes the name itself.
NAME_RULE: Final = Rule(
    cel=f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{NAME_PATTERN}')",
    message=f"metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting "
    f"with a letter) of at most {MAX_NAME_LENGTH} characters: it names the PyTorchJob and its pods",
    check=_name_problem,
    field=".metadata.name",
)


def _check_name(name: object) -> list[Problem]:
    if not isinstance(name, str) or not name:
        return [Problem("metadata.name", "required")]
    message = NAME_RULE.check(name)
    return [] if message is None else [Problem("metadata.name", message)]


# --------------------------------------------------------------------------------------------
# Fields fixed at creation: what the PyTorchJob was made from, and what changed since.


def fixed_spec(spec: GpuTrainingSpec, mutable: tuple[str, ...] = MUTABLE_SPEC_FIELDS) -> dict[str, Any]:
    """The spec without what may change on a made job, as JSON: what the job is made of.

    ``mutable``: dotted field paths, each backend's own (a TrainJob's is narrower: of runPolicy
    only suspend, as its activeDeadlineSeconds is immutable and its backoffLimit is in the
    TrainingRuntime, made once).
    """
    document: dict[str, Any] = encode(spec)
    for path in mutable:
        *parents, leaf = path.split(".")
        node = document
        for parent in parents:
            node = node.get(parent) or {}
        node.pop(leaf, None)
    return document


def fixed_spec_record(spec: GpuTrainingSpec, mutable: tuple[str, ...] = MUTABLE_SPEC_FIELDS) -> str:
    """:func:`fixed_spec` as the compact JSON a job carries (read by :func:`fixed_spec_changes`)."""
    return json.dumps(fixed_spec(spec, mutable), separators=(",", ":"), sort_keys=True)


def fixed_spec_changes(record: str, spec: GpuTrainingSpec) -> tuple[str, ...]:
    """The fixed fields that differ between what a job was created from and ``spec`` now.

    The CRD's transition rules refuse such changes; this catches those that got past a CRD
    without them (applied before the CRD was upgraded). ``record`` (from
    :func:`fixed_spec_record`) is decoded with today's model, so a field added by an operator
    upgrade takes its default on both sides and is no change. One entry per leaf, e.g.
    ``spec.workers (2 -> 4)``; nothing when the record cannot be read (not JSON, or written by
    a newer operator).
    """
    try:
        created_from = json.loads(record)
        if not isinstance(created_from, dict):
            return ()
        before = decode(GpuTrainingSpec, created_from, "spec")
    except (ValueError, SpecError):
        return ()
    changes: list[str] = []
    for field in dataclasses.fields(GpuTrainingSpec):
        key = json_name(field.name)
        if key not in MUTABLE_SPEC_FIELDS:
            _diff(getattr(before, field.name), getattr(spec, field.name), f"spec.{key}", changes)
    if "runPolicy" in created_from:  # a TrainJob's record: of runPolicy, only suspend may change
        made = dataclasses.replace(before.run_policy, suspend=spec.run_policy.suspend)
        _diff(made, spec.run_policy, "spec.runPolicy", changes)
    return tuple(changes)


def _diff(before: Any, after: Any, path: str, out: list[str]) -> None:
    if before == after:
        return
    if dataclasses.is_dataclass(before) and type(before) is type(after):
        for field in dataclasses.fields(before):
            _diff(
                getattr(before, field.name),
                getattr(after, field.name),
                f"{path}.{json_name(field.name)}",
                out,
            )
        return
    show = all(isinstance(v, (int, float, str, bool, type(None))) for v in (before, after))
    out.append(f"{path} ({_shown(before)} -> {_shown(after)})" if show else path)


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)
