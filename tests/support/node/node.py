"""A real node against the tests' control plane (containerd + runc + CNI bridge + kubelet), and
the real kube-scheduler that places pods on it.

:func:`running_node` starts one in a work directory of its own, registered as ``name``, and stops
it as a node is taken out of a cluster: its pods deleted through the API (the kubelet stops
their containers and sandboxes, which releases their network namespaces, veths, mounts and
addresses), then the kubelet, then containerd. Whatever is still on the machine after that
(:class:`~support.node.hoststate.Footprint`) is removed by force and recorded in
:attr:`Node.swept`, so a test can tell a clean stop from a swept one.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.node import hoststate, images
from support.node.binaries import NodeBinaries
from support.node.containerd import Containerd
from support.node.kubelet import Kubelet
from support.node.process import Supervised, spawn, wait_until
from support.plane.cluster import Api
from support.plane.controlplane import ControlPlane, free_port, kubeconfig

PREFIX = "gpuopnode-"  # every bridge and cgroup root a node here makes starts with it
GPU = "nvidia.com/gpu"
POD_NETWORKS = ipaddress.ip_network("10.244.0.0/16")


def free_subnet() -> str:
    """A /24 of 10.244.0.0/16 that no route of this machine touches (another node's bridge)."""
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout
    taken = []
    for line in routes.splitlines():
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.ip_network(line.split()[0], strict=False))
    for subnet in POD_NETWORKS.subnets(new_prefix=24):
        if subnet.network_address.packed[2] and not any(subnet.overlaps(net) for net in taken):
            return str(subnet)
    raise RuntimeError(f"no free /24 left in {POD_NETWORKS}")


def session_ident(letter: str) -> str:
    """``<this process's pid in base 36><letter>``: a node's ident. A second test session on the
    same machine (another checkout's `make test`) gets bridges and cgroup roots of its own."""
    digits, pid, alphabet = "", os.getpid(), "0123456789abcdefghijklmnopqrstuvwxyz"
    while pid:
        pid, digit = divmod(pid, 36)
        digits = alphabet[digit] + digits
    return f"{digits}{letter}"


@dataclass
class Timings:
    """Seconds from :meth:`Node.start`'s call to each step's end."""

    containerd_ready: float = 0.0
    images_imported: float = 0.0
    kubelet_healthy: float = 0.0
    node_ready: float = 0.0


