"""The real operator against the real control plane, installed by the chart and running as the
chart's ServiceAccount: the real authorizer judges every call, the real garbage collector
deletes children, and the audit log says who asked for what.

No Kubeflow controller and no kubelet run here: the test plays both, writing what they write
(the PyTorchJob's status, pods with their IPs and termination messages) as the admin.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import random
import re
import signal
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuop.api.identity import report_audience, report_path
from gpuop.api.spec import parse
from gpuop.backends.registry import render_job
from gputrain.contract import Progress
from support import specs
from support.controllers import kueue
from support.plane.cluster import (
    Api,
    Installed,
    OperatorProcess,
    install_chart,
    install_crds,
    service_account_kubeconfig,
    uninstall_chart,
)
from support.plane.controlplane import ControlPlane, free_port
from support.plane.faultproxy import FaultProxy
from support.samples import PRINTER_COLUMNS, RUNNING, StandInTrainers
from support.tools.helm import RELEASE, RELEASE_NAMESPACE, helm
from support.waiting import wait_for

NAMESPACE = "training"
STAMP = "%Y-%m-%dT%H:%M:%SZ"
# The chart's values for this suite: scraping every second (the default 10 s would only slow
# the tests), through pod IPs (the test's pods live on loopback addresses, which the API
# server's pod proxy refuses to reach: it never proxies to loopback).
VALUES = {"operator.scrapeInterval": 1, "operator.scrapeTimeout": 0.5, "operator.scrapeVia": "pod-ip"}


def _helm(plane: ControlPlane, *args: str) -> str:
    return helm(*args, "--kubeconfig", str(plane.kubeconfig)).stdout


@pytest.fixture(scope="module")
def suite_chart(plane: ControlPlane, api: Api) -> Iterator[Installed]:
    """The chart installed (cluster-wide RBAC, the Lease's Role) for this suite."""
    suite_chart = install_chart(plane, VALUES)
    plane.kubectl("create", "namespace", NAMESPACE)
    yield suite_chart
    uninstall_chart(plane)
    # Nothing of this suite may outlive it: the session's control plane goes on to the chain,
    # whose training-operator would run a job left here on its nodes (seen: two left 2-GPU
    # trainings held all four stand-in GPUs there), and whose operator would reconcile it.
    _delete_namespace(plane, NAMESPACE)


def _delete_namespace(plane: ControlPlane, namespace: str) -> None:
    """Deleted, and waited for: while a namespace terminates, an operator of a later test that
    still sees a training in it is refused (403) what it writes there, which the chart's-rules
    test reads as a missing rule."""
    plane.kubectl("delete", "namespace", namespace, "--ignore-not-found", "--wait=true", "--timeout=120s",
                  timeout=130)  # fmt: skip


@pytest.fixture
def fresh_operator(plane: ControlPlane, suite_chart: Installed, tmp_path: Path) -> Iterator[OperatorProcess]:
    """``gpuop operator`` with the chart's environment and its ServiceAccount's token."""
    config = service_account_kubeconfig(
        plane, RELEASE_NAMESPACE, suite_chart.service_account, tmp_path / "kubeconfig"
    )
    process = OperatorProcess(config, tmp_path, env=suite_chart.env)
    yield process
    process.stop()
    said = process.log()
    # Captured, so shown only where the test failed: what the operator did meanwhile.
    print(f"the operator's log, its end:\n{said[-6000:]}")
    assert "Traceback" not in said, said[-4000:]


@pytest.fixture(autouse=True)
def clean_namespace(plane: ControlPlane, api: Api, suite_chart: Installed) -> Iterator[None]:
    """Each test starts with no GpuTraining and no PyTorchJob in the namespace, whatever the last left."""
    yield
    plane.kubectl("delete", "gputrainings", "--all", "-n", NAMESPACE, "--wait=true")
    wait_for("the children garbage-collected", lambda: _jobs(api) == [], timeout=90)


# The suite's GpuTrainings live in its own namespace.
training = functools.partial(specs.training, namespace=NAMESPACE)


class KubeflowStandIn:
    """The test's stand-in for the training-operator and the kubelet, writing what they write."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.trainers = StandInTrainers(first_ip=10)

    def job_status(self, name: str, *conditions: str, **fields: Any) -> None:
        now = time.strftime(STAMP, time.gmtime())
        status = {
            "conditions": [
                {"type": c, "status": "True", "reason": f"PyTorchJob{c}", "message": f"job is {c.lower()}",
                 "lastUpdateTime": now, "lastTransitionTime": now}
                for c in conditions
            ],
            "replicaStatuses": {},
            **fields,
        }  # fmt: skip
        self.api.patch_status("pytorchjobs", name, status, NAMESPACE)

    def start_pods(
        self,
        job: dict[str, Any],
        progress: Progress,
        gpu_percent: float,
        *,
        dribbling: bool = False,
        nodes: tuple[str, str] | None = None,
    ) -> list[str]:
        """The job's pods, owned by it as the training-operator makes them, Running with an IP;
        ``dribbling``: their endpoints answer a byte at a time; ``nodes``: the master's and the
        worker's, as the scheduler binds them (no kubelet runs them)."""
        name = job["metadata"]["name"]
        names = []
        for role in ("master", "worker"):
            pod_name = f"{name}-{role}-0"
            if dribbling:
                ip = self.trainers.start_dribbling(pod_name)
            else:
                ip = self.trainers.start(pod_name, progress, gpu_percent)
            pod = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {
                    "name": pod_name, "namespace": NAMESPACE,
                    "labels": {"gpuop.io/gputraining": name, "training.kubeflow.org/job-name": name,
                               "training.kubeflow.org/replica-type": role, "training.kubeflow.org/replica-index": "0"},
                    "ownerReferences": [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": name,
                                         "uid": job["metadata"]["uid"], "controller": True,
                                         "blockOwnerDeletion": True}],
                },
                "spec": {"containers": [{"name": "pytorch", "image": "trainer"}]},
            }  # fmt: skip
            if nodes is not None:
                pod["spec"]["nodeName"] = nodes[0 if role == "master" else 1]
            self.api.create("pods", pod, NAMESPACE)
            self.api.patch_status("pods", pod_name, {
                "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": "True"}],
            }, NAMESPACE)  # fmt: skip
            names.append(pod_name)
        return names

    def finish_pod(self, pod: str, record: dict[str, Any]) -> None:
        self.trainers.stop(pod)
        self.api.patch_status("pods", pod, {
            "phase": "Succeeded", "conditions": [{"type": "Ready", "status": "False"}],
            "containerStatuses": [{
                "name": "pytorch", "image": "trainer", "imageID": "", "ready": False, "restartCount": 0,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed", "message": json.dumps(record)}},
            }],
        }, NAMESPACE)  # fmt: skip

    def close(self) -> None:
        self.trainers.close()


@pytest.fixture
def stand_in(api: Api) -> Iterator[KubeflowStandIn]:
    stand_in = KubeflowStandIn(api)
    yield stand_in
    stand_in.close()


def _status(api: Api, name: str) -> dict[str, Any]:
    return dict((api.get("gputrainings", name, NAMESPACE) or {}).get("status") or {})


def _stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _phase(api: Api, name: str, phase: str) -> bool:
    return _status(api, name).get("phase") == phase


def _jobs(api: Api) -> list[dict[str, Any]]:
    return [
        obj for kind in ("pytorchjobs", "trainjobs", "trainingruntimes") for obj in api.list(kind, NAMESPACE)
    ]


def _calls(plane: ControlPlane, installed: Installed) -> list[dict[str, Any]]:
    """The audit log's requests by the chart's ServiceAccount since this install of the chart
    (the real-node suite, which runs first, ran the operator under the same name)."""
    return [e for e in plane.audit(installed.user) if e["requestReceivedTimestamp"] >= installed.since]


def _forbidden(plane: ControlPlane, installed: Installed) -> list[dict[str, Any]]:
    return [e for e in _calls(plane, installed) if e.get("responseStatus", {}).get("code") == 403]


