"""The chart's PrometheusRule as an object: off by default, shaped by its values (each refused
when malformed), valid for prometheus-operator's own CRD, and every alert complete: a `for`, a
severity, a summary and description naming the training and namespace, and a runbook that is a
section of docs/troubleshooting.md."""

from __future__ import annotations

import re
from typing import Any

import pytest

from support.paths import ROOT
from support.schemas import crd as crdschema
from support.tools import prometheus
from support.tools.helm import RELEASE_NAMESPACE, render_error, template

ON = {"metrics.serviceMonitor.enabled": True, "metrics.prometheusRule.enabled": True}
RUNBOOKS = ROOT / "docs" / "troubleshooting.md"


def _prometheus_rule(values: dict[str, Any] | None = None) -> dict[str, Any]:
    (rule,) = [o for o in template({**ON, **(values or {})}) if o["kind"] == "PrometheusRule"]
    return rule


def _rules(rule: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(group["name"], r) for group in rule["spec"]["groups"] for r in group["rules"]]


def test_off_by_default_and_only_with_the_operators_service_monitor() -> None:
    assert not [o for o in template() if o["kind"] == "PrometheusRule"]
    assert not [
        o for o in template({"metrics.serviceMonitor.enabled": True}) if o["kind"] == "PrometheusRule"
    ]
    assert "metrics.prometheusRule.enabled needs metrics.serviceMonitor.enabled" in render_error(
        {"metrics.prometheusRule.enabled": True}
    )


def test_the_service_monitor_keeps_the_trainings_namespace_label() -> None:
    (monitor,) = [o for o in template(ON) if o["kind"] == "ServiceMonitor"]
    assert [e["honorLabels"] for e in monitor["spec"]["endpoints"]] == [True]


