"""The real Kueue v0.16.2 controller manager, built from its Go module (``tests/kueue/go.mod``)
and run against a control plane as its release manifests run it, webhooks included.

A module of its own: Kueue v0.16.2 is built against k8s.io v0.35 and controller-runtime v0.22,
while the Kubeflow tools module settles on v0.36 / v0.24 (MVS would lift Kueue onto APIs it was
not written for). v0.16.2 is the newest release whose go.mod the Go checksum database vouches for
from this machine (v0.17.x: 404 from sum.golang.org).

Its CRDs and webhook configurations are read from the same module version the binary is built
from (``go list -m -json sigs.k8s.io/kueue`` in the tools module: the module cache, downloaded
if missing), with what ``config/default``'s kustomization does done here in code: the ``kueue-``
name prefix, the ``kueue-system`` namespace, and the namespace selectors that keep its pod,
deployment and statefulset webhooks out of kube-system and kueue-system. Its own cert rotator
(``internalCertManagement``, the release default) fills the Secret and the webhooks' CA bundle.

What is not run: the visibility API server (an aggregated API; ``VisibilityOnDemand=false``) and
the metrics endpoint. Integrations are the ones the release's config file lists; Kueue skips
those whose CRDs the cluster does not serve.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Final

import yaml

from support.controllers.webhooked import ControllerSpec, Ports, WebhookedController
from support.paths import ROOT
from support.plane import gobuild
from support.plane.cluster import Api, install_crds
from support.plane.controlplane import ControlPlane

MODULE: Final = ROOT / "tests" / "kueue"
NAMESPACE: Final = "kueue-system"
SERVICE: Final = "kueue-webhook-service"
SECRET: Final = "kueue-webhook-server-cert"
# config/default/kustomization.yaml: the pod-like webhooks never see these namespaces.
_SYSTEM_NAMESPACES: Final = ["kube-system", NAMESPACE]
_POD_LIKE_WEBHOOKS: Final = {"mpod.kb.io", "vpod.kb.io", "mdeployment.kb.io", "vdeployment.kb.io",
                             "mstatefulset.kb.io", "vstatefulset.kb.io"}  # fmt: skip


def recipe() -> gobuild.Recipe:
    version = gobuild.required_version(MODULE, "sigs.k8s.io/kueue")
    return gobuild.Recipe(
        name="kueue",
        module=MODULE,
        packages={"kueue": "sigs.k8s.io/kueue/cmd/kueue"},
        label=f"kueue-{version}",
        cold_cost="measured 2.3 min on 2 cores with the other tools modules' dependencies cached",
    )


def ensure_binary() -> Path:
    return gobuild.ensure(recipe()) / "kueue"


def source() -> Path:
    """The Kueue module's directory in the module cache, the version go.mod pins."""
    return gobuild.module_source(MODULE, "sigs.k8s.io/kueue")


def crds(workdir: Path) -> list[Path]:
    """Upstream's CRDs, written to ``workdir`` with config/components/crd's patches applied: the
    conversion webhook (v1beta1 <-> v1beta2) on those that have one, pointed at our Service."""
    crd = source() / "config" / "components" / "crd"
    converted = {}
    for patch in (crd / "patches").glob("webhook_in_*.yaml"):
        document = yaml.safe_load(patch.read_text())
        converted[document["metadata"]["name"]] = document["spec"]["conversion"]
    out = []
    for base in sorted((crd / "bases").glob("*.yaml")):
        document = yaml.safe_load(base.read_text())
        conversion = copy.deepcopy(converted.get(document["metadata"]["name"]))
        if conversion is not None:
            conversion["webhook"]["clientConfig"]["service"].update(name=SERVICE, namespace=NAMESPACE)
            document["spec"]["conversion"] = conversion
        path = workdir / base.name
        path.write_text(yaml.safe_dump(document))
        out.append(path)
    return out


def webhooks() -> list[dict[str, Any]]:
    """Upstream's two webhook configurations, as config/default names and patches them."""
    out = []
    for document in yaml.safe_load_all((source() / "config/components/webhook/manifests.yaml").read_text()):
        if not document:
            continue
        configuration = copy.deepcopy(document)
        configuration["metadata"] = {"name": "kueue-" + configuration["metadata"]["name"]}
        for hook in configuration["webhooks"]:
            hook["clientConfig"]["service"].update(name=SERVICE, namespace=NAMESPACE, port=443)
            if hook["name"] in _POD_LIKE_WEBHOOKS:
                hook["namespaceSelector"] = {"matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": _SYSTEM_NAMESPACES}
                ]}  # fmt: skip
        out.append(configuration)
    return out


def _command(binary: Path, ports: Ports, workdir: Path) -> list[str]:
    release = yaml.safe_load(
        (source() / "config/components/manager/controller_manager_config.yaml").read_text()
    )
    config = {
        "apiVersion": release["apiVersion"],
        "kind": release["kind"],
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports.health}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"port": ports.webhook},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": SERVICE,
            "webhookSecretName": SECRET,
        },
        "controller": release["controller"],
        "clientConnection": release["clientConnection"],
        "integrations": release["integrations"],
    }
    path = workdir / "kueue-config.yaml"
    path.write_text(yaml.safe_dump(config))
    return [str(binary), f"--config={path}", "--feature-gates=VisibilityOnDemand=false", "--zap-log-level=2"]


KUEUE: Final = ControllerSpec(
    name="kueue",
    binary=ensure_binary,
    namespace=NAMESPACE,
    service=SERVICE,
    secret=SECRET,
    webhooks=webhooks,
    command=_command,
)


def kueue(plane: ControlPlane, api: Api, host_ip: str, workdir: Path) -> WebhookedController:
    """Kueue with its CRDs installed; not started."""
    install_crds(plane, crds(workdir))
    return WebhookedController(KUEUE, plane, api, host_ip, workdir)


def queues(
    name: str, namespace: str, quota: dict[str, str], preemption: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """A ResourceFlavor, a ClusterQueue with ``quota`` of it (and Kueue's ``preemption`` policy,
    if given), and a LocalQueue ``name`` in ``namespace`` pointing at it: the smallest setup
    Kueue's quick start describes."""
    flavor = f"{name}-flavor"
    policy = {"preemption": preemption} if preemption else {}
    return [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": flavor}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name},
         "spec": {"namespaceSelector": {}, **policy, "resourceGroups": [{
             "coveredResources": sorted(quota),
             "flavors": [{"name": flavor, "resources": [
                 {"name": resource, "nominalQuota": amount} for resource, amount in sorted(quota.items())]}],
         }]}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": name, "namespace": namespace}, "spec": {"clusterQueue": name}},
    ]  # fmt: skip
