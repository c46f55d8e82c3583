"""The Helm chart installed into the real control plane with the real helm: with the default
values and with each cloud's values file, every object created, and uninstall keeping the CRD
(and with it the users' GpuTrainings), as the chart's README says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from support.plane.cluster import OUR_CRD, Api, install_crds
from support.plane.controlplane import ControlPlane
from support.specs import minimal
from support.tools.helm import CHART, RELEASE, RELEASE_NAMESPACE, TEAM_VALUES, helm, value_args

MONITORING_CRDS = sorted((Path(__file__).parents[1] / "reference").glob("monitoring.coreos.com_*.yaml"))
CLOUDS = [None, *sorted((CHART / "ci").glob("*-values.yaml"))]


def _helm(plane: ControlPlane, *args: str, check: bool = True) -> str:
    result = helm(*args, "--kubeconfig", str(plane.kubeconfig), check=check)
    return result.stdout + result.stderr


@pytest.fixture(scope="module", autouse=True)
def prerequisites(plane: ControlPlane, crd_warnings: str) -> None:
    """The chart's documented prerequisites and nothing more: Kubeflow's CRDs (the session's
    fixture applied them, with ours), no prometheus-operator and no team namespaces.
    The cloud values files must install on that as they are."""
    crds = plane.kubectl("get", "crd", "-o", "name").stdout.split()
    assert not [name for name in crds if name.endswith(".monitoring.coreos.com")], crds


def _namespace(plane: ControlPlane, name: str) -> None:
    """A namespace a team makes after the operator is installed (there already or not)."""
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    plane.kubectl("apply", "-f", "-", input=json.dumps(namespace))


def test_helm_takes_over_a_hand_applied_crd_only_once_it_carries_helms_ownership(plane: ControlPlane) -> None:
    """The CRD was applied with kubectl (the session's fixture did, as a user who applied
    crds/gputraining.yaml by hand first would): helm refuses to take it, and the adoption
    docs/operating.md documents makes the same install pass."""
    refused = _helm(plane, "install", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace",
                    check=False)  # fmt: skip
    assert "gputrainings.gpuop.io" in refused
    assert "cannot be imported into the current release" in refused
    plane.kubectl("label", "crd", "gputrainings.gpuop.io", "app.kubernetes.io/managed-by=Helm")
    plane.kubectl("annotate", "crd", "gputrainings.gpuop.io", f"meta.helm.sh/release-name={RELEASE}",
                  f"meta.helm.sh/release-namespace={RELEASE_NAMESPACE}")  # fmt: skip
    _helm(plane, "install", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace")
    _helm(plane, "uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait")


def _manifest_objects(plane: ControlPlane) -> list[dict[str, object]]:
    text = _helm(plane, "get", "manifest", RELEASE, "-n", RELEASE_NAMESPACE)
    return [doc for doc in yaml.safe_load_all(text) if doc]


@pytest.mark.parametrize("values", CLOUDS, ids=[p.name if p else "defaults" for p in CLOUDS])
def test_install_creates_every_object_and_uninstall_keeps_the_crd(
    values: Path | None, plane: ControlPlane, api: Api
) -> None:
    files = ["--values", str(values)] if values else []
    _helm(plane, "install", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace", *files)
    objects = _manifest_objects(plane)
    kinds = {str(o["kind"]) for o in objects}
    assert {"Deployment", "ServiceAccount", "Service", "CustomResourceDefinition"} <= kinds
    for obj in objects:
        meta = obj["metadata"]
        assert isinstance(meta, dict)
        namespace = meta.get("namespace") or (
            RELEASE_NAMESPACE
            if obj["kind"]
            not in ("ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PriorityClass")
            else None
        )
        where = ["-n", str(namespace)] if namespace else []
        stored = json.loads(
            plane.kubectl("get", str(obj["kind"]), str(meta["name"]), *where, "-o", "json").stdout
        )
        assert stored["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"

    _namespace(plane, "ml-training")
    survivor = minimal()
    survivor["metadata"] = {"name": "survivor", "namespace": "ml-training"}
    plane.kubectl("create", "-f", "-", input=json.dumps(survivor))

    _helm(plane, "uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait")
    assert plane.kubectl("get", "deployment", "-n", RELEASE_NAMESPACE, "-o", "name").stdout.strip() == ""
    crd = json.loads(plane.kubectl("get", "crd", "gputrainings.gpuop.io", "-o", "json").stdout)
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert api.get("gputrainings", "survivor", "ml-training") is not None
    api.delete("gputrainings", "survivor", "ml-training")


def test_the_monitors_the_values_files_leave_commented_install_once_prometheus_operators_crds_are_there(
    plane: ControlPlane,
) -> None:
    """The commented monitoring blocks of ci/eks-values.yaml and ci/aks-values.yaml, on a
    cluster with kube-prometheus-stack's CRDs: the API server takes both monitors as rendered."""
    install_crds(plane, MONITORING_CRDS)
    try:
        monitors = {"metrics.serviceMonitor.enabled": True, "metrics.trainerPodMonitor.enabled": True,
                    "metrics.serviceMonitor.labels": {"release": "kube-prometheus-stack"}}  # fmt: skip
        _helm(plane, "install", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, "--create-namespace",
              *value_args(monitors))  # fmt: skip
        kinds = {str(o["kind"]) for o in _manifest_objects(plane)}
        assert {"ServiceMonitor", "PodMonitor"} <= kinds
        for kind in ("servicemonitors", "podmonitors"):
            assert plane.kubectl("get", kind, "-n", RELEASE_NAMESPACE, "-o", "name").stdout.strip()
        _helm(plane, "uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait")
    finally:
        for path in MONITORING_CRDS:
            plane.kubectl("delete", "-f", str(path), "--ignore-not-found")


def test_the_installed_crd_is_the_generated_one(plane: ControlPlane) -> None:
    generated = yaml.safe_load(OUR_CRD.read_text())
    stored = json.loads(plane.kubectl("get", "crd", "gputrainings.gpuop.io", "-o", "json").stdout)
    assert stored["spec"]["versions"][0]["schema"] == generated["spec"]["versions"][0]["schema"]


def test_a_teams_values_are_accepted_by_the_api_server_and_a_rerun_upgrades_in_place(
    plane: ControlPlane,
) -> None:
    """The pod-spec values (probes, strategy, env, volumes) are checked by the API server itself,
    which refuses what a schema cannot see (two probe handlers, Recreate with rollingUpdate);
    ``upgrade --install`` twice is how CI and scripts rerun."""
    values = {**TEAM_VALUES, "crds.keep": True}  # the CRD stays for the tests after this one
    for _ in range(2):
        _helm(plane, "upgrade", "--install", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE,
              "--create-namespace", *value_args(values))  # fmt: skip
    name = f"{RELEASE}-gpu-training-operator"
    stored = json.loads(
        plane.kubectl("get", "deployment", name, "-n", RELEASE_NAMESPACE, "-o", "json").stdout
    )
    assert stored["metadata"]["generation"] == 1  # the rerun changed nothing
    assert stored["spec"]["strategy"] == {"type": "Recreate"}
    (container,) = stored["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["tcpSocket"] == {"port": "health"}
    assert [e["name"] for e in container["env"]][-3:] == ["HTTPS_PROXY", "SSL_CERT_FILE", "TEAM"]
    _helm(plane, "uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait")
