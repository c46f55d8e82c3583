"""The whole chain on this machine, no Docker, every pod a container: the real control plane,
two real nodes (containerd, runc, the CNI bridge and kubelet v1.35; kube-scheduler,
kube-proxy and CoreDNS: :mod:`support.node.pool`), the real Kubeflow training-operator,
Trainer v2 with JobSet and Kueue (controllers and webhooks, processes on this machine), and our
operator as a user installs it: ``make release`` pushed its image and chart to a real registry
(:mod:`support.registry`), the real helm installs the chart from ``oci://`` and the node pulls
the image.

The trainers run from the trainer image ``make release`` built from images/trainer.Dockerfile
and pushed, which the nodes pull before the first test; the user's own programs run from a
team's own image built as a user builds it, examples/own-code.Dockerfile on that trainer image,
pushed to the same registry and pulled the same way. Each node knows the trainer by the kind
examples' name too, and the own image by the name the tests give it, as ``kind load`` would
(``make cluster``'s test has the kubelet pull the trainer image).

Every test here is marked ``e2e_local`` (`make e2e-local` runs them alone); none skips. The
nodes need root, as CI and the development machines have it. The nodes, controllers, operator
and claims live as long as this package (package scope: set up once for its modules, about
three minutes, most of it the own image's build and the pulls); Kueue only for its module.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Final

import pytest

from support import chain, monitoring
from support.chain import (
    CLAIMS_LABEL,
    EXAMPLE_IMAGE,
    NAMESPACE,
    OWN_CODE_IMAGE,
    Claims,
    InClusterOperator,
    Timeline,
)
from support.controllers import kueue, trainerv2, trainingoperator
from support.controllers.webhooked import WebhookedController
from support.fixtures import Released
from support.images import build
from support.node import binaries
from support.node.node import Node
from support.node.pool import Pool, running_pool
from support.plane import controlplane
from support.plane.cluster import (
    Api,
    install_chart,
    install_crds,
    pod_ready,
    ready_operator_pod,
    uninstall_chart,
)
from support.tools import lanes
from support.tools.helm import RELEASE, RELEASE_NAMESPACE
from support.waiting import wait_for

# The chart's defaults but a 1 s scrape (its default 10 s would outlast a short training) and
# GPUs underutilized after 5 s under the threshold, not 10 min (only test_monitoring's GPUs,
# whose figures a dcgm-exporter stand-in gives, have figures at all); and the operator on the
# node named after this machine, whose pods `kubectl logs` reaches (chart_values).
VALUES: Final = {
    "operator.scrapeInterval": 1,
    "operator.scrapeTimeout": 0.8,
    "operator.underutilized.seconds": 5,
}
# Monitoring on, as a user turns it on, every scrape a second and the `for` of each alert
# test_monitoring drives a second, its thresholds in seconds (each state comes in seconds). None
# of these changes the operator's Deployment: turning them on and off rolls no pod.
MONITORING_VALUES: Final = {
    "metrics.serviceMonitor": {"enabled": True, "interval": "1s", "scrapeTimeout": "1s"},
    "metrics.trainerPodMonitor": {"enabled": True, "interval": "1s", "scrapeTimeout": "1s"},
    "metrics.prometheusRule": {
        "enabled": True,
        "stalled": {"for": "1s"},
        "underutilized": {"for": "1s"},
        "failed": {"for": "1s"},
        "queuedTooLong": {"seconds": 5, "for": "1s"},
        "noProgressReport": {"seconds": 8, "for": "1s"},
        "operatorDown": {"for": "1s"},
        "notReconciling": {"for": "1s", "window": "20s"},
    },
}


def chart_values(nodes: Pool) -> dict[str, object]:
    """The chart's values in this chain: :data:`VALUES`, and the operator on the first node."""
    return {**VALUES, "nodeSelector": {"kubernetes.io/hostname": nodes.first.name}}


# What an earlier suite on the session's control plane may have left: the chain's controllers
# would run such a job on its nodes and its operator would reconcile such a training, taking
# GPUs, CPUs and reconciles from the chain's tests (seen: two left 2-GPU trainings held all four
# stand-in GPUs, and their reconciles kept NotReconciling's error ratio low). Each suite cleans
# up after itself; this is the chain's guard against one that does not.
LEFTOVER_KINDS: Final = (
    "gputrainings.gpuop.io",
    "pytorchjobs.kubeflow.org",
    "trainjobs.trainer.kubeflow.org",
)


@pytest.fixture(scope="package", autouse=True)
def machine_turn(nodes: Pool) -> Iterator[float]:
    """Under `make test`, only once the lanes that hold the turn (the checks and servers lanes)
    are over: beside them the paced trainings here would miss their stall timeouts (see
    support.tools.lanes; the trainer lane runs beside the chain in an idle cpu cgroup instead).
    The nodes start, and pull the images, before the turn: nothing of theirs is paced, and done
    beside the other lanes' last minutes they cost the chain's first test none of its wait."""
    with lanes.machine_turn() as waited:
        yield waited