def test_lifecycle_as_the_charts_service_account(
    plane: ControlPlane,
    api: Api,
    suite_chart: Installed,
    fresh_operator: OperatorProcess,
    stand_in: KubeflowStandIn,
) -> None:
    fresh_operator.start()
    plane.kubectl("create", "-f", "-", input=json.dumps(training("mnist")))

    job = wait_for("the PyTorchJob", lambda: api.get("pytorchjobs", "mnist", NAMESPACE), timeout=60)
    owner = job["metadata"]["ownerReferences"][0]
    assert owner["uid"] == api.get("gputrainings", "mnist", NAMESPACE)["metadata"]["uid"]
    assert owner["controller"] is True
    wait_for("phase Created", lambda: _phase(api, "mnist", "Created"))

    running_since = time.time()
    stand_in.job_status("mnist", "Created", "Running", startTime=_stamp(running_since))
    pods = stand_in.start_pods(job, RUNNING, gpu_percent=85.0)
    # Both pods, seen by one tick: the first look may come between the two pods' creation.
    status = wait_for("progress and both pods' GPU figures", lambda: (
        (s := _status(api, "mnist")).get("progress", {}).get("step") == 30
        and len(s.get("gpu", {}).get("perWorker", ())) == 2 and s.get("workers", {}).get("ready") == 2
        and s), timeout=30)  # fmt: skip
    assert status["phase"] == "Running"
    assert status["workers"] == {"ready": 2, "total": 2}
    assert status["gpu"]["utilizationPercent"] == 85.0
    assert "accuracy" not in status["progress"]  # no evaluation yet: absent, not 0
    # `kubectl get` shows figures with their units; `-o wide` adds backend, queue, GPU model,
    # samples/s and the last checkpoint's age (none reported here: tests/e2e_local/test_own_code).
    header, line = plane.kubectl("get", "gtr", "mnist", "-n", NAMESPACE, "-o", "wide").stdout.splitlines()
    assert header.split() == [*PRINTER_COLUMNS, "BACKEND", "QUEUE", "GPU-MODEL", "SAMPLES/S", "CHECKPOINT"]
    # kubectl aligns each cell under its header (an empty one, as QUEUE's here, stays empty).
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    ends = [*starts[1:], None]
    cells = dict(
        zip(header.split(), (line[a:b].strip() for a, b in zip(starts, ends, strict=True)), strict=True)
    )
    assert cells["PROGRESS"] == f"{int(status['progress']['percent'])}%", cells
    assert cells["GPU-UTIL"] == "85%", cells
    assert (cells["BACKEND"], cells["QUEUE"], cells["GPU-MODEL"]) == (
        "pytorchjob",
        "",
        "NVIDIA H100 80GB HBM3",
    )
    assert float(cells["SAMPLES/S"]) == status["progress"]["samplesPerSecond"]
    # The status said Running by now: the span gpuHours counts starts at or before this moment
    # (not at running_since: a slow first reconcile moves its start past running_since + 3).
    seen_running = time.time()

    # A runPolicy change reaches the running job.
    plane.kubectl("patch", "gtr", "mnist", "-n", NAMESPACE, "--type=merge",
                  "-p", '{"spec": {"runPolicy": {"activeDeadlineSeconds": 7200}}}')  # fmt: skip
    wait_for("the job's new deadline", lambda: (api.get("pytorchjobs", "mnist", NAMESPACE) or {})
             .get("spec", {}).get("runPolicy", {}).get("activeDeadlineSeconds") == 7200)  # fmt: skip

    record = {"phase": "Succeeded", "epoch": 2, "totalEpochs": 2, "step": 100, "totalSteps": 100, "loss": 0.21,
              "accuracy": 0.955, "testLoss": 0.18, "samplesPerSecond": 530.0, "durationSeconds": 95.0,
              "worldSize": 2}  # fmt: skip
    for pod in pods:
        stand_in.finish_pod(pod, record)
    time.sleep(max(0.0, seen_running + 3 - time.time()))  # a span gpuHours can show at 4 decimals
    finished = time.time()
    stand_in.job_status("mnist", "Created", "Succeeded", startTime=_stamp(running_since),
                        completionTime=_stamp(finished))  # fmt: skip
    status = wait_for("Succeeded", lambda: (s := _status(api, "mnist")).get("phase") == "Succeeded" and s)
    # 2 GPUs held from the first Running status to the completion: seconds' worth.
    assert 0 < status["gpuHours"] <= round(2 * (finished + 1 - running_since) / 3600, 4)
    assert status["progress"]["accuracy"] == 0.955

    table = plane.kubectl("get", "gtr", "-n", NAMESPACE).stdout.splitlines()
    assert table[0].split() == PRINTER_COLUMNS
    row = table[1].split()
    assert row[:5] == ["mnist", "Succeeded", "2", "2", "100%"]
    assert re.fullmatch(r"\d+s|\d+m\d*s?", row[-1]), row  # an age, not a timestamp
    assert plane.kubectl("get", "gpuop", "-n", NAMESPACE, "-o", "name").stdout.split() == [
        "gputraining.gpuop.io/mnist"
    ]
    events = wait_for("the events", lambda: (e := plane.kubectl(
        "get", "events", "-n", NAMESPACE, "--field-selector", "involvedObject.name=mnist",
        "-o", "jsonpath={.items[*].reason}").stdout.split()) and len(e) >= 3 and e)  # fmt: skip
    assert sorted(events) == sorted(["PyTorchJobCreated", "PyTorchJobRunning", "TrainingSucceeded"])
    # No output volume: valid, but the model goes with the pod; `kubectl describe` says so, once.
    described = plane.kubectl("describe", "gtr", "mnist", "-n", NAMESPACE).stdout
    assert described.count("warning: spec.output.volume: not set") == 2, described  # condition, event

    assert _forbidden(plane, suite_chart) == []  # the chart's rules allowed every call the operator made
    plane.kubectl("delete", "gtr", "mnist", "-n", NAMESPACE)
    wait_for("the PyTorchJob garbage-collected", lambda: api.get("pytorchjobs", "mnist", NAMESPACE) is None,
             timeout=60)  # fmt: skip
    wait_for("its pods garbage-collected", lambda: api.list("pods", NAMESPACE) == [], timeout=60)


def _set_suspend(plane: ControlPlane, name: str, suspend: bool) -> None:
    """``kubectl patch`` of the GpuTraining's runPolicy.suspend, as a user suspends or resumes."""
    patch = json.dumps({"spec": {"runPolicy": {"suspend": suspend}}})
    plane.kubectl("patch", "gtr", name, "-n", NAMESPACE, "--type=merge", "-p", patch)


def _trainjob_status(api: Api, name: str, conditions: dict[str, str], ready: int = 0) -> None:
    """What Trainer v2 writes into a TrainJob's status (the test plays its controller here)."""
    now = time.strftime(STAMP, time.gmtime())
    status = {
        "conditions": [{"type": kind, "status": state, "reason": kind if state == "True" else "Resumed",
                        "message": f"{kind} {state}", "lastTransitionTime": now}
                       for kind, state in conditions.items()],
        "jobsStatus": [{"name": "node", "ready": ready, "active": 1 if ready else 0, "succeeded": 0, "failed": 0,
                        "suspended": 0}],
    }  # fmt: skip
    api.patch_status("trainjobs", name, status, NAMESPACE)


def _strangers_names_refused(plane: ControlPlane, api: Api, backend: str, taken: dict[str, str]) -> None:
    """For each name -> kind of ``taken``: that object made by a stranger (not owned by any
    GpuTraining), then a training of that name on ``backend``, which is refused with
    NameConflict and never touches the stranger's object."""
    for name, kind in taken.items():
        stranger = render_job(parse(training(name, backend=backend)), backend, default_image="x")
        plural = kind.lower() + "s"
        api.create(plural, next(o for o in stranger if o["kind"] == kind), NAMESPACE)
        plane.kubectl("create", "-f", "-", input=json.dumps(training(name, backend=backend)))
    for name, kind in taken.items():
        conflict = wait_for(f"{name}'s NameConflict", lambda n=name: next(
            (c for c in _status(api, n).get("conditions", []) if c["type"] == "NameConflict"), None), timeout=30)  # fmt: skip
        assert conflict["message"].startswith(f"a {kind} named {name} already exists and is not owned")


