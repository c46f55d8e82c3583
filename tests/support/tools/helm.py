"""The chart rendered by the real helm binary that `make test` fetches (tests/support/tools/fetch_helm.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from support.paths import ROOT

CHART = ROOT / "charts" / "gpu-training-operator"
RELEASE = "gpuop"
RELEASE_NAMESPACE = "gpuop-system"

# What a platform team adds: a private registry, a proxy and its CA bundle, its own probes and
# strategy, labels on the ServiceAccount for its policy engine.
TEAM_VALUES: dict[str, Any] = {
    "imagePullSecrets": [{"name": "registry"}],
    "extraArgs": ["--verbose"],
    "extraEnv": [
        {"name": "HTTPS_PROXY", "value": "http://proxy.internal:3128"},
        {"name": "SSL_CERT_FILE", "value": "/etc/proxy-ca/ca.crt"},
        {"name": "TEAM", "valueFrom": {"configMapKeyRef": {"name": "team", "key": "name"}}},
    ],
    "volumes": [{"name": "proxy-ca", "configMap": {"name": "proxy-ca"}}],
    "volumeMounts": [{"name": "proxy-ca", "mountPath": "/etc/proxy-ca", "readOnly": True}],
    "serviceAccount.labels": {"policy.example.com/tier": "platform"},
    "serviceAccount.automountServiceAccountToken": False,
    "livenessProbe.periodSeconds": 60,
    "readinessProbe": {"httpGet": None, "tcpSocket": {"port": "health"}, "periodSeconds": 5},
    "strategy": {"type": "Recreate"},
    "crds.keep": False,
}


def helm_binary() -> Path:
    path = Path(os.environ.get("HELM") or ROOT / ".venv" / "bin" / "helm")
    if not path.is_file():
        pytest.fail(f"no helm at {path}: `make test` fetches it (or set HELM=/path/to/helm)")
    return path


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(helm_binary()), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HOME": "/tmp"},
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{result.stderr}")
    return result


def value_args(values: dict[str, Any] | None = None, files: tuple[Path, ...] = ()) -> list[str]:
    args: list[str] = []
    for path in files:
        args += ["--values", str(path)]
    if values:
        for key, value in values.items():
            args += ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def template(
    values: dict[str, Any] | None = None, files: tuple[Path, ...] = (), kube_version: str = "1.32.0"
) -> list[dict[str, Any]]:
    """Every object the chart renders (``helm template --include-crds``), as dicts."""
    result = helm(
        "template", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE, "--include-crds",
        "--kube-version", kube_version, *value_args(values, files),
    )  # fmt: skip
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_error(values: dict[str, Any] | None = None, files: tuple[Path, ...] = ()) -> str:
    """What helm says when the values are refused (fails the test when they are not)."""
    result = helm("template", RELEASE, str(CHART), *value_args(values, files), check=False)
    assert result.returncode != 0, f"helm accepted {values}"
    return result.stderr.strip()


def rules(objects: list[dict[str, Any]]) -> list[tuple[str | None, dict[str, Any]]]:
    """(namespace or None for a ClusterRole, rule) for every RBAC rule rendered."""
    return [
        (obj["metadata"].get("namespace") if obj["kind"] == "Role" else None, rule)
        for obj in objects
        if obj["kind"] in ("Role", "ClusterRole")
        for rule in obj.get("rules", [])
    ]
