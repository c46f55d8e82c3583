"""A small cluster's worth of nodes on this machine: kube-scheduler, two nodes with the stand-in
GPU device plugin, kube-proxy and CoreDNS, started in that order and stopped in reverse (each
node drained and swept), with images imported on both nodes at once.

What `make cluster` runs for a person (support.cluster) and the end-to-end chain for its
tests (tests/e2e_local); the real-node suite starts the same pieces one fixture at a time
(support.node.fixtures), as its modules need fewer of them.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from support.node.binaries import NodeBinaries
from support.node.dns import running_cluster_dns
from support.node.images import ImageArchive
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
    imported: dict[str, float]  # seconds each node took to import the images

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


def import_everywhere(
    nodes: tuple[Node, ...], images: list[ImageArchive], then: Callable[[Node], None]
) -> dict[str, float]:
    """``images`` imported into every node at once (disk-bound: the two imports of the 4.8 GB
    trainer archive take about 65 s side by side, as one alone does), then ``then(node)`` on
    each; the seconds each import took."""
    _enough_disk(nodes, images)
    seconds: dict[str, float] = {}
    failed: list[BaseException] = []

    def load(into: Node) -> None:
        try:
            seconds[into.name] = into.containerd.import_images(images, timeout=600)
            then(into)
        except BaseException as exc:  # raised below, in the caller's thread
            failed.append(exc)

    threads = [threading.Thread(target=load, args=(node,), name=f"import-{node.name}") for node in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
    return seconds


def _enough_disk(nodes: tuple[Node, ...], images: list[ImageArchive]) -> None:
    """Refuse at once, saying what to free, when the imports cannot fit: each node's containerd
    holds an archive's layers twice while it imports them (the content store, then the unpacked
    snapshot; the first is discarded after), every node at once. Without this the import dies
    half-way on ENOSPC in ctr's words (a CI run did, with stale clones filling the disk)."""
    archives = sum(image.path.stat().st_size for image in images)
    for node in nodes:
        device = node.workdir.stat().st_dev
        sharing = [n for n in nodes if n.workdir.stat().st_dev == device]  # room needed together
        needed, free = 2 * archives * len(sharing), shutil.disk_usage(node.workdir).free
        if free < needed:
            raise RuntimeError(
                f"importing {len(images)} images ({archives / 1e9:.1f} GB) on {len(sharing)} nodes needs about "
                f"{needed / 1e9:.0f} GB free on the filesystem of {node.workdir}, which has {free / 1e9:.1f} GB: "
                "free some (old clones of this repository, /tmp) and run again"
            )


@contextlib.contextmanager
def running_pool(
    plane: ControlPlane,
    api: Api,
    binaries: NodeBinaries,
    workdir: Path,
    images: list[ImageArchive],
    then: Callable[[Node], None] = lambda _: None,
) -> Iterator[Pool]:
    """The pool for the ``with`` block, ``images`` on both nodes (and ``then`` done on each)
    before kube-proxy and CoreDNS start; everything stopped and swept after."""
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
        imported = import_everywhere(both, images, then)
        proxy = pieces.enter_context(
            running_service_proxy(plane, binaries, workdir / "kube-proxy", both[0].name)
        )
        dns = pieces.enter_context(running_cluster_dns(api, both[0]))
        yield Pool(scheduler, both, proxy, dns, imported)
