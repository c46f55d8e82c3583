"""Prometheus's own rule checker, promtool, built from its Go module (``tests/monitoring/go.mod``:
``github.com/prometheus/prometheus`` pinned, go.sum committed) with the ordinary ``go`` client, and
prometheus-operator's CRDs read from the module version that go.mod pins.

The chart's alerts are checked by what Prometheus itself runs: ``promtool check rules`` parses
them as the rule manager does, and ``promtool test rules`` evaluates them over synthetic series
(tests/monitoring/test_alerts.py).

Built with ``-tags remove_all_sd,enable_kubernetes_sd``: Prometheus's service discoveries are
pulled in by build tags, and with every one of them the build needs a Nomad API version that the
Go proxy does not serve; promtool checks rules either way. The tools module pins
``cmd/prometheus`` as well (same version, same go.sum) so that the server can be built from it
later; it is not built here: with promtool's packages compiled it adds another 2.2 min on two
cores (promtool alone: 4.4 min with empty Go caches), for nothing these tests run.

prometheus-operator v0.85.0 is required by the module only for its CRDs
(``example/prometheus-operator-crd/``, the ones its releases ship): no package of it is built,
so ``go mod tidy`` would drop the line; keep it.

    PYTHONPATH=tests python3 -m support.tools.prometheus      # build (or find) promtool
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Final

from support.paths import ROOT
from support.plane import gobuild

MODULE: Final = ROOT / "tests" / "monitoring"
PROMETHEUS: Final = "github.com/prometheus/prometheus"
PROMETHEUS_OPERATOR: Final = "github.com/prometheus-operator/prometheus-operator"
TAGS: Final = "remove_all_sd,enable_kubernetes_sd"


def recipe() -> gobuild.Recipe:
    version = gobuild.required_version(MODULE, PROMETHEUS)
    return gobuild.Recipe(
        name="monitoring",
        module=MODULE,
        packages={"promtool": f"{PROMETHEUS}/cmd/promtool"},
        label=f"promtool-{version}",
        cold_cost="measured 4.4 min on 2 cores with empty Go caches",
        tags=TAGS,
    )


def ensure_promtool() -> Path:
    """The cached promtool, built first when missing. Safe from several processes."""
    return gobuild.ensure(recipe()) / "promtool"


def operator_crd(plural: str) -> Path:
    """One of prometheus-operator's CRDs (``prometheusrules``, ``servicemonitors``, ...)."""
    path = (
        gobuild.module_source(MODULE, PROMETHEUS_OPERATOR)
        / "example"
        / "prometheus-operator-crd"
        / f"monitoring.coreos.com_{plural}.yaml"
    )
    if not path.is_file():
        raise RuntimeError(f"{PROMETHEUS_OPERATOR} has no CRD for {plural} at {path}")
    return path


def main() -> int:
    try:
        print(ensure_promtool())
        print(operator_crd("prometheusrules"))  # fetched now, so that no test waits on the proxy
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
