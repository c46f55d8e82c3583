"""GpuTraining documents for tests: a minimal valid one and a way to vary it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from support.paths import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def minimal(**spec: Any) -> dict[str, Any]:
    """The smallest valid GpuTraining, with ``spec`` fields merged in (None deletes)."""
    body: dict[str, Any] = {
        "apiVersion": "gpuop.io/v1alpha1",
        "kind": "GpuTraining",
        "metadata": {"name": "demo", "namespace": "ml"},
        "spec": {"dataset": {"name": "mnist"}},
    }
    return with_spec(body, **spec)


def with_spec(body: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """A copy of ``body`` with top-level spec fields replaced (None deletes the field)."""
    out = copy.deepcopy(body)
    for key, value in spec.items():
        if value is None:
            out["spec"].pop(key, None)
        else:
            out["spec"][key] = value
    return out


def load_example(path: Path) -> dict[str, Any]:
    body: dict[str, Any] = yaml.safe_load(path.read_text())
    return body


def training(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    """A two-worker, one-GPU-each GpuTraining named ``name`` in ``namespace``, as the operator
    suites apply them (``spec`` fields merged in)."""
    body = minimal(**{"workers": 2, "gpusPerWorker": 1, **spec})
    body["metadata"] = {"name": name, "namespace": namespace}
    return body
