"""A third job API is one class and one registry entry: a toy backend, registered for each test, runs
through the real Reconciler (choose, render with a companion, create, read its conditions,
suspension and times, patch, derive status, events) with nothing else changed, and is in the
CRD (its name, its refusals) and the chart's RBAC as generated.

The Kubernetes API is a small in-memory store (support.toyjob, with the toy): what is under
test is that the reconciler asks the backend and never branches on which one it is.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml

from gpuop._kits.schema import SpecError
from gpuop.api.crd import build_crd
from gpuop.backends import registry
from gpuop.controller import discovery
from gpuop.controller.apiclient import ApiError
from gpuop.controller.reconciler import Reconciler
from gpuop.controller.settings import OperatorSettings
from gpuop.observing import observe
from gpuop.observing.endpoint import ReportBook
from gpuop.observing.records import ReceivedReport
from gpuop.observing.reports import parse_report
from support.specs import minimal
from support.toyjob import Store, ToyJobApi


def test_a_registered_backend_runs_through_reconcile(toy: ToyJobApi) -> None:
    store = Store()
    body = minimal()
    body["metadata"] |= {"name": "t", "namespace": "default", "uid": "u-1", "generation": 1}
    store.trainings[("default", "t")] = store._stamp(copy.deepcopy(body))
    clock = iter(datetime(2026, 11, 23, 10, 0, s, tzinfo=UTC) for s in range(60))
    reconciler = Reconciler(store, OperatorSettings(), clock=lambda: next(clock))  # type: ignore[arg-type]
    try:
        reconciler.training_event("ADDED", store.get_training("default", "t") or {})
        reconciler.run_pending()
        # Auto took the only API served; its companion was made first, the job last, ours.
        assert store.created == ["ToyConfig", "ToyJob"]
        job = store.job()
        assert job["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        assert observe.created_from(job) is not None
        status = store.trainings[("default", "t")]["status"]
        assert (status["phase"], status["backend"]) == ("Created", "toyjob")
        selected = next(c for c in status["conditions"] if c["type"] == "BackendSelected")
        assert (
            selected["message"]
            == "spec.backend is auto; the cluster serves ToyJob and no PyTorchJob or TrainJob or Job"
        )

        # Its state, read by the backend, becomes the phase; its start time, status's.
        job["status"] = {"state": "Running", "began": "2026-11-23T10:00:05Z"}
        reconciler.job_event("MODIFIED", store._stamp(copy.deepcopy(job)))
        reconciler.run_pending()
        status = store.trainings[("default", "t")]["status"]
        assert (status["phase"], status["message"]) == ("Running", "ToyJob t is running")
        assert status["startTime"] == "2026-11-23T10:00:05Z"
        # The job, named in status: no field of its own (those are the deprecated ones).
        assert status["job"] == {"apiVersion": "toy.example.com/v1", "kind": "ToyJob", "name": "t"}
        assert "pytorchJob" not in status
        assert "trainJob" not in status

        # Another controller's job that copied our labels (a TrainJob's JobSet makes batch/v1
        # Jobs so) is not the training's: every backend names its job after the training.
        foreign = copy.deepcopy(job)
        foreign["metadata"] |= {"name": "t-node-0-0", "uid": "u-other"}
        foreign |= {"apiVersion": "batch/v1", "kind": "Job", "status": {}}
        reconciler.job_event("ADDED", store._stamp(foreign))
        reconciler.run_pending()
        assert store.trainings[("default", "t")]["status"]["phase"] == "Running"

        # A spec change reaches the job through the backend's patch.
        training = store.trainings[("default", "t")]
        training["spec"]["runPolicy"] = {"suspend": True}
        training["metadata"]["generation"] = 2
        reconciler.training_event("MODIFIED", store._stamp(copy.deepcopy(training)))
        reconciler.run_pending()
        assert store.job()["spec"]["paused"] is True

        writes = store.status_writes
        reconciler.reconcile(("default", "t"))  # nothing new: no write
        assert store.status_writes == writes

        job = store.job()
        job["status"] = {"state": "Done", "began": "2026-11-23T10:00:05Z", "since": "2026-11-23T10:00:30Z"}
        reconciler.job_event("MODIFIED", store._stamp(copy.deepcopy(job)))
        reconciler.run_pending()
        status = store.trainings[("default", "t")]["status"]
        assert status["phase"] == "Succeeded"
        assert status["completionTime"] == "2026-11-23T10:00:30Z"
    finally:
        reconciler.close()  # waits for the Events, posted off the reconcile's thread
    # Posted by a pool of threads: in any order.
    assert sorted(store.events) == ["ToyJobCreated", "ToyRunning", "TrainingSucceeded"]


def test_auto_passes_over_a_backend_that_cannot_carry_the_spec(toy: ToyJobApi) -> None:
    spec_gaps = {"toyjob": ("spec.elastic",)}
    choice = registry.choose("auto", frozenset({"toyjob"}), spec_gaps)
    assert (choice.backend, choice.reason) == (None, "Unsupported")
    assert choice.message == (
        "the cluster serves only ToyJob (the toy controller), which cannot carry spec.elastic: install the "
        "Kubeflow training-operator v1 or Kubeflow Trainer v2 or Kubernetes' batch/v1 API, or drop those fields"
    )
    assert registry.choose("auto", frozenset({"toyjob", "trainjob"}), spec_gaps).backend == "trainjob"


def test_its_name_and_refusals_are_in_the_crd_and_its_access_in_the_charts_rbac(toy: ToyJobApi) -> None:
    """What the CRD and the chart say of the backends comes from the registry: a new one is in
    spec.backend's enum and description, its refusals are the CRD's rules and ``gpuop
    validate``'s, and the chart grants what it does to its objects."""
    crd = build_crd(registry.summaries(), registry.all_gaps())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["backend"]["enum"] == ["auto", "pytorchjob", "trainjob", "job", "toyjob"]
    assert "toyjob: a toy's ToyJob." in spec["properties"]["backend"]["description"]
    rule = {"rule": "self.backend != 'toyjob' || !(has(self.elastic))",
            "message": "cannot be used with backend toyjob: toys do not stretch", "fieldPath": ".elastic"}  # fmt: skip
    assert rule in spec["x-kubernetes-validations"]
    body = minimal(backend="toyjob", elastic={"maxWorkers": 2})
    with pytest.raises(SpecError) as refused:
        registry.parse_training(body)
    assert str(refused.value) == "spec.elastic: cannot be used with backend toyjob: toys do not stretch"
    assert registry.parse_training(minimal(backend="toyjob")).spec.backend == "toyjob"
    rules = yaml.safe_load(registry.rbac_rules_yaml())
    assert rules[-2:] == [
        {"apiGroups": ["toy.example.com"], "resources": ["toyjobs"], "verbs": ["get", "list", "watch", "create", "patch"]},
        {"apiGroups": ["toy.example.com"], "resources": ["toyconfigs"], "verbs": ["get", "create"]},
    ]  # fmt: skip
    assert "# The ToyConfig of each ToyJob (backend toyjob)" in registry.rbac_rules_yaml()