def test_every_alert_has_a_for_a_severity_and_annotations_naming_what_it_is_about() -> None:
    rule = _prometheus_rule()
    found = _rules(rule)
    assert len(found) == 7
    for group, alert in found:
        name = alert["alert"]
        assert re.fullmatch(r"\d+[smh]", alert["for"]), name
        assert alert["labels"]["severity"] in {"warning", "critical"}, name
        annotations = alert["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        for text in (annotations["summary"], annotations["description"]):
            if group == "gpu-training-operator.trainings":
                assert "{{ $labels.gputraining }}" in text, name
                assert "{{ $labels.namespace }}" in text, name
                assert "by (namespace, gputraining)" in alert["expr"], name  # the labels they name
            else:  # the operator's: its namespace (and Deployment) from the release
                assert f"namespace {RELEASE_NAMESPACE}" in text, name
        if group != "gpu-training-operator.trainings":
            assert "Deployment gpuop-gpu-training-operator" in annotations["description"], name


def _anchors(markdown: str) -> list[str]:
    """GitHub's anchor of each heading: lower case, punctuation dropped, spaces as hyphens; a
    repeated one gets -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = []
    for heading in re.findall(r"^#{1,6} +(.+?) *$", markdown, re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.append(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_runbook_is_its_own_section_of_the_troubleshooting_page() -> None:
    page = "https://github.com/gpu-training-operator/gpu-training-operator/blob/main/docs/troubleshooting.md"
    text = RUNBOOKS.read_text()
    anchors = _anchors(text)
    for _, alert in _rules(_prometheus_rule()):
        url, _, anchor = alert["annotations"]["runbook_url"].partition("#")
        assert url == page, alert["alert"]
        assert anchor == f"alert-{alert['alert'].lower()}", alert["alert"]
        assert anchors.count(anchor) == 1, (
            f"docs/troubleshooting.md has no section '## Alert: {alert['alert']}'"
        )
        section = text.split(f"## Alert: {alert['alert']}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("**What it means.**", "**What to check.**", "**What to do.**"):
            assert part in section, f"{alert['alert']}'s runbook lacks {part}"


def test_values_reach_the_rule() -> None:
    rule = _prometheus_rule({
        "fullnameOverride": "gpuop",
        "metrics.prometheusRule.labels": {"release": "kube-prometheus-stack"},
        "metrics.prometheusRule.alertLabels": {"team": "ml-platform"},
        "metrics.prometheusRule.runbookUrl": "https://wiki.example.com/gpu/runbooks",
        "metrics.prometheusRule.stalled.for": "2m",
        "metrics.prometheusRule.queuedTooLong": {"seconds": 7200, "for": "10m", "severity": "info"},
        "metrics.prometheusRule.noProgressReport.seconds": 900,
        "metrics.prometheusRule.notReconciling.errorRatio": 0.25,
        "metrics.prometheusRule.notReconciling.window": "30m",
        "metrics.prometheusRule.operatorDown.severity": "page",
    })  # fmt: skip
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["namespace"] == RELEASE_NAMESPACE
    alerts = {a["alert"]: a for _, a in _rules(rule)}
    for name, alert in alerts.items():
        assert alert["labels"]["team"] == "ml-platform", name
        assert (
            alert["annotations"]["runbook_url"]
            == f"https://wiki.example.com/gpu/runbooks#alert-{name.lower()}"
        )
        assert 'job="gpuop-metrics"' in alert["expr"], name  # the metrics Service of this release
    assert alerts["GpuTrainingStalled"]["for"] == "2m"
    queued = alerts["GpuTrainingQueuedTooLong"]
    assert (queued["for"], queued["labels"]["severity"]) == ("10m", "info")
    assert queued["expr"].endswith("> 7200")
    assert "7200s" in queued["annotations"]["description"]
    assert "> 900\n" in alerts["GpuTrainingNoProgressReport"]["expr"]
    assert ") > 0.25\n" in alerts["GpuTrainingOperatorNotReconciling"]["expr"]
    not_reconciling = alerts["GpuTrainingOperatorNotReconciling"]
    assert "more than 25% of its reconciles over 30m" in not_reconciling["annotations"]["description"]
    assert not_reconciling["expr"].count("[30m]") == 3
    assert "[10m]" not in not_reconciling["expr"]
    assert alerts["GpuTrainingOperatorDown"]["labels"]["severity"] == "page"
    assert 'namespace="gpuop-system"' in alerts["GpuTrainingOperatorDown"]["expr"]


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"metrics.prometheusRule.stalled.fore": "5m"}, "fore"),  # a typo fails the install
    ({"metrics.prometheusRule.stalled.for": "5 minutes"}, "metrics.prometheusRule.stalled.for"),
    ({"metrics.prometheusRule.failed.severity": "very bad"}, "metrics.prometheusRule.failed.severity"),
    ({"metrics.prometheusRule.alertLabels": {"severity": "page"}}, "metrics.prometheusRule.alertLabels"),
    ({"metrics.prometheusRule.queuedTooLong.seconds": 0}, "metrics.prometheusRule.queuedTooLong.seconds"),
    (
        {"metrics.prometheusRule.notReconciling.errorRatio": 0},
        "metrics.prometheusRule.notReconciling.errorRatio",
    ),
    (
        {"metrics.prometheusRule.notReconciling.errorRatio": 1.5},
        "metrics.prometheusRule.notReconciling.errorRatio",
    ),
    ({"metrics.prometheusRule.runbookUrl": "docs/troubleshooting.md"}, "metrics.prometheusRule.runbookUrl"),
    (
        {"metrics.prometheusRule.runbookUrl": "https://x.example/t.md#top"},
        "metrics.prometheusRule.runbookUrl",
    ),
]


@pytest.mark.parametrize(("values", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_bad_values_are_refused_naming_the_value(values: dict[str, Any], message: str) -> None:
    assert message in render_error({**ON, **values})


@pytest.mark.parametrize(
    ("kind", "plural"),
    [
        ("PrometheusRule", "prometheusrules"),
        ("ServiceMonitor", "servicemonitors"),
        ("PodMonitor", "podmonitors"),
    ],
)
def test_the_monitoring_objects_are_valid_for_prometheus_operators_own_crds(kind: str, plural: str) -> None:
    """Against the CRDs prometheus-operator v0.85.0 ships (its module, pinned in
    tests/monitoring/go.mod), structurally and with their CEL rules, unknown fields refused."""
    schema = crdschema.load_schema(prometheus.operator_crd(plural), "v1")
    values = {**ON, "metrics.trainerPodMonitor.enabled": True, "watchNamespaces": ["team-a"],
              "metrics.prometheusRule.alertLabels": {"team": "ml-platform"}}  # fmt: skip
    (obj,) = [o for o in template(values) if o["kind"] == kind]
    assert obj["apiVersion"] == "monitoring.coreos.com/v1"
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    assert crdschema.validate(schema, body) == []
