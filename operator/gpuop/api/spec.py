"""The GpuTraining API: the spec model, the one place that knows defaults and rules.

``parse(body)`` turns a GpuTraining object (from a file or from the API server) into a
frozen, typed, defaulted :class:`GpuTraining`, or raises :class:`SpecError` listing every
problem as ``<field path>: <rule> (got <value>)``. The CRD in ``crds/`` is generated from
these classes (``gpuop crd``), so ``kubectl explain`` reads the same descriptions and the API
server applies the same defaults and CEL rules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
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
    show,
)
from gpuop.api.identity import API_VERSION, KIND
from gpuop.api.podspec import (
    K8S_NAME_HINT,
    K8S_NAME_PATTERN,
    OWNED_RESOURCES,
    EnvVar,
    Nccl,
    PodMetadata,
    Resources,
    Scheduling,
    SecurityContext,
)
from gpuop.api.runspec import Checkpoint, Dataset, Elastic, Model, Output, RunPolicy, Training

# The PyTorchJob is named after the GpuTraining, and the training-operator names a Service
# per pod "<job>-worker-<index>": a DNS-1035 label of at most 63 characters. 48 leaves room
# for "-worker-" and a 7-digit index.
MAX_NAME_LENGTH: Final = 48
NAME_PATTERN: Final = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

# What may change on a created GpuTraining: the operator patches these onto the running
# PyTorchJob (runPolicy) or reads them on every check (the timeouts). Anything else
# would need new pods, and the CRD's transition rules refuse the change.
MUTABLE_SPEC_FIELDS: Final = ("runPolicy", "stallTimeoutSeconds", "nodeLossTimeoutSeconds")

# spec.backend: "auto", or the name of one of the operator's backends (gpuop.backends), which
# are above this layer: the CRD's enum of them, and each one's refusals (gaps.SpecGap), are added
# where the CRD is generated, from the backends' registry.
AUTO_BACKEND: Final = "auto"


# Each check returns None when its rule holds, else what fills its message (Rule).
_HOLDS: Final = None
_BROKEN: Final[Mapping[str, str]] = MappingProxyType({})


def _fp16_needs_gpus(s: GpuTrainingSpec) -> Mapping[str, str] | None:
    return _BROKEN if s.training.precision == "fp16" and not s.uses_gpus else _HOLDS


def _workers_within_elastic(s: GpuTrainingSpec) -> Mapping[str, str] | None:
    e = s.elastic
    if e is not None and not e.min_workers <= s.workers <= e.max_workers:
        return {"bounds": f" ({e.min_workers}..{e.max_workers})", "got": f" (got {s.workers})"}
    return _HOLDS


def _args_need_command(s: GpuTrainingSpec) -> Mapping[str, str] | None:
    return _BROKEN if s.args is not None and s.command is None else _HOLDS


def _needs_dataset(s: GpuTrainingSpec) -> Mapping[str, str] | None:
    return _BROKEN if s.dataset is None and s.command is None else _HOLDS


def _shm_within_memory(s: GpuTrainingSpec) -> Mapping[str, str] | None:
    memory = s.resources.memory
    if s.shm_size is None or memory is None or parse_quantity(s.shm_size) < parse_quantity(memory):
        return _HOLDS
    return {"memory": f" ({memory})", "got": f" (got {s.shm_size})"}


def _one_store_secret(s: GpuTrainingSpec) -> Mapping[str, str] | None:
    """output.secretName, when set, is checkpoint.secretName where that is set too."""
    ours, other = s.output.secret_name, s.checkpoint.secret_name
    return {"got": f" (got {ours!r} and {other!r})"} if ours and other and ours != other else _HOLDS


def store_secret(s: GpuTrainingSpec) -> str | None:
    """The Secret whose keys are the trainer's store credentials: one, by the spec's rule."""
    return s.checkpoint.secret_name or s.output.secret_name


def dataset_secret(s: GpuTrainingSpec) -> str | None:
    """The Secret of the dataset step: its own (another account, a read-only key), else the
    trainer's; none means the pod's workload identity."""
    own = s.dataset.secret_name if s.dataset is not None else None
    return own or store_secret(s)


def _efa_needs_profile(s: GpuTrainingSpec) -> Mapping[str, str] | None:
    if s.nccl.efa_devices > 0 and s.nccl.profile != "eks-efa":
        return {"got": f' (got "{s.nccl.profile}")'}
    return _HOLDS


@api_object
class GpuTrainingSpec:
    """What to train, on how many GPUs, and how."""

    # The CRD lists the backends (an enum) and says what each is: gpuop.api.crd.build_crd.
    backend: str = api_field(
        "The job API that runs the training, or auto: the first the cluster serves, in the "
        "order below, that can carry the spec. Chosen once, when the job is made; status.backend "
        "says which and why.",
        default=AUTO_BACKEND,
        max_length=63,
        pattern=r"^[a-z][a-z0-9]*$",
        pattern_hint="auto or a backend name such as pytorchjob",
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
        pattern=K8S_NAME_PATTERN,
        pattern_hint=K8S_NAME_HINT,
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
        "A running or restarting job whose step counter has not moved for this long gets the "
        "Stalled condition (NCCL hangs, dead data loaders, a pod that cannot come back). 0 disables "
        "the check.",
        default=900,
        minimum=0,
        maximum=604800,
    )
    node_loss_timeout_seconds: int = api_field(
        "Seconds after a worker's node stops being Ready (dead, cut off, deleted) until the "
        "operator deletes the training's pods so that its job makes them again on the nodes left, "
        "every rank resuming from the last checkpoint; Kubernetes alone would wait 5 minutes and "
        "then for a kubelet that may never answer. A node that is only cut off may run its old pod "
        "beside the new one until it is back. 0 leaves the pods to Kubernetes.",
        default=60,
        minimum=0,
        maximum=3600,
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
            message="must be within elastic.minWorkers..maxWorkers{bounds}{got}",
            check=_workers_within_elastic,
            field=".workers",
        ),
        Rule(
            cel="has(self.dataset) || has(self.command)",
            message="required unless spec.command runs your own training code",
            check=_needs_dataset,
            field=".dataset",
        ),
        Rule(
            cel="!has(self.args) || has(self.command)",
            message="needs spec.command: args are passed to your command (the built-in trainer takes none)",
            check=_args_need_command,
            field=".args",
        ),
        Rule(
            cel="self.nccl.efaDevices == 0 || self.nccl.profile == 'eks-efa'",
            message="efaDevices needs profile eks-efa{got}",
            check=_efa_needs_profile,
            field=".nccl.efaDevices",
        ),
        Rule(
            # The Kubernetes quantity library is in the CRD CEL environment from 1.29 on.
            cel="!has(self.shmSize) || !has(self.resources.memory) || "
            "quantity(string(self.shmSize)).isLessThan(quantity(string(self.resources.memory)))",
            message="must be smaller than resources.memory{memory}: /dev/shm is memory-backed and counts "
            "against it{got}",
            check=_shm_within_memory,
            field=".shmSize",
        ),
        Rule(
            cel="!has(self.output.secretName) || !has(self.checkpoint.secretName) || "
            "self.output.secretName == self.checkpoint.secretName",
            message="must name the Secret checkpoint.secretName names: its keys become the trainer's "
            "environment, which holds one set of the store's variables{got}",
            check=_one_store_secret,
            field=".output.secretName",
        ),
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
    places = [("spec.output", spec.output.path, spec.output.volume)]
    if spec.checkpoint.uri is None:  # else nothing is mounted at checkpoint.path
        places.insert(0, ("spec.checkpoint", spec.checkpoint.path, spec.checkpoint.volume))
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
    if spec.output.volume is None and spec.output.uri is None and spec.command is None:
        found.append(Problem("spec.output.volume", "not set: the trained model is written to an emptyDir and "
                             "lost with the pod (only the result in the termination message stays); set "
                             "output.volume.claimName or output.uri to keep it"))  # fmt: skip
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


# The CRD's root rules, where CEL may read metadata.name; their checks take the name itself.
NAME_RULES: Final = (
    Rule(
        cel=f"self.metadata.name.size() <= {MAX_NAME_LENGTH}",
        message=f"must be at most {MAX_NAME_LENGTH} characters{{got}}: it names the PyTorchJob and its "
        "per-pod Services",
        check=lambda name: {"got": f" (got {len(name)})"} if len(name) > MAX_NAME_LENGTH else None,
        field=".metadata.name",
    ),
    Rule(
        cel=f"self.metadata.name.matches('{NAME_PATTERN}')",
        message="must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter{got}",
        check=lambda name: (
            None if k8svalidation.fullmatch(NAME_PATTERN, name) else {"got": f" (got {show(name)})"}
        ),
        field=".metadata.name",
    ),
)


def _check_name(name: object) -> list[Problem]:
    """The name's first problem: a name too long is not also said to be malformed."""
    if not isinstance(name, str) or not name:
        return [Problem("metadata.name", "required")]
    message = next((m for rule in NAME_RULES if (m := rule.violation(name)) is not None), None)
    return [] if message is None else [Problem("metadata.name", message)]
