"""The real nodes' fixtures (tests/conftest.py loads this as a plugin): one or two nodes
(containerd v2 + runc + CNI bridge + kubelet v1.35, built from their Go modules:
:mod:`support.node.binaries`), the real kube-scheduler, kube-proxy and CoreDNS, against the
session's control plane. Pods run as containers, in cgroups, with the kubelet's volumes.

Module-scoped: each module that asks for them starts them again (about 3 s a node, plus what
it imports into them), and they are gone, swept from the machine, when the module ends, so no
two modules' nodes, binders or kube-proxies meet. Needs root (cgroups, mounts, network
namespaces). Nothing here skips: without ``go`` and ``gcc`` the binaries cannot be built and
the suite fails, saying so. Cold, the builds cost about ten minutes on two cores (each recipe's
cold_cost); cached in ~/.cache/gpuop, a start costs seconds.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from support.node import binaries
from support.node.dns import running_cluster_dns
from support.node.node import Node, Scheduler, running_node, running_scheduler, session_ident
from support.node.pool import GPUS_PER_NODE
from support.node.proxy import ServiceProxy, running_service_proxy
from support.plane.cluster import Api
from support.plane.controlplane import ControlPlane


@pytest.fixture(scope="session")
def node_binaries() -> binaries.NodeBinaries:
    return binaries.ensure_all()


@pytest.fixture(scope="session")
def node_api(plane: ControlPlane) -> Api:
    return Api(plane)


@pytest.fixture(scope="module")
def scheduler(
    plane: ControlPlane, node_binaries: binaries.NodeBinaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Scheduler]:
    with running_scheduler(plane, node_binaries, tmp_path_factory.mktemp("scheduler")) as running:
        yield running


@pytest.fixture(scope="module")
def node(
    plane: ControlPlane,
    node_api: Api,
    node_binaries: binaries.NodeBinaries,
    scheduler: Scheduler,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Node]:
    """The session's node, named after this machine: the apiserver calls a kubelet at its Node's
    Hostname address (for logs), and this machine's own name is the one that resolves here. Its
    kubelet allocates two stand-in GPUs (support.node.node.Node's ``gpus``)."""
    with running_node(
        plane, node_api, node_binaries, tmp_path_factory.mktemp("node-a"), name=socket.gethostname(),
        ident=session_ident("a"), gpus=GPUS_PER_NODE,
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def second_node(
    plane: ControlPlane,
    node_api: Api,
    node_binaries: binaries.NodeBinaries,
    node: Node,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Node]:
    """A second node, its own containerd, kubelet, bridge, subnet and cgroup root, with two
    stand-in GPUs as well: a two-worker training with two GPUs a worker must span both. The
    apiserver cannot reach its kubelet by name (it is not this machine's), so no ``kubectl
    logs`` or ``exec`` there: read its pods' logs from its disk (:meth:`Node.log_of`)."""
    ident = session_ident("c")
    with running_node(
        plane, node_api, node_binaries, tmp_path_factory.mktemp("node-c"), name=f"gpuopnode-{ident}",
        ident=ident, gpus=GPUS_PER_NODE,
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def service_proxy(
    plane: ControlPlane,
    node_binaries: binaries.NodeBinaries,
    node: Node,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServiceProxy]:
    """kube-proxy, for the modules whose pods reach a Service (the API's own, 10.96.0.1)."""
    with running_service_proxy(
        plane, node_binaries, tmp_path_factory.mktemp("kube-proxy"), node.name
    ) as running:
        yield running
    assert running.left == [], f"kube-proxy's stop left iptables chains on the machine: {running.left}"


@pytest.fixture(scope="module")
def cluster_dns(node_api: Api, node: Node, service_proxy: ServiceProxy) -> Iterator[str]:
    """CoreDNS in a pod behind the kube-dns Service (10.96.0.10); its address."""
    with running_cluster_dns(node_api, [node]) as address:
        yield address
