"""The Kubeflow job APIs a GpuTraining runs on, and which one it gets. Pure.

Two generations of Kubeflow run PyTorch jobs: the v1 training-operator's ``PyTorchJob``
(legacy, no longer maintained, still on most clusters) and Trainer v2's ``TrainJob``. A
GpuTraining says ``spec.backend``: one of them, or ``auto`` for what the cluster serves.
:func:`choose` decides from the API server's discovery; the operator calls it once per
training, before its job exists, and keeps the answer in ``status.backend`` for good: a
training never moves to the other API mid-run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from gpuop.identity import PYTORCHJOB_API_VERSION, PYTORCHJOB_KIND, TRAINJOB_API_VERSION, TRAINJOB_KIND
from gpuop.render import render_pytorchjob
from gpuop.spec import Backend, GpuTraining, JobBackend
from gpuop.trainjob import render_runtime, render_trainjob


@dataclass(frozen=True)
class JobApi:
    """One Kubeflow job API: where it lives and what installs it."""

    backend: JobBackend
    api_version: str
    kind: str
    plural: str
    installed_by: str

    @property
    def group(self) -> str:
        return self.api_version.split("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.split("/")[1]


PYTORCHJOB: Final = JobApi(
    "pytorchjob", PYTORCHJOB_API_VERSION, PYTORCHJOB_KIND, "pytorchjobs", "the Kubeflow training-operator v1"
)
TRAINJOB: Final = JobApi("trainjob", TRAINJOB_API_VERSION, TRAINJOB_KIND, "trainjobs", "Kubeflow Trainer v2")
APIS: Final = {api.backend: api for api in (PYTORCHJOB, TRAINJOB)}
RUNTIME_PLURAL: Final = "trainingruntimes"  # the TrainJob's companion, see gpuop.trainjob


@dataclass(frozen=True)
class Choice:
    """The backend for one training, or None (and why) when none can run it here."""

    backend: JobBackend | None
    reason: str  # CamelCase, for the condition: Requested, Auto, NotServed, Unsupported
    message: str


def choose(requested: Backend, served: frozenset[JobBackend], spec_gaps: tuple[str, ...]) -> Choice:
    """The backend to make a training's job on.

    ``served``: the job APIs the cluster serves. ``spec_gaps``: the spec's fields a TrainJob
    cannot carry (:func:`gpuop.spec.trainjob_gaps`); an explicit ``trainjob`` never has any,
    the CRD refuses them. ``auto`` prefers PyTorchJob when both are served: a cluster that
    still runs the v1 training-operator was set up for it (its gang scheduler, its quotas).
    """
    if requested != "auto":
        api = APIS[requested]
        if requested in served:
            return Choice(
                requested, "Requested", f"spec.backend is {requested}; the cluster serves {api.kind}"
            )
        other = APIS["trainjob" if requested == "pytorchjob" else "pytorchjob"]
        alternative = f" or set spec.backend to auto or {other.backend}" if other.backend in served else ""
        return Choice(
            None,
            "NotServed",
            f"spec.backend is {requested}, but the cluster serves no {api.kind} ({api.api_version}): "
            f"install {api.installed_by}{alternative}",
        )
    if "pytorchjob" in served:
        also = " and TrainJob; auto prefers PyTorchJob" if "trainjob" in served else ""
        return Choice("pytorchjob", "Auto", f"spec.backend is auto; the cluster serves PyTorchJob{also}")
    if "trainjob" in served and not spec_gaps:
        return Choice(
            "trainjob", "Auto", "spec.backend is auto; the cluster serves TrainJob and no PyTorchJob"
        )
    if "trainjob" in served:
        return Choice(
            None,
            "Unsupported",
            f"the cluster serves only TrainJob (Kubeflow Trainer v2), which cannot carry "
            f"{', '.join(spec_gaps)}: install the Kubeflow training-operator v1, or drop those fields",
        )
    return Choice(
        None,
        "NotServed",
        "the cluster serves neither PyTorchJob (the Kubeflow training-operator v1) nor TrainJob "
        "(Kubeflow Trainer v2): install one of them",
    )


def render_job(training: GpuTraining, backend: JobBackend, *, default_image: str) -> list[dict[str, Any]]:
    """The objects to create for a training on ``backend``, in creation order (the job last)."""
    if backend == "pytorchjob":
        return [render_pytorchjob(training, default_image=default_image)]
    return [
        render_runtime(training, default_image=default_image),
        render_trainjob(training, default_image=default_image),
    ]
