"""The spec model: defaults, and the exact message for each kind of bad input."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, get_args, get_type_hints

import pytest

from gpuop._kits.schema import SpecError
from gpuop.api.fixed import fixed_spec, fixed_spec_changes, fixed_spec_record
from gpuop.api.runspec import Dataset, Model, Training
from gpuop.api.spec import GpuTrainingSpec, parse
from gpuop.backends.job import GAPS as JOB_GAPS
from gpuop.backends.registry import parse_training
from gpuop.backends.trainjob import GAPS as TRAINJOB_GAPS
from gputrain.contract import DATASET_NAMES, MODEL_NAMES, PRECISIONS
from support.specs import minimal


def problems(body: dict[str, Any]) -> list[str]:
    """What `gpuop validate` and the operator refuse in ``body``: the spec model's rules and the
    backends' (a field a backend cannot carry)."""
    with pytest.raises(SpecError) as caught:
        parse_training(body)
    return [str(p) for p in caught.value.problems]


def test_minimal_spec_gets_the_documented_defaults() -> None:
    training = parse(minimal())
    spec = training.spec
    assert (training.name, training.namespace, training.uid) == ("demo", "ml", None)
    assert spec.workers == 1
    assert spec.gpus_per_worker == 1
    assert spec.distributed_backend == "nccl"
    assert spec.model.name == "cnn"
    assert spec.dataset == Dataset(name="mnist", path="/data", volume=None, loader_workers=4)
    assert spec.training == Training(
        epochs=10,
        batch_size=64,
        learning_rate=0.001,
        precision="bf16",
        gradient_accumulation_steps=1,
        seed=0,
        max_grad_norm=1.0,
        channels_last=True,
        compile=None,  # auto
        log_every_steps=20,
    )
    assert (spec.checkpoint.path, spec.checkpoint.every_steps, spec.checkpoint.keep) == (
        "/checkpoints",
        500,
        3,
    )
    assert spec.run_policy.clean_pod_policy == "Running"
    assert spec.run_policy.suspend is False
    assert spec.nccl.profile == "none"
    assert spec.stall_timeout_seconds == 900
    assert spec.termination_grace_period_seconds == 120
    assert spec.env == ()
    assert dict(spec.scheduling.node_selector) == {}


def test_parsed_spec_is_frozen() -> None:
    spec = parse(minimal()).spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.workers = 3  # type: ignore[misc]


def test_cpu_mode_uses_gloo_and_one_process_per_pod() -> None:
    spec = parse(minimal(gpusPerWorker=0)).spec
    assert (spec.distributed_backend, spec.processes_per_worker) == ("gloo", 1)
    assert parse(minimal(gpusPerWorker=4)).spec.processes_per_worker == 4


def test_enums_are_the_trainers_own_lists() -> None:
    """The API offers exactly what the trainer can build: one list, in the contract."""
    assert get_args(get_type_hints(Model)["name"]) == MODEL_NAMES
    assert get_args(get_type_hints(Dataset)["name"]) == DATASET_NAMES
    assert get_args(get_type_hints(Training)["precision"]) == PRECISIONS


def test_explicit_null_means_absent_as_in_the_api_server() -> None:
    spec = parse(minimal(shmSize=None, elastic=None)).spec
    assert spec.shm_size is None
    assert spec.elastic is None


def test_integer_quantities_are_accepted() -> None:
    assert parse(minimal(shmSize=1073741824)).spec.shm_size == "1073741824"


def test_scheduler_name_is_any_schedulers_and_unset_by_default() -> None:
    """Unset, nothing is rendered and the training-operator names its gang scheduler; a set name
    is taken as given, default-scheduler too when nothing asks for a gang."""
    assert parse(minimal()).spec.scheduling.scheduler_name is None
    for scheduling in (
        {"schedulerName": "default-scheduler"},
        {"gang": True, "schedulerName": "volcano"},
        {"gang": True, "schedulerName": "scheduler-plugins-scheduler"},
        {"backend": "trainjob", "schedulerName": "volcano"},
    ):
        backend = scheduling.pop("backend", "auto")
        spec = parse(minimal(backend=backend, scheduling=scheduling)).spec
        assert spec.scheduling.scheduler_name == scheduling["schedulerName"]