def test_a_backend_the_operator_does_not_have_is_refused_naming_the_choices() -> None:
    with pytest.raises(SpecError) as refused:
        registry.parse_training(minimal(backend="toyjob"))
    assert str(refused.value) == 'spec.backend: must be one of auto, pytorchjob, trainjob, job (got "toyjob")'
    choice = registry.choose("toyjob", frozenset({"pytorchjob"}), {})
    assert (choice.backend, choice.reason) == (None, "Unsupported")
    assert choice.message == str(refused.value)  # the same line, wherever it is said


def _report(step: int, percent: int) -> ReceivedReport:
    body = {"trainerStatus": {"progressPercentage": percent, "metrics": [
        {"name": "current_step", "value": str(step)}, {"name": "total_steps", "value": "40"},
        {"name": "loss", "value": "0.5"}]}}  # fmt: skip
    return ReceivedReport(
        "t-node-0", parse_report(json.dumps(body).encode()), datetime(2026, 11, 23, tzinfo=UTC)
    )


def _reporting_training(
    store: Store, now: list[datetime] | None = None, **spec: Any
) -> tuple[Reconciler, ReportBook]:
    """A training ``t`` in ``store`` whose code reports (spec.command, and ``spec``), and a
    reconciler over both whose clock moves a second a call, or is ``now[0]`` (the work queue's
    delays too)."""
    body = minimal(command=["python", "train.py"], dataset=None, **spec)
    body["metadata"] |= {"name": "t", "namespace": "default", "uid": "u-1", "generation": 1}
    store.trainings[("default", "t")] = store._stamp(copy.deepcopy(body))
    seconds = itertools.count()
    book = ReportBook()
    clocks: dict[str, Any] = (
        {"clock": lambda: now[0], "timer": lambda: now[0].timestamp()}
        if now is not None
        else {"clock": lambda: datetime(2026, 11, 23, 10, tzinfo=UTC) + timedelta(seconds=next(seconds))}
    )
    reconciler = Reconciler(store, OperatorSettings(), reports=book, **clocks)  # type: ignore[arg-type]
    return reconciler, book