def test_a_trainjob_training_as_the_charts_service_account(
    plane: ControlPlane, api: Api, suite_chart: Installed, fresh_operator: OperatorProcess
) -> None:
    """backend trainjob: the TrainingRuntime, then the TrainJob, made by the chart's
    ServiceAccount and accepted by Trainer v2.3.0's CRDs; suspend patched through; Trainer's
    status read into phases; the GC takes both with the GpuTraining. (Trainer's controller does
    not run in this suite: the test writes its status. tests/e2e_local runs the real one.)"""
    fresh_operator.start()
    plane.kubectl("create", "-f", "-", input=json.dumps(training("tj", backend="trainjob")))
    job = wait_for("the TrainJob", lambda: api.get("trainjobs", "tj", NAMESPACE), timeout=60)
    runtime = api.get("trainingruntimes", "tj", NAMESPACE)
    assert runtime is not None
    uid = api.get("gputrainings", "tj", NAMESPACE)["metadata"]["uid"]
    assert [o["uid"] for o in job["metadata"]["ownerReferences"]] == [uid]
    assert [o["uid"] for o in runtime["metadata"]["ownerReferences"]] == [uid]
    assert job["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": "tj",
    }
    assert job["spec"]["managedBy"] == "trainer.kubeflow.org/trainjob-controller"  # the CRD's default
    status = wait_for("Created", lambda: (s := _status(api, "tj")).get("phase") == "Created" and s)
    assert (status["backend"], status["trainJob"]) == ("trainjob", "tj")
    assert "pytorchJob" not in status
    selected = next(c for c in status["conditions"] if c["type"] == "BackendSelected")
    assert (selected["reason"], selected["message"]) == (
        "Requested",
        "spec.backend is trainjob; the cluster serves TrainJob",
    )

    _set_suspend(plane, "tj", True)
    wait_for(
        "the TrainJob suspended", lambda: api.get("trainjobs", "tj", NAMESPACE)["spec"]["suspend"] is True
    )
    _trainjob_status(api, "tj", {"Suspended": "True"})
    wait_for("Suspended", lambda: _phase(api, "tj", "Suspended"))
    _set_suspend(plane, "tj", False)
    wait_for(
        "the TrainJob resumed", lambda: api.get("trainjobs", "tj", NAMESPACE)["spec"]["suspend"] is False
    )
    _trainjob_status(api, "tj", {"Suspended": "False"}, ready=1)
    wait_for("Running", lambda: _phase(api, "tj", "Running"))
    _trainjob_status(api, "tj", {"Suspended": "False", "Complete": "True"}, ready=1)
    status = wait_for("Succeeded", lambda: (s := _status(api, "tj")).get("phase") == "Succeeded" and s)
    assert status["completionTime"]

    _strangers_names_refused(plane, api, "trainjob", {"taken": "TrainJob", "taken-rt": "TrainingRuntime"})
    assert api.get("trainjobs", "taken-rt", NAMESPACE) is None  # no TrainJob on a stranger's runtime
    api.delete("trainjobs", "taken", NAMESPACE)
    api.delete("trainingruntimes", "taken-rt", NAMESPACE)

    assert _forbidden(plane, suite_chart) == []
    plane.kubectl("delete", "gtr", "tj", "-n", NAMESPACE)
    wait_for("the TrainJob and its runtime garbage-collected", lambda: api.get("trainjobs", "tj", NAMESPACE) is None
             and api.get("trainingruntimes", "tj", NAMESPACE) is None, timeout=60)  # fmt: skip


def test_a_job_training_as_the_charts_service_account(
    plane: ControlPlane, api: Api, suite_chart: Installed, fresh_operator: OperatorProcess
) -> None:
    """backend job: the headless Service, then the Indexed Job, made by the chart's
    ServiceAccount and run by the real Job controller (the plane's controller-manager; no node
    runs here, so its pods stay Pending); suspend and the deadline patched through and acted on
    by that controller; names taken by strangers refused; the GC takes both with the
    GpuTraining. (tests/e2e_local trains on it, on real nodes.)"""
    fresh_operator.start()
    plane.kubectl("create", "-f", "-", input=json.dumps(training("bj", backend="job")))
    job = wait_for("the Job", lambda: api.get("jobs", "bj", NAMESPACE), timeout=60)
    service = api.get("services", "bj", NAMESPACE)
    assert service is not None
    uid = api.get("gputrainings", "bj", NAMESPACE)["metadata"]["uid"]
    assert [o["uid"] for o in job["metadata"]["ownerReferences"]] == [uid]
    assert [o["uid"] for o in service["metadata"]["ownerReferences"]] == [uid]
    assert service["spec"]["clusterIP"] == "None"
    selector = "batch.kubernetes.io/job-name=bj"
    pods = wait_for(
        "the Job controller's pods", lambda: len(p := api.list("pods", NAMESPACE, selector)) == 2 and p
    )
    # Each pod's host is <job>-<index> under the Service: worker 0's name is the rendezvous.
    assert sorted((p["spec"]["hostname"], p["spec"]["subdomain"]) for p in pods) == [
        ("bj-0", "bj"),
        ("bj-1", "bj"),
    ]
    status = wait_for("Created", lambda: (s := _status(api, "bj")).get("phase") == "Created" and s)
    assert (status["backend"], status["job"]) == (
        "job",
        {"apiVersion": "batch/v1", "kind": "Job", "name": "bj"},
    )
    assert not {"pytorchJob", "trainJob"} & status.keys()  # the deprecated fields name Kubeflow jobs only

    _set_suspend(plane, "bj", True)
    wait_for("Suspended by the Job controller", lambda: _phase(api, "bj", "Suspended"), timeout=60)
    wait_for("its pods deleted", lambda: api.list("pods", NAMESPACE, selector) == [], timeout=60)
    _set_suspend(plane, "bj", False)
    wait_for("its pods made again", lambda: len(api.list("pods", NAMESPACE, selector)) == 2, timeout=60)
    plane.kubectl("patch", "gtr", "bj", "-n", NAMESPACE, "--type=merge",
                  "-p", '{"spec": {"runPolicy": {"activeDeadlineSeconds": 1}}}')  # fmt: skip
    wait_for("Failed past its deadline", lambda: _phase(api, "bj", "Failed"), timeout=60)
    reasons = [c.get("reason") for c in api.get("jobs", "bj", NAMESPACE)["status"]["conditions"]]
    assert "DeadlineExceeded" in reasons

    _strangers_names_refused(plane, api, "job", {"taken-job": "Job", "taken-svc": "Service"})
    assert api.get("jobs", "taken-svc", NAMESPACE) is None  # no Job beside a stranger's Service
    # kubectl deletes a Job's pods with it (a bare DELETE of a batch/v1 Job orphans them).
    plane.kubectl("delete", "job", "taken-job", "-n", NAMESPACE)
    plane.kubectl("delete", "service", "taken-svc", "-n", NAMESPACE)

    assert _forbidden(plane, suite_chart) == []
    plane.kubectl("delete", "gtr", "bj", "-n", NAMESPACE)
    wait_for("the Job and its Service garbage-collected", lambda: api.get("jobs", "bj", NAMESPACE) is None
             and api.get("services", "bj", NAMESPACE) is None, timeout=60)  # fmt: skip


def test_a_call_outside_the_charts_rules_is_refused_by_the_real_authorizer(
    plane: ControlPlane, api: Api, suite_chart: Installed, fresh_operator: OperatorProcess
) -> None:
    """Prove the RBAC check can fail: take `create` on pytorchjobs out of the chart's
    ClusterRole; the operator's create meets 403, and works again once the rule is back."""
    role_name = next(
        r["metadata"]["name"] for r in api.list("clusterroles", None)
        if r["metadata"].get("labels", {}).get("app.kubernetes.io/instance") == RELEASE
    )  # fmt: skip
    role = api.get("clusterroles", role_name, None)
    assert role is not None
    original = json.loads(json.dumps(role["rules"]))
    for rule in role["rules"]:
        if "pytorchjobs" in rule.get("resources", []):
            rule["verbs"] = [v for v in rule["verbs"] if v != "create"]
    api.request("PUT", api.path("clusterroles", None, role_name), role)
    try:
        fresh_operator.start()
        plane.kubectl("create", "-f", "-", input=json.dumps(training("denied")))
        wait_for("a 403 for the create", lambda: [
            e for e in _forbidden(plane, suite_chart)
            if e["verb"] == "create" and e["objectRef"]["resource"] == "pytorchjobs"
            and e["objectRef"]["namespace"] == NAMESPACE], timeout=30)  # fmt: skip
        assert api.get("pytorchjobs", "denied", NAMESPACE) is None
        wait_for("the operator saying so", lambda: "403" in fresh_operator.log())
    finally:
        role = api.get("clusterroles", role_name, None)
        assert role is not None
        role["rules"] = original
        api.request("PUT", api.path("clusterroles", None, role_name), role)
    wait_for("the job, once allowed", lambda: api.get("pytorchjobs", "denied", NAMESPACE), timeout=60)


