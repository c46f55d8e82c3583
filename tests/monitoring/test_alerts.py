"""The chart's alerts, run by Prometheus's own promtool (built from tests/monitoring/go.mod).

The PrometheusRule is rendered by the real helm with the chart's defaults; its groups become a
rule file that ``promtool check rules`` parses as Prometheus's rule manager does, and that
``promtool test rules`` evaluates over synthetic series: for each alert, its expression turns true
at a known minute, the alert is still pending one minute before its ``for`` has passed and
firing at that minute, with the labels and the annotations (Prometheus's templates rendered by
Prometheus) that name the training; and a healthy training beside it raises nothing.

The series are named and labelled as the operator exports them (checked against its registry
below) and as the chart's ServiceMonitor collects them: the target's job, pod and instance,
and the training's ``namespace`` kept (``honorLabels``).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.tools import prometheus
from support.tools.helm import RELEASE_NAMESPACE, template

ON = {"metrics.serviceMonitor.enabled": True, "metrics.prometheusRule.enabled": True}
JOB = "gpuop-gpu-training-operator-metrics"  # the metrics Service's name, the ServiceMonitor's job
# What prometheus-operator's ServiceMonitor gives every series of the operator's target.
TARGET = {"job": JOB, "namespace": RELEASE_NAMESPACE, "service": JOB, "endpoint": "metrics",
          "container": "operator", "pod": "gpuop-gpu-training-operator-5c9d7-x2x4q",
          "instance": "10.244.1.7:8080"}  # fmt: skip

# Another pod of the operator: the standby, or the one a rollout made.
ROLLED = {"pod": "gpuop-gpu-training-operator-5c9d7-k8s2p", "instance": "10.244.2.9:8080"}


@pytest.fixture(scope="session")
def promtool() -> Path:
    return prometheus.ensure_promtool()


@pytest.fixture(scope="module")
def rules() -> dict[str, dict[str, Any]]:
    """The rendered rules by alert name, with defaults."""
    (rule,) = [o for o in template(ON) if o["kind"] == "PrometheusRule"]
    return {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}


def _rule_file(directory: Path, values: dict[str, Any] | None = None) -> Path:
    (rule,) = [o for o in template({**ON, **(values or {})}) if o["kind"] == "PrometheusRule"]
    path = directory / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


def _run(promtool: Path, *args: str, cwd: Path) -> str:
    done = subprocess.run([str(promtool), *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"metrics.prometheusRule.queuedTooLong": {"seconds": 600, "for": "1m", "severity": "info"},
         "metrics.prometheusRule.alertLabels": {"team": "ml-platform"},
         "metrics.prometheusRule.notReconciling.errorRatio": 0.25, "fullnameOverride": "gpuop"},
    ],
    ids=["defaults", "tuned"],
)  # fmt: skip
def test_promtool_parses_every_rule_and_finds_nothing_to_lint(
    promtool: Path, tmp_path: Path, values: dict[str, Any]
) -> None:
    path = _rule_file(tmp_path, values)
    out = _run(promtool, "check", "rules", "--lint=all", "--lint-fatal", path.name, cwd=tmp_path)
    assert "SUCCESS: 7 rules found" in out


# -- each alert over synthetic series ----------------------------------------------------------


def _series(name: str, values: str, **labels: str) -> dict[str, str]:
    """One input series as the operator's target gives it (labels given win: a training's
    ``namespace`` is honored over the target's)."""
    merged = {**TARGET, **labels}
    text = ", ".join(f'{k}="{v}"' for k, v in sorted(merged.items()))
    return {"series": f"{name}{{{text}}}", "values": values}


def _training(name: str, values: str, training: str, **labels: str) -> dict[str, str]:
    return _series(name, values, namespace="team-a", gputraining=training, **labels)


@dataclass(frozen=True)
class Firing:
    """An alert expected to fire: its training (None for the operator's) and ``$value`` as
    ``humanizeDuration`` writes it, where an annotation shows it."""

    training: str | None = None
    value: str | None = None


@dataclass(frozen=True)
class Case:
    alert: str
    series: list[dict[str, str]]
    true_from: int  # the first minute at which the expression has a result
    firing: list[Firing] = field(default_factory=lambda: [Firing("llm")])
    value_at_firing: str | None = None


