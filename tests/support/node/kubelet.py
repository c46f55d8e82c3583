"""One kubelet v1.35 of one node: its configuration, its credentials, its process.

Credentials: a client certificate minted by the control plane's own CA for ``system:node:<name>``
in group ``system:nodes``, what a kubeadm join ends with. So the apiserver's Node authorizer and
the NodeRestriction admission plugin judge this kubelet as they judge a real cluster's: it may
only touch its own Node and Lease and the pods bound to it, and may ask the TokenRequest API only
for the service accounts of those pods (projected tokens).

The kubelet's own server (logs, exec, port-forward for the apiserver) listens on loopback at a
free port and, as kubeadm sets it up, takes no anonymous request: a caller shows a client
certificate of the control plane's CA (the apiserver's ``kube-apiserver-kubelet-client``) or a
bearer token, and the kubelet asks the apiserver (a SubjectAccessReview) whether that caller may
do what it asks. So another user of the machine cannot exec into a pod through it. The
apiserver reaches it at the Node's ``Hostname`` address (its default preference), so logs work
only for a node named after this machine's hostname, which resolves to 127.0.0.1 here;
``--kubelet-preferred-address-types=InternalIP`` on the apiserver would lift that.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any, Final

from support.node.binaries import NodeBinaries
from support.node.process import Supervised, spawn
from support.plane.controlplane import ControlPlane, free_port, kubeconfig

CLUSTER_DNS: Final = "10.96.0.10"  # the kube-dns Service's cluster IP


def node_credentials(plane: ControlPlane, node_name: str, directory: Path) -> Path:
    """A kubeconfig for node ``node_name``'s kubelet, with a certificate from the plane's CA."""
    cert, key = plane.ca.issue(
        f"kubelet-{node_name}", f"system:node:{node_name}", organization="system:nodes"
    )
    path = directory / "kubelet.kubeconfig"
    path.write_text(
        kubeconfig(plane.server, plane.ca.cert, user=f"system:node:{node_name}", cert=cert, key=key)
    )
    return path


class Kubelet:
    """The kubelet of node ``node_name``, its files under ``workdir``, its pods in ``cgroup_root``."""

    def __init__(self, workdir: Path, binaries: NodeBinaries, node_name: str, cgroup_root: str,
                 runtime_endpoint: str, taints: list[dict[str, str]] | None = None) -> None:  # fmt: skip
        self.workdir = workdir
        self.binaries = binaries
        self.node_name = node_name
        self.cgroup_root = cgroup_root
        self.runtime_endpoint = runtime_endpoint
        self.taints = taints or []
        self.root_dir = workdir / "root"
        self.pod_logs_dir = workdir / "pod-logs"
        self.port = 0
        self.healthz_port = 0
        self.client_ca = Path()  # the control plane's CA, set at start
        self.process: Supervised | None = None

    def configuration(self) -> dict[str, Any]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # This kernel has cgroup v1 controllers only (v2 is mounted, controller-less, beside
            # them): kubelet 1.35 refuses v1 unless told, and only the cgroupfs driver works
            # without systemd.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            # A cgroup root of this node's own, so a second node's pods never share its groups.
            "cgroupRoot": f"/{self.cgroup_root}",
            "failSwapOn": False,
            # No iptables chains of the kubelet's own (KUBE-FIREWALL, its canaries): every
            # kubelet here shares the machine's tables, which kube-proxy alone programs
            # (support.node.proxy), and nothing would remove them at a node's stop.
            "makeIPTablesUtilChains": False,
            "containerRuntimeEndpoint": self.runtime_endpoint,
            "imageServiceEndpoint": self.runtime_endpoint,
            "address": "127.0.0.1",
            "port": self.port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},  # bearer tokens: a TokenReview
                "x509": {"clientCAFile": str(self.client_ca)},
            },
            "authorization": {"mode": "Webhook"},  # a SubjectAccessReview per request
            "podLogsDir": str(self.pod_logs_dir),
            "volumePluginDir": str(self.workdir / "volume-plugins"),
            "registerNode": True,
            "registerWithTaints": self.taints,
            # Pods ask the kube-dns Service (CoreDNS, support.node.dns, where a module runs it);
            # with no DNS running a lookup simply fails, and no other test looks a name up.
            "clusterDNS": [CLUSTER_DNS],
            "clusterDomain": "cluster.local",
            "resolvConf": "/etc/resolv.conf",
            # The machine's disk is shared with other runs and may be well filled: evict on
            # nothing but a truly full disk, and never garbage-collect the images imported at
            # start (they cannot be pulled again: there is no registry).
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            # Status reported every 2 s (default 10 s): the tests wait on what the kubelet says.
            "nodeStatusReportFrequency": "2s",
            "nodeStatusUpdateFrequency": "2s",
            "serializeImagePulls": False,
            "rotateCertificates": False,
            "serverTLSBootstrap": False,
            "shutdownGracePeriod": "0s",  # graceful node shutdown needs systemd-logind's inhibitor
        }

    def start(self, plane: ControlPlane) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for directory in (self.root_dir, self.pod_logs_dir):
            directory.mkdir(exist_ok=True)
        self.port, self.healthz_port = free_port(), free_port()
        self.client_ca = plane.ca.cert
        config = self.workdir / "kubelet-config.json"
        config.write_text(json.dumps(self.configuration(), indent=1))
        credentials = node_credentials(plane, self.node_name, self.workdir)
        self.process = spawn(
            "kubelet",
            [
                str(self.binaries.path("kubelet")),
                f"--config={config}",
                f"--kubeconfig={credentials}",
                f"--root-dir={self.root_dir}",
                f"--cert-dir={self.workdir / 'pki'}",
                f"--hostname-override={self.node_name}",
                "--v=2",
            ],
            self.workdir / "kubelet.log",
        )

    def healthy(self) -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.healthz_port}/healthz", timeout=2) as reply:
            return bool(reply.status == 200)

    def stop(self, grace: float = 10.0) -> None:
        if self.process is not None:
            self.process.stop(grace)
            self.process = None
