"""The operator as users run it: what ``make release`` pushed to a real registry, installed by
``helm install oci://...`` with the chart's defaults, its image pulled and started by a real kubelet in containerd under restricted Pod Security, talking to the
API through the ``kubernetes`` Service (kube-proxy's rules) with its ServiceAccount's token.

Here, in `make cluster` and in the end-to-end chain the operator runs this way; the
control-plane suite runs it as a process on the test host with a kubeconfig. This module checks
what the image and the chart bring: the image's USER and ENTRYPOINT, the chart's
securityContext (read-only root filesystem, no capabilities, RuntimeDefault seccomp, uid
65532), its probes and in-cluster configuration, against the real thing.

The image is built by BuildKit from images/operator.Dockerfile, unchanged (support.images; cold
once per machine, then cached by content) and pushed with the chart by the session's one
``make release`` (support.fixtures' ``released``); each node trusts the registry's CA, as a cloud
node trusts a private registry, and its kubelet pulls the image when a pod first needs it.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from support import specs
from support.controllers import trainingoperator
from support.controllers.webhooked import WebhookedController
from support.fixtures import Released
from support.images import build
from support.node.images import ImageArchive
from support.node.node import Node, Scheduler
from support.node.proxy import ServiceProxy
from support.paths import ROOT
from support.plane.cluster import Api, install_chart, ready_operator_pod, uninstall_chart
from support.plane.controlplane import ControlPlane
from support.tools.helm import RELEASE, RELEASE_NAMESPACE, helm
from support.waiting import wait_for

pytestmark = pytest.mark.node

NAMESPACE = "gpuop-in-cluster"
RESTRICTED = {
    "pod-security.kubernetes.io/enforce": "restricted",
    "pod-security.kubernetes.io/enforce-version": "latest",
}
# Run in the operator's container: its uid and gid, what a write to the root filesystem meets,
# its effective capabilities and its seccomp mode, a line each.
INSPECT = """
import os, errno
print(os.getuid(), os.getgid())
try:
    open("/opt/gpuop-write-probe", "w")
    print("writable")
except OSError as error:
    print(errno.errorcode[error.errno])
status = open("/proc/self/status").read()
print(status.split("CapEff:")[1].split()[0])
print(status.split("Seccomp:")[1].split()[0])
"""


def _log_until_exit(plane: ControlPlane, pod: str, stop: Callable[[], object]) -> tuple[str, float]:
    """The operator pod's log from now until its container exits after ``stop()`` (the pod and
    its log are gone after), and the seconds that took."""
    follow = subprocess.Popen(
        [str(plane.binary("kubectl")), f"--kubeconfig={plane.kubeconfig}", "logs", "-f", "-n", RELEASE_NAMESPACE, pod],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        started = time.monotonic()
        stop()
        said, _ = follow.communicate(timeout=60)  # the log ends when the container does
        return said, time.monotonic() - started
    finally:
        follow.kill()


def _waited(
    api: Api, kubeflow: WebhookedController, name: str, what: str, check: Callable[[], dict[str, Any] | None]
) -> dict[str, Any]:
    """What ``check`` returns for the GpuTraining ``name`` once it returns something; on a
    timeout, the failure says what the training, the namespace's events and the
    training-operator showed."""
    try:
        found: dict[str, Any] = wait_for(f"{name}: {what}", check, timeout=150, every=1)
    except AssertionError as exc:
        status = (api.get("gputrainings", name, NAMESPACE) or {}).get("status")
        raise AssertionError(f"{exc}\nstatus: {json.dumps(status)}\nevents: {_events(api, NAMESPACE)}"
                             f"\ntraining-operator: {kubeflow.tail()}") from None  # fmt: skip
    return found


def _events(api: Api, namespace: str) -> list[str]:
    return [f"{e['involvedObject'].get('name')}: {e['reason']}: {e.get('message', '')}"
            for e in api.list("events", namespace)]  # fmt: skip


@pytest.fixture(scope="module")
def image() -> ImageArchive:
    started = time.monotonic()
    archive = build.operator_image()
    print(f"operator image {archive.name} at {archive.path} in {time.monotonic() - started:.2f}s")
    return archive


@pytest.fixture(scope="module")
def version() -> str:
    made = subprocess.run(["make", "-s", "version"], cwd=ROOT, capture_output=True, text=True, check=True)
    return made.stdout.strip()


@pytest.fixture(scope="module")
def image_on_node(node: Node, released: Released) -> str:
    """The operator image as ``make release`` pushed it, by the name the released chart deploys;
    the node trusts the registry's CA and its kubelet pulls the image (no import)."""
    node.containerd.trust(released.registry.address, released.registry.ca)
    return released.reference("operator")


