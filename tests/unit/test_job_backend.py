"""The Job backend: an Indexed batch/v1 Job and its headless Service carry what the Kubeflow
backends guarantee (the real API server and Job controller take them in
tests/controlplane/test_job_backend.py, the real nodes train on them in tests/e2e_local)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuop._kits.schema import SpecError
from gpuop.api.spec import parse
from gpuop.backends.job import COMPLETION_INDEX_ANNOTATION, JOB, master_address, render_job, render_service
from gpuop.backends.pod import kubeflow_backoff_limit
from gpuop.backends.pytorchjob import render_pytorchjob
from gpuop.backends.registry import choose, gaps, render_objects
from gpuop.observing import observe
from gpuop.observing.records import JobCondition
from gputrain.contract import RENDEZVOUS_PORT
from support.paths import ROOT
from support.specs import EXAMPLES, load_example, minimal

GOLDEN = ROOT / "tests" / "golden" / "job"
UID = "9b2f4c1e-0d7a-4a8e-9a51-3f0c6a2b7d10"
RENDERED = [p for p in EXAMPLES if "job" not in gaps(parse(load_example(p)).spec)]


def job_of(body: dict[str, Any]) -> dict[str, Any]:
    return render_job(parse(body), default_image="trainer:test")


def env_of(job: dict[str, Any]) -> dict[str, Any]:
    container = job["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("example", RENDERED, ids=[p.name for p in RENDERED])
def test_examples_match_their_golden_files(example: Path) -> None:
    body = load_example(example)
    body["metadata"] |= {"namespace": "ml", "uid": UID}
    rendered = yaml.safe_dump_all(JOB.render(parse(body), default_image="trainer:test"), sort_keys=False)
    golden = GOLDEN / example.name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(rendered)
    assert golden.read_text() == rendered, (
        f"{golden} differs; UPDATE_GOLDEN=1 pytest rewrites it, then review"
    )


def test_most_examples_run_on_a_job() -> None:
    assert len(RENDERED) >= len(EXAMPLES) - 2  # the elastic ones are the exceptions


def test_one_pod_per_worker_each_its_index_and_host_under_the_service() -> None:
    training = parse(minimal(workers=3, gpusPerWorker=2))
    service, job = render_service(training), render_job(training)
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == training.name
    assert pod["restartPolicy"] == "OnFailure"  # a failed trainer restarts in its pod, checkpoints kept
    assert spec["podReplacementPolicy"] == "Failed"  # never two pods answering to one rank
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])  # /dev/shm


def test_the_rendezvous_is_worker_zero_and_the_rank_its_index() -> None:
    job = job_of(minimal(workers=4, gpusPerWorker=8))
    env = env_of(job)
    assert env["MASTER_ADDR"] == env["PET_MASTER_ADDR"] == master_address(job["metadata"]["name"])
    assert env["MASTER_PORT"] == env["PET_MASTER_PORT"] == str(RENDEZVOUS_PORT)
    assert env["PET_NNODES"] == env["WORLD_SIZE"] == "4"
    assert env["PET_NPROC_PER_NODE"] == "8"
    index = {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}
    assert env["PET_NODE_RANK"] == env["RANK"] == index
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == ["--nproc-per-node=8", "--master-addr=$(MASTER_ADDR)", "--master-port=$(MASTER_PORT)"]


def test_the_spec_env_comes_after_the_rank_env_so_it_may_name_it() -> None:
    job = job_of(minimal(env=[{"name": "INIT", "value": "tcp://$(MASTER_ADDR):$(MASTER_PORT)"}]))
    names = [e["name"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert names.index("MASTER_ADDR") < names.index("MASTER_PORT") < names.index("INIT")


def test_the_pod_is_the_pytorchjobs_but_for_what_each_controller_adds() -> None:
    body = minimal(workers=2, gpusPerWorker=8, scheduling={"priorityClassName": "high"})
    ours = job_of(body)["spec"]["template"]
    kubeflow = render_pytorchjob(parse(body), default_image="trainer:test")["spec"]["pytorchReplicaSpecs"]
    theirs = kubeflow["Worker"]["template"]
    rank = {e["name"] for e in ours["spec"]["containers"][0]["env"]} - {
        e["name"] for e in theirs["spec"]["containers"][0]["env"]
    }
    assert rank == {"PYTHONUNBUFFERED", "MASTER_ADDR", "MASTER_PORT", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                    "WORLD_SIZE", "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "RANK"}  # fmt: skip
    for key in ("volumes", "securityContext", "priorityClassName", "shareProcessNamespace"):
        assert ours["spec"][key] == theirs["spec"][key]


@pytest.mark.parametrize(
    ("restarts", "limit"),
    [(None, 2**31 - 1), (0, kubeflow_backoff_limit(0, 3)), (4, kubeflow_backoff_limit(4, 3))],
)
def test_backoff_counts_every_pods_restarts_and_none_means_no_limit(restarts: int | None, limit: int) -> None:
    run_policy = {} if restarts is None else {"backoffLimit": restarts}
    assert job_of(minimal(workers=3, runPolicy=run_policy))["spec"]["backoffLimit"] == limit


def test_the_run_policy_is_the_jobs_own() -> None:
    spec = job_of(
        minimal(runPolicy={"activeDeadlineSeconds": 60, "ttlSecondsAfterFinished": 30, "suspend": True})
    )["spec"]
    assert (spec["activeDeadlineSeconds"], spec["ttlSecondsAfterFinished"], spec["suspend"]) == (60, 30, True)
    queued = job_of(minimal(scheduling={"queueName": "team-a"}))
    assert queued["spec"]["suspend"] is True  # Kueue unsuspends it on admission
    assert queued["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert JOB.wake_times(queued) == ()  # the Job's controllers keep their own clocks


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"elastic": {"maxWorkers": 3}}, "spec.elastic"),
        ({"scheduling": {"gang": True}}, "spec.scheduling.gang"),
        ({"runPolicy": {"cleanPodPolicy": "All"}}, "spec.runPolicy.cleanPodPolicy"),
    ],
)
def test_what_a_job_cannot_carry_is_refused_naming_the_field(spec: dict[str, Any], field: str) -> None:
    training = parse(minimal(**spec))
    assert field in gaps(training.spec)["job"]
    with pytest.raises(SpecError) as refused:
        render_job(training)
    assert str(refused.value).startswith(f"{field}: cannot be used with backend job: ")


def test_the_service_is_made_before_the_job() -> None:
    kinds = [o["kind"] for o in render_objects(JOB, parse(minimal()), default_image="trainer:test")]
    assert kinds == ["Service", "Job"]


def test_auto_takes_a_job_where_no_kubeflow_is_served() -> None:
    assert choose("auto", frozenset({"job"}), {}).backend == "job"
    assert choose("auto", frozenset({"pytorchjob", "job"}), {}).backend == "pytorchjob"
    elastic = gaps(parse(minimal(elastic={"maxWorkers": 3})).spec)
    assert choose("auto", frozenset({"trainjob", "job"}), elastic).backend is None  # neither carries it


def condition(type_: str, status: str = "True", reason: str | None = None) -> dict[str, Any]:
    return {"type": type_, "status": status, "reason": reason, "lastTransitionTime": "2026-11-28T10:00:00Z"}


def job_status(*conditions: dict[str, Any], ready: int | None = None, **status: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"conditions": list(conditions), **status}
    if ready is not None:
        body["ready"] = ready
    return {"kind": "Job", "spec": {"parallelism": 2}, "status": body}


def kinds(job: dict[str, Any]) -> dict[str, str]:
    return {c.type: c.status for c in JOB.conditions(job)}


def test_a_jobs_conditions_read_as_the_pytorchjobs() -> None:
    assert kinds(job_status(ready=0)) == {"Created": "True", "Running": "False"}
    assert kinds(job_status(ready=2)) == {"Created": "True", "Running": "True"}
    assert kinds(job_status(condition("Suspended"), ready=0))["Suspended"] == "True"
    done = job_status(
        condition("SuccessCriteriaMet"), condition("Complete"), ready=0, completionTime="2026-11-28T10:01:00Z"
    )
    assert kinds(done) == {"Created": "True", "Succeeded": "True", "Running": "False"}
    assert observe.finished(JOB.conditions(done))
    assert JOB.times(done)[1] == "2026-11-28T10:01:00Z"
    failed = job_status(condition("FailureTarget", reason="BackoffLimitExceeded"), ready=1)
    assert kinds(failed)["Failed"] == "True"
    assert kinds(failed)["Running"] == "False"
    deadline = job_status(condition("Failed", reason="DeadlineExceeded"))
    assert next(c for c in JOB.conditions(deadline) if c.type == "Failed") == JobCondition(
        "Failed", "True", "DeadlineExceeded", None, "2026-11-28T10:00:00Z"
    )
    assert JOB.times(deadline)[1] == "2026-11-28T10:00:00Z"  # no completionTime on failure


def test_the_patch_brings_the_mutable_fields_to_the_spec_and_survives_the_slim_copy() -> None:
    made = job_of(minimal(runPolicy={"activeDeadlineSeconds": 60}))
    kept = observe.slim_job({**made, "status": {}})
    assert "template" not in kept["spec"]  # the big part is dropped
    assert JOB.mutable_patch(made, kept) is None
    wanted = job_of(minimal(runPolicy={"activeDeadlineSeconds": 120, "backoffLimit": 1, "suspend": True}))
    assert JOB.mutable_patch(wanted, kept) == {
        "spec": {"suspend": True, "activeDeadlineSeconds": 120, "backoffLimit": kubeflow_backoff_limit(1, 1)}
    }
    assert JOB.mutable_patch(wanted, kept, skip=("suspend",)) == {
        "spec": {"activeDeadlineSeconds": 120, "backoffLimit": kubeflow_backoff_limit(1, 1)}
    }
    assert JOB.suspended({"spec": JOB.suspend_patch()["spec"]})