def _running(reconciler: Reconciler, store: Store, began: str) -> None:
    """Training ``t`` made, and its job Running since ``began``, all reconciled."""
    reconciler.training_event("ADDED", store.get_training("default", "t") or {})
    reconciler.run_pending()
    job = store.job()
    job["status"] = {"state": "Running", "began": began}
    reconciler.job_event("MODIFIED", store._stamp(copy.deepcopy(job)))
    reconciler.run_pending()


def test_reports_reach_status_once_a_tick_not_on_every_event(toy: ToyJobApi) -> None:
    """Every status write comes back as a watch event. Were that event's reconcile to read the
    reports that arrived since the tick, a training reporting every 5 s would be written twice
    within milliseconds (bench/report_scale.py saw it): reports enter status at the tick, and
    at the job's end (its last report, percent 100) at once."""
    store = Store()
    reconciler, book = _reporting_training(store)
    key = ("default", "t")
    try:
        _running(reconciler, store, "2026-11-23T10:00:05Z")

        book.put(key, _report(10, 25))
        reconciler.tick()
        reconciler.run_pending()
        assert store.trainings[key]["status"]["progress"]["step"] == 10
        writes = store.status_writes

        book.put(key, _report(20, 50))  # between two ticks
        reconciler.training_event("MODIFIED", store.get_training(*key) or {})  # our own write, echoed
        reconciler.run_pending()
        assert store.status_writes == writes
        assert store.trainings[key]["status"]["progress"]["step"] == 10

        reconciler.tick()
        reconciler.run_pending()
        assert store.status_writes == writes + 1
        assert store.trainings[key]["status"]["progress"]["step"] == 20

        book.put(key, _report(40, 100))  # the last, as the code ended
        job = store.job()
        job["status"] = {"state": "Done", "began": "2026-11-23T10:00:05Z", "since": "2026-11-23T10:00:30Z"}
        reconciler.job_event("MODIFIED", store._stamp(copy.deepcopy(job)))
        reconciler.run_pending()
        status = store.trainings[key]["status"]
        assert status["phase"] == "Succeeded"
        assert (status["progress"]["step"], status["progress"]["percent"]) == (40, 100)
    finally:
        reconciler.close()


class FailingOnce(Store):
    """The store, whose next status write fails once ``fail`` is set."""

    fail = False

    def patch_training_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        if self.fail:
            self.fail = False
            raise ApiError(500, "InternalError", "etcdserver: request timed out")
        return super().patch_training_status(namespace, name, patch)


def test_the_tick_passes_over_a_quiet_created_training_and_not_over_what_changed(toy: ToyJobApi) -> None:
    """A job made and its pods not yet there (a burst of 1,000 new trainings): the tick's
    reconcile would see what the last one saw, so it is not made. New reports, a failed
    reconcile to retry, or a running job (the clock decides Stalled) are reconciled each tick."""
    store = FailingOnce()
    reconciler, book = _reporting_training(store)
    key = ("default", "t")
    reconciled: list[str] = []
    reconcile = reconciler.reconcile
    reconciler.reconcile = lambda k: reconciled.append(reconcile(k)) or reconciled[-1]  # type: ignore[method-assign]
    try:
        reconciler.training_event("ADDED", store.get_training(*key) or {})
        reconciler.run_pending()
        assert store.trainings[key]["status"]["phase"] == "Created"
        reconciled.clear()
        reconciler.tick()
        reconciler.run_pending()
        reconciler.tick()
        reconciler.run_pending()
        assert reconciled == []

        book.put(key, _report(0, 0))  # its code says something: seen at the next tick
        reconciler.tick()
        reconciler.run_pending()
        assert len(reconciled) == 1
        reconciler.tick()
        reconciler.run_pending()
        assert len(reconciled) == 1

        store.fail = True  # a report whose status write fails: the next tick tries again
        book.put(key, _report(5, 10))
        reconciler.tick()
        reconciler.run_pending()
        assert reconciled[-1] == "error"
        reconciler.tick()
        reconciler.run_pending()
        assert reconciled[-1] != "error"
        assert store.trainings[key]["status"]["progress"]["step"] == 5
        count = len(reconciled)
        reconciler.tick()
        reconciler.run_pending()
        assert len(reconciled) == count

        job = store.job()
        job["status"] = {"state": "Running", "began": "2026-11-23T10:00:05Z"}
        reconciler.job_event("MODIFIED", store._stamp(copy.deepcopy(job)))
        reconciler.run_pending()
        count = len(reconciled)
        reconciler.tick()
        reconciler.run_pending()
        reconciler.tick()
        reconciler.run_pending()
        assert len(reconciled) == count + 2  # Running: the clock may raise Stalled
    finally:
        reconciler.close()


