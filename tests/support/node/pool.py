"""A small cluster's worth of nodes on this machine: kube-scheduler, two nodes with the stand-in
GPU device plugin, kube-proxy and CoreDNS, started in that order and stopped in reverse (each
node drained and swept).

What `make cluster` runs for a person (support.cluster) and the end-to-end chain for its
tests (tests/e2e_local); the real-node suite starts the same pieces one fixture at a time
(support.node.fixtures), as its modules need fewer of them.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from support.node.binaries import NodeBinaries
from support.node.dns import running_cluster_dns
from support.node.node import PREFIX, Node, Scheduler, running_node, running_scheduler, session_ident
from support.node.proxy import ServiceProxy, running_service_proxy
from support.plane.cluster import Api
from support.plane.controlplane import ControlPlane

GPUS_PER_NODE: Final = 2


@dataclass(frozen=True)
class Pool:
    """The pieces, and the nodes' order: the first is named after this machine, the one
    whose kubelet the apiserver reaches by name (`kubectl logs` and `exec` work for its pods;
    read the second's from its disk, :meth:`Node.log_of`)."""

    scheduler: Scheduler
    nodes: tuple[Node, Node]
    proxy: ServiceProxy
    dns: str  # the kube-dns Service's address

    @property
    def first(self) -> Node:
        return self.nodes[0]

    @property
    def second(self) -> Node:
        return self.nodes[1]

    def of(self, pod: dict[str, Any]) -> Node:
        """The node a pod is bound to."""
        bound = pod["spec"].get("nodeName")
        found = next((node for node in self.nodes if node.name == bound), None)
        if found is None:
            raise LookupError(f"pod {pod['metadata']['name']} is on no node of the pool ({bound})")
        return found


def enough_disk(nodes: tuple[Node, ...], per_node: int, what: str) -> None:
    """Refuse at once, saying what to free, when ``per_node`` bytes on every node cannot fit
    (nodes on one filesystem need the room together). Without this a pull dies half-way on
    ENOSPC in the kubelet's words (a CI run's import did, with stale clones filling the disk)."""
    for node in nodes:
        device = node.workdir.stat().st_dev
        sharing = [n for n in nodes if n.workdir.stat().st_dev == device]
        needed, free = per_node * len(sharing), shutil.disk_usage(node.workdir).free
        if free < needed:
            raise RuntimeError(
                f"{what} on {len(sharing)} nodes needs about {needed / 1e9:.0f} GB free on the filesystem of "
                f"{node.workdir}, which has {free / 1e9:.1f} GB: free some (old clones of this repository, "
                "/tmp) and run again"
            )


@contextlib.contextmanager
def running_pool(
    plane: ControlPlane,
    api: Api,
    binaries: NodeBinaries,
    workdir: Path,
    then: Callable[[Node], None] = lambda _: None,
) -> Iterator[Pool]:
    """The pool for the ``with`` block, ``then`` done on each node before kube-proxy and CoreDNS
    start; everything stopped and swept after."""
    with contextlib.ExitStack() as pieces:
        scheduler = pieces.enter_context(running_scheduler(plane, binaries, workdir / "scheduler"))
        nodes = []
        for letter, name in (("a", socket.gethostname()), ("b", None)):
            ident = session_ident(letter)
            nodes.append(pieces.enter_context(running_node(
                plane, api, binaries, workdir / f"node-{letter}", name or f"{PREFIX}{ident}", ident,
                gpus=GPUS_PER_NODE,
            )))  # fmt: skip
        both = (nodes[0], nodes[1])
        for node in both:
            then(node)
        proxy = pieces.enter_context(
            running_service_proxy(plane, binaries, workdir / "kube-proxy", both[0].name)
        )
        dns = pieces.enter_context(running_cluster_dns(api, both))
        yield Pool(scheduler, both, proxy, dns)
