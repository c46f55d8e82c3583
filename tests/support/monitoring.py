"""prometheus-operator and Prometheus in the chain, installed as a user installs them.

prometheus-operator from the ``bundle.yaml`` its module ships (its CRDs, RBAC, ServiceAccount,
Deployment and Service, in ``default``; applied server-side, as its CRDs are too large for a
client-side apply's annotation), Prometheus's RBAC from the module's ``example/rbac/prometheus``,
and one ``Prometheus`` object that selects every ServiceMonitor, PodMonitor and PrometheusRule
of every namespace, scraping and evaluating every second. prometheus-operator turns that
object into a StatefulSet whose pod runs Prometheus beside the config reloader; the real
controller-manager, scheduler and kubelet run it on the first node; Prometheus finds its
targets through the API server (its ServiceAccount's token, the ``kubernetes`` Service through
kube-proxy) and scrapes pods over the nodes' pod network.

The three images are STAND-INS for the ones a cluster pulls from quay.io (no registry is
reachable here), each the one static binary built from the pinned Go modules
(:mod:`support.tools.prometheus`) under the name the manifests ask for, its entrypoint where
the released image has it. Everything else is the real programs and the released manifests.

The test host reads Prometheus's HTTP API at its pod's address (the nodes share this
machine's network namespace, where the pod network is routed).
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Final

import yaml

from support.node import images
from support.node.node import Node
from support.node.pool import Pool
from support.plane.cluster import Api, pod_ready
from support.plane.controlplane import ControlPlane
from support.tools import prometheus as tools
from support.waiting import wait_for

NAMESPACE: Final = "default"  # where bundle.yaml puts prometheus-operator
PROMETHEUS: Final = "gpuop"  # the Prometheus object: its pod is prometheus-gpuop-0
PROMETHEUS_POD: Final = f"prometheus-{PROMETHEUS}-0"
PORT: Final = 9090
# The kinds a chart's monitoring makes (the CRDs it needs served).
MONITORS: Final = ("servicemonitors", "podmonitors", "prometheusrules")


@dataclass(frozen=True)
class Released:
    """What the bundle's Deployment runs: its image, and the config reloader's image it passes."""

    operator_image: str
    reloader_image: str


def released() -> Released:
    """From the Deployment as the module ships it on its own (bundle.yaml holds the same one
    after the CRDs, whose YAML PyYAML cannot read: an enum value ``=``)."""
    path = tools.operator_file(
        "example", "rbac", "prometheus-operator", "prometheus-operator-deployment.yaml"
    )
    container = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]["containers"][0]
    prefix = "--prometheus-config-reloader="
    reloader = next(a.removeprefix(prefix) for a in container["args"] if a.startswith(prefix))
    return Released(container["image"], reloader)


def prometheus_image() -> str:
    return f"quay.io/prometheus/prometheus:{tools.prometheus_version()}"


def stand_in_images() -> list[images.ImageArchive]:
    """The three images, each its binary at the path the released image's entrypoint names."""
    names, built = released(), tools.ensure_operator()
    return [
        images.single_binary_image(names.operator_image, built / "operator", "bin/operator"),
        images.single_binary_image(
            names.reloader_image, built / "prometheus-config-reloader", "bin/prometheus-config-reloader"
        ),
        images.single_binary_image(prometheus_image(), tools.ensure_prometheus(), "bin/prometheus"),
    ]


def prometheus_object(node: Node) -> dict[str, Any]:
    """One Prometheus for the chain: every monitor and rule of every namespace, a scrape and an
    evaluation every second (the chart's monitors set their own interval), on ``node`` (whose
    pods `kubectl logs` reaches)."""
    everything: dict[str, Any] = {}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "Prometheus",
        "metadata": {"name": PROMETHEUS, "namespace": NAMESPACE},
        "spec": {
            "replicas": 1,
            "image": prometheus_image(),
            "version": tools.prometheus_version(),
            "serviceAccountName": "prometheus",
            "serviceMonitorSelector": everything, "serviceMonitorNamespaceSelector": everything,
            "podMonitorSelector": everything, "podMonitorNamespaceSelector": everything,
            "ruleSelector": everything, "ruleNamespaceSelector": everything,
            "scrapeInterval": "1s",
            "evaluationInterval": "1s",
            "nodeSelector": {"kubernetes.io/hostname": node.name},
        },
    }  # fmt: skip