def test_the_image_is_named_as_the_chart_deploys_it_and_runs_gpuop_operator_as_65532(
    image: ImageArchive, version: str
) -> None:
    assert image.name == build.chart_image() == f"ghcr.io/gpu-training-operator/operator:{version}"
    config = build.image_config(image.path)["config"]
    assert config["User"] == "65532"  # the chart's runAsUser; runAsNonRoot needs a numeric one
    assert (config["Entrypoint"], config["Cmd"]) == (["gpuop"], ["operator"])  # the chart passes args only
    layers = [layer["size"] for layer in build.image_manifest(image.path)["layers"]]
    print(f"operator image: {len(layers)} layers, {sum(layers) / 1e6:.0f} MB compressed "
          f"(the base's {layers[0] / 1e6:.0f} MB)")  # fmt: skip


@pytest.fixture(scope="module")
def operator_pod(
    plane: ControlPlane, api: Api, node: Node, scheduler: Scheduler, service_proxy: ServiceProxy,
    image_on_node: str, released: Released,
) -> Iterator[dict[str, Any]]:  # fmt: skip
    """The released chart (``helm install oci://...``) installed with its defaults into a namespace that enforces restricted Pod
    Security; the Deployment's pod once Ready (its readiness probe is the operator's /healthz).

    One value differs from the defaults: a node selector for this node, so that the second node
    the module starts for one test is never chosen. The suite runs before the others
    (tests/conftest.py), on a cluster no chart or operator has been put in yet."""
    for namespace, labels in ((RELEASE_NAMESPACE, RESTRICTED), (NAMESPACE, {})):
        api.request("POST", "/api/v1/namespaces", {"metadata": {"name": namespace, "labels": labels}})
    installing = time.monotonic()
    install_chart(plane, {"nodeSelector": {"kubernetes.io/hostname": node.name}}, released.helm_chart())
    print(f"helm install: {time.monotonic() - installing:.1f}s")
    try:
        try:
            running = wait_for(
                "the operator's pod Ready", lambda: ready_operator_pod(api), timeout=120, every=0.5
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nevents: {_events(api, RELEASE_NAMESPACE)}") from None
        print(f"helm install -> operator pod Ready: {time.monotonic() - installing:.1f}s")
        yield running
    finally:
        # The training's namespace goes first, while the operator still runs to release the
        # GpuTraining's finalizer; without it the namespace would hang in Terminating.
        api.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}")
        wait_for(
            "the training namespace gone", lambda: api.get("namespaces", NAMESPACE, None) is None, timeout=60
        )
        uninstall_chart(plane)


# Run in the operator's container: each name given, resolved through its resolv.conf.
RESOLVE = "import socket, sys\nfor name in sys.argv[1:]:\n    print(name, socket.gethostbyname(name))"


def test_pods_resolve_services_and_headless_names_through_cluster_dns(
    plane: ControlPlane, api: Api, cluster_dns: str, operator_pod: dict[str, Any]
) -> None:
    """CoreDNS behind kube-dns answers what a training needs: the API's name, the operator's
    report Service (the URL trainers are told) and a headless Service's name, as Kubeflow's
    rendezvous ``<job>-master-0`` is (here one that selects CoreDNS's own pod)."""
    dns_pod = api.list("pods", "kube-system", selector="k8s-app=kube-dns")[0]
    api.create("services", {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "in-cluster-master-0"},
        "spec": {"clusterIP": "None", "selector": {"k8s-app": "kube-dns"}, "ports": [{"port": 23456}]},
    }, "kube-system")  # fmt: skip
    try:
        reports = next(
            s for s in api.list("services", RELEASE_NAMESPACE) if s["metadata"]["name"].endswith("-reports")
        )
        names = {
            "kubernetes.default.svc.cluster.local": "10.96.0.1",
            f"{reports['metadata']['name']}.{RELEASE_NAMESPACE}.svc": reports["spec"]["clusterIP"],
            "in-cluster-master-0.kube-system": dns_pod["status"]["podIP"],  # the search path completes it
        }
        name = operator_pod["metadata"]["name"]
        said = wait_for("the names resolved", lambda: (r := plane.kubectl(
            "exec", "-n", RELEASE_NAMESPACE, name, "--", "python", "-c", RESOLVE, *names, check=False,
        )).returncode == 0 and r.stdout, timeout=30, every=1)  # fmt: skip
        assert dict(line.split() for line in said.splitlines()) == names, said
    finally:
        api.delete("services", "in-cluster-master-0", "kube-system")