CASES = [
    Case(
        "GpuTrainingStalled",
        [
            # Stalled from minute 10; the operator is rolled at 14 (a new pod, a new series): the
            # alert goes on, as its expression keeps only the training's labels.
            _training("gpuop_training_condition", "0x9 1x3", "llm", condition="Stalled"),
            _training("gpuop_training_condition", "_x14 1x30", "llm", condition="Stalled", **ROLLED),
            _training("gpuop_training_condition", "0x45", "healthy", condition="Stalled"),
        ],
        true_from=10,
    ),
    Case(
        "GpuTrainingUnderutilized",
        [
            _training("gpuop_training_condition", "0x9 1x60", "llm", condition="Underutilized"),
            _training("gpuop_training_condition", "0x70", "healthy", condition="Underutilized"),
        ],
        true_from=10,
    ),
    Case(
        "GpuTrainingFailed",
        [
            _training("gpuop_training_phase", "1x9", "llm", phase="Running"),
            _training("gpuop_training_phase", "_x10 1x20", "llm", phase="Failed"),
            _training("gpuop_training_phase", "1x30", "healthy", phase="Running"),
        ],
        true_from=10,
    ),
    Case(
        "GpuTrainingQueuedTooLong",
        [
            # Queued since the epoch (minute 0): over 4 h from minute 241, firing at 246, 4h6m in.
            _training("gpuop_training_phase_since_timestamp_seconds", "0x300", "llm", phase="Queued"),
            # Queued since minute 200: 46 minutes by then.
            _training(
                "gpuop_training_phase_since_timestamp_seconds", "_x200 12000x100", "healthy", phase="Queued"
            ),
            # Running for 5 h is no queueing.
            _training("gpuop_training_phase_since_timestamp_seconds", "0x300", "running", phase="Running"),
        ],
        true_from=241,
        firing=[Firing("llm", "4h 6m 0s")],
    ),
    Case(
        "GpuTrainingNoProgressReport",
        [
            # Last heard of at minute 10: over 30 min of silence from minute 41; 36m at 46.
            _training("gpuop_training_last_progress_timestamp_seconds", "600x100", "llm"),
            _training("gpuop_training_last_progress_timestamp_seconds", "0+60x100", "healthy"),
            # As silent, but Stalled: that alert says it, not this one.
            _training("gpuop_training_last_progress_timestamp_seconds", "600x100", "stuck"),
            _training("gpuop_training_condition", "1x100", "stuck", condition="Stalled"),
        ],
        true_from=41,
        firing=[Firing("llm", "36m 0s")],
    ),
    Case(
        "GpuTrainingOperatorDown",
        [
            # Two replicas; the standby stops answering at 11, the leader at 21, and its target
            # then goes (a staleness marker, as when the pod is gone): down from 21.
            _series("up", "1x20 0x5 stale", pod="gpuop-gpu-training-operator-5c9d7-x2x4q"),
            _series("up", "1x10 0x30", **ROLLED),
            # Another operator's target, down all along, is not ours.
            _series("up", "0x40", job="other-operator-metrics"),
        ],
        true_from=21,
        firing=[Firing()],
    ),
    Case(
        "GpuTrainingOperatorNotReconciling",
        [
            # Two trainings wait; reconciles stop at minute 20. The last increase leaves the
            # left-open 10-minute window at 29 (the sample at 19 is in (19, 29], at 20 it is equal).
            _series("gpuop_trainings", "2x80", namespace="team-a", phase="Running"),
            _series("gpuop_trainings", "5x80", namespace="team-a", phase="Succeeded"),
            _series("gpuop_reconciles_total", "0+6x20 120x60", outcome="unchanged"),
        ],
        true_from=29,
        firing=[Firing()],
    ),
]


def _minutes(duration: str) -> int:
    match = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?", duration)
    assert duration, "a `for` expected"
    assert match is not None, f"a `for` of whole minutes expected, got {duration}"
    return int(match[1] or 0) * 60 + int(match[2] or 0)


def _expected(rule: dict[str, Any], firing: Firing) -> dict[str, Any]:
    """The labels and annotations promtool must find: the rule's own, with the three Prometheus
    templates they use filled in as Prometheus would."""
    labels = dict(rule["labels"])
    if firing.training is not None:
        labels |= {"namespace": "team-a", "gputraining": firing.training}
    annotations = {}
    for key, text in rule["annotations"].items():
        text = text.replace("{{ $labels.namespace }}", "team-a")
        text = text.replace("{{ $labels.gputraining }}", firing.training or "")
        text = text.replace("{{ $value | humanizeDuration }}", firing.value or "")
        assert "{{" not in text, f"{rule['alert']}: a template this test does not fill: {text}"
        annotations[key] = text
    return {"exp_labels": labels, "exp_annotations": annotations}


