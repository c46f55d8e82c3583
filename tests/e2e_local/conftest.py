"""The whole chain on this machine, no Docker: the real control plane, the real Kubeflow
training-operator (controller and validating webhook), our chart installed by the real helm
and our operator running as its ServiceAccount, and pods run by the node agent (the one test
double: kubelet + container runtime, tests/support/nodeagent.py) as torchrun processes in
network namespaces of their own.

Every test here is marked ``e2e_local`` (`make e2e-local` runs them alone); none skips. The
node agent needs root for its namespaces, as CI and the development machines have it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from support import nodeagent
from support.controllers import kueue, trainerv2, trainingoperator
from support.plane import controlplane
from support.plane.cluster import (
    Api,
    Installed,
    OperatorProcess,
    install_chart,
    install_crds,
    service_account_kubeconfig,
)
from support.plane.controlplane import free_port
from support.tools.helm import RELEASE_NAMESPACE

REPORT_PORT = free_port()

# The chart's defaults but a 1 s scrape (its default 10 s would outlast a short training).
VALUES = {"operator.scrapeInterval": 1, "operator.scrapeTimeout": 0.8}
# Two nodes the size of a small CPU node pool: both pods of a spec fit, as on kind.
NODES = [nodeagent.Node("node-a", cpu="4", memory="8Gi"), nodeagent.Node("node-b", cpu="4", memory="8Gi")]


@pytest.fixture(scope="session")
def agent(api: Api, tmp_path_factory: pytest.TempPathFactory) -> Iterator[nodeagent.NodeAgent]:
    with nodeagent.running(api, tmp_path_factory.mktemp("node-agent"), NODES) as running:
        yield running
    assert running.errors == []


@pytest.fixture(scope="session")
def kubeflow(
    plane: controlplane.ControlPlane,
    api: Api,
    agent: nodeagent.NodeAgent,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[trainingoperator.WebhookedController]:
    process = trainingoperator.training_operator(
        plane, api, agent.host_ip, tmp_path_factory.mktemp("kubeflow")
    )
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def trainer(
    plane: controlplane.ControlPlane,
    api: Api,
    agent: nodeagent.NodeAgent,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[trainingoperator.WebhookedController]]:
    """Kubeflow Trainer v2 and JobSet, beside the training-operator: a cluster that serves both."""
    install_crds(plane, [trainerv2.JOBSET_CRD])
    processes = trainerv2.trainer_and_jobset(plane, api, agent.host_ip, tmp_path_factory.mktemp("trainer"))
    try:
        for process in processes:
            process.start()
        yield processes
    finally:
        for process in reversed(processes):
            process.stop()


@pytest.fixture(scope="session")
def queueing(
    plane: controlplane.ControlPlane,
    api: Api,
    agent: nodeagent.NodeAgent,
    kubeflow: trainingoperator.WebhookedController,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[trainingoperator.WebhookedController]:
    """The real Kueue v0.16.2 (controller and webhooks), beside the training-operator. Its pod
    and job webhooks see every namespace but kube-system and kueue-system from here on, as in a
    cluster that runs Kueue; the tests that use it come last in their module."""
    process = kueue.kueue(plane, api, agent.host_ip, tmp_path_factory.mktemp("kueue"))
    try:
        process.start()
        yield process
    finally:
        process.stop()


# The report endpoint's certificate, as cert-manager would provide it (the chart's
# reports.tls.secretName), valid for the Service's names and the host's address.
REPORT_SECRET = "gpuop-report-tls-e2e"


@pytest.fixture(scope="session")
def installed(plane: controlplane.ControlPlane, api: Api, agent: nodeagent.NodeAgent) -> Installed:
    """The chart, with the operator's report endpoint where the pods reach it: the operator runs
    on the host, not in a pod behind its Service (no cluster DNS or kube-proxy here), so the
    trainers are told the host's address on the node agent's network."""
    service = "gpuop-gpu-training-operator-reports"
    cert, key = plane.ca.issue("reports", service, sans=[
        f"IP:{agent.host_ip}", f"DNS:{service}.{RELEASE_NAMESPACE}.svc",
    ])  # fmt: skip
    plane.kubectl("create", "namespace", RELEASE_NAMESPACE, check=False)
    plane.kubectl("delete", "secret", REPORT_SECRET, "-n", RELEASE_NAMESPACE, "--ignore-not-found")
    plane.kubectl("create", "secret", "generic", REPORT_SECRET, "-n", RELEASE_NAMESPACE, "--type=kubernetes.io/tls",
                  f"--from-file=tls.crt={cert}", f"--from-file=tls.key={key}", f"--from-file=ca.crt={plane.ca.cert}")  # fmt: skip
    installed = install_chart(plane, {**VALUES, "reports.tls.secretName": REPORT_SECRET})
    installed.env["GPUOP_REPORT_URL"] = f"https://{agent.host_ip}:{REPORT_PORT}"
    return installed


@pytest.fixture(scope="session")
def operator(
    plane: controlplane.ControlPlane,
    installed: Installed,
    kubeflow: trainingoperator.WebhookedController,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[OperatorProcess]:
    """``gpuop operator`` with the chart's environment and its ServiceAccount's token."""
    workdir = tmp_path_factory.mktemp("operator")
    config = service_account_kubeconfig(
        plane, RELEASE_NAMESPACE, installed.service_account, workdir / "kubeconfig"
    )
    process = OperatorProcess(config, workdir, env=installed.env, report_port=REPORT_PORT)
    process.start()
    yield process
    process.stop()
    assert "Traceback" not in process.log(), process.log()[-4000:]
