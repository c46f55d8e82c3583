"""Backends: which Kubeflow API a training gets, a TrainJob read as job conditions, and the status
and events that say so. Table-driven, no cluster."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from gpuop.api.spec import parse
from gpuop.backends.pytorchjob import PYTORCHJOB
from gpuop.backends.registry import APIS, Choice, choose, gaps, render_job
from gpuop.backends.trainjob import TRAINJOB
from gpuop.observing import observe
from gpuop.observing.derive import derive_status, events
from gpuop.observing.records import JobCondition, Observation, Thresholds
from support.specs import minimal

BOTH: frozenset[str] = frozenset({"pytorchjob", "trainjob"})
V1: frozenset[str] = frozenset({"pytorchjob"})
V2: frozenset[str] = frozenset({"trainjob"})
NONE: frozenset[str] = frozenset()

CHOICES: list[tuple[str, str, frozenset[str], tuple[str, ...], str | None, str]] = [
    ("auto on both prefers v1", "auto", BOTH, (), "pytorchjob", "Auto"),
    ("auto on v1", "auto", V1, ("spec.elastic",), "pytorchjob", "Auto"),
    ("auto on v2", "auto", V2, (), "trainjob", "Auto"),
    ("auto on v2 with elastic", "auto", V2, ("spec.elastic",), None, "Unsupported"),
    ("auto on nothing", "auto", NONE, (), None, "NotServed"),
    ("explicit v2 served", "trainjob", BOTH, (), "trainjob", "Requested"),
    ("explicit v1 served", "pytorchjob", V1, (), "pytorchjob", "Requested"),
    ("explicit v2 missing", "trainjob", V1, (), None, "NotServed"),
    ("explicit v1 missing", "pytorchjob", V2, (), None, "NotServed"),
    ("explicit v1 on nothing", "pytorchjob", NONE, (), None, "NotServed"),
]


@pytest.mark.parametrize(
    ("requested", "served", "gaps", "backend", "reason"),
    [c[1:] for c in CHOICES],
    ids=[c[0] for c in CHOICES],
)
def test_choose(
    requested: Any,
    served: frozenset[str],
    gaps: tuple[str, ...],
    backend: str | None,
    reason: str,
) -> None:
    choice = choose(requested, served, {"trainjob": gaps})
    assert (choice.backend, choice.reason) == (backend, reason)
    assert "\n" not in choice.message


def test_refusals_name_the_fix() -> None:
    assert choose("trainjob", V1, {}).message == (
        "spec.backend is trainjob, but the cluster serves no TrainJob (trainer.kubeflow.org/v1alpha1): "
        "install Kubeflow Trainer v2 or set spec.backend to auto or pytorchjob"
    )
    assert choose("pytorchjob", NONE, {}).message == (
        "spec.backend is pytorchjob, but the cluster serves no PyTorchJob (kubeflow.org/v1): install the "
        "Kubeflow training-operator v1"
    )
    assert "spec.elastic" in choose("auto", V2, {"trainjob": ("spec.elastic",)}).message


def trainjob(conditions: list[dict[str, str]], jobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"kind": "TrainJob", "status": {"conditions": conditions, "jobsStatus": jobs or []}}


def true(kind: str, reason: str = "", at: str = "2026-11-22T10:00:00Z") -> dict[str, str]:
    return {"type": kind, "status": "True", "reason": reason, "message": kind, "lastTransitionTime": at}


NODE_READY = [{"name": "node", "ready": 1, "active": 1, "succeeded": 0, "failed": 0, "suspended": 0}]
NODE_PENDING = [{"name": "node", "ready": 0, "active": 1, "succeeded": 0, "failed": 0, "suspended": 0}]
TRAINJOB_STATES: list[tuple[str, dict[str, Any], set[str]]] = [
    ("just made", trainjob([]), {"Created"}),
    ("pods pending", trainjob([], NODE_PENDING), {"Created"}),
    ("all pods ready", trainjob([], NODE_READY), {"Created", "Running"}),
    ("suspended", trainjob([true("Suspended", "Suspended")]), {"Created", "Suspended"}),
    ("resumed", trainjob([{"type": "Suspended", "status": "False", "reason": "Resumed"}], NODE_READY),
     {"Created", "Running"}),
    ("complete", trainjob([true("Complete")], NODE_READY), {"Created", "Succeeded"}),
    ("failed", trainjob([true("Failed", "DeadlineExceeded")], NODE_READY), {"Created", "Failed"}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("job", "holding"), [c[1:] for c in TRAINJOB_STATES], ids=[c[0] for c in TRAINJOB_STATES]
)
def test_trainjob_states_read_as_job_conditions(job: dict[str, Any], holding: set[str]) -> None:
    assert {c.type for c in TRAINJOB.conditions(job) if c.status == "True"} == holding


def test_a_trainjob_finishes_when_its_condition_turned_true() -> None:
    job = trainjob([true("Complete", at="2026-11-22T10:05:00Z")])
    assert observe.finished(TRAINJOB.conditions(job))
    assert TRAINJOB.times(job) == (None, "2026-11-22T10:05:00Z")
    failed = trainjob([true("Failed", "DeadlineExceeded")])
    assert next(c for c in TRAINJOB.conditions(failed) if c.type == "Failed").reason == "DeadlineExceeded"


def test_slim_job_keeps_what_the_patch_and_status_read() -> None:
    job = {
        "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
        "metadata": {"name": "t", "managedFields": [{}] * 10},
        "spec": {"suspend": True, "activeDeadlineSeconds": 5, "trainer": {"env": [{}] * 100}},
        "status": {"conditions": []},
    }  # fmt: skip
    slim = observe.slim_job(job)
    assert slim["kind"] == "TrainJob"
    assert slim["spec"] == {"suspend": True, "activeDeadlineSeconds": 5}
    assert "managedFields" not in slim["metadata"]


def test_slim_job_keeps_every_backends_patched_fields_and_drops_the_pods() -> None:
    """Whatever the backend: the fields its patch and status read stay (a gang's whole runPolicy
    among them), the pod templates go."""
    body = minimal(workers=3, runPolicy={"activeDeadlineSeconds": 60, "ttlSecondsAfterFinished": 9, "backoffLimit": 2},
                   scheduling={"gang": True, "queueName": "q", "priorityClassName": "p"})  # fmt: skip
    plain = minimal(runPolicy={"activeDeadlineSeconds": 60})  # for a backend that refuses the gang
    for backend in APIS:
        carried = plain if gaps(parse(body).spec).get(backend) else body
        job = render_job(parse(carried), backend, default_image="t:1")[-1]
        slim = observe.slim_job({**job, "status": {}})
        assert APIS[backend].mutable_patch(job, slim) is None, backend
        assert "template" not in json.dumps(slim["spec"]), backend


NOW = datetime(2026, 11, 22, 10, 0, 0, tzinfo=UTC)
NO_ALARMS = Thresholds(stall_timeout_seconds=0)


def test_no_backend_here_is_pending_with_one_warning_and_clears_when_one_appears() -> None:
    choice = choose("trainjob", V1, {})
    waiting = Observation(
        now=NOW, generation=1, workers_total=1, gpus=0, backend_unavailable=(choice.reason, choice.message)
    )
    status = derive_status(None, waiting, NO_ALARMS)
    assert (status.phase, status.message, status.backend) == ("Pending", choice.message, None)
    assert [(e.type, e.reason) for e in events(None, status)] == [("Warning", "NotServed")]
    assert derive_status(status, waiting, NO_ALARMS) is status  # no write while it waits

    chosen = choose("trainjob", BOTH, {})
    made = Observation(
        now=NOW, generation=1, workers_total=1, gpus=0, job_api=TRAINJOB.facts,
        backend_choice=(chosen.reason, chosen.message), job_name="t",
        job_conditions=TRAINJOB.conditions(trainjob([])),
    )  # fmt: skip
    after = derive_status(status, made, NO_ALARMS)
    assert (after.phase, after.backend, after.train_job, after.pytorch_job) == (
        "Created",
        "trainjob",
        "t",
        None,
    )
    kinds = {c.type: (c.status, c.reason) for c in after.conditions}
    assert kinds["BackendUnavailable"] == ("False", "Cleared")
    assert kinds["BackendSelected"] == ("True", "Requested")
    created = [e for e in events(status, after) if e.reason == "TrainJobCreated"]
    assert created[0].message == f"TrainJob t created ({chosen.message})"
    assert not [e for e in events(status, after) if e.reason == "Requested"]  # said once, in Created

    # Chosen once: later observations carry no choice, and the status keeps why.
    later = derive_status(after, Observation(**{**made.__dict__, "backend_choice": None}), NO_ALARMS)
    assert later is after


def test_a_trainjob_runs_succeeds_and_says_its_kind() -> None:
    choice = Choice("trainjob", "Auto", "spec.backend is auto; the cluster serves TrainJob and no PyTorchJob")

    def seen(job: dict[str, Any]) -> Observation:
        return Observation(
            now=NOW, generation=1, workers_total=2, gpus=0, job_api=TRAINJOB.facts,
            backend_choice=(choice.reason, choice.message), job_name="t",
            job_conditions=TRAINJOB.conditions(job),
        )  # fmt: skip

    running = derive_status(None, seen(trainjob([], NODE_READY)), NO_ALARMS)
    assert (running.phase, running.message) == ("Running", "TrainJob t is running")
    failed = derive_status(running, seen(trainjob([true("Failed", "DeadlineExceeded")])), NO_ALARMS)
    assert failed.phase == "Failed"
    assert next(c for c in failed.conditions if c.type == "Failed").reason == "DeadlineExceeded"


def test_job_conditions_of_a_pytorchjob_are_as_kubeflow_wrote_them() -> None:
    job = {"kind": "PyTorchJob", "status": {"conditions": [true("Running", "PyTorchJobRunning")]}}
    assert PYTORCHJOB.conditions(job) == (
        JobCondition("Running", "True", "PyTorchJobRunning", "Running", "2026-11-22T10:00:00Z"),
    )


def _pytorchjob(run_policy: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "PyTorchJob", "spec": {"runPolicy": run_policy}, "status": status}


_STARTED = {"startTime": "2026-11-24T10:00:00Z", "conditions": [{"type": "Running", "status": "True"}]}
_FINISHED = {
    "startTime": "2026-11-24T10:00:00Z", "completionTime": "2026-11-24T10:05:00Z",
    "conditions": [{"type": "Succeeded", "status": "True"}],
}  # fmt: skip


@pytest.mark.parametrize(
    ("run_policy", "status", "due"),
    [
        ({"activeDeadlineSeconds": 20}, _STARTED, ["2026-11-24T10:00:20+00:00"]),
        ({"activeDeadlineSeconds": 20}, {"conditions": [{"type": "Created", "status": "True"}]}, []),
        ({"activeDeadlineSeconds": 20, "suspend": True}, _STARTED, []),
        ({}, _STARTED, []),
        # Once finished the deadline is moot: the TTL counts, from completionTime alone.
        (
            {"activeDeadlineSeconds": 20, "ttlSecondsAfterFinished": 60},
            _FINISHED,
            ["2026-11-24T10:06:00+00:00"],
        ),
        ({"ttlSecondsAfterFinished": 0}, _FINISHED, ["2026-11-24T10:05:00+00:00"]),
        ({"activeDeadlineSeconds": 20}, _FINISHED, []),
        ({"ttlSecondsAfterFinished": 60}, {**_FINISHED, "completionTime": None}, []),
        ({"activeDeadlineSeconds": 20}, {**_STARTED, "startTime": "yesterday"}, []),
    ],
    ids=[
        "deadline",
        "not started",
        "suspended",
        "no deadline",
        "ttl",
        "ttl 0",
        "finished, no ttl",
        "no completion time",
        "not a time",
    ],
)
def test_a_pytorchjob_wakes_at_its_deadline_and_at_its_ttl(
    run_policy: dict[str, Any], status: dict[str, Any], due: list[str]
) -> None:
    """The v1 training-operator sleeps through both (kubeflow/trainer#3358); the operator
    touches the job at these times, and only at these."""
    assert [t.isoformat() for t in PYTORCHJOB.wake_times(_pytorchjob(run_policy, status))] == due
    assert PYTORCHJOB.wake_times(None) == ()


def test_a_trainjob_keeps_its_own_clocks() -> None:
    job = {"kind": "TrainJob", "spec": {"activeDeadlineSeconds": 20}, "status": _STARTED}
    assert TRAINJOB.wake_times(job) == ()