def test_a_stall_is_raised_at_its_deadline_by_the_clock_alone(toy: ToyJobApi) -> None:
    """A running training whose steps stop: its last reconcile queued its key for the stall
    deadline (add_after), so Stalled comes then, with no tick and no event to bring it."""
    store = Store()
    start = datetime(2026, 11, 23, 10, tzinfo=UTC)
    now = [start]
    reconciler, book = _reporting_training(store, now, stallTimeoutSeconds=60)
    key = ("default", "t")

    def conditions() -> dict[str, str]:
        status = store.trainings[key]["status"]
        return {c["type"]: c["status"] for c in status.get("conditions") or []}

    try:
        _running(reconciler, store, "2026-11-23T10:00:00Z")
        book.put(key, _report(5, 10))
        reconciler.tick()  # the one tick: it brings the report, step 5 at 10:00:00
        reconciler.run_pending()
        assert store.trainings[key]["status"]["phase"] == "Running"
        assert store.trainings[key]["status"]["progress"]["step"] == 5
        now[0] = start + timedelta(seconds=59)
        assert reconciler.run_pending() == 0  # nothing is due yet
        assert conditions().get("Stalled") != "True"
        now[0] = start + timedelta(seconds=60)
        assert reconciler.run_pending() == 1
        assert conditions()["Stalled"] == "True"
        now[0] = start + timedelta(hours=1)
        assert reconciler.run_pending() == 0  # raised: that clock runs no more
    finally:
        reconciler.close()


class StoreWithKueue(Store):
    """The store, serving Kueue's Workloads (v1beta2) once ``kueue`` is set."""

    kueue = False

    def served_resources(self, api_version: str) -> frozenset[str]:
        if api_version == "kueue.x-k8s.io/v1beta2":
            return frozenset({"workloads", "localqueues"}) if self.kueue else frozenset()
        return super().served_resources(api_version)


