"""Prometheus and prometheus-operator, built from their Go modules with the ordinary ``go``
client, and the manifests prometheus-operator's module ships, at the version its binary is
built from.

Two tools modules, as their dependency graphs differ: ``tests/monitoring`` pins
``github.com/prometheus/prometheus`` (``promtool`` and the server, ``cmd/prometheus``), and
``tests/prometheus-operator`` pins prometheus-operator v0.85.0 (``cmd/operator`` and
``cmd/prometheus-config-reloader``). In one module MVS lifts the operator onto Prometheus
v0.316's ``automemlimit`` v1, whose API its v0.85.0 does not compile against.

The chart's alerts are checked by what Prometheus itself runs: ``promtool check rules`` parses
them as the rule manager does, and ``promtool test rules`` evaluates them over synthetic series
(tests/monitoring/test_alerts.py). The server and the operator run in the end-to-end chain
(:mod:`support.monitoring`).

Prometheus is built with ``-tags remove_all_sd,enable_kubernetes_sd``: its service discoveries
are pulled in by build tags, and with every one of them the build needs a Nomad API version
that the Go proxy does not serve. Kubernetes discovery, the one prometheus-operator's
configurations use, is kept. No web UI assets are built in (the HTTP API is whole).

    PYTHONPATH=tests python3 -m support.tools.prometheus      # build (or find) all four
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

from support.paths import ROOT
from support.plane import gobuild

MODULE: Final = ROOT / "tests" / "monitoring"
OPERATOR_MODULE: Final = ROOT / "tests" / "prometheus-operator"
PROMETHEUS: Final = "github.com/prometheus/prometheus"
PROMETHEUS_OPERATOR: Final = "github.com/prometheus-operator/prometheus-operator"
TAGS: Final = "remove_all_sd,enable_kubernetes_sd"


def recipe() -> gobuild.Recipe:
    version = gobuild.required_version(MODULE, PROMETHEUS)
    return gobuild.Recipe(
        name="monitoring",
        module=MODULE,
        packages={"promtool": f"{PROMETHEUS}/cmd/promtool", "prometheus": f"{PROMETHEUS}/cmd/prometheus"},
        label=f"prometheus-{version}",
        cold_cost="measured 6.6 min on 2 cores at load 3 to 7 with empty Go caches; 2.5 min idle, sources downloaded",
        tags=TAGS,
    )


def operator_recipe() -> gobuild.Recipe:
    version = operator_version()
    return gobuild.Recipe(
        name="prometheus-operator",
        module=OPERATOR_MODULE,
        packages={
            "operator": f"{PROMETHEUS_OPERATOR}/cmd/operator",
            "prometheus-config-reloader": f"{PROMETHEUS_OPERATOR}/cmd/prometheus-config-reloader",
        },
        label=f"prometheus-operator-{version}",
        cold_cost="about 4 min cold (machine-facts.md); 1.8 min on 2 idle cores, module sources downloaded",
    )


def prometheus_version() -> str:
    """The release the pinned module is: Prometheus 3.x is module v0.3xx.y (v0.316.0 is 3.16.0)."""
    module = gobuild.required_version(MODULE, PROMETHEUS)
    major_minor, _, patch = module.removeprefix("v0.").partition(".")
    return f"v{int(major_minor) // 100}.{int(major_minor) % 100}.{patch}"


def operator_version() -> str:
    return gobuild.required_version(OPERATOR_MODULE, PROMETHEUS_OPERATOR)


def ensure_promtool() -> Path:
    """The cached promtool, built first when missing. Safe from several processes."""
    return gobuild.ensure(recipe()) / "promtool"


def ensure_prometheus() -> Path:
    return gobuild.ensure(recipe()) / "prometheus"


def ensure_operator() -> Path:
    """The directory of ``operator`` and ``prometheus-config-reloader``."""
    return gobuild.ensure(operator_recipe())


def operator_file(*parts: str) -> Path:
    """A file prometheus-operator's module ships (``bundle.yaml``, ``example/...``), at the
    version its binaries are built from."""
    path = gobuild.module_source(OPERATOR_MODULE, PROMETHEUS_OPERATOR).joinpath(*parts)
    if not path.is_file():
        raise RuntimeError(f"{PROMETHEUS_OPERATOR} ships no {'/'.join(parts)} at {path}")
    return path


def operator_crd(plural: str) -> Path:
    """One of prometheus-operator's CRDs (``prometheusrules``, ``servicemonitors``, ...)."""
    return operator_file("example", "prometheus-operator-crd", f"monitoring.coreos.com_{plural}.yaml")


def main() -> int:
    # The bundle is fetched now, so that no test waits on the proxy.
    return gobuild.print_built(ensure_promtool, ensure_operator, lambda: operator_file("bundle.yaml"))


if __name__ == "__main__":
    sys.exit(main())
