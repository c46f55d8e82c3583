"""bench/operator_scale.py counts what the operator really did: its writes from the operator's
own request counters (Kubernetes verbs, as gpuop_api_requests_total labels them), no crash
when a watch saw nothing, and floors that make the operator's very writes."""

from __future__ import annotations

import copy
import importlib.util
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from types import ModuleType
from typing import Any

import pytest
from prometheus_client import generate_latest

from gpuop.controller.reconciler import Reconciler
from gpuop.controller.settings import OperatorSettings
from gpuop.controller.telemetry import OperatorMetrics
from support.paths import ROOT
from support.toyjob import Store


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


class _KubeflowStore(Store):
    """The toy store serving PyTorchJobs, keeping what was posted."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[dict[str, Any]] = []
        self.patches: list[dict[str, Any]] = []
        self.posted: list[tuple[str, str, str]] = []

    def served_resources(self, api_version: str) -> frozenset[str]:
        return frozenset({"pytorchjobs"}) if api_version == "kubeflow.org/v1" else frozenset()

    def create_object(self, obj: Mapping[str, Any], plural: str) -> dict[str, Any]:
        self.made.append(copy.deepcopy(dict(obj)))
        return super().create_object(obj, plural)

    def patch_training_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        self.patches.append(copy.deepcopy(dict(patch)))
        return super().patch_training_status(namespace, name, patch)

    def post_event(
        self, training: Mapping[str, Any], kind: str, reason: str, message: str, now: datetime
    ) -> None:
        self.posted.append((kind, reason, message))


def test_the_floors_make_the_very_writes_the_operator_makes(bench: ModuleType) -> None:
    """The floors once wrote a job with no ownerReference and a one-condition status, cheaper
    than the operator's: a floor is only a bound when its writes are the operator's."""
    now = datetime(2026, 11, 25, 10, tzinfo=UTC)
    body = bench._training("scale-0001", "bench")
    body["metadata"] |= {"uid": "u-1", "generation": 1, "resourceVersion": "7"}
    store = _KubeflowStore()
    store.trainings[("bench", "scale-0001")] = copy.deepcopy(body)
    reconciler = Reconciler(store, OperatorSettings(peering_name=None), clock=lambda: now)  # type: ignore[arg-type]
    try:
        reconciler.training_event("ADDED", copy.deepcopy(body))
    finally:
        reconciler.close()  # posts its Event
    job, status, event = bench.operator_writes(body, now)
    assert store.made == [job]
    assert job["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert store.patches == [status]
    assert store.posted == [(event["type"], event["reason"], event["message"])]
    assert event["involvedObject"]["uid"] == "u-1"
