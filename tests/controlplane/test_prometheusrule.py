"""The chart's PrometheusRule as the real kube-apiserver takes it, against prometheus-operator
v0.85.0's own CRD (read from the module tests/monitoring/go.mod pins): accepted as rendered, and
a malformed rule refused, so the check has teeth."""

from __future__ import annotations

import copy
import json

import yaml

from support.plane.cluster import install_crds
from support.plane.controlplane import ControlPlane
from support.tools import prometheus
from support.tools.helm import template

NAMESPACE = "alerts"


def test_the_api_server_takes_the_charts_prometheusrule_and_refuses_a_broken_one(plane: ControlPlane) -> None:
    crd = prometheus.operator_crd("prometheusrules")
    install_crds(plane, [crd])
    values = {"metrics.serviceMonitor.enabled": True, "metrics.prometheusRule.enabled": True,
              "metrics.prometheusRule.alertLabels": {"team": "ml-platform"}}  # fmt: skip
    (rule,) = [o for o in template(values) if o["kind"] == "PrometheusRule"]
    rule["metadata"]["namespace"] = NAMESPACE
    plane.kubectl("create", "namespace", NAMESPACE)
    try:
        plane.kubectl("create", "-f", "-", input=json.dumps(rule))
        stored = json.loads(
            plane.kubectl(
                "get", "prometheusrule", rule["metadata"]["name"], "-n", NAMESPACE, "-o", "json"
            ).stdout
        )
        assert stored["spec"] == rule["spec"]  # nothing pruned, nothing defaulted away

        broken = copy.deepcopy(rule)
        broken["metadata"]["name"] += "-broken"
        broken["spec"]["groups"][0]["rules"][0]["for"] = "5 minutes"
        refused = plane.kubectl("create", "-f", "-", input=json.dumps(broken), check=False)
        assert refused.returncode != 0
        assert "spec.groups[0].rules[0].for" in refused.stderr
    finally:
        plane.kubectl("delete", "namespace", NAMESPACE, "--wait=false")
        name = yaml.safe_load(crd.read_text())["metadata"]["name"]
        plane.kubectl("delete", "crd", name)