@pytest.fixture
def kubeflow_v1(
    plane: ControlPlane, api: Api, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WebhookedController]:
    """The real training-operator (a process on this machine, its webhook reached at the
    machine's own address), to turn the in-cluster operator's PyTorchJobs into pods here. For
    one test at a time (5 s to start): left running, it would keep making the pods of the other
    tests' PyTorchJobs (whose default trainer image is not on these nodes) while their namespace
    and nodes are taken down."""
    process = trainingoperator.training_operator(
        plane, api, plane.advertise_address, tmp_path_factory.mktemp("kubeflow")
    )
    process.start()
    yield process
    process.retire()


# Run by the worker: more memory than its limit, a page at a time (the kernel kills it as the
# cgroup passes the limit; a single huge allocation could fail with MemoryError instead).
HOG = "import time\nheld = []\nwhile True:\n    held.append(bytearray(8 << 20))\n    time.sleep(0.01)"


def test_a_worker_over_its_memory_limit_is_oomkilled_and_the_gputraining_says_which_the_limit_and_the_fix(
    plane: ControlPlane, api: Api, node: Node, kubeflow_v1: WebhookedController, image_on_node: str,
    operator_pod: dict[str, Any],
) -> None:  # fmt: skip
    """The kernel's OOM kill, which only a real node does: the worker's cgroup passes the memory
    limit the operator rendered, the kubelet says OOMKilled, and the GpuTraining says which pod,
    what limit and what to change: while the kubelet restarts it (Restarting), and once Kubeflow
    gives up (Failed). Without it a user sees exit code 137 and a backoff limit."""
    common = {"image": image_on_node, "command": ["python", "-c", HOG], "workers": 1, "gpusPerWorker": 0,
              "resources": {"cpu": "200m", "memory": "96Mi"}, "shmSize": "16Mi"}  # fmt: skip
    trainings = {
        "oom-restarting": specs.training("oom-restarting", NAMESPACE, **common),
        "oom-failed": specs.training("oom-failed", NAMESPACE, runPolicy={"backoffLimit": 0}, **common),
    }
    for body in trainings.values():
        api.create("gputrainings", body, NAMESPACE)
    try:
        wanted = {"oom-restarting": ("Restarting", "Restarting"), "oom-failed": ("Failed", "Failed")}
        for name, (phase, condition_type) in wanted.items():

            def said(
                name: str = name, phase: str = phase, kind: str = condition_type
            ) -> dict[str, Any] | None:
                status = (api.get("gputrainings", name, NAMESPACE) or {}).get("status") or {}
                found = [
                    c for c in status.get("conditions") or [] if c["type"] == kind and c["status"] == "True"
                ]
                return found[0] if status.get("phase") == phase and found else None

            condition = _waited(api, kubeflow_v1, name, f"{phase} with the OOM kill", said)
            print(f"{name}: {condition['reason']}: {condition['message']}")
            assert condition["reason"] == "OOMKilled", condition
            assert f"pod {name}-master-0's trainer" in condition["message"], condition
            assert "at its memory limit of 96Mi (OOMKilled)" in condition["message"], condition
            assert "Raise spec.resources.memory" in condition["message"], condition
            # The kubelet's own word for it, on the pod the condition names, where it is still
            # there: Kubeflow deletes a failed job's running pods (cleanPodPolicy Running, the
            # default), and then the condition above is what is left to say why.
            worker = api.get("pods", f"{name}-master-0", NAMESPACE)
            if worker is None:
                assert name == "oom-failed", f"{name}-master-0 is gone"
                continue
            trainer = worker["status"]["containerStatuses"][0]
            killed = [s["terminated"] for s in (trainer.get("state"), trainer.get("lastState"))
                      if s and "terminated" in s]  # fmt: skip
            assert any(t["reason"] == "OOMKilled" and t["exitCode"] == 137 for t in killed), trainer
        events = _events(api, NAMESPACE)
        assert any("OOMKilled" in e and e.startswith("oom-failed:") for e in events), events
    finally:
        for name in trainings:
            api.delete("gputrainings", name, NAMESPACE)