def test_killed_at_random_moments_ends_with_exactly_one_job_each(
    plane: ControlPlane, api: Api, fresh_operator: OperatorProcess
) -> None:
    rng = random.Random(11)
    names = [f"crash-{i:02d}" for i in range(20)]
    fresh_operator.start()
    kills = 0
    for name in names:
        plane.kubectl("create", "-f", "-", input=json.dumps(training(name)))
        time.sleep(rng.uniform(0.0, 0.6))
        fresh_operator.kill()  # SIGKILL: no cleanup, mid-request or mid-reconcile
        kills += 1
        fresh_operator.start()
    for _ in range(4):
        time.sleep(rng.uniform(0.2, 1.5))
        fresh_operator.kill()
        kills += 1
        fresh_operator.start()
    assert kills >= 20

    for name in names:
        wait_for(f"{name} Created", lambda n=name: _phase(api, n, "Created"), timeout=90)
    jobs = _jobs(api)
    assert sorted(j["metadata"]["name"] for j in jobs) == names
    for job in jobs:
        owner = api.get("gputrainings", job["metadata"]["name"], NAMESPACE)
        assert owner is not None
        assert job["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]

    # A job lost before it ran (deleted by hand): its DELETED makes the operator ask whether the
    # GpuTraining is still there, and it is, so the job is made again.
    lost = api.get("pytorchjobs", "crash-00", NAMESPACE)
    assert lost is not None
    api.delete("pytorchjobs", "crash-00", NAMESPACE)
    remade = wait_for("crash-00's job made again", lambda: (j := api.get("pytorchjobs", "crash-00", NAMESPACE))
                      and j["metadata"]["uid"] != lost["metadata"]["uid"] and j, timeout=30)  # fmt: skip
    assert remade["metadata"]["ownerReferences"][0]["uid"] == lost["metadata"]["ownerReferences"][0]["uid"]


def test_api_faults_on_a_fifth_of_requests_every_job_converges_once(
    plane: ControlPlane, api: Api, suite_chart: Installed, stand_in: KubeflowStandIn, tmp_path: Path
) -> None:
    token_config = service_account_kubeconfig(
        plane, RELEASE_NAMESPACE, suite_chart.service_account, tmp_path / "sa"
    )
    token = json.loads(token_config.read_text())["users"][0]["user"]["token"]
    # Every watch is cut after 0.5-3 s (a load balancer that drops long connections): at
    # 50% an unlucky run ends with every stream on an uncut watch, held for minutes.
    proxy = FaultProxy(plane.server, plane.ca.cert, rate=0.2, watch_rate=1.0, seed=5)
    config = tmp_path / "through-proxy"
    config.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": proxy.url}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }))  # fmt: skip
    fresh_operator = OperatorProcess(config, tmp_path, env=suite_chart.env)
    names = [f"faulty-{i:02d}" for i in range(50)]
    try:
        fresh_operator.start()
        for name in names:
            plane.kubectl("create", "-f", "-", input=json.dumps(training(name)))
        for name in names:
            wait_for(f"{name} Created", lambda n=name: _phase(api, n, "Created"), timeout=180)
        for name in names[:5]:
            stand_in.job_status(name, "Created", "Running", startTime="2026-01-01T00:00:00Z")
        for name in names[:5]:
            wait_for(f"{name} Running", lambda n=name: _phase(api, n, "Running"), timeout=60)
        assert sorted(j["metadata"]["name"] for j in _jobs(api)) == names
        # The rate over the other requests (a lost reply and a cut watch were forwarded too).
        injected = sum(proxy.injected.values()) - proxy.injected["cut"]
        seen = proxy.forwarded - proxy.injected["cut"] + injected - proxy.injected["lost-reply"]
        assert seen >= 150, seen
        assert 0.12 <= injected / seen <= 0.3, (seen, proxy.injected)
        assert {"500", "429", "409", "timeout", "lost-reply"} <= set(proxy.injected), proxy.injected
        # Then prove the operator still sees what happens after the cuts (its watches came back).
        assert proxy.injected["cut"] >= 3, proxy.injected
        plane.kubectl("create", "-f", "-", input=json.dumps(training("after-cuts")))
        wait_for("after-cuts Created", lambda: _phase(api, "after-cuts", "Created"), timeout=60)
    finally:
        fresh_operator.stop()
        proxy.close()
    ours = fresh_operator.log().splitlines()
    assert not [line for line in ours if "Traceback" in line], "\n".join(ours)[-4000:]
    events = [e for e in api.list("events", NAMESPACE)  # earlier tests' events outlive their objects
              if e["reason"] == "PyTorchJobCreated" and e["involvedObject"]["name"] in names]  # fmt: skip
    assert len(events) <= len(names) + proxy.injected["lost-reply"], "an event per created job, not per retry"


def test_outside_a_pod_without_a_lease_namespace_the_operator_says_so_and_runs_standalone(
    plane: ControlPlane, api: Api, tmp_path: Path
) -> None:
    """A newcomer's `gpuop operator` on a laptop: no pod, no Lease namespace given. It works,
    alone, and says once that a second replica would not be safe."""
    plane.kubectl("create", "namespace", "lonely")
    fresh_operator = OperatorProcess(plane.kubeconfig, tmp_path)
    try:
        fresh_operator.start("--namespace", "lonely", "--scrape-interval", "1", "--scrape-timeout", "0.5")
        plane.kubectl("create", "-f", "-", input=json.dumps(training("alone", namespace="lonely")))
        wait_for("its PyTorchJob", lambda: api.get("pytorchjobs", "alone", "lonely"), timeout=60)
    finally:
        fresh_operator.stop()
        _delete_namespace(plane, "lonely")
    assert len(re.findall(r"WARNING.*no Lease namespace .*running standalone, so run one replica only",
                          fresh_operator.log())) == 1, fresh_operator.log()  # fmt: skip


def test_a_lease_it_cannot_write_is_said_and_nothing_is_done_until_it_can(
    plane: ControlPlane, api: Api, tmp_path: Path
) -> None:
    """A Lease in a namespace that does not exist yet (or one RBAC refuses): the replica cannot
    know it leads, so it acts on nothing, says why with the fix, and leads once it can."""
    plane.kubectl("create", "namespace", "waiting")
    fresh_operator = OperatorProcess(plane.kubeconfig, tmp_path)
    try:
        fresh_operator.start("--namespace", "waiting", "--lease-namespace", "leases-later")
        plane.kubectl("create", "-f", "-", input=json.dumps(training("patient", namespace="waiting")))
        wait_for("the warning", lambda: re.search(
            r"WARNING.*the Lease leases-later/gpu-training-operator: .*this replica cannot lead .*create the "
            r"namespace leases-later, or name one that exists", fresh_operator.log()))  # fmt: skip
        time.sleep(3)
        assert api.get("pytorchjobs", "patient", "waiting") is None  # a standby, acting on nothing
        plane.kubectl("create", "namespace", "leases-later")
        wait_for("its PyTorchJob once the Lease is held",
                 lambda: api.get("pytorchjobs", "patient", "waiting"), timeout=30)  # fmt: skip
    finally:
        fresh_operator.stop()
        _delete_namespace(plane, "waiting")
        _delete_namespace(plane, "leases-later")
    assert len(re.findall("this replica cannot lead", fresh_operator.log())) == 1, fresh_operator.log()


@dataclass
class Replicas:
    """Two operator replicas under the chart's Lease: which one works, which one waits."""

    processes: dict[str, OperatorProcess]
    api: Api
    lease: str
    leader: str = ""
    standby: str = ""

    def holder(self) -> str | None:
        found = self.api.request(
            "GET", f"/apis/coordination.k8s.io/v1/namespaces/{RELEASE_NAMESPACE}/leases/{self.lease}"
        )
        return (found.get("spec") or {}).get("holderIdentity")


@contextlib.contextmanager
def two_replicas(
    plane: ControlPlane, api: Api, suite_chart: Installed, tmp_path: Path, pods: tuple[str, str]
) -> Iterator[Replicas]:
    """The chart's set-up for replicas > 1: each pod its own identity (POD_ID) and the Lease in
    the release's namespace; the first started holds it, then the second stands by. Both
    stopped at the end, and neither may have logged a traceback."""
    config = service_account_kubeconfig(
        plane, RELEASE_NAMESPACE, suite_chart.service_account, tmp_path / "sa"
    )
    processes = {}
    for pod in pods:
        (tmp_path / pod).mkdir()
        processes[pod] = OperatorProcess(config, tmp_path / pod, env={**suite_chart.env, "POD_ID": pod})
    replicas = Replicas(processes, api, suite_chart.env["GPUOP_LEASE"], leader=pods[0], standby=pods[1])
    try:
        processes[replicas.leader].start()
        wait_for(
            "the first replica holding the Lease", lambda: replicas.holder() == replicas.leader, timeout=60
        )
        processes[replicas.standby].start()
        wait_for("the standby started", lambda: "gpu-training-operator: watching" in processes[replicas.standby].log(),
                 timeout=60)  # fmt: skip
        time.sleep(2)  # its watches listed (a standby's table stays current)
        yield replicas
    finally:
        for process in processes.values():
            process.stop()
    for process in processes.values():
        assert "Traceback" not in process.log(), process.log()[-3000:]


def _created(plane: ControlPlane, suite_chart: Installed, names: list[str]) -> list[dict[str, Any]]:
    return [e for e in _calls(plane, suite_chart) if e["verb"] == "create"
            and e["objectRef"]["resource"] == "pytorchjobs" and e["objectRef"].get("name") in names]  # fmt: skip


def test_two_replicas_under_the_charts_lease_one_works_and_the_other_takes_over_at_once(
    plane: ControlPlane, api: Api, suite_chart: Installed, tmp_path: Path
) -> None:
    """One replica works; the other takes over as soon as it stops the ordinary way (a rollout,
    a drain: SIGTERM, and the Lease is given up on the way out)."""
    with two_replicas(plane, api, suite_chart, tmp_path, ("gpuop-a", "gpuop-b")) as replicas:
        names = ["peer-a", "peer-b", "peer-c"]
        for name in names:
            plane.kubectl("create", "-f", "-", input=json.dumps(training(name)))
        for name in names:
            wait_for(f"{name} Created", lambda n=name: _phase(api, n, "Created"), timeout=60)
        assert sorted(e["responseStatus"]["code"] for e in _created(plane, suite_chart, names)) == [
            201, 201, 201]  # fmt: skip  # the standby made none

        stopping = time.monotonic()
        replicas.processes[replicas.leader].stop()
        wait_for("the standby holding the Lease", lambda: replicas.holder() == replicas.standby, timeout=30,
                 every=0.2)  # fmt: skip
        took = time.monotonic() - stopping
        print(f"SIGTERMed leader -> the standby holds the Lease in {took:.1f}s")
        assert took <= 2 + 5, took  # its next round (RETRY_SECONDS), as the Lease was given up
        plane.kubectl("create", "-f", "-", input=json.dumps(training("peer-d")))
        wait_for("peer-d Created by the standby", lambda: _phase(api, "peer-d", "Created"), timeout=60)
        standby = replicas.processes[replicas.standby].process
        assert standby is not None
        assert standby.poll() is None
        assert sorted(j["metadata"]["name"] for j in _jobs(api)) == [*names, "peer-d"]
        assert len(_created(plane, suite_chart, [*names, "peer-d"])) == 4  # none made twice


def test_a_killed_leader_is_replaced_by_the_standby_once_its_lease_expires(
    plane: ControlPlane, api: Api, suite_chart: Installed, tmp_path: Path
) -> None:
    """A crash, an OOM kill of the operator or a lost node: the leader gives nothing up, so the
    standby takes the Lease once it has seen it unrenewed for its 15 s, and works: 13 to 19 s
    after the kill. docs/operating.md states it; this measures it, to the standby's first
    write, and what the leader did before is not done again."""
    with two_replicas(plane, api, suite_chart, tmp_path, ("gpuop-x", "gpuop-y")) as replicas:
        plane.kubectl("create", "-f", "-", input=json.dumps(training("crash-a")))
        wait_for("crash-a Created by the leader", lambda: _phase(api, "crash-a", "Created"), timeout=60)

        replicas.processes[replicas.leader].kill()  # SIGKILL: no handler runs, the Lease stays held
        killed = time.monotonic()
        assert replicas.holder() == replicas.leader
        plane.kubectl("create", "-f", "-", input=json.dumps(training("crash-b")))
        wait_for("crash-b Created by the standby", lambda: _phase(api, "crash-b", "Created"), timeout=120,
                 every=0.5)  # fmt: skip
        took = time.monotonic() - killed
        print(f"SIGKILLed leader -> the standby made crash-b's job in {took:.1f}s (Lease duration 15 s)")
        # The Lease's duration after the last renewal the standby read (within a round, 2 s, of
        # the kill), then a round to take it and the reconcile of a training it already knew
        # (its watches stayed open).
        assert 13 <= took <= 19 + 6, took
        assert replicas.holder() == replicas.standby
        standby = replicas.processes[replicas.standby].process
        assert standby is not None
        assert standby.poll() is None
        assert [e["responseStatus"]["code"] for e in _created(plane, suite_chart, ["crash-a"])] == [201]
        assert [e["responseStatus"]["code"] for e in _created(plane, suite_chart, ["crash-b"])] == [201]


def test_a_finished_training_is_never_run_again_when_kubeflow_deletes_its_job(
    plane: ControlPlane, api: Api, fresh_operator: OperatorProcess, stand_in: KubeflowStandIn
) -> None:
    """Kubeflow deletes a finished PyTorchJob after runPolicy.ttlSecondsAfterFinished. Making it
    again would train again on the GPUs: the status and result stay, the deletion is recorded."""
    fresh_operator.start()
    plane.kubectl(
        "create", "-f", "-", input=json.dumps(training("ttl", runPolicy={"ttlSecondsAfterFinished": 60}))
    )
    job = wait_for("the PyTorchJob", lambda: api.get("pytorchjobs", "ttl", NAMESPACE), timeout=60)
    stand_in.job_status("ttl", "Created", "Running", startTime="2026-01-01T00:00:00Z")
    pods = stand_in.start_pods(job, RUNNING, gpu_percent=80.0)
    for pod in pods:
        stand_in.finish_pod(pod, {"phase": "Succeeded", "step": 100, "totalSteps": 100, "accuracy": 0.97})
    stand_in.job_status("ttl", "Created", "Succeeded", startTime="2026-01-01T00:00:00Z",
                        completionTime="2026-01-01T01:00:00Z")  # fmt: skip
    done = wait_for("Succeeded", lambda: (s := _status(api, "ttl")).get("phase") == "Succeeded" and s)

    api.delete("pytorchjobs", "ttl", NAMESPACE)  # what the TTL controller does
    gone = wait_for("JobDeleted", lambda: (s := _status(api, "ttl")) and any(
        c["type"] == "JobDeleted" for c in s.get("conditions", [])) and s)  # fmt: skip

    def ttl_reasons() -> list[str]:
        return plane.kubectl("get", "events", "-n", NAMESPACE, "--field-selector", "involvedObject.name=ttl",
                             "-o", "jsonpath={.items[*].reason}").stdout.split()  # fmt: skip

    # Events are posted a moment after the status, off the reconcile path: the SIGKILL below
    # would lose one not posted yet.
    wait_for("the PyTorchJobDeleted event", lambda: "PyTorchJobDeleted" in ttl_reasons())
    time.sleep(3)  # three ticks
    fresh_operator.kill()  # and a restart, which sees the GpuTraining before any job event
    fresh_operator.start()
    # The restarted operator at work (it starts in seconds idle, in more on a loaded machine):
    # a training made after the restart has its job; then three ticks more.
    plane.kubectl("create", "-f", "-", input=json.dumps(training("ttl-probe")))
    wait_for(
        "ttl-probe Created by the restarted operator", lambda: _phase(api, "ttl-probe", "Created"), timeout=60
    )
    time.sleep(3)
    assert api.get("pytorchjobs", "ttl", NAMESPACE) is None
    after = _status(api, "ttl")
    assert after["phase"] == "Succeeded"
    for key in ("completionTime", "progress", "gpuHours", "pytorchJob"):
        assert after[key] == done[key] == gone[key], key
    assert after["progress"]["accuracy"] == 0.97
    reasons = ttl_reasons()
    assert reasons.count("PyTorchJobDeleted") == 1
    assert reasons.count("PyTorchJobCreated") == 1


def test_one_poisonous_training_stops_no_other(
    plane: ControlPlane, api: Api, fresh_operator: OperatorProcess
) -> None:
    """A memory the CRD's pattern admits but no int64 holds (the operator's exact arithmetic
    once spent a minute of a core on it while every other training waited)."""
    fresh_operator.start()
    plane.kubectl(
        "create", "-f", "-", input=json.dumps(training("poison", resources={"memory": "1e999999999"}))
    )
    for name in ("fine-a", "fine-b"):
        plane.kubectl("create", "-f", "-", input=json.dumps(training(name)))
    for name in ("fine-a", "fine-b"):
        wait_for(f"{name} Created", lambda n=name: _phase(api, n, "Created"), timeout=30)
    status = wait_for("poison Failed", lambda: (s := _status(api, "poison")).get("phase") == "Failed" and s)
    assert status["message"] == (
        'spec.resources.memory: must be at most 9223372036854775807, Kubernetes\' int64 (got "1e999999999")'
    )
    assert api.get("pytorchjobs", "poison", NAMESPACE) is None


def test_one_pod_that_answers_a_byte_at_a_time_holds_no_other_trainings_status(
    plane: ControlPlane, api: Api, fresh_operator: OperatorProcess, stand_in: KubeflowStandIn
) -> None:
    """Issue 28: the tick waited for every pod's scrape, and a per-read timeout never fires on an
    endpoint that sends a byte every 0.1 s (any user's image can), so one such pod froze every
    training's status. Now it costs only its own figures: the other training's steps still
    reach its status tick after tick."""
    fresh_operator.start()
    jobs = {}
    for name in ("dribbler", "fine"):
        plane.kubectl("create", "-f", "-", input=json.dumps(training(name)))
        jobs[name] = wait_for(f"{name}'s PyTorchJob", lambda n=name: api.get("pytorchjobs", n, NAMESPACE),
                              timeout=60)  # fmt: skip
        stand_in.job_status(name, "Created", "Running", startTime=_stamp(time.time()))
    stand_in.start_pods(jobs["dribbler"], RUNNING, gpu_percent=85.0, dribbling=True)
    pods = stand_in.start_pods(jobs["fine"], RUNNING, gpu_percent=85.0)
    wait_for("fine's first figures", lambda: _status(api, "fine").get("progress", {}).get("step") == 30,
             timeout=30)  # fmt: skip
    for step in (40, 50, 60):  # each a tick or more apart (1 s, the suite's scrape interval)
        for pod in pods:
            stand_in.trainers.report(pod, dataclasses.replace(RUNNING, step=step), gpu_percent=85.0)
        wait_for(f"fine's step {step} in its status",
                 lambda s=step: _status(api, "fine").get("progress", {}).get("step") == s, timeout=15)  # fmt: skip
    dribbler = _status(api, "dribbler")
    assert dribbler["phase"] == "Running"
    assert "progress" not in dribbler or "step" not in dribbler["progress"]  # none of its bytes made figures


def test_a_queue_without_kueue_is_said_at_once_and_once_kueue_is_served_suspend_is_kueues(
    plane: ControlPlane, api: Api, fresh_operator: OperatorProcess, tmp_path: Path
) -> None:
    """A queued training on a cluster that serves no Kueue API gets no job (suspended, it would
    wait for nobody) and says so at once: Pending, reason KueueNotInstalled. Once Kueue's own
    CRDs are served (the real API server's discovery, asked again while it waits), the job is
    made suspended; Kueue resumes it on admission and suspends it again to preempt it, and the
    operator never undoes either. (Kueue's controller does not run here: the test writes what
    it writes. Its CRDs stay for the session, as a cluster's would.)"""
    fresh_operator.start()
    plane.kubectl(
        "create", "-f", "-", input=json.dumps(training("queued", scheduling={"queueName": "team-a"}))
    )

    def waiting_for_kueue() -> dict[str, Any] | None:
        conditions = _status(api, "queued").get("conditions", [])
        return next(
            (c for c in conditions if c["reason"] == "KueueNotInstalled" and c["status"] == "True"), None
        )

    condition = wait_for("KueueNotInstalled", waiting_for_kueue, timeout=30)
    assert condition["type"] == "BackendUnavailable"
    assert "install Kueue with its PyTorchJob integration" in condition["message"], condition
    assert _status(api, "queued")["phase"] == "Pending"
    assert api.get("pytorchjobs", "queued", NAMESPACE) is None
    installed = time.monotonic()
    install_crds(plane, kueue.crds(tmp_path))
    job = wait_for("the PyTorchJob", lambda: api.get("pytorchjobs", "queued", NAMESPACE), timeout=90)
    print(f"job made {time.monotonic() - installed:.1f}s after Kueue's CRDs were served")
    assert job["spec"]["runPolicy"]["suspend"] is True
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"

    def kueue_sets(suspend: bool) -> None:
        api.request("PATCH", api.path("pytorchjobs", NAMESPACE, "queued"),
                    {"spec": {"runPolicy": {"suspend": suspend}}}, "application/merge-patch+json")  # fmt: skip

    # Kueue's API is served but no Kueue made a Workload: queued, saying what it waits for.
    wait_for("queued Queued", lambda: _phase(api, "queued", "Queued"), timeout=30)
    condition = next(c for c in _status(api, "queued")["conditions"] if c["type"] == "Queued")
    assert condition["reason"] == "WaitingForKueue", condition
    for suspend in (False, True, False):  # admitted, preempted, admitted again
        kueue_sets(suspend)
        time.sleep(3)  # three ticks
        stored = api.get("pytorchjobs", "queued", NAMESPACE)
        assert stored is not None
        assert stored["spec"]["runPolicy"]["suspend"] is suspend


def _down_after(api: Api, pod: str, record: dict[str, Any]) -> None:
    """What the kubelet shows of a trainer that ended with ``record`` and waits to restart."""
    api.patch_status("pods", pod, {"containerStatuses": [{
        "name": "pytorch", "image": "trainer", "imageID": "", "ready": False, "restartCount": 1,
        "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting failed container"}},
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": json.dumps(record)}},
    }]}, NAMESPACE)  # fmt: skip