@pytest.fixture(scope="package", autouse=True)
def namespace(plane: controlplane.ControlPlane) -> str:
    for kind in LEFTOVER_KINDS:
        left = plane.kubectl("get", kind, "-A", "-o", "name", check=False)
        if left.returncode == 0 and left.stdout.strip():  # a kind not served yet has none
            print(f"deleting what earlier suites left: {' '.join(left.stdout.split())}")
            plane.kubectl("delete", kind, "--all", "-A", "--wait=false")
    plane.kubectl("create", "namespace", NAMESPACE)
    return NAMESPACE


@pytest.fixture(scope="package")
def own_code(released: Released) -> str:
    """The team's own image: examples/own-code.Dockerfile on the released trainer image, pushed
    beside it (:func:`support.images.build.own_code_image`); its reference there."""
    return build.own_code_image(released.registry, released.reference("trainer"))


@pytest.fixture(scope="package")
def nodes(
    plane: controlplane.ControlPlane,
    node_api: Api,
    node_binaries: binaries.NodeBinaries,
    released: Released,
    own_code: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Pool]:
    """Both nodes, kube-scheduler, kube-proxy and CoreDNS. Each trusts the session's registry and
    pulls from it: its kubelet the operator's image when the chart is installed; its containerd,
    before any test, the trainer image and the own image (as ``kind load`` loads them), which
    it knows by the kind examples' name and the tests' name too."""

    def trust(node: Node) -> None:
        node.containerd.trust(released.registry.address, released.registry.ca)

    with running_pool(plane, node_api, node_binaries, tmp_path_factory.mktemp("pool"), trust) as pool:
        aliases = {released.reference("trainer"): EXAMPLE_IMAGE, own_code: OWN_CODE_IMAGE}
        took = chain.preload(pool, released.registry, aliases)
        print("pulled the trainer and own images: " + ", ".join(f"{n} {s:.0f}s" for n, s in took.items()))
        yield pool


@pytest.fixture
def timelines(plane: controlplane.ControlPlane) -> Iterator[list[Timeline]]:
    """The test's timelines; after it, each training it watched is deleted, pods and all: the
    two nodes have two CPUs each (this machine's), so a training a failed test left running
    would keep the next test's pods Pending."""
    made: list[Timeline] = []
    yield made
    for timeline in made:
        timeline.close()
    for timeline in made:
        plane.kubectl("delete", "gtr", timeline.name, "-n", NAMESPACE, "--ignore-not-found", "--wait=false")
    for timeline in made:
        plane.kubectl("wait", "--for=delete", "pods", "-l", f"gpuop.io/gputraining={timeline.name}",
                      "-n", NAMESPACE, "--timeout=90s", check=False, timeout=100)  # fmt: skip


@pytest.fixture(scope="package")
def kubeflow(
    plane: controlplane.ControlPlane, api: Api, nodes: Pool, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WebhookedController]:
    process = trainingoperator.training_operator(
        plane, api, plane.advertise_address, tmp_path_factory.mktemp("kubeflow")
    )
    process.start()
    yield process
    process.retire()


@pytest.fixture(scope="package")
def trainer_v2(
    plane: controlplane.ControlPlane, api: Api, nodes: Pool, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[WebhookedController]]:
    """Kubeflow Trainer v2 and JobSet, beside the training-operator: a cluster that serves both."""
    install_crds(plane, [trainerv2.JOBSET_CRD])
    processes = trainerv2.trainer_and_jobset(
        plane, api, plane.advertise_address, tmp_path_factory.mktemp("trainer")
    )
    try:
        for process in processes:
            process.start()
        yield processes
    finally:
        for process in reversed(processes):
            process.retire()


@pytest.fixture(scope="module")
def queueing(
    plane: controlplane.ControlPlane,
    api: Api,
    kubeflow: WebhookedController,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[WebhookedController]:
    """The real Kueue v0.16.2 (controller and webhooks), beside the training-operator. Its pod
    and job webhooks see every namespace but kube-system and kueue-system from here on, as in a
    cluster that runs Kueue; for its module alone (retired after, its webhooks with it)."""
    process = kueue.kueue(plane, api, plane.advertise_address, tmp_path_factory.mktemp("kueue"))
    try:
        process.start()
        yield process
    finally:
        process.retire()


@pytest.fixture(scope="package")
def operator(
    plane: controlplane.ControlPlane,
    api: Api,
    nodes: Pool,
    kubeflow: WebhookedController,
    released: Released,
) -> Iterator[InClusterOperator]:
    """``helm install oci://...`` of the released chart with its defaults (and :data:`VALUES`):
    the operator's Deployment runs the released image, pulled by the first node, its report endpoint behind its Service with
    the certificate the chart makes, which the trainers reach by the Service's name."""
    started = time.monotonic()
    install_chart(plane, chart_values(nodes), released.helm_chart())
    pod = wait_for("the operator's pod Ready", lambda: ready_operator_pod(api), timeout=120, every=0.5)
    print(f"helm install -> operator pod Ready: {time.monotonic() - started:.1f}s")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    running = InClusterOperator(pod, env["GPUOP_REPORT_URL"])
    try:
        yield running
    finally:
        said = running.log(plane)
        _uninstall(plane, api)
    assert "Traceback" not in said, said[-4000:]


def _uninstall(plane: controlplane.ControlPlane, api: Api) -> None:
    """The chart gone, and the chain's namespace before it (the operator releases its
    GpuTrainings' finalizers), so that a later suite meets a cluster without either."""
    with contextlib.suppress(Exception):
        api.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}")
        wait_for(
            "the chain's namespace gone", lambda: api.get("namespaces", NAMESPACE, None) is None, timeout=90
        )
    uninstall_chart(plane)