def test_a_training_whose_secret_is_missing_says_which_and_starts_once_it_is_made(
    plane: ControlPlane, api: Api, node: Node, kubeflow_v1: WebhookedController, image_on_node: str,
    operator_pod: dict[str, Any],
) -> None:  # fmt: skip
    """spec.checkpoint.secretName names a Secret nobody made: the real kubelet cannot start the
    trainer (CreateContainerConfigError) and retries on its own, saying why only in the pod. The
    GpuTraining says it, naming the Secret, and clears it once the Secret is made and the
    trainer starts."""
    name, secret = "missing-secret", "store-credentials"
    body = specs.training(
        name, NAMESPACE, image=image_on_node, command=["python", "-c", "print('started')"], workers=1,
        gpusPerWorker=0, resources={"cpu": "100m", "memory": "96Mi"}, shmSize="16Mi",
        checkpoint={"uri": "s3://checkpoints/runs", "secretName": secret},
    )  # fmt: skip
    api.create("gputrainings", body, NAMESPACE)
    try:

        def condition(status: str) -> dict[str, Any] | None:
            said = (api.get("gputrainings", name, NAMESPACE) or {}).get("status") or {}
            return next((c for c in said.get("conditions") or [] if c["type"] == "PodsNotStarting"
                         and c["status"] == status), None)  # fmt: skip

        blocked = _waited(api, kubeflow_v1, name, "PodsNotStarting", lambda: condition("True"))
        print(f"{name}: {blocked['reason']}: {blocked['message']}")
        assert blocked["reason"] == "CreateContainerConfigError", blocked
        assert blocked["message"].startswith(f"pod {name}-master-0's trainer cannot start: "), blocked
        assert f'secret "{secret}" not found' in blocked["message"], blocked  # the kubelet's words
        assert "spec.checkpoint.secretName" in blocked["message"], blocked
        made = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret},
                "stringData": {"AWS_REGION": "us-east-1"}}  # fmt: skip
        api.create("secrets", made, NAMESPACE)
        wait_for(f"{name}: PodsNotStarting cleared", lambda: condition("False"), timeout=150, every=1)
    finally:
        api.delete("gputrainings", name, NAMESPACE)
        api.delete("secrets", secret, NAMESPACE)


# Run by both pods of a two-worker training: rank 0 listens on MASTER_PORT, rank 1 finds it by
# MASTER_ADDR (cluster DNS: the training-operator's headless Service), from another node where
# there are two, and sends its devices; each prints what the kubelet's device manager gave it.
# Rank 0 ends only once rank 1 has reached it: a PyTorchJob succeeds with its master, and a
# worker whose master is gone never gets past its init container (the master's name resolves
# only while the master runs).
RENDEZVOUS = """
import os, socket, time
rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
devices = os.environ.get("NVIDIA_VISIBLE_DEVICES", "")
print(f"rank {rank} devices {devices}", flush=True)
if rank == 0:
    server = socket.create_server(("", port))
    server.settimeout(120)
    peer, address = server.accept()
    print(f"rank 1 devices {peer.recv(200).decode()} from {address[0]}", flush=True)
else:
    for attempt in range(240):
        try:
            connection = socket.create_connection((os.environ["MASTER_ADDR"], port), timeout=2)
            break
        except OSError:
            time.sleep(0.5)
    connection.sendall(devices.encode())
"""