@dataclass
class Node:
    """One node: ``ident`` (a letter or two) names its bridge and cgroup root ``gpuopnode-<ident>``."""

    plane: ControlPlane
    api: Api
    binaries: NodeBinaries
    workdir: Path
    name: str
    ident: str
    taints: list[dict[str, str]] = field(default_factory=list)
    # nvidia.com/gpu devices its kubelet allocates, from the device-plugin stand-in
    # (tests/controlplane/gpuplugin): none when 0.
    gpus: int = 0
    timings: Timings = field(default_factory=Timings)
    swept: hoststate.Footprint | None = None
    gpu_plugin: Supervised | None = None

    def __post_init__(self) -> None:
        self.bridge = f"{PREFIX}{self.ident}"
        if len(self.bridge) > 15:  # IFNAMSIZ - 1
            raise ValueError(f"bridge name {self.bridge!r} is longer than a link name may be")
        self.cgroup_root = self.bridge
        self.subnet = ""
        self.created_shared_dirs: list[Path] = []
        self.containerd = Containerd(self.workdir / "containerd", self.binaries, self.bridge, "")
        self.kubelet = Kubelet(self.workdir / "kubelet", self.binaries, self.name, self.cgroup_root,
                               self.containerd.endpoint, self.taints)  # fmt: skip

    def start(self, timeout: float = 120.0) -> None:
        started = time.monotonic()
        # What killed sessions left (their images: gigabytes) goes before this node needs room.
        hoststate.sweep_orphans()
        hoststate.claim(self.ident, self.workdir, self.cgroup_root, self.bridge, self.containerd.store)
        self.subnet = free_subnet()
        hoststate.create_bridge(self.bridge, self.subnet)
        # Directories the daemons make at paths fixed in their code, shared by every node: this
        # node removes at stop, once empty, those that did not exist before it started.
        self.created_shared_dirs = hoststate.missing_shared_directories()
        self.containerd.subnet = self.subnet
        hoststate.create_cgroup_root(self.cgroup_root)
        self.containerd.start(timeout)
        self.timings.containerd_ready = time.monotonic() - started
        self.containerd.import_images(images.all_images())
        self.timings.images_imported = time.monotonic() - started
        self.kubelet.start(self.plane)
        kubelet = self.kubelet.process
        wait_until(self.kubelet.healthy, timeout, "kubelet /healthz", kubelet)
        self.timings.kubelet_healthy = time.monotonic() - started
        wait_until(self.ready, timeout, f"Node {self.name} Ready", kubelet, interval=0.5)
        self.timings.node_ready = time.monotonic() - started
        if self.gpus:
            self._start_gpu_plugin(timeout)

    def _start_gpu_plugin(self, timeout: float) -> None:
        """The stand-in registers through this kubelet's plugin watcher; ready once the Node
        offers its devices."""
        sockets = self.workdir / "gpuplugin"
        sockets.mkdir(exist_ok=True)
        registry = self.kubelet.root_dir / "plugins_registry"
        registry.mkdir(exist_ok=True)
        self.gpu_plugin = spawn("gpuplugin", [
            str(self.binaries.path("gpuplugin")), f"--registry-dir={registry}", f"--socket-dir={sockets}",
            f"--count={self.gpus}", f"--node={self.name}",
        ], self.workdir / "gpuplugin.log")  # fmt: skip

        def offered() -> bool:
            allocatable = self.node_object().get("status", {}).get("allocatable", {})
            return bool(allocatable.get(GPU) == str(self.gpus))

        wait_until(
            offered, timeout, f"Node {self.name} offering {self.gpus} {GPU}", self.gpu_plugin, interval=0.5
        )

    def node_object(self) -> dict[str, Any]:
        node: dict[str, Any] = self.api.request("GET", f"/api/v1/nodes/{self.name}")
        return node

    def ready(self) -> bool:
        conditions = self.node_object().get("status", {}).get("conditions", [])
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def pods(self) -> list[dict[str, Any]]:
        """Every pod bound to this node, in any namespace."""
        listing = self.api.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{self.name}")
        items: list[dict[str, Any]] = listing["items"]
        return items

    def log_of(self, pod: dict[str, Any], container: str) -> str:
        """A container's log as this node's kubelet wrote it (every attempt, oldest first): what
        ``kubectl logs`` reads through the apiserver, which reaches only a node named after
        this machine."""
        meta = pod["metadata"]
        directory = (
            self.kubelet.pod_logs_dir / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / container
        )
        # The CRI's log format: "<time> <stream> <F|P> <text>" a line.
        return "".join(
            line.split(" ", 3)[3] + "\n"
            for path in sorted(directory.glob("*.log"), key=lambda p: int(p.stem))
            for line in path.read_text(errors="replace").splitlines()
            if line.count(" ") >= 3
        )

    def pod_cgroup(self, uid: str, hierarchy: str = "memory") -> Path:
        """A pod's cgroup directory under this node's kubepods (whatever its QoS class)."""
        kubepods = hoststate.CGROUP_MOUNT / hierarchy / self.cgroup_root / "kubepods"
        found = [path for path in kubepods.rglob(f"pod{uid}") if path.is_dir()]
        if len(found) != 1:
            raise LookupError(f"pod{uid} under {kubepods}: {found}")
        return found[0]

    def container_pids(self, pod: dict[str, Any], container: str) -> list[int]:
        """The processes of a running container of ``pod`` (its current attempt), from its
        cgroup: what the kernel's OOM killer or a test's SIGKILL would pick from."""
        status = next(
            (s for s in pod["status"].get("containerStatuses") or [] if s["name"] == container), None
        )
        if status is None or "running" not in status.get("state", {}) or not status.get("containerID"):
            return []
        container_id = status["containerID"].split("://", 1)[1]
        try:
            procs = self.pod_cgroup(pod["metadata"]["uid"], "pids") / container_id / "cgroup.procs"
            return [int(pid) for pid in procs.read_text().split()]
        except (LookupError, OSError):  # the container or the pod went meanwhile
            return []

    # -- death ----------------------------------------------------------------------------

    def die(self) -> None:
        """Die as a machine does (a GPU's Xid, a kernel panic, a preempted VM): the kubelet, the
        device plugin and every process of every pod SIGKILLed at once, nobody told. containerd
        lives on but nothing asks it anything, so to the cluster the node is as dead as a lost
        one: its status and Lease stop, its pods are never confirmed gone."""
        for daemon in (self.kubelet.process, self.gpu_plugin):
            if daemon is not None and daemon.alive():
                daemon.process.kill()
                daemon.process.wait()
        self.kubelet.process, self.gpu_plugin = None, None
        kubepods = hoststate.CGROUP_MOUNT / "pids" / self.cgroup_root / "kubepods"
        for procs in kubepods.rglob("cgroup.procs"):
            for pid in procs.read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    def revive(self, timeout: float = 120.0) -> None:
        """The machine back after :meth:`die`: its kubelet starts again, finds its pods' containers
        dead and the cluster's word on each (made again in place, or gone), and the node Ready."""
        self.kubelet.start(self.plane)
        kubelet = self.kubelet.process
        wait_until(self.kubelet.healthy, timeout, "kubelet /healthz", kubelet)
        wait_until(self.ready, timeout, f"Node {self.name} Ready again", kubelet, interval=0.5)
        if self.gpus:
            self._start_gpu_plugin(timeout)

    def footprint(self) -> hoststate.Footprint:
        return hoststate.Footprint.of(self.workdir, self.cgroup_root, self.bridge)

    # -- stop -----------------------------------------------------------------------------

    def drain(self, timeout: float = 60.0) -> None:
        """Cordon the node, delete its pods (1 s grace) and wait until the kubelet has torn them
        down: the pods gone from the API, no task left in containerd, no volume mounted. The
        cordon keeps the replacements a controller makes (a Deployment's, a job's) off it."""
        with contextlib.suppress(Exception):  # gone already: nothing to keep off it
            self.api.request(
                "PATCH",
                f"/api/v1/nodes/{self.name}",
                {"spec": {"unschedulable": True}},
                "application/merge-patch+json",
            )
        for pod in self.pods():
            metadata = pod["metadata"]
            with contextlib.suppress(Exception):  # already going
                self.api.request("DELETE", f"/api/v1/namespaces/{metadata['namespace']}/pods/{metadata['name']}",
                                 {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 1})  # fmt: skip
        kubelet = self.kubelet.process

        def torn_down() -> bool:
            pods_dir = self.kubelet.root_dir / "pods"
            return (not self.pods() and not self.containerd.running_tasks()
                    and not hoststate.mounts_under(pods_dir))  # fmt: skip

        wait_until(torn_down, timeout, f"node {self.name}'s pods torn down", kubelet, interval=0.5)

    def stop(self) -> hoststate.Footprint:
        """Stop everything, sweep what is left; the footprint after (empty unless the sweep failed)."""
        try:
            if self.kubelet.process is not None and self.containerd.process is not None:
                self.drain()
        finally:
            if self.gpu_plugin is not None:
                self.gpu_plugin.stop()
                self.gpu_plugin = None
            self.kubelet.stop()
            if self.containerd.process is not None:
                self.containerd.remove_everything()
            self.containerd.stop()
            self.swept = self.footprint()
            self._sweep()
            with contextlib.suppress(Exception):
                self.api.request("DELETE", f"/api/v1/nodes/{self.name}")
        left = self.footprint()
        if left.empty():  # else the claim stays, for a later session to sweep again
            hoststate.release(self.ident)
        return left

    def _sweep(self) -> None:
        hoststate.sweep(self.workdir, self.cgroup_root, self.bridge)
        if not hoststate.mounts_under(self.workdir):  # never delete through a mount left behind
            self.containerd.discard_store()
        hoststate.remove_dead_sockets_and_empty(self.created_shared_dirs)