def test_custom_command_needs_no_dataset() -> None:
    spec = parse(minimal(dataset=None, command=["python", "train.py"])).spec
    assert spec.dataset is None
    assert spec.command == ("python", "train.py")


# (case id, spec fields to set, the exact problems expected)
# Bad specs the CRD cannot express, so only `gpuop validate` (and the operator's parse, which
# fails that GpuTraining alone with the same line) refuses them. Measured against the real API
# server (tests/controlplane/test_api.py fails when one of them starts being refused there, or
# another stops being): quantities whose value no int64 holds pass the CRD's pattern.
# One line each, naming the field: what a TrainJob cannot carry (the elastic case is spelled
# out in full above).
TRAINJOB_REFUSES: dict[str, str] = {
    gap.field.rsplit(".", 1)[1]: f"spec{gap.field}: cannot be used with backend trainjob: {gap.why}"
    for gap in TRAINJOB_GAPS
}
JOB_REFUSES: dict[str, str] = {
    gap.field.rsplit(".", 1)[1]: f"spec{gap.field}: cannot be used with backend job: {gap.why}"
    for gap in JOB_GAPS
}
# Refused by gpuop's parse (so by `gpuop validate`, and by the operator as InvalidSpec) but
# admitted by the CRD's schema: the API server would refuse these later, at the job or its pods.
KUBERNETES_RULES: list[tuple[str, dict[str, Any], list[str]]] = [
    (
        "a gpu as an extended resource",
        {"resources": {"extended": [{"name": "nvidia.com/gpu", "count": 2}]}},
        [
            "spec.resources.extended[0].name: nvidia.com/gpu is set by its own field (gpusPerWorker, nccl.efaDevices, "
            "resources.cpu or memory), not here"
        ],
    ),
    (
        "an extended resource without a domain",
        {"resources": {"extended": [{"name": "rdma", "count": 1}]}},
        [
            "spec.resources.extended[0].name: must be an extended resource: a domain other than kubernetes.io, '/', "
            'a name (got "rdma")'
        ],
    ),
    (
        "a label key with a space",
        {"podMetadata": {"labels": {"bad key!": "v"}}},
        ["spec.podMetadata.labels[bad key!]: must be a name of at most 63 characters (letters, digits, '-', "
         "'_' and '.', starting and ending alphanumeric), with an optional DNS prefix and '/' (got \"bad key!\")"],
    ),
    (
        "a nodeSelector key with two slashes",
        {"scheduling": {"nodeSelector": {"a/b/c": "v"}}},
        ["spec.scheduling.nodeSelector[a/b/c]: must have a DNS subdomain prefix before its '/', such as "
         'example.com/name (got "a/b/c")'],
    ),
    (
        "an Exists toleration with a value",
        {"scheduling": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
        ["spec.scheduling.tolerations[0].value: must be empty with operator Exists (which matches any value)"],
    ),
    (
        "a pull secret that is not a DNS name",
        {"imagePullSecrets": ["Bad_Name"]},
        ["spec.imagePullSecrets[0]: must be a lowercase DNS name (letters, digits, '-' and '.', starting and "
         'ending alphanumeric) (got "Bad_Name")'],
    ),
    ("'..' in a path", {"checkpoint": {"path": "/a/../b"}}, ['spec.checkpoint.path: must not contain \'..\' (got "/a/../b")']),
    (
        "an absolute subPath",
        {"checkpoint": {"volume": {"claimName": "c", "subPath": "/x"}}},
        ['spec.checkpoint.volume.subPath: must be a relative path inside the volume (got "/x")'],
    ),
    (
        "output over /dev/shm",
        {"output": {"path": "/dev/shm"}},
        ["spec.output.path: /dev/shm is also the shared-memory volume; each needs a directory of its own"],
    ),
    (
        "checkpoints and output in one directory",
        {"checkpoint": {"path": "/out"}, "output": {"path": "/out/"}},
        ["spec.output.path: /out/ is also spec.checkpoint.path; each needs a directory of its own"],
    ),
]  # fmt: skip
ONLY_GPUOP_VALIDATE: frozenset[str] = frozenset(
    {"memory out of range", "shm out of range", *(case for case, _, _ in KUBERNETES_RULES)}
)

BAD_SPECS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("workers zero", {"workers": 0}, ["spec.workers: must be >= 1 (got 0)"]),
    ("root", {"securityContext": {"runAsUser": 0}}, ["spec.securityContext.runAsUser: must be >= 1 (got 0)"]),
    (
        "no devices",
        {"resources": {"extended": [{"name": "rdma/ib", "count": 0}]}},
        ["spec.resources.extended[0].count: must be >= 1 (got 0)"],
    ),
    ("workers too many", {"workers": 5000}, ["spec.workers: must be <= 1024 (got 5000)"]),
    ("workers a string", {"workers": "two"}, ['spec.workers: must be an integer (got "two")']),
    ("workers a bool", {"workers": True}, ["spec.workers: must be an integer (got true)"]),
    ("workers a float", {"workers": 2.5}, ["spec.workers: must be an integer (got 2.5)"]),
    ("negative gpus", {"gpusPerWorker": -1}, ["spec.gpusPerWorker: must be >= 0 (got -1)"]),
    ("too many gpus", {"gpusPerWorker": 17}, ["spec.gpusPerWorker: must be <= 16 (got 17)"]),
    (
        "node loss timeout too long",
        {"nodeLossTimeoutSeconds": 4000},
        ["spec.nodeLossTimeoutSeconds: must be <= 3600 (got 4000)"],
    ),
    (
        "negative node loss timeout",
        {"nodeLossTimeoutSeconds": -1},
        ["spec.nodeLossTimeoutSeconds: must be >= 0 (got -1)"],
    ),
    (
        "unknown model",
        {"model": {"name": "vgg16"}},
        ['spec.model.name: must be one of cnn, resnet18, resnet50 (got "vgg16")'],
    ),
    (
        "unknown dataset",
        {"dataset": {"name": "imagenet"}},
        ['spec.dataset.name: must be one of mnist, cifar10, imagefolder, digits, synthetic (got "imagenet")'],
    ),
    ("dataset without name", {"dataset": {"path": "/data"}}, ["spec.dataset.name: required"]),
    (
        "relative dataset path",
        {"dataset": {"name": "mnist", "path": "data"}},
        ['spec.dataset.path: must be an absolute path (got "data")'],
    ),
    (
        "no dataset and no command",
        {"dataset": None},
        ["spec.dataset: required unless spec.command runs your own training code"],
    ),
    (
        "args without command (the built-in trainer ignored them)",
        {"args": ["--fast"]},
        ["spec.args: needs spec.command: args are passed to your command (the built-in trainer takes none)"],
    ),
    (
        "an argument over 32 KiB",
        {"dataset": None, "command": ["python"], "args": ["x" * 32769]},
        ["spec.args[0]: must be at most 32768 characters long"],
    ),
    (
        "a label value over 63 characters",
        {"podMetadata": {"labels": {"team": "x" * 64}}},
        ["spec.podMetadata.labels.team: must be at most 63 characters long"],
    ),
    (
        "a non-finite number",
        {"training": {"maxGradNorm": float("inf")}},
        ["spec.training.maxGradNorm: must be a finite number (got inf)"],
    ),
    (
        "a negative quantity",
        {"resources": {"memory": "-1Gi"}},
        ['spec.resources.memory: must not be negative (got "-1Gi")'],
    ),
    (
        "misspelled field",
        {"trainng": {"epochs": 3}},
        ['spec.trainng: unknown field; did you mean "training"?'],
    ),
    ("unknown field", {"colour": "blue"}, ["spec.colour: unknown field"]),
    (
        "zero learning rate",
        {"training": {"learningRate": 0}},
        ["spec.training.learningRate: must be > 0 (got 0)"],
    ),
    (
        "bad precision",
        {"training": {"precision": "fp8"}},
        ['spec.training.precision: must be one of fp32, bf16, fp16 (got "fp8")'],
    ),
    (
        "fp16 on CPU",
        {"gpusPerWorker": 0, "training": {"precision": "fp16"}},
        ["spec.training.precision: fp16 needs GPUs (gpusPerWorker >= 1); use bf16 or fp32 on CPU"],
    ),
    (
        "shm not a quantity",
        {"shmSize": "2GB"},
        ['spec.shmSize: must be a Kubernetes quantity such as 512Mi or 2Gi (got "2GB")'],
    ),
    (
        "shm larger than memory",
        {"shmSize": "8Gi", "resources": {"memory": "4Gi"}},
        [
            "spec.shmSize: must be smaller than resources.memory (4Gi): /dev/shm is memory-backed "
            "and counts against it (got 8Gi)"
        ],
    ),
    (
        "cpu not a quantity",
        {"resources": {"cpu": "four"}},
        ['spec.resources.cpu: must be a Kubernetes quantity such as 512Mi or 2Gi (got "four")'],
    ),
    (
        "elastic min above max",
        {"workers": 2, "elastic": {"minWorkers": 3, "maxWorkers": 2}},
        ["spec.elastic.maxWorkers: must be >= minWorkers (3) (got 2)"],
    ),
    (
        "workers outside elastic range",
        {"workers": 5, "elastic": {"minWorkers": 1, "maxWorkers": 4}},
        ["spec.workers: must be within elastic.minWorkers..maxWorkers (1..4) (got 5)"],
    ),
    ("elastic without max", {"elastic": {"minWorkers": 1}}, ["spec.elastic.maxWorkers: required"]),
    (
        "checkpoint uri and volume",
        {"checkpoint": {"uri": "s3://bkt/p", "volume": {"claimName": "ckpt"}}},
        ["spec.checkpoint.uri: set volume or uri, not both: a training's checkpoints are in one place"],
    ),
    (
        "checkpoint secret without uri",
        {"checkpoint": {"secretName": "creds"}},
        ["spec.checkpoint.secretName: is for a uri's credentials: set uri too, or leave secretName out"],
    ),
    (
        "output secret without uri",
        {"output": {"secretName": "creds"}},
        ["spec.output.secretName: is for a uri's credentials: set uri too, or leave secretName out"],
    ),
    (
        "two store secrets",
        {
            "checkpoint": {"uri": "s3://bkt/ckpt", "secretName": "ckpt-creds"},
            "output": {"uri": "s3://bkt/models", "secretName": "model-creds"},
        },
        [
            "spec.output.secretName: must name the Secret checkpoint.secretName names: its keys become the "
            "trainer's environment, which holds one set of the store's variables (got 'model-creds' and "
            "'ckpt-creds')"
        ],
    ),
    (
        "dataset secret without uri",
        {"dataset": {"name": "imagefolder", "secretName": "creds"}},
        ["spec.dataset.secretName: is for a uri's credentials: set uri too, or leave secretName out"],
    ),
    (
        "checkpoint uri not a bucket",
        {"checkpoint": {"uri": "https://example.com/b"}},
        [
            "spec.checkpoint.uri: must be s3://bucket/prefix, gs://bucket/prefix or az://container/prefix "
            '(got "https://example.com/b")'
        ],
    ),
    (
        "reserved env name",
        {"env": [{"name": "MASTER_ADDR", "value": "x"}]},
        ["spec.env[0].name: MASTER_ADDR is set by the operator and cannot be overridden; remove it"],
    ),
    (
        "reserved env prefix",
        {"env": [{"name": "GPUTRAIN_EPOCHS", "value": "1"}]},
        ["spec.env[0].name: GPUTRAIN_EPOCHS is set by the operator and cannot be overridden; remove it"],
    ),
    (
        "nccl var in env",
        {"env": [{"name": "NCCL_DEBUG", "value": "INFO"}]},
        ["spec.env[0].name: NCCL_DEBUG is an NCCL setting: put it in spec.nccl.env"],
    ),
    (
        "env name not an identifier",
        {"env": [{"name": "MY-VAR", "value": "x"}]},
        ['spec.env[0].name: must be a C identifier such as WANDB_PROJECT (got "MY-VAR")'],
    ),
    (
        "duplicate env",
        {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]},
        ['spec.env[1]: duplicate name "A"'],
    ),
    (
        "env with value and valueFrom",
        {"env": [{"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]},
        ["spec.env[0]: set exactly one of value and valueFrom"],
    ),
    (
        "env with neither",
        {"env": [{"name": "A"}]},
        ["spec.env[0]: set exactly one of value and valueFrom"],
    ),
    (
        "env source with two refs",
        {
            "env": [
                {
                    "name": "A",
                    "valueFrom": {
                        "secretKeyRef": {"name": "s", "key": "k"},
                        "configMapKeyRef": {"name": "c", "key": "k"},
                    },
                }
            ]
        },
        ["spec.env[0].valueFrom: set exactly one of secretKeyRef and configMapKeyRef"],
    ),
    (
        "non-nccl key in nccl.env",
        {"nccl": {"env": {"HOME": "/tmp"}}},
        ["spec.nccl.env: HOME is not an NCCL_*, TORCH_NCCL_*, FI_* or UCX_* variable; put it in spec.env"],
    ),
    (
        "efa without the efa profile",
        {"nccl": {"efaDevices": 4}},
        ['spec.nccl.efaDevices: efaDevices needs profile eks-efa (got "none")'],
    ),
    (
        "bad backend",
        {"backend": "tfjob"},
        ['spec.backend: must be one of auto, pytorchjob, trainjob, job (got "tfjob")'],
    ),
    (
        "elastic on trainjob",
        {"backend": "trainjob", "elastic": {"maxWorkers": 2}},
        [
            "spec.elastic: cannot be used with backend trainjob: Trainer v2 has no elastic PyTorch yet; "
            "use backend pytorchjob or drop elastic"
        ],
    ),
    ("gang on trainjob", {"backend": "trainjob", "scheduling": {"gang": True}}, [TRAINJOB_REFUSES["gang"]]),
    ("elastic on job", {"backend": "job", "elastic": {"maxWorkers": 2}}, [JOB_REFUSES["elastic"]]),
    ("gang on job", {"backend": "job", "scheduling": {"gang": True}}, [JOB_REFUSES["gang"]]),
    (
        "clean pod policy on job",
        {"backend": "job", "runPolicy": {"cleanPodPolicy": "All"}},
        [JOB_REFUSES["cleanPodPolicy"]],
    ),
    (
        "ttl on trainjob",
        {"backend": "trainjob", "runPolicy": {"ttlSecondsAfterFinished": 60}},
        [TRAINJOB_REFUSES["ttlSecondsAfterFinished"]],
    ),
    (
        "clean pod policy on trainjob",
        {"backend": "trainjob", "runPolicy": {"cleanPodPolicy": "All"}},
        [TRAINJOB_REFUSES["cleanPodPolicy"]],
    ),
    (
        "clean pod policy None on trainjob",
        {"backend": "trainjob", "runPolicy": {"cleanPodPolicy": "None"}},
        [TRAINJOB_REFUSES["cleanPodPolicy"]],
    ),
    (
        "bad nccl profile",
        {"nccl": {"profile": "azure"}},
        ['spec.nccl.profile: must be one of none, eks-efa, gke, aks-infiniband (got "azure")'],
    ),
    (
        "bad claim name",
        {"checkpoint": {"volume": {"claimName": "My_Claim"}}},
        ['spec.checkpoint.volume.claimName: must be a lowercase DNS name such as my-claim (got "My_Claim")'],
    ),
    (
        "tolerations not a list",
        {"scheduling": {"tolerations": {"key": "x"}}},
        ["spec.scheduling.tolerations: must be a list (got an object)"],
    ),
    (
        "bad toleration operator",
        {"scheduling": {"tolerations": [{"key": "x", "operator": "In"}]}},
        ['spec.scheduling.tolerations[0].operator: must be one of Exists, Equal (got "In")'],
    ),
    (
        "node selector value not a string",
        {"scheduling": {"nodeSelector": {"zone": 1}}},
        ["spec.scheduling.nodeSelector.zone: must be a string (got 1)"],
    ),
    ("spec section not an object", {"training": "fast"}, ['spec.training: must be an object (got "fast")']),
    (
        "gang not a bool",
        {"scheduling": {"gang": "yes"}},
        ['spec.scheduling.gang: must be true or false (got "yes")'],
    ),
    (
        "scheduler name not a DNS name",
        {"scheduling": {"schedulerName": "Volcano_GPU"}},
        ['spec.scheduling.schedulerName: must be a lowercase DNS name such as volcano (got "Volcano_GPU")'],
    ),
    (
        "scheduler name too long",
        {"scheduling": {"schedulerName": "s" * 254}},
        ["spec.scheduling.schedulerName: must be at most 253 characters long"],
    ),
    (
        "gang placed by the default scheduler",
        {"scheduling": {"gang": True, "schedulerName": "default-scheduler"}},
        [
            "spec.scheduling.schedulerName: default-scheduler does not gang-schedule: leave schedulerName "
            "empty with gang (the training-operator fills in its gang scheduler) or name your gang scheduler"
        ],
    ),
    (
        "memory out of range",
        {"resources": {"memory": "1e999999999"}},
        [
            "spec.resources.memory: must be at most 9223372036854775807, Kubernetes' int64 "
            '(got "1e999999999")'
        ],
    ),
    (
        "shm out of range",
        {"shmSize": "9e99999"},
        ['spec.shmSize: must be at most 9223372036854775807, Kubernetes\' int64 (got "9e99999")'],
    ),
    (
        "several problems at once",
        {"workers": 0, "gpusPerWorker": 99, "training": {"epochs": 0}},
        [
            "spec.workers: must be >= 1 (got 0)",
            "spec.gpusPerWorker: must be <= 16 (got 99)",
            "spec.training.epochs: must be >= 1 (got 0)",
        ],
    ),
    *KUBERNETES_RULES,
]


@pytest.mark.parametrize(("fields", "expected"), [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
def test_bad_spec_gets_exact_messages(fields: dict[str, Any], expected: list[str]) -> None:
    assert problems(minimal(**fields)) == expected


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"kind": "GpuTraining", "metadata": {"name": "x"}, "spec": {}},
            ["apiVersion: required: gpuop.io/v1alpha1"],
        ),
        (
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}},
            [
                'apiVersion: must be gpuop.io/v1alpha1 (got "apps/v1")',
                'kind: must be GpuTraining (got "Deployment")',
            ],
        ),
        (
            {
                "apiVersion": "gpuop.io/v1alpha1",
                "kind": "GpuTraining",
                "spec": {"dataset": {"name": "digits"}},
            },
            ["metadata.name: required"],
        ),
        (
            {"apiVersion": "gpuop.io/v1alpha1", "kind": "GpuTraining", "metadata": {"name": "x"}},
            ["spec: required"],
        ),
    ],
    ids=["no apiVersion", "another kind", "no name", "no spec"],
)
def test_bad_object_gets_exact_messages(body: dict[str, Any], expected: list[str]) -> None:
    assert problems(body) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "Mnist",
            "must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter (got \"Mnist\")",
        ),
        (
            "1job",
            "must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter (got \"1job\")",
        ),
        (
            "my.job",
            "must be a DNS-1035 label: lowercase letters, digits and '-', starting with a letter (got \"my.job\")",
        ),
        (
            "j" * 49,
            "must be at most 48 characters (got 49): it names the PyTorchJob and its per-pod Services",
        ),
    ],
)
def test_names_that_cannot_name_a_pytorchjob_are_refused(name: str, expected: str) -> None:
    body = minimal()
    body["metadata"]["name"] = name
    assert problems(body) == [f"metadata.name: {expected}"]


