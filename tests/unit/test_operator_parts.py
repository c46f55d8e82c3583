"""The operator's pure parts and its API client, each on its own: readings of API objects,
settings, the runPolicy patch, and the client's retries against the emulator's faults."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuop.api.spec import parse
from gpuop.backends.pytorchjob import PYTORCHJOB, render_pytorchjob
from gpuop.backends.trainjob import TRAINJOB, render_trainjob
from gpuop.controller import table
from gpuop.controller.apiclient import ApiError, Backoff, request_target
from gpuop.controller.credentials import Credentials
from gpuop.controller.kube import Kube
from gpuop.controller.settings import OperatorSettings, SettingsError
from gpuop.observing import observe
from gpuop.observing.records import QueueState
from gputrain.contract import Result
from support.emulator.server import ApiServer, RunningApiServer
from support.specs import minimal
from support.tools.operator_args import parse_operator_args


def _pod(trainer: str = "pytorch", **status: Any) -> dict[str, Any]:
    """A training pod whose trainer container is ``trainer``, as its template names it."""
    annotations = {"kubectl.kubernetes.io/default-container": trainer}
    return {"metadata": {"name": "p", "labels": {"gpuop.io/gputraining": "t"}, "annotations": annotations},
            "status": status}  # fmt: skip


@pytest.mark.parametrize(
    ("pod", "ip", "ready", "message"),
    [
        (_pod(phase="Pending"), None, False, None),
        (_pod(phase="Running", podIP="10.0.0.5", conditions=[{"type": "Ready", "status": "True"}]), "10.0.0.5", True, None),
        (
            _pod(phase="Failed", containerStatuses=[
                {"name": "sidecar", "state": {"terminated": {"message": "not ours"}}},
                {"name": "pytorch", "state": {"terminated": {"message": '{"phase": "Failed"}'}}},
            ]),
            None, False, '{"phase": "Failed"}',
        ),
        (
            _pod(phase="Running", podIP="10.0.0.6", containerStatuses=[
                {"name": "pytorch", "state": {"running": {}}, "lastState": {"terminated": {"message": '{"phase": "Failed", "reason": "r"}'}}},
            ]),
            "10.0.0.6", False, '{"phase": "Failed", "reason": "r"}',  # the record from before the restart
        ),
    ],
)  # fmt: skip
def test_pod_readings(pod: dict[str, Any], ip: str | None, ready: bool, message: str | None) -> None:
    assert observe.pod_ip(pod) == ip
    seen = observe.pod_observation(pod, None)
    assert seen.ready == ready
    assert seen.result == (Result.from_json(message) if message is not None else None)
    assert observe.training_of(pod) == "t"


@pytest.mark.parametrize(
    ("containers", "oom_killed"),
    [
        ([{"name": "pytorch", "state": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}], True),
        ([{"name": "node", "state": {"running": {}},
           "lastState": {"terminated": {"reason": "OOMKilled", "exitCode": 137}}}], True),  # restarted since
        ([{"name": "pytorch", "state": {"terminated": {"reason": "Error", "exitCode": 137}}}], False),
        ([{"name": "sidecar", "state": {"terminated": {"reason": "OOMKilled"}}},
          {"name": "pytorch", "state": {"running": {}}}], False),  # not the trainer
        ([{"name": "pytorch", "state": None, "lastState": "odd"}], False),
    ],
)  # fmt: skip
def test_an_oom_kill_of_the_trainer_is_read_with_its_memory_limit(
    containers: list[dict[str, Any]], oom_killed: bool
) -> None:
    pod = _pod(containers[-1]["name"], phase="Running", containerStatuses=containers)
    pod["spec"] = {"containers": [{"name": "sidecar", "resources": {"limits": {"memory": "1Gi"}}},
                                  {"name": containers[-1]["name"], "resources": {"limits": {"memory": "2Gi"}}}]}  # fmt: skip
    seen = observe.pod_observation(pod, None)
    assert (seen.oom_killed, seen.memory_limit) == (oom_killed, "2Gi")
    assert observe.pod_observation(_pod(phase="Running"), None).memory_limit is None


def test_a_pod_without_the_trainers_name_has_its_first_container_read_as_the_trainer() -> None:
    """A pod made before its template named the trainer (each backend renders the trainer first)."""
    statuses = [{"name": "side", "state": {"terminated": {"reason": "OOMKilled"}}},
                {"name": "pytorch", "state": {"terminated": {"reason": "OOMKilled"}}}]  # fmt: skip
    pod = {"metadata": {"name": "p"}, "status": {"phase": "Running", "containerStatuses": statuses},
           "spec": {"containers": [{"name": "pytorch", "resources": {"limits": {"memory": "2Gi"}}}, {"name": "side"}]}}  # fmt: skip
    seen = observe.pod_observation(pod, None)
    assert (seen.oom_killed, seen.memory_limit) == (True, "2Gi")
    pod["spec"]["containers"].reverse()
    assert observe.pod_observation(pod, None).memory_limit is None  # "side" has none


def test_job_readings() -> None:
    job = {
        "metadata": {
            "ownerReferences": [{"uid": "a", "controller": False}, {"uid": "b", "controller": True}]
        },
        "status": {
            "conditions": [{"type": "Created", "status": "True"}, {"type": "Succeeded", "status": "True"}],
            "startTime": "s",
            "completionTime": "c",
        },
    }
    assert observe.owner_uid(job) == "b"
    assert observe.finished(PYTORCHJOB.conditions(job))
    assert PYTORCHJOB.times(job) == ("s", "c")
    assert [c.type for c in PYTORCHJOB.conditions(job)] == ["Created", "Succeeded"]
    assert PYTORCHJOB.conditions(None) == ()
    assert not observe.finished(
        PYTORCHJOB.conditions({"status": {"conditions": [{"type": "Failed", "status": "False"}]}})
    )


def _workload(created: str, *conditions: tuple[str, str, str]) -> dict[str, Any]:
    return {"metadata": {"creationTimestamp": created}, "status": {"conditions": [
        {"type": t, "status": s, "reason": r, "message": f"{t} {r}"} for t, s, r in conditions]}}  # fmt: skip


@pytest.mark.parametrize(
    ("workloads", "expected"),
    [
        ([], None),
        ([_workload("2026-01-01T00:00:00Z")], QueueState(False, "WaitingForKueue", "Kueue has made its Workload and not considered it yet")),
        ([_workload("2026-01-01T00:00:00Z", ("QuotaReserved", "False", "Pending"))],
         QueueState(False, "Pending", "QuotaReserved Pending")),
        ([_workload("2026-01-01T00:00:00Z", ("QuotaReserved", "True", "QuotaReserved"),
                    ("Admitted", "False", "NoChecks"))],
         QueueState(False, "QuotaReserved", "QuotaReserved QuotaReserved")),
        ([_workload("2026-01-01T00:00:00Z", ("QuotaReserved", "True", "QuotaReserved"),
                    ("Admitted", "True", "Admitted"))],
         QueueState(True, "Admitted", "Admitted Admitted")),
        # Preempted: evicted wins over the admission it had, until admitted again.
        ([_workload("2026-01-01T00:00:00Z", ("Admitted", "True", "Admitted"), ("Evicted", "True", "Preempted"))],
         QueueState(False, "Preempted", "Evicted Preempted")),
        ([_workload("2026-01-01T00:00:00Z", ("Evicted", "False", "Preempted"), ("QuotaReserved", "False", "Pending"))],
         QueueState(False, "Pending", "QuotaReserved Pending")),
        # The newest Workload speaks (Kueue may have replaced one).
        ([_workload("2026-01-01T00:00:00Z", ("Admitted", "True", "Admitted")),
          _workload("2026-01-02T00:00:00Z", ("QuotaReserved", "False", "Pending"))],
         QueueState(False, "Pending", "QuotaReserved Pending")),
    ],
)  # fmt: skip
def test_queue_state_reads_kueues_workload(
    workloads: list[dict[str, Any]], expected: QueueState | None
) -> None:
    assert observe.queue_state(workloads) == expected


def test_job_suspended_reads_either_kind() -> None:
    assert PYTORCHJOB.suspended({"spec": {"runPolicy": {"suspend": True}}})
    assert TRAINJOB.suspended({"kind": "TrainJob", "spec": {"suspend": True}})
    assert not PYTORCHJOB.suspended({"spec": {"runPolicy": {"suspend": False}}})
    assert not PYTORCHJOB.suspended(None)
    assert not TRAINJOB.suspended(None)


def test_a_slim_job_reads_the_same_as_the_whole_one() -> None:
    """The table keeps a slim copy of each PyTorchJob: every reading gives what the whole does."""

    body = minimal(runPolicy={"activeDeadlineSeconds": 60})
    body["metadata"]["uid"] = "u-1"
    whole = render_pytorchjob(parse(body))
    whole["metadata"] |= {"uid": "j-1", "resourceVersion": "42", "managedFields": [{"manager": "x"}]}
    whole["status"] = {"conditions": [{"type": "Running", "status": "True"}], "startTime": "s"}
    slim = observe.slim_job(whole)
    for reading in (observe.owner_uid, PYTORCHJOB.suspended, PYTORCHJOB.times, PYTORCHJOB.conditions,
                    observe.created_from, observe.training_of):  # fmt: skip
        assert reading(slim) == reading(whole), reading.__name__
    assert observe.created_from(slim) is not None
    assert slim["spec"]["runPolicy"] == whole["spec"]["runPolicy"]
    # A copy: a job just made is the operator's cached render, which the table must not share.
    assert slim["spec"]["runPolicy"] is not whole["spec"]["runPolicy"]
    assert slim["metadata"]["resourceVersion"] == "42"
    # Most of what stays is the created-from annotation (the spec, compact): 1.4 of 4.2 KB here.
    assert len(json.dumps(slim)) < len(json.dumps(whole)) / 2.5


def test_a_job_rendered_from_the_spec_now_has_nothing_unapplied_and_an_older_one_its_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The view that rendered a job knows its record says nothing changed, without decoding it; a
    job made from an earlier generation is compared field by field, as before."""
    decoded: list[str] = []
    compare = table.fixed_spec_changes
    monkeypatch.setattr(
        table, "fixed_spec_changes", lambda record, spec: decoded.append(record) or compare(record, spec)
    )
    body = minimal(workers=2)
    body["metadata"] |= {"uid": "u-1", "generation": 1}
    tracked = table.Tracked(body)
    job = tracked.spec_view().objects(PYTORCHJOB, "trainer:1")[-1]
    assert tracked.spec_view().not_applied_to(job) == ()
    assert decoded == []
    edited = copy.deepcopy(body)
    edited["metadata"]["generation"] = 2
    edited["spec"]["workers"] = 3
    tracked.body = edited
    assert tracked.spec_view().not_applied_to(job) == ("spec.workers (2 -> 3)",)
    assert decoded == [observe.created_from(job)]