@contextlib.contextmanager
def running_node(plane: ControlPlane, api: Api, binaries: NodeBinaries, workdir: Path, name: str,
                 ident: str, taints: list[dict[str, str]] | None = None, gpus: int = 0) -> Iterator[Node]:  # fmt: skip
    node = Node(plane, api, binaries, workdir, name, ident, taints or [], gpus)
    try:
        node.start()
        yield node
    finally:
        node.stop()


# -- the scheduler ------------------------------------------------------------------------


class Scheduler:
    """kube-scheduler with its default profile, as ``system:kube-scheduler`` (a client certificate
    from the plane's CA; the bootstrap RBAC role of that name is what it may do)."""

    def __init__(self, plane: ControlPlane, binaries: NodeBinaries, workdir: Path) -> None:
        self.plane = plane
        self.binaries = binaries
        self.workdir = workdir
        self.process: Supervised | None = None

    def start(self, timeout: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cert, key = self.plane.ca.issue("kube-scheduler", "system:kube-scheduler")
        config = self.workdir / "scheduler.kubeconfig"
        config.write_text(kubeconfig(self.plane.server, self.plane.ca.cert, user="system:kube-scheduler",
                                     cert=cert, key=key))  # fmt: skip
        port = free_port()
        self.process = spawn("kube-scheduler", [
            str(self.binaries.path("kube-scheduler")), f"--kubeconfig={config}",
            f"--authentication-kubeconfig={config}", f"--authorization-kubeconfig={config}",
            "--bind-address=127.0.0.1", f"--secure-port={port}", "--leader-elect=false", "--v=1",
        ], self.workdir / "kube-scheduler.log")  # fmt: skip

        def healthy() -> bool:
            context = ssl._create_unverified_context()  # its serving certificate is self-signed
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", timeout=2, context=context) as r:
                return bool(r.status == 200)

        wait_until(healthy, timeout, "kube-scheduler /healthz", self.process)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None


@contextlib.contextmanager
def running_scheduler(plane: ControlPlane, binaries: NodeBinaries, workdir: Path) -> Iterator[Scheduler]:
    scheduler = Scheduler(plane, binaries, workdir)
    try:
        scheduler.start()
        yield scheduler
    finally:
        scheduler.stop()