def test_every_spec_field_is_documented() -> None:
    """kubectl explain must be useful: no field without a description."""
    seen: set[type] = set()

    def walk(cls: type) -> None:
        if cls in seen:
            return
        seen.add(cls)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            assert len(f.metadata["gpuop"].description) > 10, f"{cls.__name__}.{f.name}"
            for candidate in (hints[f.name], *get_args(hints[f.name])):
                for inner in (candidate, *get_args(candidate)):
                    if dataclasses.is_dataclass(inner) and isinstance(inner, type):
                        walk(inner)

    walk(GpuTrainingSpec)
    assert len(seen) > 10


FIXED_CHANGES: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("nothing", {}, ()),
    ("workers", {"workers": 4}, ("spec.workers (1 -> 4)",)),
    ("a nested leaf", {"training": {"batchSize": 32}}, ("spec.training.batchSize (64 -> 32)",)),
    ("an optional set", {"image": "me/trainer:2"}, ("spec.image (unset -> me/trainer:2)",)),
    ("a map", {"scheduling": {"nodeSelector": {"pool": "a100"}}}, ("spec.scheduling.nodeSelector",)),
    ("mutable fields only", {"runPolicy": {"suspend": True}, "stallTimeoutSeconds": 60}, ()),
]


@pytest.mark.parametrize(("name", "change", "expected"), FIXED_CHANGES, ids=[c[0] for c in FIXED_CHANGES])
def test_fixed_spec_changes_name_each_changed_field(
    name: str, change: dict[str, Any], expected: tuple[str, ...]
) -> None:
    spec = parse(minimal()).spec
    assert "runPolicy" not in fixed_spec(spec)
    assert fixed_spec_changes(fixed_spec_record(spec), parse(minimal(**change)).spec) == expected


