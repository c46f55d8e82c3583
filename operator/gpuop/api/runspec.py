"""The parts of a GpuTraining spec that say what is trained and how the run goes: model,
dataset, training settings, checkpoints, outputs, elasticity and the run policy, with their
defaults and rules.

Part of the spec model (:mod:`gpuop.api.spec` assembles it).
"""

from typing import ClassVar, Final, Literal

from gpuop._kits.schema import (
    Rule,
    api_field,
    api_object,
)
from gpuop.api.podspec import K8S_NAME_HINT, K8S_NAME_PATTERN
from gputrain.contract import DatasetName, ModelName, Precision


@api_object
class VolumeSource:
    """A PersistentVolumeClaim to mount."""

    claim_name: str = api_field(
        "Name of a PersistentVolumeClaim in the GpuTraining's namespace. For multi-worker jobs "
        "it must be ReadWriteMany (or ReadOnlyMany for datasets).",
        min_length=1,
        max_length=253,
        pattern=K8S_NAME_PATTERN,
        pattern_hint=K8S_NAME_HINT,
    )
    sub_path: str | None = api_field(
        "Path inside the volume to mount instead of its root.", default=None, max_length=1024
    )


@api_object
class Model:
    """The network the built-in trainer trains."""

    name: ModelName = api_field(
        "Model architecture: cnn (a small conv net), resnet18 or resnet50 (torchvision, "
        "randomly initialised).",
        default="cnn",
    )


# s3://bucket/prefix, gs://bucket/prefix, az://container/prefix: a scheme obstore reads, a
# bucket or container name of the clouds' characters, and an optional key prefix.
BUCKET_URI_PATTERN: Final = r"^(s3|gs|az)://[a-z0-9][a-z0-9._-]{2,254}(/[^\s?#]*)?$"


def _bucket_uri(description: str) -> str | None:
    """An optional object-store prefix field (dataset, checkpoint and output alike)."""
    hint = "s3://bucket/prefix, gs://bucket/prefix or az://container/prefix"
    field: str | None = api_field(
        description, default=None, max_length=1024, pattern=BUCKET_URI_PATTERN, pattern_hint=hint
    )
    return field


def _uri_secret(description: str) -> str | None:
    """An optional Secret name for a uri's credentials (see :data:`SECRET_NEEDS_URI`)."""
    field: str | None = api_field(
        description, default=None, min_length=1, max_length=253, pattern=K8S_NAME_PATTERN,
        pattern_hint=K8S_NAME_HINT,
    )  # fmt: skip
    return field


# A class with a uri and its Secret (dataset, checkpoint, output): the Secret only with the uri.
SECRET_NEEDS_URI: Final = Rule(
    cel="has(self.uri) || !has(self.secretName)",
    message="is for a uri's credentials: set uri too, or leave secretName out",
    check=lambda obj: None if obj.uri is not None or obj.secret_name is None else {},
    field=".secretName",
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
        "PersistentVolumeClaim holding the dataset, mounted read-only at path. With uri, the cache "
        "the copy goes to (kept between runs: a later run copies only what changed); without one "
        "the copy goes to an emptyDir.",
        default=None,
    )
    uri: str | None = _bucket_uri(
        "Object store prefix the dataset is copied from into path before training, by a step of "
        "the operator's in each pod (an init container: resumable, each object checked by size and, "
        "on S3, MD5): s3://bucket/prefix, gs://bucket/prefix or az://container/prefix. The "
        "training shows FetchingDataset while it copies. Credentials as for checkpoint.uri."
    )
    secret_name: str | None = _uri_secret(
        "Secret whose keys become the environment of the copy step alone (the SDKs' variables, as "
        "for checkpoint.secretName): a dataset in another account, a read-only key. Without it the "
        "copy uses the checkpoint's or output's Secret, else the pod's workload identity. Only with uri."
    )
    loader_workers: int = api_field(
        "DataLoader worker processes per training process. Also sizes /dev/shm when shmSize is not given.",
        default=4,
        minimum=0,
        maximum=64,
    )

    RULES: ClassVar[tuple[Rule, ...]] = (SECRET_NEEDS_URI,)


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
        "Keep images and convolution weights in the channels_last memory format: faster "
        "convolutions on tensor cores and in oneDNN on CPUs (the CNN: 1.3x on 2 CPU cores).",
        default=True,
    )
    compile: bool | None = api_field(
        "Compile the model with torch.compile (the built-in trainer): true always, false never; "
        "unset, where it pays: on a GPU whose image has a C compiler for Triton, when the steps "
        "left win back the compile (about 45 s cold, 11 s with the training's compile cache, kept "
        "beside its checkpoints). status.progress.compile says which ran and why.",
        default=None,
    )
    log_every_steps: int = api_field(
        "Steps between progress reports (metrics, logs). Loss is read from the GPU only then.",
        default=20,
        minimum=1,
        maximum=100000,
    )