def test_a_failure_no_restart_mends_stops_the_job_its_own_way_or_kueues(
    plane: ControlPlane, api: Api, fresh_operator: OperatorProcess, stand_in: KubeflowStandIn
) -> None:
    """A trainer whose record says no restart mends its failure (Result.permanent: the store
    refused its credentials): the operator, as the chart's ServiceAccount, suspends the job
    (the training-operator then deletes its pods), or, under Kueue, whose suspend it is, sets its
    Workload inactive (Kueue then evicts it); each job is annotated with why; the training is
    Failed with the trainer's line, and stays so. A queued job whose Workload cannot be found
    cannot be stopped: it says Restarting with the line, as before. (Neither Kubeflow nor Kueue
    runs here: the test plays both; the chain runs the real ones, tests/e2e_local.) Kueue's CRDs
    are served since the test above."""
    fresh_operator.start()
    refused = {"phase": "Failed", "reason": "CheckpointStorageFailed", "permanent": True,
               "message": "s3://ckpt/x: list failed: access denied (InvalidAccessKeyId); check the credentials"}  # fmt: skip
    plane.kubectl("create", "-f", "-", input=json.dumps(training("refused")))
    for name in ("queued-refused", "no-workload"):
        plane.kubectl("create", "-f", "-", input=json.dumps(training(name, scheduling={"queueName": "q"})))
    jobs = {name: wait_for(f"{name}'s PyTorchJob", lambda n=name: api.get("pytorchjobs", n, NAMESPACE), timeout=60)
            for name in ("refused", "queued-refused", "no-workload")}  # fmt: skip
    # Kueue's part: a Workload for the queued job (labelled with its uid, owned by it), admitted.
    job = jobs["queued-refused"]
    workloads = f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{NAMESPACE}/workloads"
    api.request("POST", workloads, {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
        "metadata": {"name": "pytorchjob-queued-refused", "namespace": NAMESPACE,
                     "labels": {"kueue.x-k8s.io/job-uid": job["metadata"]["uid"]},
                     "ownerReferences": [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                                          "name": "queued-refused", "uid": job["metadata"]["uid"], "controller": True}]},
        "spec": {"queueName": "q", "podSets": [{"name": "master", "count": 1, "template": {
            "spec": {"containers": [{"name": "pytorch", "image": "trainer"}]}}}]},
    })  # fmt: skip
    for name in ("queued-refused", "no-workload"):
        api.request("PATCH", api.path("pytorchjobs", NAMESPACE, name),
                    {"spec": {"runPolicy": {"suspend": False}}}, "application/merge-patch+json")  # fmt: skip
    for name, made in jobs.items():
        stand_in.job_status(name, "Created", "Running", startTime=_stamp(time.time()))
        master, _ = stand_in.start_pods(made, RUNNING, gpu_percent=85.0)
        _down_after(api, master, refused)
    status = wait_for("no-workload Restarting", lambda: (s := _status(api, "no-workload")).get("phase") == "Restarting"
                      and s, timeout=30)  # fmt: skip
    restarting = next(c for c in status["conditions"] if c["type"] == "Restarting")
    assert (restarting["reason"], refused["message"] in restarting["message"]) == (
        "CheckpointStorageFailed",
        True,
    )
    for name in ("refused", "queued-refused"):
        status = wait_for(f"{name} Failed", lambda n=name: (s := _status(api, n)).get("phase") == "Failed" and s,
                          timeout=30)  # fmt: skip
        failed = next(c for c in status["conditions"] if c["type"] == "Failed")
        assert failed["reason"] == "CheckpointStorageFailed", failed
        assert failed["message"].startswith(f"pod {name}-master-0's trainer failed: {refused['message']}; ")
        assert any(c["type"] == "JobStopped" and c["status"] == "True" for c in status["conditions"]), status
    stopped = api.get("pytorchjobs", "refused", NAMESPACE)
    assert stopped["spec"]["runPolicy"]["suspend"] is True
    assert json.loads(stopped["metadata"]["annotations"]["gpuop.io/stopped"]) == {
        "pod": "refused-master-0", "reason": "CheckpointStorageFailed", "line": refused["message"]}  # fmt: skip
    workload = api.get_at(f"{workloads}/pytorchjob-queued-refused")
    assert workload is not None
    assert workload["spec"]["active"] is False
    # The queued job's suspend is Kueue's: the operator never set it (Kueue does, on eviction).
    assert api.get("pytorchjobs", "queued-refused", NAMESPACE)["spec"]["runPolicy"]["suspend"] is False
    assert _status(api, "no-workload")["phase"] == "Restarting"
    assert "gpuop.io/stopped" not in (
        api.get("pytorchjobs", "no-workload", NAMESPACE)["metadata"].get("annotations") or {}
    )
    # Stopped for good: a spec edit is reconciled (observedGeneration follows) and resumes nothing.
    before = _status(api, "refused")
    deadline = api.get("pytorchjobs", "refused", NAMESPACE)["spec"]["runPolicy"].get("activeDeadlineSeconds")
    assert deadline != 7200
    plane.kubectl("patch", "gtr", "refused", "-n", NAMESPACE, "--type=merge",
                  "-p", '{"spec": {"runPolicy": {"activeDeadlineSeconds": 7200}}}')  # fmt: skip
    generation = api.get("gputrainings", "refused", NAMESPACE)["metadata"]["generation"]
    after = wait_for(
        "the edit seen", lambda: (s := _status(api, "refused"))["observedGeneration"] == generation and s
    )
    assert after == {**before, "observedGeneration": generation}
    job = api.get("pytorchjobs", "refused", NAMESPACE)
    run_policy = job["spec"]["runPolicy"]
    assert (run_policy["suspend"], run_policy.get("activeDeadlineSeconds")) == (True, deadline)