@pytest.mark.parametrize("case", CASES, ids=[c.alert for c in CASES])
def test_each_alert_fires_once_its_for_has_passed_and_only_for_the_training_in_trouble(
    promtool: Path, tmp_path: Path, rules: dict[str, dict[str, Any]], case: Case
) -> None:
    rule = rules[case.alert]
    after = _minutes(rule["for"])
    assert after >= 1, f"{case.alert}: a `for` of at least a minute, so that pending is seen"
    start, fired = case.true_from, case.true_from + after
    expected = [_expected(rule, f) for f in case.firing]
    count = f"count({rule['expr']})"
    tests = {
        "rule_files": [_rule_file(tmp_path).name],
        "evaluation_interval": "1m",
        "tests": [{
            "name": case.alert,
            "interval": "1m",
            "input_series": case.series,
            "promql_expr_test": [
                {"expr": count, "eval_time": f"{start - 1}m", "exp_samples": []},
                {"expr": count, "eval_time": f"{start}m", "exp_samples": [{"labels": "{}", "value": len(expected)}]},
            ],
            "alert_rule_test": [
                {"alertname": case.alert, "eval_time": f"{fired - 1}m", "exp_alerts": []},  # pending
                {"alertname": case.alert, "eval_time": f"{fired}m", "exp_alerts": expected},
            ],
        }],
    }  # fmt: skip
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    out = _run(promtool, "test", "rules", "tests.yaml", cwd=tmp_path)
    assert "SUCCESS" in out


def test_the_operators_error_ratio_fires_when_most_reconciles_fail_and_not_for_a_few(
    promtool: Path, tmp_path: Path, rules: dict[str, dict[str, Any]]
) -> None:
    """The other half of GpuTrainingOperatorNotReconciling: from minute 20 every reconcile fails
    (the API server refuses it, say). The share of failures in the 10-minute window passes one
    half at minute 25, so it fires at 40 (15 min on). Beside it, an operator (another release)
    that fails one reconcile in seven raises nothing."""
    rule = rules["GpuTrainingOperatorNotReconciling"]
    other = {"job": "other-metrics", "service": "other-metrics"}
    series = [
        _series("gpuop_reconciles_total", "0+6x20 120x60", outcome="unchanged"),
        _series("gpuop_reconciles_total", "_x20 0+6x60", outcome="error"),
        _series("gpuop_reconciles_total", "0+6x80", outcome="unchanged", **other),
        _series("gpuop_reconciles_total", "0+1x80", outcome="error", **other),
    ]
    count = f"count({rule['expr']})"
    tests = {
        "rule_files": [_rule_file(tmp_path).name],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": series,
            "promql_expr_test": [
                {"expr": count, "eval_time": "24m", "exp_samples": []},
                {"expr": count, "eval_time": "25m", "exp_samples": [{"labels": "{}", "value": 1}]},
            ],
            "alert_rule_test": [
                {"alertname": rule["alert"], "eval_time": "39m", "exp_alerts": []},
                {"alertname": rule["alert"], "eval_time": "40m", "exp_alerts": [_expected(rule, Firing())]},
            ],
        }],
    }  # fmt: skip
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    _run(promtool, "test", "rules", "tests.yaml", cwd=tmp_path)


def test_every_alert_has_a_case_here() -> None:
    (rule,) = [o for o in template(ON) if o["kind"] == "PrometheusRule"]
    names = {r["alert"] for group in rule["spec"]["groups"] for r in group["rules"]}
    assert names == {c.alert for c in CASES}


# -- the series the alerts read are the ones the operator serves --------------------------------


def _served() -> dict[str, set[str]]:
    """Every series of the operator's registry, with its labels, once every figure is set."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gpuop.controller.table import Tracked
    from gpuop.controller.telemetry import OperatorMetrics

    metrics = OperatorMetrics()
    metrics.reconciles.labels(outcome="unchanged").inc()
    stamp = "2026-11-24T10:00:00Z"
    body = {"metadata": {"name": "llm", "namespace": "team-a", "uid": "u"}, "status": {
        "phase": "Running", "progress": {"updatedAt": stamp},
        "conditions": [{"type": t, "status": "True", "lastTransitionTime": stamp}
                       for t in ("Running", "Stalled", "Underutilized")]}}  # fmt: skip
    metrics.observe_trainings(
        [(("team-a", "llm"), Tracked(body=body))], datetime(2026, 11, 24, 11, tzinfo=UTC)
    )
    served: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            served.setdefault(sample.name, set()).update(sample.labels)
    return served


def test_every_series_an_alert_reads_is_served_with_the_labels_it_matches(
    rules: dict[str, dict[str, Any]],
) -> None:
    served = _served()
    target_labels = set(TARGET)
    for name, rule in rules.items():
        for metric, matchers in re.findall(r"\b(gpuop_[a-z_]+|up)\{([^}]*)\}", rule["expr"]):
            labels = set(re.findall(r'([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)\s*"', matchers))
            if metric == "up":  # Prometheus's own, one per target
                assert labels <= target_labels, name
                continue
            assert metric in served, f"{name}: {metric} is not a series the operator serves"
            assert labels <= served[metric] | target_labels, (
                f"{name}: {metric} has no {labels - served[metric]}"
            )
        for grouped in re.findall(r"by \(([^)]*)\)|on \(([^)]*)\)", rule["expr"]):
            for label in ",".join(grouped).split(","):
                assert not label.strip() or label.strip() in {"namespace", "gputraining"}, name