def test_fixed_spec_records_from_other_operator_versions() -> None:
    spec = parse(minimal()).spec
    older = fixed_spec(spec)
    del older["terminationGracePeriodSeconds"]  # a field this version added: its default both sides
    assert fixed_spec_changes(json.dumps(older), spec) == ()
    newer = {**fixed_spec(spec), "fromTheFuture": True}  # unreadable: no verdict rather than a wrong one
    assert fixed_spec_changes(json.dumps(newer), parse(minimal(workers=9)).spec) == ()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nccl": {"env": {1: "a"}}}, "spec.nccl.env: keys must be strings (got 1)"),
        (
            {"scheduling": {"nodeSelector": {1: "a", "b": "c"}}},
            "spec.scheduling.nodeSelector: keys must be strings (got 1)",
        ),
        (
            {"podMetadata": {"labels": {True: "x"}}},
            "spec.podMetadata.labels: keys must be strings (got true)",
        ),
    ],
)
def test_a_map_with_a_key_that_is_not_a_string_is_refused_not_a_crash(
    fields: dict[str, Any], message: str
) -> None:
    """YAML reads `1:` and `yes:` as an int and a bool; before, TypeError and AttributeError."""
    with pytest.raises(SpecError) as refused:
        parse(minimal(**fields))
    assert [str(p) for p in refused.value.problems] == [message]


def test_a_checkpoint_uri_frees_the_checkpoint_path() -> None:
    """With a bucket nothing is mounted at checkpoint.path, so it may be where the output is."""
    parse(minimal(checkpoint={"uri": "az://ckpt/x", "path": "/output"}))
