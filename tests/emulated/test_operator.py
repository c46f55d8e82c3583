"""The real operator (``gpuop operator``: Kopf + the kubernetes client) against an API server
over real HTTP, driven with kubectl; the test plays the training-operator and the kubelet."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

from gputrain.contract import Progress
from support.emulator.cluster import JOBS, TRAININGS, Cluster, admit_all, cluster, stranger_job
from support.emulator.server import ApiServer
from support.samples import PRINTER_COLUMNS, RUNNING
from support.schemas.kubeflow import all_errors
from support.specs import training
from support.waiting import wait_for


def _result(**figures: Any) -> dict[str, Any]:
    record = {
        "phase": "Succeeded", "epoch": 2, "totalEpochs": 2, "step": 100, "totalSteps": 100,
        "loss": 0.21, "accuracy": 0.955, "testLoss": 0.18, "samplesPerSecond": 530.0,
        "durationSeconds": 95.0, "worldSize": 2,
    }  # fmt: skip
    record.update(figures)
    return record


AT_STEP_80 = Progress(epoch=2, total_epochs=2, step=80, total_steps=100, loss=0.4, samples_per_second=520.0,
                      estimated_remaining_seconds=40.0)  # fmt: skip


def _stamp(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def test_lifecycle_from_apply_to_succeeded(env: Cluster) -> None:
    env.start_operator()
    env.apply(training("mnist"))

    job = wait_for("the PyTorchJob", lambda: env.get(JOBS, "mnist"))
    assert all_errors({k: v for k, v in job.items() if k != "status"}) == []  # real Kubeflow CRD + webhook
    owner = job["metadata"]["ownerReferences"][0]
    assert owner["uid"] == env.get(TRAININGS, "mnist")["metadata"]["uid"]
    assert owner["controller"] is True
    wait_for("phase Created", lambda: env.status("mnist").get("phase") == "Created")
    # Reaching Created costs three writes: the job, the status, the event (posted a moment later).
    three = {
        "create kubeflow.org/v1/pytorchjobs": 1,
        "patch gpuop.io/v1alpha1/gputrainings": 1,
        "create v1/events": 1,
    }
    wait_for("the Created event", lambda: env.writes() == three)

    running_since = time.time()
    env.job_condition("mnist", "Created", "Running", startTime=_stamp(running_since))
    pods = env.start_pods("mnist", 2, RUNNING, gpu_percent=85.0)
    # Both pods, seen by one tick: the first look may come between the two pods' creation.
    status = wait_for(
        "progress and both pods' GPU figures in status",
        lambda: (
            (s := env.status("mnist")).get("progress", {}).get("step") == 30
            and len(s.get("gpu", {}).get("perWorker", ())) == 2
            and s.get("workers", {}).get("ready") == 2
            and s
        ),
    )
    assert status["phase"] == "Running"
    assert status["workers"] == {"ready": 2, "total": 2}
    assert status["progress"]["percent"] == 30.0
    assert status["progress"]["loss"] == 0.9
    assert status["gpu"]["utilizationPercent"] == 85.0
    assert status["gpu"]["count"] == 2
    assert sorted(w["pod"] for w in status["gpu"]["perWorker"]) == sorted(pods)
    # The status said Running by now: the span gpuHours counts starts at or before this moment
    # (not at running_since: a slow first reconcile moves its start past running_since + 3).
    seen_running = time.time()

    env.progress(pods[0], AT_STEP_80, gpu_percent=90.0)
    env.progress(pods[1], AT_STEP_80, gpu_percent=92.0)
    wait_for("step 80", lambda: env.status("mnist").get("progress", {}).get("step") == 80)

    for pod in pods:
        env.finish_pod(pod, _result())
    time.sleep(max(0.0, seen_running + 3 - time.time()))  # a span gpuHours can show at 4 decimals
    finished = time.time()
    env.job_condition("mnist", "Created", "Succeeded", startTime=_stamp(running_since),
                      completionTime=_stamp(finished))  # fmt: skip
    status = wait_for("Succeeded", lambda: (s := env.status("mnist")).get("phase") == "Succeeded" and s)
    assert status["completionTime"] == _stamp(finished)
    # 2 GPUs from when the status first said Running to the completion: seconds, not the hours
    # since the job's startTime (which Kubeflow moves anyway).
    assert 0 < status["gpuHours"] <= round(2 * (finished + 1 - running_since) / 3600, 4)
    assert status["progress"]["step"] == 100
    assert status["progress"]["accuracy"] == 0.955
    assert status["progress"]["percent"] == 100.0
    # Events are posted a moment after the status, off the reconcile path.
    wait_for("the Succeeded event", lambda: "TrainingSucceeded" in [r for _, r in env.events("mnist")])
    assert [r for _, r in env.events("mnist")] == [
        "PyTorchJobCreated",
        "PyTorchJobRunning",
        "TrainingSucceeded",
    ]

    # Finished and nothing changes: no more writes, however many ticks go by.
    before = env.writes()
    time.sleep(3.5)
    assert env.writes() == before, env.operator_log()[-3000:]

    table = env.kubectl("get", "gputrainings").stdout.split("\n")
    assert table[0].split() == PRINTER_COLUMNS
    assert table[1].split()[:5] == ["mnist", "Succeeded", "2", "2", "100%"]

    env.kubectl("delete", "gputraining", "mnist")
    wait_for("the PyTorchJob garbage-collected", lambda: env.get(JOBS, "mnist") is None)
    assert "Traceback" not in env.operator_log()


def test_spec_changes_reach_the_running_job_or_are_refused(env: Cluster) -> None:
    env.start_operator()
    env.apply(training("tune", runPolicy={"activeDeadlineSeconds": 3600}))
    wait_for("the PyTorchJob", lambda: env.get(JOBS, "tune"))

    env.kubectl("patch", "gputraining", "tune", "--type=merge", "-p",
                '{"spec": {"runPolicy": {"suspend": true, "activeDeadlineSeconds": 7200}}}')  # fmt: skip
    job = wait_for(
        "suspend on the job", lambda: (j := env.get(JOBS, "tune"))["spec"]["runPolicy"]["suspend"] and j
    )
    assert job["spec"]["runPolicy"]["activeDeadlineSeconds"] == 7200

    refused = env.kubectl(
        "patch", "gputraining", "tune", "--type=merge", "-p", '{"spec": {"workers": 4}}', check=False
    )
    assert refused.returncode != 0
    assert (
        "spec.workers cannot change once the GpuTraining exists (only spec.runPolicy, "
        "spec.stallTimeoutSeconds, spec.nodeLossTimeoutSeconds can); delete it and create it again to change this"
    ) in refused.stderr
    assert env.get(JOBS, "tune")["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1


def test_a_fixed_field_changed_past_an_old_crd_is_reported_not_applied(lax: Cluster) -> None:
    """No transition rules (a CRD from before they existed): the change lands, the job cannot take it."""
    lax.start_operator()
    lax.apply(training("drift"))
    wait_for("Created", lambda: lax.status("drift").get("phase") == "Created")
    lax.kubectl("patch", "gputraining", "drift", "--type=merge", "-p", '{"spec": {"workers": 4}}')
    condition = wait_for("SpecNotApplied", lambda: lax.condition("drift", "SpecNotApplied"))
    assert condition["status"] == "True"
    assert condition["message"].startswith("spec.workers (2 -> 4) changed after the PyTorchJob was created")
    assert lax.get(JOBS, "drift")["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1  # as created
    wait_for("the Warning", lambda: ("Warning", "FixedFieldChanged") in lax.events("drift"))

    lax.kubectl("patch", "gputraining", "drift", "--type=merge", "-p", '{"spec": {"workers": 2}}')
    wait_for("cleared", lambda: (lax.condition("drift", "SpecNotApplied") or {}).get("status") == "False")


# (name, spec changes, the exact InvalidSpec message)
INVALID = [
    ("zero-workers", {"workers": 0}, "spec.workers: must be >= 1 (got 0)"),
    ("typo", {"trainng": {"epochs": 1}}, 'spec.trainng: unknown field; did you mean "training"?'),
    (
        "fp16-cpu",
        {"gpusPerWorker": 0, "training": {"precision": "fp16"}},
        "spec.training.precision: fp16 needs GPUs (gpusPerWorker >= 1); use bf16 or fp32 on CPU",
    ),
    (
        "no-dataset",
        {"dataset": None},
        "spec.dataset: required unless spec.command runs your own training code",
    ),
]


def test_invalid_specs_fail_once_with_the_parse_error_and_others_run(lax: Cluster) -> None:
    lax.start_operator()
    for name, changes, _ in INVALID:
        body = training(name, **changes)
        body["spec"] = {k: v for k, v in body["spec"].items() if v is not None}
        lax.apply(body)
    lax.apply(training("fine"))

    for name, _, message in INVALID:
        status = wait_for(
            f"{name} Failed", lambda n=name: (s := lax.status(n)).get("phase") == "Failed" and s
        )
        invalid = next(c for c in status["conditions"] if c["type"] == "InvalidSpec")
        assert invalid["message"] == message
        assert status["message"] == message
        assert lax.get(JOBS, name) is None
    wait_for("fine Created", lambda: lax.status("fine").get("phase") == "Created")
    # Events are posted off the reconcile path: all of them in before counting writes (a loaded
    # machine once counted 2 of the 5 here, and the other 3 as "writes after").
    for name in (*(n for n, _, _ in INVALID), "fine"):
        wait_for(f"{name}'s event", lambda n=name: lax.events(n))

    before = lax.writes()
    time.sleep(3.5)  # several ticks: no retry loop, no second event
    assert lax.writes() == before, lax.operator_log()[-3000:]
    for name, _, _ in INVALID:
        assert lax.events(name) == [("Warning", "InvalidSpec")]


def test_a_stranger_with_our_name_is_never_touched(env: Cluster) -> None:
    env.api.call(env.server.create, JOBS, stranger_job("taken"))
    version = env.get(JOBS, "taken")["metadata"]["resourceVersion"]
    env.start_operator()
    env.apply(training("taken"))

    conflict = wait_for("NameConflict", lambda: env.condition("taken", "NameConflict"))
    assert conflict["status"] == "True"
    assert "not owned by this GpuTraining" in conflict["message"]
    assert env.status("taken")["phase"] == "Pending"
    wait_for("the NameConflict warning", lambda: ("Warning", "NameConflict") in env.events("taken"))
    time.sleep(2)
    assert env.get(JOBS, "taken")["metadata"]["resourceVersion"] == version  # untouched

    env.api.call(env.server.delete, JOBS, "default", "taken")
    wait_for("our own job", lambda: (j := env.get(JOBS, "taken")) and j["metadata"].get("ownerReferences"))
    wait_for("Created", lambda: env.status("taken").get("phase") == "Created")
    assert env.condition("taken", "NameConflict")["status"] == "False"


def test_killed_at_random_points_and_restarted_makes_exactly_one_job_each(env: Cluster) -> None:
    rng = random.Random(7)
    names = [f"restart-{i}" for i in range(24)]
    env.start_operator()
    for i, name in enumerate(names):
        env.apply(training(name))
        if i % 6 == 5:  # mid-stream: some created, some half-way, some not seen yet
            time.sleep(rng.uniform(0.0, 0.4))
            env.kill_operator()
            env.start_operator()
    for _ in range(3):
        time.sleep(rng.uniform(0.05, 0.5))
        env.kill_operator()
        env.start_operator()

    for name in names:
        wait_for(f"{name} Created", lambda n=name: env.status(n).get("phase") == "Created", timeout=30)
    jobs = env.objects(JOBS)
    assert sorted(j["metadata"]["name"] for j in jobs) == sorted(names)
    for job in jobs:
        owner = env.get(TRAININGS, job["metadata"]["name"])
        assert job["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]


def test_api_faults_are_retried_and_every_job_converges(tmp_path: Path) -> None:
    def faulty(server: ApiServer) -> None:
        admit_all(server)
        server.faults.rate = 0.25

    with cluster(tmp_path, faulty) as env:
        env.start_operator()
        names = [f"faulty-{i}" for i in range(12)]
        for name in names:
            for _ in range(20):  # kubectl itself meets the faults too
                if env.kubectl("apply", "--validate=false", "-f", "-", check=False,
                               input=json.dumps(training(name))).returncode == 0:  # fmt: skip
                    break
        for name in names:
            wait_for(f"{name} Created", lambda n=name: env.status(n).get("phase") == "Created", timeout=40)
        for name in names[:4]:
            env.job_condition(name, "Created", "Running")
        for name in names[:4]:
            wait_for(f"{name} Running", lambda n=name: env.status(n).get("phase") == "Running", timeout=40)
        assert sorted(j["metadata"]["name"] for j in env.objects(JOBS)) == sorted(names)
        # The count follows the request count, which timing moves (10 was seen at a 25% rate).
        assert env.server.faults.injected >= 5
        log = env.operator_log()
        assert "Traceback" not in log, log[-3000:]


def test_stalled_and_underutilized_jobs_get_conditions_and_warnings(env: Cluster) -> None:
    env.start_operator("--underutilized-seconds", "2", "--underutilized-percent", "30")
    env.apply(training("slow", stallTimeoutSeconds=3))
    wait_for("the PyTorchJob", lambda: env.get(JOBS, "slow"))
    env.job_condition("slow", "Created", "Running")
    pods = env.start_pods("slow", 2, RUNNING, gpu_percent=12.0)

    underused = wait_for(
        "Underutilized", lambda: (c := env.condition("slow", "Underutilized")) and c["status"] == "True" and c
    )
    assert underused["reason"] == "LowGpuUtilization"
    assert "mean GPU utilization 12%" in underused["message"]
    stalled = wait_for(
        "Stalled", lambda: (c := env.condition("slow", "Stalled")) and c["status"] == "True" and c, timeout=15
    )
    assert stalled["reason"] == "NoProgress"
    assert stalled["message"].startswith("step 30 has not advanced for")
    # Events are posted a moment after the status, off the reconcile path.
    wait_for("the Stalled warning", lambda: ("Warning", "NoProgress") in env.events("slow"))
    wait_for("the Underutilized warning", lambda: ("Warning", "LowGpuUtilization") in env.events("slow"))

    # The trainers go on at step 31, 32, ... one step per look: had they stopped at 31, a look
    # delayed past stallTimeoutSeconds (3 s) would find the job Stalled again, never cleared.
    # (99 at most, a valid figure: reached 69 looks in, after the Stalled wait's 40 at most.)
    steps = itertools.count(31)

    def advanced_and_cleared(kind: str) -> bool:
        progress = Progress(epoch=1, total_epochs=2, step=min(next(steps), 99), total_steps=100, loss=0.8,
                            samples_per_second=500.0, estimated_remaining_seconds=120.0)  # fmt: skip
        for pod in pods:
            env.progress(pod, progress, gpu_percent=95.0)
        return (env.condition("slow", kind) or {}).get("status") == "False"

    wait_for("Stalled cleared", lambda: advanced_and_cleared("Stalled"), every=0.5)
    wait_for("Underutilized cleared", lambda: advanced_and_cleared("Underutilized"), every=0.5)
    assert env.status("slow")["phase"] == "Running"


def test_scraping_through_the_pod_ip_works_too(env: Cluster) -> None:
    env.start_operator("--scrape-via", "pod-ip")
    env.apply(training("direct"))
    wait_for("the PyTorchJob", lambda: env.get(JOBS, "direct"))
    env.job_condition("direct", "Created", "Running")
    env.start_pods("direct", 1, RUNNING, gpu_percent=70.0)
    wait_for("progress", lambda: env.status("direct").get("progress", {}).get("step") == 30)
    proxied = [k for k in env.server.counts if k[0] == "gpuop" and "proxy" in k[1]]
    assert proxied == []


def test_a_failed_trainer_reports_its_reason(env: Cluster) -> None:
    env.start_operator()
    env.apply(training("broken"))
    wait_for("the PyTorchJob", lambda: env.get(JOBS, "broken"))
    env.job_condition("broken", "Created", "Running")
    pods = env.start_pods("broken", 1, RUNNING, gpu_percent=None)
    wait_for("Running", lambda: env.status("broken").get("phase") == "Running")
    env.finish_pod(
        pods[0],
        {"phase": "Failed", "reason": "DatasetMissing", "message": "dataset digits not found under /data"},
        phase="Failed",
    )
    env.job_condition("broken", "Created", "Failed")
    status = wait_for("Failed", lambda: (s := env.status("broken")).get("phase") == "Failed" and s)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DatasetMissing"
    assert failed["message"] == "dataset digits not found under /data"
    wait_for("the Failed warning", lambda: ("Warning", "DatasetMissing") in env.events("broken"))


def test_two_replicas_under_a_lease_one_works_and_the_other_takes_over(env: Cluster) -> None:
    """The chart's set-up: two replicas and a Lease in their namespace; its holder works."""
    leases = "coordination.k8s.io/v1/leases"

    def holder() -> str | None:
        lease = env.get(leases, "gpu-training-operator", namespace="default") or {}
        return (lease.get("spec") or {}).get("holderIdentity")

    def held_by(process: subprocess.Popen[bytes]) -> bool:
        # The holder's name here is host/pid/random: the pid says which process it is.
        return str(holder() or "//").split("/")[1] == str(process.pid)

    leader = env.start_operator(lease_namespace="default")
    wait_for("the first replica holding the Lease", lambda: held_by(leader))
    standby = env.start_operator(lease_namespace="default")

    names = ["peer-a", "peer-b", "peer-c"]
    for training_name in names:
        env.apply(training(training_name))
    for training_name in names:
        wait_for(f"{training_name} Created", lambda n=training_name: env.status(n).get("phase") == "Created")
    # Exactly one replica's writes: one job, one status patch, one event per training.
    wait_for(
        "one replica's writes",
        lambda: (
            {key: n for key, n in env.writes().items() if "/leases" not in key}
            == {
                "create kubeflow.org/v1/pytorchjobs": 3,
                "patch gpuop.io/v1alpha1/gputrainings": 3,
                "create v1/events": 3,
            }
        ),
    )

    env.stop_operator(leader)  # a rolling update: SIGTERM, and the Lease is given up on the way out
    wait_for("the standby holding the Lease", lambda: held_by(standby), timeout=10)
    env.apply(training("peer-d"))
    wait_for("peer-d Created by the standby", lambda: env.status("peer-d").get("phase") == "Created")
    env.job_condition("peer-a", "Created", "Running")
    env.start_pods("peer-a", 2, RUNNING, gpu_percent=70.0)
    wait_for("the standby scrapes", lambda: env.status("peer-a").get("progress", {}).get("step") == 30)
    assert standby.poll() is None
    assert sorted(j["metadata"]["name"] for j in env.objects(JOBS)) == [*names, "peer-d"]
