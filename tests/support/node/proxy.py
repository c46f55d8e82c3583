"""kube-proxy, so that a pod reaches a Service's cluster IP, the ``kubernetes`` one included.

The real kube-proxy v1.35 (the apiserver's module) in iptables mode, with Debian's ``iptables``
(nf_tables inside; this kernel has it). A pod's in-cluster client dials
``$KUBERNETES_SERVICE_HOST`` = 10.96.0.1:443, which kube-proxy rewrites to the apiserver's
advertised address (:meth:`support.plane.controlplane.ControlPlane.advertise_address`, this
machine's own address: a pod cannot reach the host's loopback).

The nodes here share the machine's network namespace, so **one kube-proxy serves every node of
a machine**: two would rewrite each other's chains on every sync. A machine-wide lock
(``<cache>/kube-proxy.lock``) keeps a second test session waiting rather than fighting, and the
stop runs ``kube-proxy --cleanup``, which removes every rule it made. kube-proxy names the node
it runs for (``--hostname-override``) only for topology-aware routing, which no test uses.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from support.node.binaries import NodeBinaries
from support.node.process import Supervised, spawn, wait_until
from support.plane import gobuild
from support.plane.controlplane import ControlPlane, free_port, kubeconfig

POD_CIDR = "10.244.0.0/16"  # every node's /24 (support.node.node.POD_NETWORKS)


def kube_chains() -> list[str]:
    """The KUBE- chains in the nat, filter and mangle tables (none of kube-proxy's once it is cleaned up)."""
    found = []
    for table in ("nat", "filter", "mangle"):
        listing = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True).stdout
        found += [f"{table}/{line.split()[1]}" for line in listing.splitlines()
                  if line.startswith("-N KUBE-")]  # fmt: skip
    return found


def _remove_firewall_chain() -> None:
    """KUBE-FIREWALL: kube-proxy makes it (with the jumps to it from INPUT and OUTPUT) and its
    --cleanup leaves it, for it is the kubelet's chain too on a node where the kubelet manages
    iptables. None here does (support.node.kubelet), so the last user removes it."""
    for rule in (["-D", "INPUT", "-j", "KUBE-FIREWALL"], ["-D", "OUTPUT", "-j", "KUBE-FIREWALL"],
                 ["-F", "KUBE-FIREWALL"], ["-X", "KUBE-FIREWALL"]):  # fmt: skip
        subprocess.run(["iptables", "-t", "filter", *rule], capture_output=True, check=False)


class ServiceProxy:
    """kube-proxy as ``system:kube-proxy`` (a client certificate from the plane's CA; the bootstrap
    ClusterRole ``system:node-proxier`` is bound to that user)."""

    def __init__(self, plane: ControlPlane, binaries: NodeBinaries, workdir: Path, node_name: str) -> None:
        self.plane = plane
        self.binaries = binaries
        self.workdir = workdir
        self.node_name = node_name
        self.process: Supervised | None = None
        self.healthz_port = 0
        self._lock: IO[str] | None = None
        # KUBE- chains on the machine when it started (another session's kubelet may own some),
        # and those its stop left beyond them: both read while it holds the machine's lock.
        self.chains_before: set[str] = set()
        self.left: list[str] = []

    def start(self, timeout: float = 60.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        lock_path = gobuild.cache_root() / "kube-proxy.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = lock_path.open("w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # another session's kube-proxy: wait for its stop
        self.chains_before = set(kube_chains())
        cert, key = self.plane.ca.issue("kube-proxy", "system:kube-proxy")
        credentials = self.workdir / "kube-proxy.kubeconfig"
        credentials.write_text(kubeconfig(self.plane.server, self.plane.ca.cert, user="system:kube-proxy",
                                          cert=cert, key=key))  # fmt: skip
        self.healthz_port = free_port()
        config = self.workdir / "kube-proxy.json"  # KubeProxyConfiguration reads JSON as YAML
        config.write_text(json.dumps({
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(credentials)},
            "mode": "iptables", "clusterCIDR": POD_CIDR, "hostnameOverride": self.node_name,
            "bindAddress": "127.0.0.1",
            "healthzBindAddress": f"127.0.0.1:{self.healthz_port}",
            "metricsBindAddress": f"127.0.0.1:{free_port()}",
            # No conntrack table sizing (a sysctl of the machine, not of a test) and no NodePorts
            # on 127.0.0.1 (that needs route_localnet, which opens the host's loopback to pods).
            "conntrack": {"maxPerCore": 0},
            "iptables": {"localhostNodePorts": False, "syncPeriod": "30s", "minSyncPeriod": "0s"},
        }))  # fmt: skip
        self.process = spawn("kube-proxy", [str(self.binaries.path("kube-proxy")), f"--config={config}", "--v=1"],
                             self.workdir / "kube-proxy.log")  # fmt: skip
        wait_until(self.healthy, timeout, "kube-proxy /healthz", self.process)

    def healthy(self) -> bool:
        """200 once its first sync of Services into iptables is done."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.healthz_port}/healthz", timeout=2) as answer:
            return bool(answer.status == 200)

    def stop(self) -> None:
        try:
            if self.process is not None:
                self.process.stop()
                self.process = None
                # Its chains stay after it exits (so that Services keep working across a
                # restart); --cleanup is how it removes them.
                subprocess.run([str(self.binaries.path("kube-proxy")), "--cleanup", "--v=0"],
                               capture_output=True, timeout=60, check=False)  # fmt: skip
                _remove_firewall_chain()
                self.left = sorted(set(kube_chains()) - self.chains_before)
        finally:
            if self._lock is not None:
                self._lock.close()  # releases the flock
                self._lock = None


@contextlib.contextmanager
def running_service_proxy(plane: ControlPlane, binaries: NodeBinaries, workdir: Path,
                          node_name: str) -> Iterator[ServiceProxy]:  # fmt: skip
    proxy = ServiceProxy(plane, binaries, workdir, node_name)
    try:
        proxy.start()
        yield proxy
    finally:
        proxy.stop()