class Prometheus:
    """Prometheus's HTTP API at its pod's address."""

    def __init__(self, address: str) -> None:
        self.url = f"http://{address}:{PORT}"

    def _get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as reply:
            body = json.loads(reply.read())
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expression: str) -> list[dict[str, Any]]:
        """An instant query's series (``/api/v1/query``); an expression Prometheus refuses raises."""
        data = self._get("/api/v1/query", query=expression)
        result: list[dict[str, Any]] = data["result"] if data["resultType"] in ("vector", "matrix") else []
        return result

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts pending or firing now (``/api/v1/alerts``)."""
        found: list[dict[str, Any]] = self._get("/api/v1/alerts")["alerts"]
        return found

    def rule_groups(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self._get("/api/v1/rules")["groups"]
        return found

    def targets(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self._get("/api/v1/targets", state="active")["activeTargets"]
        return found

    def serves_chart(self, namespace: str) -> bool:
        """Whether it scrapes the operator in ``namespace`` and evaluates the chart's rule groups."""
        groups = {group["name"] for group in self.rule_groups()}
        return bool(self.query(f'up{{namespace="{namespace}"}} == 1')) and {
            "gpu-training-operator.trainings", "gpu-training-operator.operator"} <= groups  # fmt: skip

    def alerting(self, alert: str, **labels: str) -> list[str]:
        """The states (pending, firing) of the alerts named ``alert`` with ``labels``."""
        return [
            a["state"] for a in self.alerts()
            if a["labels"].get("alertname") == alert and all(a["labels"].get(k) == v for k, v in labels.items())
        ]  # fmt: skip

    def firing(self, alert: str, **labels: str) -> bool:
        return "firing" in self.alerting(alert, **labels)


@contextlib.contextmanager
def running_monitoring(
    plane: ControlPlane,
    api: Api,
    pool: Pool,
    monitors_on: Callable[[], None] = lambda: None,
    monitors_off: Callable[[], None] = lambda: None,
) -> Iterator[Prometheus]:
    """prometheus-operator and one Prometheus, up and answering, for the ``with`` block; after
    it the Prometheus object, the bundle and the RBAC are deleted (the CRDs with the bundle:
    every monitor and rule made meanwhile goes with them).

    ``monitors_on()`` runs once prometheus-operator's CRDs are served and before Prometheus
    starts: what it makes is in Prometheus's first configuration (a monitor made later waits
    for the kubelet to refresh the configuration's Secret volume, its sync period, about a
    minute here, before the reloader has Prometheus reload it). ``monitors_off()`` runs after
    the block, while the CRDs are still served (helm cannot upgrade a release whose objects'
    kinds are gone)."""
    started = time.monotonic()
    for node in pool.nodes:
        node.containerd.import_images(stand_in_images(), timeout=300)
    bundle = tools.operator_file("bundle.yaml")
    rbac = [tools.operator_file("example", "rbac", "prometheus", f"prometheus-{part}.yaml")
            for part in ("service-account", "cluster-role", "cluster-role-binding")]  # fmt: skip
    plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(bundle), timeout=120)
    for path in rbac:
        plane.kubectl("apply", "-n", NAMESPACE, "-f", str(path))
    turned_on = False
    try:
        plane.kubectl("wait", "--for=condition=Established", "--timeout=60s",
                      *(f"crd/{plural}.monitoring.coreos.com" for plural in MONITORS))  # fmt: skip
        monitors_on()
        turned_on = True
        plane.kubectl(
            "rollout", "status", "deployment/prometheus-operator", "-n", NAMESPACE, "--timeout=120s"
        )
        plane.kubectl("apply", "-f", "-", input=json.dumps(prometheus_object(pool.first)))

        def ready() -> str | None:
            pod = api.get("pods", PROMETHEUS_POD, NAMESPACE)
            return str(pod["status"]["podIP"]) if pod is not None and pod_ready(pod) else None

        address = wait_for(f"{PROMETHEUS_POD} Ready", ready, timeout=180, every=0.5)
        print(f"prometheus-operator and Prometheus up in {time.monotonic() - started:.1f}s")
        yield Prometheus(str(address))
    finally:
        if turned_on:
            monitors_off()
        plane.kubectl("delete", "prometheus", PROMETHEUS, "-n", NAMESPACE, "--ignore-not-found",
                      "--wait=true", "--timeout=60s", check=False)  # fmt: skip
        for path in reversed(rbac):
            plane.kubectl("delete", "-n", NAMESPACE, "-f", str(path), "--ignore-not-found", check=False)
        plane.kubectl("delete", "-f", str(bundle), "--ignore-not-found", "--wait=true", "--timeout=90s",
                      check=False, timeout=150)  # fmt: skip
