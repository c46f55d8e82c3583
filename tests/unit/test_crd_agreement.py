"""The CRD and the spec model agree: the same objects pass, fail and get the same defaults.

The CRD is generated from the model, so this guards the generator and the CEL twins of the
Python rules: each case is judged by ``parse`` and by the CRD as the API server would judge
it (schema, defaults, CEL evaluated by cel-python), and every CEL rule in the CRD must be
broken by at least one case, so none goes untested.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuop._kits.schema import SpecError, encode
from gpuop.api.spec import parse
from gpuop.backends.registry import parse_training
from support.paths import ROOT
from support.schemas.crd import apply_defaults, load_schema, validate
from support.specs import EXAMPLES, load_example, minimal
from unit.test_spec import BAD_SPECS, ONLY_GPUOP_VALIDATE

SCHEMA = load_schema(ROOT / "crds" / "gputraining.yaml")

VALID: list[tuple[str, dict[str, Any]]] = [
    ("minimal", minimal()),
    ("cpu", minimal(gpusPerWorker=0, training={"precision": "fp32"})),
    ("bf16 on cpu", minimal(gpusPerWorker=0, training={"precision": "bf16"})),
    ("fp16 on gpu", minimal(training={"precision": "fp16"})),
    ("elastic at bounds", minimal(workers=4, elastic={"minWorkers": 4, "maxWorkers": 4})),
    ("custom command", minimal(dataset=None, command=["python", "x.py"])),
    ("shm under memory", minimal(shmSize="1Gi", resources={"memory": "1025Mi"})),
    ("shm as integer", minimal(shmSize=1024, resources={"memory": "2Ki"})),
    ("efa", minimal(nccl={"profile": "eks-efa", "efaDevices": 4, "env": {"FI_LOG_LEVEL": "warn"}})),
    (
        "env forms",
        minimal(
            env=[
                {"name": "A", "value": ""},
                {"name": "B", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k", "optional": True}}},
            ]
        ),
    ),
    ("omp threads", minimal(env=[{"name": "OMP_NUM_THREADS", "value": "8"}])),
]

NAMES_REFUSED = ["Upper", "9lives", "dots.in.name", "x" * 49]


def _defaulted_by_api_server(body: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = apply_defaults(SCHEMA, body)["spec"]
    # The one difference in form: the model keeps a quantity as text ("1024"), where the API
    # server keeps the integer the user wrote. Both are the same quantity.
    if isinstance(spec.get("shmSize"), int):
        spec["shmSize"] = str(spec["shmSize"])
    return spec


def _parse_ok(body: dict[str, Any]) -> bool:
    """Whether `gpuop validate` and the operator take it (the spec model's and backends' rules)."""
    try:
        parse_training(body)
    except SpecError:
        return False
    return True


@pytest.mark.parametrize(("body"), [v[1] for v in VALID], ids=[v[0] for v in VALID])
def test_valid_specs_pass_both_and_get_the_same_defaults(body: dict[str, Any]) -> None:
    assert validate(SCHEMA, body) == []
    assert encode(parse(body).spec) == _defaulted_by_api_server(body)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_get_the_same_defaults(example: Path) -> None:
    body = load_example(example)
    assert encode(parse(body).spec) == _defaulted_by_api_server(body)


# Unknown fields are the one difference by design: the API server prunes them (kubectl's
# strict field validation refuses them client-side, as our validator does), parse refuses.
@pytest.mark.parametrize(("case", "fields"), [c[:2] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS])
def test_bad_specs_fail_both(case: str, fields: dict[str, Any]) -> None:
    body = minimal(**fields)
    assert not _parse_ok(body)
    assert (validate(SCHEMA, body) == []) == (case in ONLY_GPUOP_VALIDATE)


@pytest.mark.parametrize("name", NAMES_REFUSED)
def test_bad_names_fail_both(name: str) -> None:
    body = minimal()
    body["metadata"]["name"] = name
    assert not _parse_ok(body)
    assert validate(SCHEMA, body) != []


def _cel_messages(node: dict[str, Any]) -> set[str]:
    found = {rule["message"] for rule in node.get("x-kubernetes-validations", [])}
    for sub in node.get("properties", {}).values():
        found |= _cel_messages(sub)
    if "items" in node:
        found |= _cel_messages(node["items"])
    return found


# Updates of a created GpuTraining: (field, old spec fields, new spec fields). Each immutable
# field is changed once; adding or removing an optional one counts as a change.
IMMUTABLE_UPDATES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("image", {}, {"image": "example.com/t:2"}),
    ("securityContext", {}, {"securityContext": {"runAsUser": 1001}}),
    ("command", {"dataset": None, "command": ["a"]}, {"dataset": None, "command": ["b"]}),
    ("args", {"dataset": None, "command": ["a"]}, {"dataset": None, "command": ["a"], "args": ["--x"]}),
    ("workers", {}, {"workers": 2}),
    ("gpusPerWorker", {}, {"gpusPerWorker": 2}),
    ("gpuType", {}, {"gpuType": "NVIDIA-H100-80GB-HBM3"}),
    ("resources", {}, {"resources": {"cpu": "4"}}),
    ("shmSize", {}, {"shmSize": "1Gi"}),
    ("model", {}, {"model": {"name": "resnet18"}}),
    ("dataset", {}, {"dataset": {"name": "cifar10"}}),
    ("training", {}, {"training": {"epochs": 3}}),
    ("checkpoint", {}, {"checkpoint": {"everySteps": 50}}),
    ("output", {}, {"output": {"path": "/elsewhere"}}),
    ("elastic", {}, {"elastic": {"minWorkers": 1, "maxWorkers": 2}}),
    ("scheduling", {}, {"scheduling": {"nodeSelector": {"pool": "a100"}}}),
    ("nccl", {}, {"nccl": {"debug": "INFO"}}),
    ("env", {}, {"env": [{"name": "A", "value": "1"}]}),
    ("serviceAccountName", {}, {"serviceAccountName": "trainer"}),
    ("imagePullSecrets", {}, {"imagePullSecrets": ["regcred"]}),
    ("podMetadata", {}, {"podMetadata": {"labels": {"team": "a"}}}),
    ("terminationGracePeriodSeconds", {}, {"terminationGracePeriodSeconds": 30}),
    ("backend", {}, {"backend": "trainjob"}),
]
MUTABLE_UPDATES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("suspend", {}, {"runPolicy": {"suspend": True}}),
    ("deadline", {}, {"runPolicy": {"activeDeadlineSeconds": 3600, "ttlSecondsAfterFinished": 60}}),
    ("stall timeout", {}, {"stallTimeoutSeconds": 60}),
    ("node loss timeout", {}, {"nodeLossTimeoutSeconds": 300}),
    ("no change", {"image": "x"}, {"image": "x"}),
]


@pytest.mark.parametrize(("field", "old", "new"), IMMUTABLE_UPDATES, ids=[c[0] for c in IMMUTABLE_UPDATES])
def test_the_crd_refuses_changing_an_immutable_field(
    field: str, old: dict[str, Any], new: dict[str, Any]
) -> None:
    before, after = minimal(**old), minimal(**{**old, **new})
    assert validate(SCHEMA, after) == []  # valid as a new object
    errors = validate(SCHEMA, after, old=before)
    assert errors == [
        f"spec.{field}: spec.{field} cannot change once the GpuTraining exists (only spec.runPolicy, "
        "spec.stallTimeoutSeconds, spec.nodeLossTimeoutSeconds can); delete it and create it again to change this"
    ]


@pytest.mark.parametrize(("case", "old", "new"), MUTABLE_UPDATES, ids=[c[0] for c in MUTABLE_UPDATES])
def test_the_crd_accepts_changing_a_mutable_field(
    case: str, old: dict[str, Any], new: dict[str, Any]
) -> None:
    assert validate(SCHEMA, minimal(**{**old, **new}), old=minimal(**old)) == []


def test_immutable_updates_cover_every_immutable_field() -> None:
    from gpuop.api.spec import MUTABLE_SPEC_FIELDS

    fields = set(SCHEMA["properties"]["spec"]["properties"]) - set(MUTABLE_SPEC_FIELDS)
    assert {c[0] for c in IMMUTABLE_UPDATES} == fields


def test_every_cel_rule_is_exercised_by_a_bad_case() -> None:
    broken: set[str] = set()
    bodies = [minimal(**c[1]) for c in BAD_SPECS]
    for name in NAMES_REFUSED:
        body = minimal()
        body["metadata"]["name"] = name
        bodies.append(body)
    for body in bodies:
        for error in validate(SCHEMA, body):
            broken.add(error.split(": ", 1)[1])
    for _, old, new in IMMUTABLE_UPDATES:
        for error in validate(SCHEMA, minimal(**{**old, **new}), old=minimal(**old)):
            broken.add(error.split(": ", 1)[1])
    rules = _cel_messages(SCHEMA)
    assert len(rules) >= 9
    assert rules - broken == set(), "CEL rules no bad case breaks"