@api_object
class Checkpoint:
    """Checkpointing. Without a volume or a uri, checkpoints go to an emptyDir: they survive
    container restarts within a pod, not the pod's deletion."""

    volume: VolumeSource | None = api_field(
        "PersistentVolumeClaim for checkpoints, mounted read-write at path.", default=None
    )
    uri: str | None = _bucket_uri(
        "Object store prefix for checkpoints, in place of a volume: s3://bucket/prefix, "
        "gs://bucket/prefix or az://container/prefix. Each training writes under <uri>/<name>, "
        "and `gpuop run` with the same uri resumes from what a cluster run wrote, and back. "
        "Credentials come from secretName, or from the pod's workload identity (IRSA, EKS Pod "
        "Identity, GKE or Azure Workload Identity) when none is named."
    )
    secret_name: str | None = _uri_secret(
        "Secret in the GpuTraining's namespace whose keys become the trainer's environment: name "
        "them as the cloud's SDKs do (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION and, "
        "for S3-compatible stores, AWS_ENDPOINT_URL; GOOGLE_SERVICE_ACCOUNT_KEY; "
        "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY). Only with uri."
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

    RULES: ClassVar[tuple[Rule, ...]] = (
        Rule(
            cel="!has(self.uri) || !has(self.volume)",
            message="set volume or uri, not both: a training's checkpoints are in one place",
            check=lambda c: None if c.uri is None or c.volume is None else {},
            field=".uri",
        ),
        SECRET_NEEDS_URI,
    )


@api_object
class Output:
    """Where the final model and result are written."""

    volume: VolumeSource | None = api_field(
        "PersistentVolumeClaim for the final model and result JSON, mounted read-write at path. "
        "Without one they go to an emptyDir and only the termination message outlives the pod.",
        default=None,
    )
    uri: str | None = _bucket_uri(
        "Object store prefix the final model, result JSON and metric history are uploaded to when "
        "training ends: s3://bucket/prefix, gs://bucket/prefix or az://container/prefix, under "
        "<uri>/<name>. They are written to path first (volume or emptyDir) as without it. "
        "Credentials as for checkpoint.uri: secretName, or the pod's workload identity."
    )
    secret_name: str | None = _uri_secret(
        "Secret whose keys become the trainer's environment, as checkpoint.secretName; the same "
        "Secret when both are set (a container has one set of the SDKs' variables). Only with uri."
    )
    path: str = api_field(
        "Directory for outputs inside the container.",
        default="/output",
        min_length=1,
        max_length=1024,
        pattern=r"^/",
        pattern_hint="an absolute path",
    )

    RULES: ClassVar[tuple[Rule, ...]] = (SECRET_NEEDS_URI,)


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
            message="must be >= minWorkers{min}{got}",
            check=lambda e: (
                None
                if e.min_workers <= e.max_workers
                else {"min": f" ({e.min_workers})", "got": f" (got {e.max_workers})"}
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
        "Pods deleted when the job finishes: Running deletes those still running (a job failed "
        "by its deadline or backoff limit frees its GPUs; finished pods and their logs stay), "
        "All deletes every pod, None keeps them all (a failed job's pods run on, crash-looping "
        "or training, holding their GPUs).",
        # Running, where Kubeflow's PyTorchJob default is None: on the real training-operator a
        # job failed at its deadline kept training, and one failed by backoff kept restarting
        # its pod, each on GPUs nobody could use. A TrainJob's JobSet does what Running does.
        default="Running",
    )
