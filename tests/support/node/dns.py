"""Cluster DNS: CoreDNS in a pod on each real node, behind the ``kube-dns`` Service, as kubeadm
deploys it (two replicas, apart: a node's death leaves the cluster its names), so that pods resolve ``<service>.<namespace>.svc.cluster.local`` and the names of
Kubeflow's headless Services (the rendezvous ``<job>-master-0``).

CoreDNS v1.15 is built from its Go module (``tests/dns/go.mod``, :func:`support.node.binaries.dns_recipe`),
and its image is a **stand-in** assembled here (the one static binary in an OCI archive,
:func:`support.node.images.single_binary_image`): no registry is reachable. Everything else is
real: its ``kubernetes`` plugin watches the API through the ``kubernetes`` Service (kube-proxy,
:mod:`support.node.proxy`) with its ServiceAccount's token, the kubelet writes each pod's
resolv.conf with ``nameserver 10.96.0.10`` and the search path, and kube-proxy carries port 53
to the pod. It listens on 1053 inside its pod, so it needs no capability to bind.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Final

from support.node import binaries, images
from support.node.kubelet import CLUSTER_DNS
from support.node.node import Node
from support.plane.cluster import Api, HttpError, pod_ready
from support.waiting import wait_for

NAMESPACE: Final = "kube-system"
NAME: Final = "coredns"
PORT: Final = 1053
COREFILE: Final = f"""\
.:{PORT} {{
    errors
    health :8080
    ready :8181
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }}
    cache 30
}}
"""


def image(node_binaries: binaries.NodeBinaries) -> images.ImageArchive:
    """The stand-in image of the CoreDNS the node's binaries hold (built with them)."""
    version = binaries.versions()["coredns"]
    return images.single_binary_image(
        f"registry.gpuop.test/coredns:{version}-standin", node_binaries.path("coredns"), "coredns"
    )


def objects(image_name: str, replicas: int) -> list[tuple[str, str | None, dict[str, Any]]]:
    """(resource, namespace, body) of what CoreDNS needs, in creation order (kubeadm's shape):
    ``replicas`` pods, never two on one node. kubeadm only prefers them apart; here each node
    must have one, so that the test of a node's death cannot pass by luck of placement."""
    labels = {"k8s-app": "kube-dns"}
    rbac = "rbac.authorization.k8s.io/v1"
    return [
        ("serviceaccounts", NAMESPACE, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": NAME}}),
        ("clusterroles", None, {
            "apiVersion": rbac, "kind": "ClusterRole", "metadata": {"name": f"gpuop-test:{NAME}"},
            "rules": [
                {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                 "verbs": ["list", "watch"]},
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list", "watch"]},
            ],
        }),
        ("clusterrolebindings", None, {
            "apiVersion": rbac, "kind": "ClusterRoleBinding", "metadata": {"name": f"gpuop-test:{NAME}"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"gpuop-test:{NAME}"},
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}],
        }),
        ("configmaps", NAMESPACE, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": NAME},
                                   "data": {"Corefile": COREFILE}}),
        ("services", NAMESPACE, {
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "kube-dns", "labels": labels},
            "spec": {"clusterIP": CLUSTER_DNS, "selector": labels, "ports": [
                {"name": "dns", "port": 53, "targetPort": PORT, "protocol": "UDP"},
                {"name": "dns-tcp", "port": 53, "targetPort": PORT, "protocol": "TCP"},
            ]},
        }),
        ("deployments", NAMESPACE, {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": NAME, "labels": labels},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": NAME,
                    "dnsPolicy": "Default",  # its own lookups go to the node's resolver, not to itself
                    "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                        {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"},
                    ]}},
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 65532,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [{
                        "name": NAME, "image": image_name, "imagePullPolicy": "Never",
                        "args": ["-conf", "/etc/coredns/Corefile"],
                        "ports": [{"containerPort": PORT, "protocol": "UDP"}, {"containerPort": PORT, "protocol": "TCP"}],
                        "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181}, "periodSeconds": 1},
                        "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}},
                        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}},
                        "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns", "readOnly": True}],
                    }],
                    "volumes": [{"name": "config", "configMap": {"name": NAME}}],
                },
            }},
        }),
    ]  # fmt: skip


@contextlib.contextmanager
def running_cluster_dns(api: Api, nodes: Sequence[Node], timeout: float = 120.0) -> Iterator[str]:
    """CoreDNS Ready on each of ``nodes`` behind 10.96.0.10 for the ``with`` block (needs
    kube-proxy running); yields the Service IP. Everything it created is deleted at the end."""
    archive = image(nodes[0].binaries)
    for node in nodes:
        node.containerd.import_images([archive])
    created = []
    try:
        for resource, namespace, body in objects(archive.name, len(nodes)):
            api.create(resource, body, namespace)
            created.append((resource, namespace, body["metadata"]["name"]))

        def ready() -> bool:
            pods = api.list("pods", NAMESPACE, selector="k8s-app=kube-dns")
            return sum(pod_ready(p) for p in pods) == len(nodes)

        wait_for("CoreDNS Ready", ready, timeout=timeout, every=0.5)
        yield CLUSTER_DNS
    finally:
        for resource, namespace, name in reversed(created):
            with contextlib.suppress(HttpError):
                api.delete(resource, name, namespace)
