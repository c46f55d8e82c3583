"""bench/operator_scale.py counts what the operator really did: its writes from the operator's
own request counters (Kubernetes verbs, as gpuop_api_requests_total labels them), and no crash
when a watch saw nothing."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

import pytest
from prometheus_client import generate_latest

from gpuop.controller.telemetry import OperatorMetrics
from support.paths import ROOT


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("operator_scale", ROOT / "bench" / "operator_scale.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("operator_scale", module)
    spec.loader.exec_module(module)
    return module


def test_writes_are_counted_from_the_operators_own_verbs(bench: ModuleType) -> None:
    """One job's path to Created as the operator records it: three writes among the reads. The
    bench once counted HTTP methods (POST, PATCH) against these labels and printed 0 whatever
    happened."""
    metrics = OperatorMetrics()
    metrics.api_request("list", "gputrainings", 200, 0.01)
    metrics.api_request("get", "pytorchjobs", 404, 0.01)
    metrics.api_request("create", "pytorchjobs", 201, 0.02)
    metrics.api_request("patch", "gputrainings/status", 200, 0.02)
    metrics.api_request("create", "events", 201, 0.01)
    counts = bench.request_counts(generate_latest(metrics.registry).decode())
    assert counts == {"list 200": 1, "get 404": 1, "create 201": 2, "patch 200": 1}
    assert bench.writes(counts) == 3
    metrics.api_request("delete", "pytorchjobs", 200, 0.01)
    metrics.api_request("update", "gputrainings", 409, 0.01)
    assert bench.writes(bench.request_counts(generate_latest(metrics.registry).decode())) == 5


def test_no_latency_seen_is_reported_as_such_not_a_crash(bench: ModuleType) -> None:
    assert bench.latency_figures([]) == {"p50_ms": None, "p99_ms": None}
    figures = bench.latency_figures([0.1, 0.2, 0.3])
    assert figures["p50_ms"] == pytest.approx(200)
    assert figures["p99_ms"] == pytest.approx(300)
    assert bench._ms(None) == "n/a"
