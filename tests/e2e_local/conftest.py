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
from support.tools.helm import RELEASE_NAMESPACE

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


@pytest.fixture(scope="session")
def installed(plane: controlplane.ControlPlane, api: Api) -> Installed:
    return install_chart(plane, VALUES)


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
    process = OperatorProcess(config, workdir, env=installed.env)
    process.start()
    yield process
    process.stop()
    assert "Traceback" not in process.log(), process.log()[-4000:]