@pytest.fixture(scope="package")
def claims(plane: controlplane.ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Claims]:
    made = Claims(tmp_path_factory.mktemp("claims"), plane)
    yield made
    plane.kubectl("delete", "pv", "-l", CLAIMS_LABEL, "--wait=false", check=False)


@pytest.fixture(scope="module")
def monitored(
    plane: controlplane.ControlPlane, api: Api, nodes: Pool, operator: InClusterOperator, released: Released
) -> Iterator[monitoring.Prometheus]:
    """prometheus-operator and Prometheus (:mod:`support.monitoring`), and the chart upgraded
    with :data:`MONITORING_VALUES`, for one module; then the chart as before (its monitors and
    rules gone while the CRDs still serve them), and prometheus-operator and its CRDs gone."""
    started = time.monotonic()
    with monitoring.running_monitoring(
        plane, api, nodes,
        monitors_on=lambda: install_chart(plane, {**chart_values(nodes), **MONITORING_VALUES}, released.helm_chart()),
        monitors_off=lambda: install_chart(plane, chart_values(nodes), released.helm_chart()),
    ) as prometheus:  # fmt: skip
        wait_for("Prometheus scraping the operator, with the chart's rules",
                 lambda: prometheus.serves_chart(RELEASE_NAMESPACE), timeout=120, every=1)  # fmt: skip
        print(f"monitoring on, Prometheus scraping with the chart's rules: {time.monotonic() - started:.1f}s")
        yield prometheus


DEPLOYMENT: Final = f"{RELEASE}-gpu-training-operator"
LEASE: Final = f"/apis/coordination.k8s.io/v1/namespaces/{RELEASE_NAMESPACE}/leases/{DEPLOYMENT}"


def operator_pods(api: Api) -> list[dict[str, Any]]:
    """The release's operator pods, but those being deleted."""
    return [p for p in api.list("pods", RELEASE_NAMESPACE) if "deletionTimestamp" not in p["metadata"]]


def rolled_out(plane: controlplane.ControlPlane, api: Api, replicas: int) -> list[dict[str, Any]]:
    """The operator's pods once an upgrade's rollout is over: ``kubectl rollout status`` (every
    replica of the new template available, none of an older one left), then ``replicas`` pods
    of one template, all Ready. Counting Ready pods alone is not enough: mid-rollout, the old
    template's pod and the first of the new one's are two Ready pods."""
    plane.kubectl("rollout", "status", f"deployment/{DEPLOYMENT}", "-n", RELEASE_NAMESPACE, "--timeout=180s",
                  timeout=200)  # fmt: skip

    def settled() -> list[dict[str, Any]] | None:
        pods = operator_pods(api)
        templates = {p["metadata"]["labels"].get("pod-template-hash") for p in pods}
        done = len(pods) == replicas and len(templates) == 1 and all(pod_ready(p) for p in pods)
        return pods if done else None

    return wait_for(f"{replicas} operator pod(s) of one template, Ready", settled, timeout=60, every=0.5)


def lease_holder(api: Api) -> str | None:
    """The pod that holds the release's Lease (leads), if any."""
    return (api.request("GET", LEASE).get("spec") or {}).get("holderIdentity")


@pytest.fixture
def two_replicas(plane: controlplane.ControlPlane, api: Api, nodes: Pool, operator: InClusterOperator,
                 released: Released) -> Iterator[tuple[str, str]]:  # fmt: skip
    """The release scaled to two replicas where the chart's defaults place them (its
    anti-affinity: one a node; its PodDisruptionBudget with them); the leader's and the
    standby's pod names. Back to one on the first node after."""
    install_chart(
        plane, {**chart_values(nodes), "replicaCount": 2, "nodeSelector": {}}, released.helm_chart()
    )
    try:
        # The new template's two: the first node's pod goes as its replacements come.
        pods = rolled_out(plane, api, 2)
        names = [p["metadata"]["name"] for p in pods]
        leader = wait_for(
            "a holder of the Lease", lambda: lease_holder(api) in names and lease_holder(api), timeout=30
        )
        (standby,) = [n for n in names if n != leader]
        yield leader, standby
    finally:
        install_chart(plane, chart_values(nodes), released.helm_chart())
        rolled_out(plane, api, 1)