def test_a_status_document_is_decoded_once_and_a_new_one_anew(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tick reconciles every unfinished training, most of them unchanged: their status is
    decoded once per document, not once per reconcile. Each event brings a new document, which
    is decoded again, even when it holds the same figures."""
    decoded: list[Any] = []
    decode = table.status_from_json
    monkeypatch.setattr(
        table, "status_from_json", lambda document: decoded.append(document) or decode(document)
    )
    body = minimal()
    body["status"] = {"phase": "Created", "observedGeneration": 1}
    tracked = table.Tracked(body)
    first = tracked.status()
    assert first is not None
    assert first.phase == "Created"
    assert tracked.status() is first
    assert len(decoded) == 1
    echoed = copy.deepcopy(body)
    tracked.body = echoed
    assert tracked.status() == first
    later = copy.deepcopy(body)
    later["status"]["phase"] = "Running"
    tracked.body = later
    running = tracked.status()
    assert running is not None
    assert running.phase == "Running"
    assert len(decoded) == 3
    tracked.body = minimal()  # no status yet
    assert tracked.status() is None
    assert tracked.status() is None
    assert len(decoded) == 4


def test_run_policy_patch_changes_only_what_differs() -> None:
    desired = {
        "spec": {"runPolicy": {"suspend": True, "cleanPodPolicy": "None", "activeDeadlineSeconds": 60}}
    }
    child = {"spec": {"runPolicy": {"suspend": False, "cleanPodPolicy": "All", "backoffLimit": 3}}}
    assert PYTORCHJOB.mutable_patch(desired, child) == {
        "spec": {"runPolicy": {"suspend": True, "activeDeadlineSeconds": 60, "backoffLimit": None}}
    }
    assert (
        PYTORCHJOB.mutable_patch(
            desired, {"spec": {"runPolicy": {"suspend": True, "activeDeadlineSeconds": 60}}}
        )
        is None
    )


def _settings(argv: list[str], env: dict[str, str] | None = None) -> OperatorSettings:
    return parse_operator_args(argv, env or {})


def test_settings_come_from_flags_over_env_over_defaults() -> None:
    assert _settings([]) == OperatorSettings()
    env = {"GPUOP_NAMESPACES": "ml, research", "GPUOP_SCRAPE_INTERVAL": "30", "GPUOP_LOG_FORMAT": "json"}
    got = _settings(["--scrape-interval", "15"], env)
    assert got.namespaces == ("ml", "research")
    assert got.scrape_interval_seconds == 15.0
    assert got.log_format == "json"
    assert _settings(["--namespace", "a", "--namespace", "b,c"]).namespaces == ("a", "b", "c")
    assert _settings(["--standalone"], {"POD_NAMESPACE": "ops"}).lease_namespace is None


@pytest.mark.parametrize(
    ("argv", "env", "namespace"),
    [
        ([], {}, None),  # outside a pod, none given: standalone
        ([], {"POD_NAMESPACE": "ops"}, "ops"),  # the pod's own namespace
        ([], {"POD_NAMESPACE": "ops", "GPUOP_LEASE_NAMESPACE": "lease-ns"}, "lease-ns"),
        (
            ["--lease-namespace", "flag-ns"],
            {"POD_NAMESPACE": "ops", "GPUOP_LEASE_NAMESPACE": "lease-ns"},
            "flag-ns",
        ),
        (["--standalone"], {"POD_NAMESPACE": "ops"}, None),
        (["--standalone", "--lease-namespace", "flag-ns"], {}, None),
    ],
)
def test_the_lease_namespace_is_the_flag_then_its_env_then_the_pods(
    argv: list[str], env: dict[str, str], namespace: str | None
) -> None:
    got = _settings(argv, env)
    assert got.lease_namespace == namespace
    assert got.standalone == ("--standalone" in argv)
    assert got.lease_name == "gpu-training-operator"


def test_the_lease_name_is_the_flag_then_its_env() -> None:
    assert _settings([], {"GPUOP_LEASE": "team-lease"}).lease_name == "team-lease"
    assert _settings(["--lease", "flag.lease"], {"GPUOP_LEASE": "team-lease"}).lease_name == "flag.lease"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--scrape-interval", "0"],
            "--scrape-interval / GPUOP_SCRAPE_INTERVAL: must be 1..3600 seconds (got 0)",
        ),
        (
            ["--scrape-interval", "ten"],
            "--scrape-interval / GPUOP_SCRAPE_INTERVAL: must be a number (got 'ten')",
        ),
        (
            ["--scrape-timeout", "20"],
            "--scrape-timeout / GPUOP_SCRAPE_TIMEOUT: must be at least 0.1 s and shorter than the scrape interval (got 20)",
        ),
        (
            ["--namespace", "Bad_NS"],
            "--namespace / GPUOP_NAMESPACES: 'Bad_NS' is not a namespace name (lowercase letters, digits and '-'); separate several with commas",
        ),
        (
            ["--scrape-via", "magic"],
            "--scrape-via / GPUOP_SCRAPE_VIA: must be auto, pod-ip or proxy (got 'magic')",
        ),
        (
            ["--metrics-port", "70000"],
            "--metrics-port / GPUOP_METRICS_PORT: must be 0..65535, 0 to disable (got 70000)",
        ),
        (["--metrics-port", "9000", "--health-port", "9000"], "--metrics-port and --health-port must differ"),
        (["--log-format", "xml"], "--log-format / GPUOP_LOG_FORMAT: must be text or json (got 'xml')"),
        (
            ["--underutilized-percent", "120"],
            "--underutilized-percent / GPUOP_UNDERUTILIZED_PERCENT: must be 0..100 (got 120)",
        ),
        (["--lease", "Bad_Name"], "--lease / GPUOP_LEASE: not a valid object name (got 'Bad_Name')"),
        (["--lease", "-lease"], "--lease / GPUOP_LEASE: not a valid object name (got '-lease')"),
        (
            ["--lease-namespace", "Bad_NS"],
            "--lease-namespace / GPUOP_LEASE_NAMESPACE: not a valid namespace (got 'Bad_NS')",
        ),
        (
            ["--lease-namespace", "a.b"],
            "--lease-namespace / GPUOP_LEASE_NAMESPACE: not a valid namespace (got 'a.b')",
        ),
    ],
)
def test_bad_settings_are_one_line_naming_flag_and_env(argv: list[str], message: str) -> None:
    with pytest.raises(SettingsError) as error:
        _settings(argv)
    assert str(error.value) == message


@pytest.fixture
def emulator() -> Iterator[RunningApiServer]:
    with RunningApiServer(ApiServer()) as running:
        yield running


def _kube(emulator: RunningApiServer, attempts: int = 8) -> Kube:
    return Kube(
        Credentials(server=emulator.url, in_cluster=False),
        backoff=Backoff(attempts=attempts, base_seconds=0.001),
    )


def _job(name: str) -> dict[str, Any]:
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": name, "namespace": "default"},
            "spec": {}}  # fmt: skip


def test_the_client_retries_faults_until_it_gets_through(emulator: RunningApiServer) -> None:
    kube = _kube(emulator, attempts=30)
    emulator.server.faults.rate = 0.5
    emulator.server.faults.statuses = (500, 502, 503, 504, 429)
    for i in range(10):
        kube.create_object(_job(f"j{i}"), "pytorchjobs")
    assert emulator.server.faults.injected >= 3
    codes = {code for (_, _, code) in kube.requests.counts}
    assert 201 in codes
    assert codes & {500, 502, 503, 504, 429}
    assert len(list(emulator.iter_objects("kubeflow.org/v1/pytorchjobs"))) == 10


def test_a_409_on_a_status_patch_is_retried(emulator: RunningApiServer) -> None:
    kube = _kube(emulator)
    emulator.call(
        emulator.server.create,
        "gpuop.io/v1alpha1/gputrainings",
        {"metadata": {"name": "t", "namespace": "default"}, "spec": {}},
    )
    emulator.server.faults.rate = 0.6
    emulator.server.faults.statuses = (409,)
    body = kube.patch_training_status("default", "t", {"status": {"phase": "Created"}})
    assert body is not None
    assert body["status"] == {"phase": "Created"}
    assert kube.patch_training_status("default", "absent", {"status": {}}) is None


def test_errors_that_mean_something_are_not_retried(emulator: RunningApiServer) -> None:
    kube = _kube(emulator)
    kube.create_object(_job("once"), "pytorchjobs")
    with pytest.raises(ApiError) as error:
        kube.create_object(_job("once"), "pytorchjobs")
    assert error.value.status == 409
    assert error.value.reason == "AlreadyExists"
    assert kube.get_object("kubeflow.org/v1", "pytorchjobs", "default", "nothing") is None
    assert sum(n for (verb, _, _), n in kube.requests.counts.items() if verb == "create") == 2


def test_an_unreachable_server_gives_up_with_one_error(tmp_path: Path) -> None:
    nowhere = Credentials(server="http://127.0.0.1:9", in_cluster=False)  # discard: nothing listens
    kube = Kube(nowhere, backoff=Backoff(attempts=2, base_seconds=0.001))
    with pytest.raises(ApiError) as error:
        kube.get_object("kubeflow.org/v1", "pytorchjobs", "default", "x")
    assert error.value.status == 0


def test_with_a_queue_suspend_is_left_to_kueue() -> None:
    queued = render_pytorchjob(parse(minimal(scheduling={"queueName": "team-a"})))
    assert queued["spec"]["runPolicy"]["suspend"] is True  # Kueue resumes it on admission
    assert queued["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    admitted = {"spec": {"runPolicy": {**queued["spec"]["runPolicy"], "suspend": False}}}
    assert PYTORCHJOB.mutable_patch(queued, admitted, skip=("suspend",)) is None
    assert PYTORCHJOB.mutable_patch(queued, admitted) == {"spec": {"runPolicy": {"suspend": True}}}


def test_a_trainjob_is_patched_only_in_suspend() -> None:
    """Trainer v2's TrainJob: suspend is its one mutable field (activeDeadlineSeconds is
    immutable there, and is reported as not applied instead of patched into a 422)."""
    desired = render_trainjob(parse(minimal(runPolicy={"suspend": True, "activeDeadlineSeconds": 60})))
    made = {"spec": {"suspend": False, "activeDeadlineSeconds": 30}}
    assert TRAINJOB.mutable_patch(desired, made) == {"spec": {"suspend": True}}
    assert TRAINJOB.mutable_patch(desired, made, skip=("suspend",)) is None
    assert TRAINJOB.mutable_patch(desired, {"spec": {"suspend": True}}) is None


@pytest.mark.parametrize(
    ("method", "path", "target"),
    [
        ("GET", "/apis/kubeflow.org/v1/namespaces/ml/pytorchjobs", ("list", "pytorchjobs")),
        ("POST", "/apis/kubeflow.org/v1/namespaces/ml/pytorchjobs", ("create", "pytorchjobs")),
        (
            "PATCH",
            "/apis/gpuop.io/v1alpha1/namespaces/ml/gputrainings/a/status",
            ("patch", "gputrainings/status"),
        ),
        ("GET", "/api/v1/namespaces/ml/pods?labelSelector=x", ("list", "pods")),
        ("GET", "/api/v1/namespaces/ml/pods/p-0/proxy/metrics", ("get", "pods/proxy")),
        ("GET", "/api/v1/namespaces/ml", ("get", "namespaces")),
        ("PUT", "/apis/coordination.k8s.io/v1/namespaces/ns/leases/l", ("update", "leases")),
        ("PATCH", "/api/v1/namespaces/ns/pods/p", ("patch", "pods")),
        ("GET", "/api/v1/nodes/n", ("get", "nodes")),
        ("GET", "/apis/trainer.kubeflow.org/v1alpha1", ("get", "discovery")),
    ],
)
def test_request_metrics_name_the_verb_and_resource(method: str, path: str, target: tuple[str, str]) -> None:
    assert request_target(method, path) == target


@pytest.mark.parametrize(
    ("waiting", "read"),
    [
        ({"reason": "CreateContainerConfigError", "message": 'secret "s3-creds" not found'},
         ("CreateContainerConfigError", 'secret "s3-creds" not found')),
        ({"reason": "ImagePullBackOff", "message": "Back-off pulling image"}, ("ImagePullBackOff", "Back-off pulling image")),
        ({"reason": "ContainerCreating"}, None),  # passes by itself
        ({"reason": "ErrImagePull"}, ("ErrImagePull", "")),
        ({}, None),
    ],
)  # fmt: skip
def test_a_trainer_the_kubelet_cannot_start_is_read_with_its_reason(
    waiting: dict[str, Any], read: tuple[str, str] | None
) -> None:
    pod = _pod(phase="Pending", containerStatuses=[{"name": "pytorch", "state": {"waiting": waiting}}])
    assert observe.pod_observation(pod, None).cannot_start == read


def test_the_dataset_step_is_read_while_it_copies_and_when_it_failed() -> None:
    """spec.dataset.uri's init container: until it has succeeded the pod is fetching (copying,
    or waiting to copy again: one state through the kubelet's retries); after a failed try it
    is also a pod that cannot start, with the step's own line (its termination message) or its
    exit code, until a try succeeds."""
    copying = _pod(phase="Pending", initContainerStatuses=[
        {"name": "fetch-dataset", "restartCount": 0, "state": {"running": {"startedAt": "2026-11-25T10:00:00Z"}}}])  # fmt: skip
    seen = observe.pod_observation(copying, None)
    assert (seen.fetching_dataset, seen.cannot_start) == (True, None)
    record = json.dumps({"phase": "Failed", "reason": "DatasetFetchFailed",
                         "message": "s3://data/x: list failed: the bucket does not exist; create it or correct the URI"})  # fmt: skip
    failed = _pod(phase="Pending", initContainerStatuses=[{
        "name": "fetch-dataset", "restartCount": 2, "ready": False,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}},
        "lastState": {"terminated": {"exitCode": 6, "reason": "Error", "message": record}}}])  # fmt: skip
    seen = observe.pod_observation(failed, None)
    assert seen.fetching_dataset is True
    assert seen.cannot_start == (
        "DatasetFetchFailed",
        "s3://data/x: list failed: the bucket does not exist; create it or correct the URI",
    )
    silent = _pod(phase="Pending", initContainerStatuses=[{
        "name": "fetch-dataset", "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}])  # fmt: skip
    assert observe.pod_observation(silent, None).cannot_start == ("DatasetFetchFailed", "it exited with 137")
    retrying = _pod(phase="Pending", initContainerStatuses=[{
        "name": "fetch-dataset", "restartCount": 2, "state": {"running": {"startedAt": "2026-11-25T10:01:00Z"}},
        "lastState": {"terminated": {"exitCode": 6, "reason": "Error", "message": record}}}])  # fmt: skip
    assert observe.pod_observation(retrying, None).cannot_start == seen.cannot_start  # no flapping
    done = _pod(phase="Running", initContainerStatuses=[{
        "name": "fetch-dataset", "restartCount": 1, "ready": True,
        "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
        "lastState": {"terminated": {"exitCode": 6, "reason": "Error", "message": record}}}])  # fmt: skip
    assert (
        observe.pod_observation(done, None).cannot_start,
        observe.pod_observation(done, None).fetching_dataset,
    ) == (None, False)


def test_a_container_down_after_a_failure_no_restart_mends_is_read_as_needing_a_fix() -> None:
    """Result.permanent in the trainer's record (or the dataset step's): read while the container
    is down (just ended, or waiting to restart), not once it runs again, and never from a record
    that does not say so (a store down past its retries may be back)."""
    refused = json.dumps({"phase": "Failed", "reason": "CheckpointStorageFailed", "permanent": True,
                          "message": "s3://ckpt/x: list failed: access denied (InvalidAccessKeyId)"})  # fmt: skip
    ended = _pod(phase="Running", containerStatuses=[{
        "name": "pytorch", "restartCount": 0, "state": {"terminated": {"exitCode": 1, "message": refused}}}])  # fmt: skip
    want = ("CheckpointStorageFailed", "s3://ckpt/x: list failed: access denied (InvalidAccessKeyId)")
    assert observe.pod_observation(ended, None).needs_fix == want
    waiting = _pod(phase="Running", containerStatuses=[{
        "name": "pytorch", "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "message": refused}}}])  # fmt: skip
    assert observe.pod_observation(waiting, None).needs_fix == want
    running_again = _pod(phase="Running", containerStatuses=[{
        "name": "pytorch", "restartCount": 1, "state": {"running": {"startedAt": "2026-11-25T10:00:00Z"}},
        "lastState": {"terminated": {"exitCode": 1, "message": refused}}}])  # fmt: skip
    assert observe.pod_observation(running_again, None).needs_fix is None
    for unsaid in ({"permanent": False}, {"permanent": "yes"}, {}):
        record = json.dumps(
            {"phase": "Failed", "reason": "CheckpointStorageFailed", "message": "503", **unsaid}
        )
        pod = _pod(phase="Running", containerStatuses=[{
            "name": "pytorch", "state": {"terminated": {"exitCode": 1, "message": record}}}])  # fmt: skip
        assert observe.pod_observation(pod, None).needs_fix is None, unsaid
    no_bucket = json.dumps({"phase": "Failed", "reason": "DatasetFetchFailed", "permanent": True,
                            "message": "s3://data/x: list failed: the bucket does not exist"})  # fmt: skip
    fetch = _pod(phase="Pending", initContainerStatuses=[{
        "name": "fetch-dataset", "restartCount": 1, "ready": False,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 6, "message": no_bucket}}}])  # fmt: skip
    assert observe.pod_observation(fetch, None).needs_fix == (
        "DatasetFetchFailed",
        "s3://data/x: list failed: the bucket does not exist",
    )


def test_only_the_newest_attempt_says_whether_a_restart_mends_it_and_a_job_says_it_was_stopped() -> None:
    """A trainer that just ended with no record (a crash's log lines, an OOM kill) after an
    attempt that said no restart mends it: the newest attempt decides, and it said nothing (the
    older record may predate a fix). A job's stop annotation reads back as written."""
    refused = json.dumps(
        {"phase": "Failed", "reason": "CheckpointStorageFailed", "permanent": True, "message": "x"}
    )
    pod = _pod(phase="Running", containerStatuses=[{
        "name": "pytorch", "restartCount": 1, "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
        "lastState": {"terminated": {"exitCode": 1, "message": refused}}}])  # fmt: skip
    pod["metadata"]["creationTimestamp"] = "2026-11-25T10:00:00Z"
    seen = observe.pod_observation(pod, None)
    assert (seen.needs_fix, seen.created_at) == (None, "2026-11-25T10:00:00Z")
    why = ("t-master-0", "CheckpointStorageFailed", 's3://b/t: list failed: access denied ("x")')
    job = {
        "metadata": {"annotations": observe.stop_annotation(why), "creationTimestamp": "2026-11-25T09:00:00Z"}
    }
    assert observe.job_stop(job) == why
    assert observe.job_stop(observe.slim_job(job)) == why  # kept between reconciles
    assert observe.created_at(observe.slim_job(job)) == "2026-11-25T09:00:00Z"
    for broken in ("{", "[]", '{"pod": "p"}'):
        assert observe.job_stop({"metadata": {"annotations": {"gpuop.io/stopped": broken}}}) is None


def test_the_operator_leaves_its_start_up_heap_out_of_collections_and_collects_in_full_rarely() -> None:
    """In a process of its own: the collector's settings are the whole process's."""
    probe = (
        "import gc, json\n"
        "from gpuop.controller.app import FULL_COLLECTION_EVERY, settle_the_heap\n"
        "before = gc.get_threshold()\n"
        "settle_the_heap()\n"
        "print(json.dumps([before, gc.get_threshold(), gc.get_freeze_count(), FULL_COLLECTION_EVERY]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    before, after, frozen, every = json.loads(out.stdout)
    assert after[:2] == before[:2]
    if before[2]:  # an interpreter with a third generation (not 3.14's incremental collector)
        assert after[2] == every > before[2]
    assert frozen > 10_000  # the modules' objects, Kopf's and the client's