def test_a_two_worker_gpu_training_spans_both_nodes_each_worker_with_the_gpus_its_kubelet_allocated(
    plane: ControlPlane, api: Api, node: Node, second_node: Node, kubeflow_v1: WebhookedController,
    cluster_dns: str, released: Released, image_on_node: str, operator_pod: dict[str, Any],
) -> None:  # fmt: skip
    """Two nodes with two stand-in GPUs each, and a training of two workers with two GPUs each:
    the scheduler can only place one worker on each node, each kubelet's device manager gives its
    worker both of its node's devices (the device plugin's NVIDIA_VISIBLE_DEVICES), and the
    workers meet across the nodes by the master's name, as a DDP rendezvous does."""
    second_node.containerd.trust(released.registry.address, released.registry.ca)  # it pulls the image too
    name = "two-nodes"
    # Both pods kept after the job ends (cleanPodPolicy None): the master's success ends it, and
    # with the default (Running) the training-operator deletes the worker if its kubelet has not
    # yet said it finished; a CI run (2026-11-26) lost the worker's pod and log so.
    body = specs.training(name, NAMESPACE, image=image_on_node, command=["python", "-c", RENDEZVOUS],
                          workers=2, gpusPerWorker=2, resources={"cpu": "200m", "memory": "256Mi"},
                          runPolicy={"cleanPodPolicy": "None"})  # fmt: skip
    api.create("gputrainings", body, NAMESPACE)
    try:

        def finished() -> str | None:
            phase = ((api.get("gputrainings", name, NAMESPACE) or {}).get("status") or {}).get("phase")
            return phase if phase in ("Succeeded", "Failed") else None

        try:
            phase = wait_for(f"{name} finished", finished, timeout=180, every=1)
        except AssertionError as exc:
            pods = {p["metadata"]["name"]: p["status"] for p in api.list("pods", NAMESPACE)}
            raise AssertionError(f"{exc}\npods: {json.dumps(pods)[-4000:]}\nevents: {_events(api, NAMESPACE)}"
                                 f"\ntraining-operator: {kubeflow_v1.tail()}") from None  # fmt: skip
        pods = {
            p["metadata"]["name"]: p
            for p in api.list("pods", NAMESPACE)
            if p["metadata"]["name"].startswith(name)
        }
        nodes = {n.name: n for n in (node, second_node)}
        said = {pod: nodes[p["spec"]["nodeName"]].log_of(p, "pytorch") for pod, p in pods.items()}
        print(json.dumps({pod: [p["spec"]["nodeName"], said[pod]] for pod, p in pods.items()}, indent=1))
        assert phase == "Succeeded", said
        placed = {pod: p["spec"]["nodeName"] for pod, p in pods.items()}
        assert sorted(placed.values()) == sorted(nodes), placed  # one worker on each node

        def devices(line: str) -> set[str]:  # the kubelet gives them in any order
            return set(line.split(" devices ")[1].split(" from ")[0].split(","))

        for pod, p in pods.items():
            assert p["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
            rank = 0 if pod.endswith("master-0") else 1
            line = next(line for line in said[pod].splitlines() if line.startswith(f"rank {rank} devices "))
            assert devices(line) == {f"GPU-standin-{placed[pod]}-{i}" for i in range(2)}, said
        # The worker's devices, as it sent them across the nodes to the master.
        sent = next(
            line for line in said[f"{name}-master-0"].splitlines() if line.startswith("rank 1 devices ")
        )
        assert devices(sent) == {f"GPU-standin-{placed[f'{name}-worker-0']}-{i}" for i in range(2)}, sent
    finally:
        api.delete("gputrainings", name, NAMESPACE)


def test_the_charts_defaults_run_the_operator_from_its_image_under_restricted_pod_security(
    plane: ControlPlane, api: Api, node: Node, image_on_node: str, operator_pod: dict[str, Any], version: str
) -> None:
    spec = operator_pod["spec"]
    container = spec["containers"][0]
    assert container["image"] == image_on_node  # the released chart's default: the image it was released with
    # The kubelet pulled it from the registry, as a cloud node pulls a release.
    events = [e for e in api.list("events", RELEASE_NAMESPACE)
              if e["involvedObject"].get("name") == operator_pod["metadata"]["name"]]  # fmt: skip
    pulled = [e["message"] for e in events if e["reason"] == "Pulled"]
    print(f"the kubelet's word: {pulled}")  # "Successfully pulled image ... in 1.2s (...)": the pull's time
    assert any(f'"{image_on_node}"' in message and "Successfully pulled" in message for message in pulled), (
        events
    )
    assert operator_pod["spec"]["nodeName"] == node.name
    started = operator_pod["status"]["containerStatuses"][0]
    assert started["restartCount"] == 0, started
    # Restricted Pod Security admitted it (the namespace enforces it); the runtime applied it.
    name = operator_pod["metadata"]["name"]
    probe = plane.kubectl("exec", "-n", RELEASE_NAMESPACE, name, "--", "python", "-c", INSPECT, check=False)
    assert probe.returncode == 0, probe.stderr
    uid_gid, write, capabilities, seccomp = probe.stdout.split("\n")[:4]
    assert uid_gid == "65532 65532", probe.stdout
    assert write == "EROFS", probe.stdout  # the root filesystem is read-only
    assert int(capabilities, 16) == 0, probe.stdout  # every capability dropped
    assert seccomp == "2", probe.stdout  # SECCOMP_MODE_FILTER: the runtime's default profile
    said = plane.kubectl("exec", "-n", RELEASE_NAMESPACE, name, "--", "gpuop", "--version").stdout
    assert said.split() == ["gpuop", version], said

    # The operator, from inside the pod, reconciles a GpuTraining: it renders the PyTorchJob (the
    # default backend), and the apiserver saw the call come from the pod's own address, as its
    # ServiceAccount.
    api.create("gputrainings", specs.training("in-cluster", NAMESPACE), NAMESPACE)
    job = wait_for("the PyTorchJob the in-cluster operator renders",
                   lambda: api.get("pytorchjobs", "in-cluster", NAMESPACE), timeout=60)  # fmt: skip
    assert job["metadata"]["ownerReferences"][0]["name"] == "in-cluster"
    created = [e for e in plane.audit() if e.get("verb") == "create"
               and e.get("objectRef", {}).get("resource") == "pytorchjobs"
               and e.get("objectRef", {}).get("namespace") == NAMESPACE]  # fmt: skip
    assert created, "no create of the PyTorchJob in the audit log"
    account = spec["serviceAccountName"]
    assert created[-1]["user"]["username"] == f"system:serviceaccount:{RELEASE_NAMESPACE}:{account}"
    assert operator_pod["status"]["podIP"] in created[-1]["sourceIPs"], created[-1]["sourceIPs"]
    status = wait_for("the GpuTraining's status from the in-cluster operator",
                      lambda: (api.get("gputrainings", "in-cluster", NAMESPACE) or {}).get("status", {}).get("phase"),
                      timeout=30)  # fmt: skip
    print(f"in-cluster operator: phase {status!r}")
    logs = plane.kubectl("logs", "-n", RELEASE_NAMESPACE, name).stdout
    assert "Traceback" not in logs, logs[-3000:]
    lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    assert lines, logs[-2000:]  # the chart's default log format: one JSON object a line

    # The pod leads: it holds the chart's Lease and carries the label the report Service selects.
    lease_path = (
        f"/apis/coordination.k8s.io/v1/namespaces/{RELEASE_NAMESPACE}/leases/{RELEASE}-gpu-training-operator"
    )
    assert api.request("GET", lease_path)["spec"]["holderIdentity"] == name
    wait_for("the leader's label", lambda: ((api.get("pods", name, RELEASE_NAMESPACE) or {})["metadata"].get(
        "labels") or {}).get("gpuop.io/leader") == "true", timeout=30)  # fmt: skip
    # A rollout, a drain or a scale-down: SIGTERM, and the operator gives its Lease up and exits
    # well inside the chart's grace period (30 s), not killed at its end.
    # Scaled to none, so no replacement comes (and the teardown's uninstall, which takes the
    # RBAC away with the Deployment, finds no operator left to wait for).
    said, took = _log_until_exit(
        plane,
        name,
        lambda: plane.kubectl("scale", "deployment", "--all", "--replicas=0", "-n", RELEASE_NAMESPACE),
    )
    print(f"operator pod: SIGTERM -> exited in {took:.1f}s")
    assert took < 10, said[-3000:]
    assert "Operator is stopping" in said, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    assert not api.request("GET", lease_path)["spec"].get("holderIdentity"), (
        "the stopped pod still holds the Lease"
    )


def test_helm_uninstall_stops_the_operator_in_seconds_though_its_rbac_goes_with_it(
    plane: ControlPlane, api: Api, operator_pod: dict[str, Any]
) -> None:
    """``helm uninstall`` deletes the Deployment and the ClusterRole at once, so the stopping
    operator's last calls (giving its Lease up) meet 403s: it must give up on them in seconds,
    not retry until the kubelet kills it at the end of its 30 s grace period."""
    plane.kubectl("scale", "deployment", "--all", "--replicas=1", "-n", RELEASE_NAMESPACE)

    def running() -> str | None:
        pods = [p for p in api.list("pods", RELEASE_NAMESPACE) if "deletionTimestamp" not in p["metadata"]]
        ready = [p for p in pods if all(s.get("ready") for s in p["status"].get("containerStatuses") or [{}])]
        return ready[0]["metadata"]["name"] if ready else None

    name = wait_for("the operator's pod Ready again", running, timeout=120, every=0.5)
    stopping = time.monotonic()
    said, _ = _log_until_exit(
        plane,
        name,
        lambda: helm("uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--kubeconfig", str(plane.kubeconfig)),
    )
    wait_for("the pod gone", lambda: api.get("pods", name, RELEASE_NAMESPACE) is None, timeout=60)
    took = time.monotonic() - stopping
    print(f"operator pod: helm uninstall -> gone in {took:.1f}s")
    assert took < 15, said[-3000:]
    assert "SIGTERM received: stopping" in said, said[-3000:]
