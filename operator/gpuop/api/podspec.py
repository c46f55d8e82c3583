"""The parts of a GpuTraining spec that shape each trainer pod: resources, placement and
scheduling, NCCL, environment, security and pod metadata, with their defaults and rules.

Part of the spec model (:mod:`gpuop.api.spec` assembles it); Kubernetes' own rules for names,
labels and the like come from :mod:`gpuop._kits.k8svalidation`.
"""

from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar, Final, Literal

from gpuop._kits import k8svalidation
from gpuop._kits.schema import (
    Quantity,
    Rule,
    api_field,
    api_object,
)
from gpuop.api.identity import EFA_RESOURCE, GPU_RESOURCE

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
    # Where the training code reports progress (Kubeflow's variables, the operator's endpoint).
    "KUBEFLOW_TRAINER_SERVER_URL",
    "KUBEFLOW_TRAINER_SERVER_CA_CERT",
    "KUBEFLOW_TRAINER_SERVER_TOKEN",
)


RESERVED_ENV_PREFIXES: Final = ("GPUTRAIN_", "PET_", "TORCHELASTIC_", "NCCL_")


NCCL_ENV_PATTERN: Final = r"^(NCCL|TORCH_NCCL|FI|UCX)_[A-Z0-9_]+$"


ENV_NAME_PATTERN: Final = r"^[A-Za-z_][A-Za-z0-9_]*$"


K8S_NAME_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


K8S_NAME_HINT: Final = "a lowercase DNS name such as my-claim"


# NCCL_* is reserved too, with a rule of its own that says where those go.
_OPERATOR_PREFIXES: Final = tuple(p for p in RESERVED_ENV_PREFIXES if p != "NCCL_")


def _set_by_operator(name: str) -> bool:
    return name in RESERVED_ENV_NAMES or name.startswith(_OPERATOR_PREFIXES)


_OPERATOR_ENV_CEL: Final = (
    "!(self in ["
    + ", ".join(f"'{n}'" for n in RESERVED_ENV_NAMES)
    + "]) && "
    + " && ".join(f"!self.startsWith('{p}')" for p in _OPERATOR_PREFIXES)
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
        pattern=K8S_NAME_PATTERN,
        pattern_hint=K8S_NAME_HINT,
    )
    priority_class_name: str | None = api_field(
        "PriorityClass of the worker pods.",
        default=None,
        max_length=253,
        pattern=K8S_NAME_PATTERN,
        pattern_hint=K8S_NAME_HINT,
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
        "training-operator (its --gang-scheduler-name), which makes the job's PodGroup from it.",
        default=False,
    )
    scheduler_name: str | None = api_field(
        "Scheduler of the worker pods (their spec.schedulerName), e.g. volcano; empty: the "
        "cluster's default-scheduler. With gang on backend pytorchjob leave it empty: the "
        "training-operator fills in the scheduler its --gang-scheduler-name names; a different "
        "name is kept (the training-operator warns SetPodTemplateSchedulerName) and the pods "
        "are placed by that scheduler, not the gang scheduler.",
        default=None,
        max_length=253,
        pattern=K8S_NAME_PATTERN,
        pattern_hint="a lowercase DNS name such as volcano",
    )

    RULES: ClassVar[tuple[Rule, ...]] = (
        # Kubernetes' own scheduler places pods one by one: named with gang, the PodGroup would
        # be made and then ignored, and the all-or-nothing promise silently dropped.
        Rule(
            cel="!self.gang || !has(self.schedulerName) || self.schedulerName != 'default-scheduler'",
            message="default-scheduler does not gang-schedule: leave schedulerName empty with gang "
            "(the training-operator fills in its gang scheduler) or name your gang scheduler",
            check=lambda s: {} if s.gang and s.scheduler_name == "default-scheduler" else None,
            field=".schedulerName",
        ),
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
                message="{key} is not an NCCL_*, TORCH_NCCL_*, FI_* or UCX_* variable; put it in spec.env",
                check=lambda env: next(
                    ({"key": k} for k in env if not k8svalidation.fullmatch(NCCL_ENV_PATTERN, k)), None
                ),
                cel_words={"key": "a key"},
            ),
        ),
    )


@api_object
class KeyRef:
    """A key of a Secret or ConfigMap."""

    name: str = api_field(
        "Name of the Secret or ConfigMap.",
        max_length=253,
        pattern=K8S_NAME_PATTERN,
        pattern_hint=K8S_NAME_HINT,
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
            check=lambda s: None if (s.secret_key_ref is None) != (s.config_map_key_ref is None) else {},
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
                cel="!self.startsWith('NCCL_')",
                message="{name} is an NCCL setting: put it in spec.nccl.env",
                check=lambda name: {"name": name} if name.startswith("NCCL_") else None,
                cel_words={"name": "this variable"},
            ),
            Rule(
                cel=_OPERATOR_ENV_CEL,
                message="{name} is set by the operator and cannot be overridden; remove it",
                check=lambda name: {"name": name} if _set_by_operator(name) else None,
                cel_words={"name": "this variable"},
            ),
        ),
    )
    value: str | None = api_field("Literal value.", default=None, max_length=32768)
    value_from: EnvSource | None = api_field("Take the value from a Secret or ConfigMap key.", default=None)

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="has(self.value) != has(self.valueFrom)",
            message="set exactly one of value and valueFrom",
            check=lambda e: None if (e.value is None) != (e.value_from is None) else {},
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
