"""Every ``$(VAR)`` an example's trainer container uses is defined in that backend's pods.

Kubernetes expands ``$(VAR)`` in command and args from the container's env, and in an env
value from the entries before it; a name it cannot find stays literally ``$(VAR)``: torchrun
then gets ``--master-addr=$(MASTER_ADDR)`` and waits for a host of that name. The env of the
pods is ours (rendered) plus what the backend's controller adds (``controller_env``: the
training-operator's MASTER_* and PET_*, Trainer v2's PET_* only; the Job backend renders its
own, the Job controller adds none we read). The controllers' sets are
checked on their real pods in tests/e2e_local/test_examples.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from gpuop.api.spec import parse
from gpuop.backends.contract import JobApi
from gpuop.backends.job import JOB
from gpuop.backends.pytorchjob import PYTORCHJOB
from gpuop.backends.registry import gaps
from gpuop.backends.trainjob import TRAINJOB
from support.schemas.kubeflow import merged_pod_template
from support.specs import EXAMPLES, load_example, minimal

VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def references(text: str) -> set[str]:
    """The names ``$(NAME)`` in ``text`` refers to (``$$`` escapes a ``$``)."""
    return set(VAR.findall(text.replace("$$", "")))


BACKENDS: dict[str, JobApi] = {"pytorchjob": PYTORCHJOB, "trainjob": TRAINJOB, "job": JOB}


def trainer_containers(api: JobApi, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The trainer container of each pod template the backend's controller makes pods from."""
    objects = api.render(parse(body), default_image="trainer:test")
    if api is TRAINJOB:
        runtime, job = objects
        return [merged_pod_template(job, runtime)["spec"]["containers"][0]]
    if api is JOB:
        _service, job = objects
        return [job["spec"]["template"]["spec"]["containers"][0]]
    (job,) = objects
    return [
        replica["template"]["spec"]["containers"][0]
        for replica in job["spec"]["pytorchReplicaSpecs"].values()
    ]


def undefined(api: JobApi, body: dict[str, Any]) -> set[str]:
    """The ``$(VAR)`` names of the trainer containers that nothing in their pods defines."""
    added = api.controller_env(parse(body).spec)
    missing: set[str] = set()
    for container in trainer_containers(api, body):
        env = container.get("env") or []
        assert not {e["name"] for e in env} & added, "rendered what the controller adds"
        defined = {e["name"] for e in env} | added
        words = [*container.get("command", []), *container.get("args", [])]
        missing |= {name for word in words for name in references(word)} - defined
        before: set[str] = set()  # an env value sees the entries above it only
        for entry in env:
            missing |= references(str(entry.get("value", ""))) - before
            before.add(entry["name"])
    return missing


CASES = [
    (example, backend)
    for example in EXAMPLES
    for backend, api in BACKENDS.items()
    if backend not in gaps(parse(load_example(example)).spec)
]


@pytest.mark.parametrize(("example", "backend"), CASES, ids=[f"{e.name}-{b}" for e, b in CASES])
def test_every_variable_an_example_uses_is_defined_in_that_backends_pods(example: Path, backend: str) -> None:
    assert undefined(BACKENDS[backend], load_example(example)) == set()


def test_every_backend_takes_every_example_it_can_carry() -> None:
    assert {b for _, b in CASES} == set(BACKENDS)
    assert len(CASES) > len(EXAMPLES)  # most examples run on both


@pytest.mark.parametrize(
    ("args", "backend", "missing"),
    [
        (["--master-addr=$(MASTER_ADDR)"], "trainjob", {"MASTER_ADDR"}),  # Trainer sets PET_* only
        (["--master-addr=$(MASTER_ADDR)"], "pytorchjob", set()),
        (["--master-addr=$(PET_MASTER_ADDR)"], "trainjob", set()),
        (["--master-addr=$(PET_MASTER_ADDR)"], "pytorchjob", set()),
        (["--out=$(NOWHERE)"], "pytorchjob", {"NOWHERE"}),
        (["--master-addr=$(MASTER_ADDR)"], "job", set()),  # rendered before the spec's own
        (["--out=$(NOWHERE)"], "job", {"NOWHERE"}),
        (["$$(MASTER_ADDR) is escaped"], "trainjob", set()),  # a literal $(MASTER_ADDR)
    ],
)
def test_a_variable_no_pod_defines_is_found(args: list[str], backend: str, missing: set[str]) -> None:
    body = minimal(dataset=None, command=["torchrun"], args=["/app/train.py", *args])
    assert undefined(BACKENDS[backend], body) == missing