def test_a_queued_training_on_a_cluster_without_kueue_says_so_at_once_and_gets_its_job_once_kueue_is_there(
    toy: ToyJobApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """spec.scheduling.queueName with no Kueue API served: no job is made (suspended, it would
    wait for nobody; running, it would skip the queue), the status is Pending with reason
    KueueNotInstalled naming the field and what to install, said once as a Warning; once
    discovery finds Kueue, the job is made, suspended for Kueue to admit."""
    monkeypatch.setattr(discovery, "DISCOVERY_TTL_SECONDS", 0.0)  # every reconcile asks again
    store = StoreWithKueue()
    body = minimal(scheduling={"queueName": "team-a"})
    body["metadata"] |= {"name": "t", "namespace": "default", "uid": "u-1", "generation": 1}
    store.trainings[("default", "t")] = store._stamp(copy.deepcopy(body))
    clock = iter(datetime(2026, 11, 24, 10, 0, s, tzinfo=UTC) for s in range(60))
    reconciler = Reconciler(store, OperatorSettings(), clock=lambda: next(clock))  # type: ignore[arg-type]
    try:
        reconciler.training_event("ADDED", store.get_training("default", "t") or {})
        reconciler.run_pending()
        assert store.created == []
        status = store.trainings[("default", "t")]["status"]
        waiting = next(c for c in status["conditions"] if c["type"] == "BackendUnavailable")
        assert (status["phase"], waiting["status"], waiting["reason"]) == (
            "Pending",
            "True",
            "KueueNotInstalled",
        )
        assert waiting["message"] == (
            "spec.scheduling.queueName is 'team-a', but this cluster serves no Kueue API (kueue.x-k8s.io/v1beta2 "
            "or kueue.x-k8s.io/v1beta1 Workloads): install Kueue with its ToyJob integration "
            "(https://kueue.sigs.k8s.io/docs/installation/), or remove spec.scheduling.queueName; the ToyJob is "
            "made once Kueue is served"
        )
        writes = store.status_writes
        reconciler.reconcile(("default", "t"))  # still none: no second write, no job
        assert (store.status_writes, store.created) == (writes, [])

        store.kueue = True
        reconciler.reconcile(("default", "t"))
        assert store.created == ["ToyConfig", "ToyJob"]
        assert store.job()["spec"]["paused"] is True  # Kueue's to resume
        status = store.trainings[("default", "t")]["status"]
        assert {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}[
            "BackendUnavailable"
        ] == (
            "False",
            "Cleared",
        )
    finally:
        reconciler.close()
    assert store.events.count("KueueNotInstalled") == 1


def test_a_clock_the_controller_sleeps_through_wakes_it_when_due_and_again_only_if_it_slept_on(
    toy: ToyJobApi,
) -> None:
    """The v1 training-operator fails a job past its deadline and deletes one past its TTL only
    when something makes it reconcile (kubeflow/trainer#3358). The operator touches the job at
    the time its backend names: once, again 30 s later if nothing came of it, and for a
    finished job too: each reconcile queues its key for the job's next clock (add_after)."""
    store = Store()
    body = minimal()
    body["metadata"] |= {"name": "t", "namespace": "default", "uid": "u-1", "generation": 1}
    store.trainings[("default", "t")] = store._stamp(copy.deepcopy(body))
    now = [datetime(2026, 11, 24, 10, 0, 0, tzinfo=UTC)]
    reconciler = Reconciler(
        store,  # type: ignore[arg-type]
        OperatorSettings(),
        clock=lambda: now[0],
        timer=lambda: now[0].timestamp(),  # the work queue's delays on the same clock
    )

    def at(seconds: int) -> None:
        now[0] = datetime(2026, 11, 24, 10, 0, 0, tzinfo=UTC) + timedelta(seconds=seconds)
        reconciler.run_pending()  # what is due by then; no tick (a clock is the queue's alone)

    try:
        reconciler.training_event("ADDED", store.get_training("default", "t") or {})
        reconciler.run_pending()
        job = store.job()
        job["status"] = {
            "state": "Running",
            "began": "2026-11-24T10:00:00Z",
            "wakeAt": "2026-11-24T10:00:20Z",
        }
        reconciler.job_event("MODIFIED", store._stamp(copy.deepcopy(job)))
        reconciler.run_pending()
        at(10)
        assert store.annotated == []
        at(20)
        assert store.annotated == ["gpuop.io/woken-at=2026-11-24T10:00:20+00:00"]
        at(30)
        at(45)
        assert len(store.annotated) == 1  # one PATCH; the controller has 30 s to act on it
        at(50)
        assert store.annotated[1:] == ["gpuop.io/woken-at=2026-11-24T10:00:50+00:00"]

        # Finished, with a TTL: nothing reconciles it but its clock, at its TTL's end.
        job = store.job()
        job["status"] = {"state": "Done", "began": "2026-11-24T10:00:00Z", "since": "2026-11-24T10:01:00Z",
                         "wakeAt": "2026-11-24T10:03:00Z"}  # fmt: skip
        reconciler.job_event("MODIFIED", store._stamp(copy.deepcopy(job)))
        reconciler.run_pending()
        assert store.trainings[("default", "t")]["status"]["phase"] == "Succeeded"
        writes = store.status_writes
        at(120)
        assert (len(store.annotated), store.status_writes) == (2, writes)
        at(180)
        assert store.annotated[2:] == ["gpuop.io/woken-at=2026-11-24T10:03:00+00:00"]

        # Deleted meanwhile (its controller acted): the touch finds nothing, and says nothing.
        store.objects = {k: v for k, v in store.objects.items() if v["kind"] != "ToyJob"}
        at(210)
        assert len(store.annotated) == 3
        assert store.trainings[("default", "t")]["status"]["phase"] == "Succeeded"
    finally:
        reconciler.close()
    assert "ReconcileError" not in store.events