def _node(api: Api, name: str, ready: str) -> None:
    """A Node whose Ready condition says ``ready`` since now (no kubelet posts for it)."""
    if api.get("nodes", name) is None:
        api.create("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
    reason = "KubeletReady" if ready == "True" else "NodeStatusUnknown"
    api.patch_status("nodes", name, {"conditions": [{
        "type": "Ready", "status": ready, "reason": reason, "message": "the test says so",
        "lastHeartbeatTime": _stamp(time.time()), "lastTransitionTime": _stamp(time.time()),
    }]})  # fmt: skip


def test_a_lost_node_is_said_at_once_and_the_gang_restarted_after_its_timeout(
    plane: ControlPlane, api: Api, fresh_operator: OperatorProcess, stand_in: KubeflowStandIn
) -> None:
    """The worker's node stops being Ready: the training says NodeLost at once, naming the node
    and the pod; at spec.nodeLossTimeoutSeconds the operator, as the chart's ServiceAccount,
    deletes the pod on the lost node at once (no kubelet would confirm a graceful stop) and the
    master with its grace period (it stays Terminating here: no kubelet runs it), for the job's
    controller to make both again; the event says so. The Nodes are the test's: no kubelet."""
    nodes = ("nodeloss-healthy", "nodeloss-lost")
    fresh_operator.start()
    try:
        for node in nodes:
            _node(api, node, "True")
        plane.kubectl("create", "-f", "-", input=json.dumps(training("lost", nodeLossTimeoutSeconds=8)))
        job = wait_for("lost's PyTorchJob", lambda: api.get("pytorchjobs", "lost", NAMESPACE), timeout=60)
        stand_in.job_status("lost", "Created", "Running", startTime=_stamp(time.time()))
        master, worker = stand_in.start_pods(job, RUNNING, gpu_percent=85.0, nodes=nodes)
        uids = {pod: api.get("pods", pod, NAMESPACE)["metadata"]["uid"] for pod in (master, worker)}
        wait_for("lost Running", lambda: _phase(api, "lost", "Running"), timeout=30)
        _node(api, nodes[1], "Unknown")
        _node(api, nodes[0], "True")  # a heartbeat, or the node controller would say Unknown too
        api.patch_status("pods", worker, {"conditions": [{"type": "Ready", "status": "False"}]}, NAMESPACE)
        lost_at = time.monotonic()
        status = wait_for("NodeLost", lambda: (s := _status(api, "lost")) and any(
            c["type"] == "NodeLost" and c["status"] == "True" for c in s["conditions"]) and s, timeout=30)  # fmt: skip
        said = next(c for c in status["conditions"] if c["type"] == "NodeLost")
        assert said["reason"] == "NodeStatusUnknown"
        assert said["message"].startswith(f"node {nodes[1]} is not ready (NodeStatusUnknown) since ")
        assert f"with pod {worker}; the operator deletes the training's pods at " in said["message"]
        assert api.get("pods", worker, NAMESPACE) is not None  # not before its timeout
        wait_for(
            "the lost node's pod deleted", lambda: api.get("pods", worker, NAMESPACE) is None, timeout=30
        )
        assert time.monotonic() - lost_at >= 6  # its timeout (8 s), less the clocks' whole seconds
        going = wait_for("the master deleted with its grace period", lambda: (
            (p := api.get("pods", master, NAMESPACE)) and p["metadata"].get("deletionTimestamp") and p), timeout=30)  # fmt: skip
        assert going["metadata"]["uid"] == uids[master]
        events = wait_for("the GangRestarted event", lambda: [
            e for e in api.list("events", NAMESPACE) if e["reason"] == "GangRestarted"
            and e["involvedObject"]["name"] == "lost"], timeout=30)  # fmt: skip
        assert [e["message"] for e in events] == [
            f"node {nodes[1]} lost: the operator deleted pod {worker} at once and pod {master} with its grace "
            "period, so that the PyTorchJob's controller makes the gang again on the nodes left"
        ]
    finally:
        for pod in ("lost-master-0", "lost-worker-0"):  # no kubelet will ever confirm them
            with contextlib.suppress(Exception):
                api.request("DELETE", api.path("pods", NAMESPACE, pod), {"gracePeriodSeconds": 0})
        for node in nodes:  # the chain's scheduler must never place a pod on them
            api.delete("nodes", node, None)


def test_a_progress_report_reaches_status_through_the_charts_rules(
    plane: ControlPlane, api: Api, fresh_operator: OperatorProcess, suite_chart: Installed
) -> None:
    """A training's pod reports progress (Kubeflow's protocol, with a token the real API server
    minted for that pod and the training's audience) to the operator running as the chart's
    ServiceAccount: the TokenReview and the pod read go through the chart's rules, and status
    shows the report. A stranger's ConfigMap under the name of a training's CA ConfigMap is left
    alone, and that training says NameConflict."""
    port = free_port()
    fresh_operator.report_port = port
    fresh_operator.start()
    plane.kubectl(
        "create", "configmap", "stranger-report-ca", "-n", NAMESPACE, "--from-literal=ca.crt=theirs"
    )
    plane.kubectl("create", "-f", "-", input=json.dumps(training("stranger")))
    plane.kubectl("create", "-f", "-", input=json.dumps(training("reporting")))
    wait_for("reporting Created", lambda: _phase(api, "reporting", "Created"), timeout=60)
    pod = api.create("pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "reporting-master-0", "labels": {"gpuop.io/gputraining": "reporting"}},
        "spec": {"containers": [{"name": "pytorch", "image": "trainer"}]},
    }, NAMESPACE)  # fmt: skip
    minted = api.request("POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default/token", {"spec": {
        "audiences": [report_audience(NAMESPACE, "reporting")], "expirationSeconds": 600,
        "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": "reporting-master-0",
                           "uid": pod["metadata"]["uid"]},
    }})  # fmt: skip
    # The chart's certificate names the Service; here the operator is reached on loopback, so
    # the chain is checked against the chart's CA and the name is not.
    context = ssl.create_default_context(cafile=str(Path(suite_chart.env["GPUOP_REPORT_TLS_DIR"]) / "ca.crt"))
    context.check_hostname = False
    body = {"trainerStatus": {"progressPercentage": 35, "estimatedRemainingSeconds": 120, "metrics": [
        {"name": "current_step", "value": "7"}, {"name": "total_steps", "value": "20"},
        {"name": "loss", "value": "0.75"}]}}  # fmt: skip
    url = f"https://127.0.0.1:{port}{report_path(NAMESPACE, 'reporting')}"

    def post(payload: dict[str, Any] | None = None, token: str | None = minted["status"]["token"]) -> int:
        request = urllib.request.Request(
            url,
            data=json.dumps(payload or body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {token}"} if token else {}),
        )
        try:
            with urllib.request.urlopen(request, timeout=10, context=context) as reply:
                return int(reply.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0  # the endpoint is not up yet

    # Hostile first, each refused by the operator's endpoint with no status written: no token,
    # a token of this pod for another training's audience, 300 metrics, a NaN, a flood.
    wait_for("the endpoint up", lambda: post(token=None) != 0, timeout=60, every=0.5)
    assert post(token=None) == 401
    elsewhere = api.request("POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/default/token", {"spec": {
        "audiences": [report_audience(NAMESPACE, "stranger")], "expirationSeconds": 600,
        "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": "reporting-master-0",
                           "uid": pod["metadata"]["uid"]},
    }})  # fmt: skip
    assert post(token=elsewhere["status"]["token"]) == 401
    many = [{"name": f"m{i}", "value": "1"} for i in range(300)]
    assert post({"trainerStatus": {"progressPercentage": 50, "metrics": many}}) == 400
    assert post({"trainerStatus": {"progressPercentage": math.nan}}) == 400  # JSON's NaN; "nan" text is text
    flood = [post({"trainerStatus": {"progressPercentage": 50, "metrics": many}}) for _ in range(20)]
    assert 429 in flood, flood
    # Logged once per client and reason (by the endpoint's process, into the operator's log).
    refusals = [
        line
        for line in fresh_operator.log().splitlines()
        if "refused: 429 more reports than the rate" in line
    ]
    assert len(refusals) == 1, refusals
    time.sleep(3)  # three ticks: nothing of theirs may reach status
    assert "progress" not in _status(api, "reporting")
    assert wait_for("the report accepted", lambda: post() == 200, timeout=60, every=0.5)
    progress = wait_for(
        "the report in status",
        lambda: (
            (_status(api, "reporting").get("progress") or {}).get("source") == "TrainerStatus"
            and _status(api, "reporting")["progress"]
        ),
        timeout=30,
    )
    assert (progress["step"], progress["totalSteps"], progress["percent"], progress["loss"]) == (
        7,
        20,
        35,
        0.75,
    )
    assert progress["reportedBy"] == "reporting-master-0"
    # The endpoint serves from a process of its own (gpuop.controller.reportproc); killed, it is
    # started again on the same port, and the next report reaches status as the first did.
    assert fresh_operator.process is not None
    tasks = Path(f"/proc/{fresh_operator.process.pid}/task")

    def endpoints() -> list[int]:  # the children running it (of any of the operator's threads)
        pids = [int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()]
        return [
            pid for pid in pids if b"gpuop.controller.reportproc" in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]

    first = endpoints()
    assert len(first) == 1, first
    os.kill(first[0], signal.SIGKILL)
    body["trainerStatus"]["metrics"][0]["value"] = "9"
    assert wait_for("a report accepted by the new endpoint", lambda: post() == 200, timeout=90, every=0.5)
    assert len(endpoints()) == 1
    assert endpoints() != first
    wait_for(
        "the next report in status", lambda: _status(api, "reporting")["progress"]["step"] == 9, timeout=30
    )
    # The stranger's ConfigMap: untouched, and the training with that name waits with NameConflict.
    wait_for("stranger NameConflict", lambda: any(
        c["type"] == "NameConflict" and c["status"] == "True" for c in _status(api, "stranger").get("conditions", [])
    ), timeout=60)  # fmt: skip
    theirs = api.get("configmaps", "stranger-report-ca", NAMESPACE)
    assert theirs is not None
    assert theirs["data"] == {"ca.crt": "theirs"}
    assert not theirs["metadata"].get("ownerReferences")
    plane.kubectl("delete", "configmap", "stranger-report-ca", "-n", NAMESPACE)


def _granted(plane: ControlPlane) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for every rule of the chart's ClusterRoles, and of its Role in
    the release's namespace (the Lease and the leader's pod label)."""
    manifest = _helm(plane, "get", "manifest", RELEASE, "-n", RELEASE_NAMESPACE)
    roles = [d for d in yaml.safe_load_all(manifest) if d and d["kind"] in ("ClusterRole", "Role")]
    return {(g, r, v) for role in roles for rule in role["rules"] for g in rule["apiGroups"]
            for r in rule["resources"] for v in rule["verbs"]}  # fmt: skip


def test_the_charts_rules_are_exactly_what_the_operator_asked_for(
    plane: ControlPlane, suite_chart: Installed
) -> None:
    """Read from the API server's audit log, after the tests above: each request the chart's
    ServiceAccount made was allowed (but the one whose rule a test took away), and each rule
    the chart grants was used by at least one request: nothing missing, nothing more."""
    asked: set[tuple[str, str, str]] = set()
    refused: set[tuple[str, str, str]] = set()
    for event in _calls(plane, suite_chart):
        ref = event.get("objectRef")
        if ref is None:  # discovery (/api, /apis): every authenticated user may
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        request = (ref.get("apiGroup", ""), resource, event["verb"])
        (refused if event["responseStatus"]["code"] == 403 else asked).add(request)
    assert refused == {("kubeflow.org", "pytorchjobs", "create")}  # the rule the test took away
    granted = _granted(plane)
    assert asked - granted == set()
    assert granted - asked == set(), "rules the chart grants that no request used"


def test_in_role_mode_the_operator_needs_nothing_cluster_scoped_but_its_outside_reads(
    plane: ControlPlane, api: Api, suite_chart: Installed, tmp_path: Path
) -> None:
    """`watchNamespaces`: the chart makes Roles only, and the operator works with them under the
    real authorizer (Kopf's cluster scanning off; the Lease in the operator's own namespace). Last in
    this module: it turns the release into Role mode."""
    role_mode = install_chart(plane, {**VALUES, "watchNamespaces": [NAMESPACE]})
    manifest = [
        d for d in yaml.safe_load_all(_helm(plane, "get", "manifest", RELEASE, "-n", RELEASE_NAMESPACE)) if d
    ]
    kinds = {d["kind"] for d in manifest}
    # Cluster-scoped only what has no namespaced form: the Node of a pod that may be lost,
    # TokenReview for progress reports, and dcgm-exporter's Endpoints (by name) in a namespace
    # the operator does not watch.
    (cluster_role,) = [d for d in manifest if d["kind"] == "ClusterRole"]
    assert {(r["resources"][0], tuple(r["verbs"])) for r in cluster_role["rules"]} == {
        ("nodes", ("get",)), ("tokenreviews", ("create",)), ("endpoints", ("get",))}  # fmt: skip
    assert {"Role", "RoleBinding"} <= kinds
    assert role_mode.env["GPUOP_NAMESPACES"] == NAMESPACE
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
    config = service_account_kubeconfig(plane, RELEASE_NAMESPACE, role_mode.service_account, tmp_path / "sa")
    fresh_operator = OperatorProcess(config, tmp_path, env=role_mode.env)
    try:
        fresh_operator.start()
        plane.kubectl("create", "-f", "-", input=json.dumps(training("scoped")))
        wait_for("scoped Created", lambda: _phase(api, "scoped", "Created"), timeout=60)
    finally:
        fresh_operator.stop()
    assert "Traceback" not in fresh_operator.log(), fresh_operator.log()[-3000:]
    refused = [e for e in _forbidden(plane, role_mode) if e["requestReceivedTimestamp"] >= since]
    assert refused == []
