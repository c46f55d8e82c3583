"""The PodGroup CRDs of the two gang schedulers the v1 training-operator drives, at the versions
of their Go types that the training-operator binary is linked with.

With ``--gang-scheduler-name`` the training-operator makes a PodGroup per job from its
``runPolicy.schedulingPolicy``; the API server judges it against the scheduler's CRD. So the CRDs
here are the schedulers' own, not hand-written:

* **Volcano** (``podgroups.scheduling.volcano.sh``, v1beta1). No Go module the proxy serves ships
  its CRD: ``volcano.sh/volcano`` is refused (403) and ``volcano.sh/apis`` holds the Go types
  only. It is generated from those types the way Volcano's Makefile generates its own
  (``controller-gen crd:crdVersions=v1,generateEmbeddedObjectMeta=true``, controller-tools
  v0.20.0, the version that Makefile installs), from ``tests/podgroups/go.mod``. That module
  pins ``volcano.sh/apis`` at the version the training-operator binary links: training-operator
  v1.9.4 asks for v1.9.0, and Trainer v2.3.0, in the same tools module (``tests/kubeflow``),
  lifts it to a v1.13.1 pre-release (``go version -m`` on the binary says so). The two pins
  must agree; :func:`recipe` refuses to build when they do not.
* **The coscheduler** of sigs.k8s.io/scheduler-plugins (``podgroups.scheduling.x-k8s.io``,
  v1alpha1): its module ships the CRD (``config/crd/bases``), read from the version
  ``tests/kubeflow`` links (the module cache, downloaded if missing).

controller-gen and the generated CRD are cached like every Go-built tool
(:mod:`support.plane.gobuild`): ``<cache>/podgroups/<versions>-<hash>/``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Final

from support.controllers import trainingoperator
from support.paths import ROOT
from support.plane import gobuild

MODULE: Final = ROOT / "tests" / "podgroups"
VOLCANO_APIS: Final = "volcano.sh/apis"
SCHEDULER_PLUGINS: Final = "sigs.k8s.io/scheduler-plugins"
CONTROLLER_TOOLS: Final = "sigs.k8s.io/controller-tools"
# Volcano's Makefile (CRD_OPTIONS): v1 CRDs, with the metadata of embedded templates kept.
CRD_OPTIONS: Final = "crd:crdVersions=v1,generateEmbeddedObjectMeta=true"
VOLCANO_PACKAGE: Final = f"{VOLCANO_APIS}/pkg/apis/scheduling/v1beta1"
VOLCANO_CRD: Final = "scheduling.volcano.sh_podgroups.yaml"
COSCHEDULER_CRD: Final = "config/crd/bases/scheduling.x-k8s.io_podgroups.yaml"


def recipe() -> gobuild.Recipe:
    """controller-gen, from the tools module that also pins Volcano's API types."""
    apis = gobuild.required_version(MODULE, VOLCANO_APIS)
    linked = gobuild.required_version(trainingoperator.MODULE, VOLCANO_APIS)
    if apis != linked:
        raise RuntimeError(
            f"tests/podgroups/go.mod pins {VOLCANO_APIS} {apis}, but the training-operator is linked with "
            f"{linked} (tests/kubeflow/go.mod); run `cd tests/podgroups && go get {VOLCANO_APIS}@{linked} "
            "&& go mod tidy`"
        )
    tools = gobuild.required_version(MODULE, CONTROLLER_TOOLS)
    return gobuild.Recipe(
        name="podgroups",
        module=MODULE,
        packages={"controller-gen": f"{CONTROLLER_TOOLS}/cmd/controller-gen"},
        label=f"controller-gen-{tools}-volcano-apis-{apis}",
        cold_cost="measured 1.7 min on 2 cores with empty Go caches (at load 10); 28 s with the other "
        "tools modules' dependencies cached",
    )


def volcano_crd() -> Path:
    """Volcano's PodGroup CRD, generated once per tools module content (beside controller-gen)."""
    directory = gobuild.ensure(recipe())
    generated = directory / "crds"
    if (generated / VOLCANO_CRD).is_file():
        return generated / VOLCANO_CRD
    with (directory.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be generating it
        if not (generated / VOLCANO_CRD).is_file():
            staging = Path(tempfile.mkdtemp(prefix=".generating-", dir=directory))
            try:
                # controller-gen loads the package through `go list`: the module's go.sum vouches
                # for the exact volcano.sh/apis it reads.
                subprocess.run(
                    [str(directory / "controller-gen"), CRD_OPTIONS, f"paths={VOLCANO_PACKAGE}",
                     f"output:crd:dir={staging}"],
                    cwd=MODULE, env={**os.environ, **gobuild.GO_ENV}, check=True, capture_output=True, text=True,
                )  # fmt: skip
            except subprocess.CalledProcessError as exc:
                shutil.rmtree(staging, ignore_errors=True)
                raise RuntimeError(f"controller-gen failed:\n{exc.stderr}") from None
            staging.rename(generated)
    return generated / VOLCANO_CRD


def coscheduler_crd() -> Path:
    """The scheduler-plugins coscheduler's PodGroup CRD, as its module ships it."""
    return gobuild.module_source(trainingoperator.MODULE, SCHEDULER_PLUGINS) / COSCHEDULER_CRD
