"""The job APIs a GpuTraining can run on, one interface, and which one a training gets. Pure.

Two generations of Kubeflow run PyTorch jobs: the v1 training-operator's ``PyTorchJob``
(legacy, no longer maintained, still on most clusters) and Trainer v2's ``TrainJob``. Each is
a :class:`JobApi`, in a module of its own; :data:`APIS` lists them in the order ``auto``
prefers them, and a new one is one module and one line here. Nothing outside this package
branches on which backend a training has: the controller asks its ``JobApi``.

A GpuTraining says ``spec.backend``: one of them, or ``auto`` for what the cluster serves.
:func:`choose` decides from the API server's discovery; the operator calls it once per
training, before its job exists, and keeps the answer in ``status.backend`` for good: a
training never moves to another API mid-run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Protocol

from gpuop.api.identity import KUEUE_API_VERSIONS
from gpuop.api.spec import GpuTraining, GpuTrainingSpec
from gpuop.api.status import GpuTrainingStatus
from gpuop.backends.pod import ReportEndpoint, report_ca_object
from gpuop.backends.pytorchjob import PYTORCHJOB
from gpuop.backends.trainjob import TRAINJOB
from gpuop.observing.records import JobCondition, JobKind


class JobApi(Protocol):
    """One job API a training can run on: where it lives, how a training becomes its objects,
    and how its job is read and changed."""

    @property
    def backend(self) -> str: ...  # spec.backend and status.backend say this
    @property
    def api_version(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def plural(self) -> str: ...
    @property
    def installed_by(self) -> str: ...  # what to install, in the message when it is missing
    @property
    def facts(self) -> JobKind: ...  # what status says of it
    @property
    def companion_plurals(
        self,
    ) -> Mapping[str, str]: ...  # kind -> plural, for what render makes before the job

    def served(self, resources: Callable[[str], frozenset[str]]) -> bool:
        """Whether the cluster serves it, given discovery (apiVersion -> resource plurals)."""
        ...

    def spec_gaps(self, spec: GpuTrainingSpec) -> tuple[str, ...]:
        """The spec's fields it cannot carry (``auto`` passes it over for them)."""
        ...

    def controller_env(self, spec: GpuTrainingSpec) -> frozenset[str]:
        """The variables its controller adds to the trainer container of such a spec's pods
        (never rendered by us): what a ``$(VAR)`` in the spec may name besides its own env."""
        ...

    def render(
        self, training: GpuTraining, *, default_image: str, reports: ReportEndpoint | None = None
    ) -> list[dict[str, Any]]:
        """The objects to create, in creation order, the job last; with ``reports``, its pods
        report progress to that endpoint."""
        ...

    def conditions(self, job: Mapping[str, Any] | None) -> tuple[JobCondition, ...]:
        """The job's state as conditions in the PyTorchJob's terms (status derives from those)."""
        ...

    def suspended(self, job: Mapping[str, Any] | None) -> bool:
        """Whether the job's spec says suspended (Kueue's hold, or the user's)."""
        ...

    def times(self, job: Mapping[str, Any] | None) -> tuple[str | None, str | None]:
        """When the job started and finished, as far as it says."""
        ...

    def mutable_patch(
        self, desired: Mapping[str, Any], child: Mapping[str, Any], skip: tuple[str, ...] = ()
    ) -> dict[str, Any] | None:
        """The merge patch bringing a made job's mutable fields to ``desired``'s, but ``skip``."""
        ...

    def suspend_patch(self) -> dict[str, Any]:
        """The merge patch that suspends a made job: its controller deletes the job's pods."""
        ...

    def wake_times(self, job: Mapping[str, Any] | None) -> tuple[datetime, ...]:
        """When its controller must act on the job by the clock alone (a deadline, a TTL) and is
        known to sleep through it unless the job changes: the operator touches the job then.
        Empty for a controller that keeps its own clocks."""
        ...


# In the order ``auto`` prefers them: a cluster that still runs the v1 training-operator was
# set up for it (its gang scheduler, its quotas).
APIS: Final[dict[str, JobApi]] = {api.backend: api for api in (PYTORCHJOB, TRAINJOB)}


@dataclass(frozen=True)
class Choice:
    """The backend for one training, or None (and why) when none can run it here."""

    backend: str | None
    reason: str  # CamelCase, for the condition: Requested, Auto, NotServed, Unsupported, KueueNotInstalled
    message: str


def served(resources: Callable[[str], frozenset[str]]) -> frozenset[str]:
    """The backends the cluster serves, given discovery."""
    return frozenset(name for name, api in APIS.items() if api.served(resources))


def gaps(spec: GpuTrainingSpec) -> dict[str, tuple[str, ...]]:
    """Per backend, the spec's fields it cannot carry (none: every one can run it)."""
    return {name: found for name, api in APIS.items() if (found := api.spec_gaps(spec))}


def without_kueue(api: JobApi, queue_name: str) -> Choice:
    """No job for a training that names a Kueue queue on a cluster that serves no Kueue API.

    Made suspended, as a queued job is, it would wait for a Kueue that is not there (before,
    it did, as ``WaitingForKueue``, for ever); made running, it would skip the queue its spec
    asked for. So it is not made, and the status says what to install; once Kueue is served
    (discovery is asked again while the training waits) the job is made as usual.
    """
    return Choice(
        None,
        "KueueNotInstalled",
        f"spec.scheduling.queueName is {queue_name!r}, but this cluster serves no Kueue API "
        f"({' or '.join(KUEUE_API_VERSIONS)} Workloads): install Kueue with its {api.kind} integration "
        f"(https://kueue.sigs.k8s.io/docs/installation/), or remove spec.scheduling.queueName; the "
        f"{api.kind} is made once Kueue is served",
    )


def choose(requested: str, served: frozenset[str], spec_gaps: Mapping[str, tuple[str, ...]]) -> Choice:
    """The backend to make a training's job on.

    ``served``: the backends the cluster serves. ``spec_gaps``: per backend, the spec's fields
    it cannot carry (:func:`gaps`); an explicit backend never has any, the CRD refuses them.
    """
    if requested != "auto":
        return _requested(APIS[requested], served)
    present = [api for api in APIS.values() if api.backend in served]
    fitting = [api for api in present if not spec_gaps.get(api.backend)]
    if fitting:
        return Choice(fitting[0].backend, "Auto", _auto_message(fitting[0], present, spec_gaps))
    if present:
        unfit = sorted({field for api in present for field in spec_gaps[api.backend]})
        missing = [api.installed_by for api in APIS.values() if api not in present]
        return Choice(
            None,
            "Unsupported",
            f"the cluster serves only {' and '.join(f'{a.kind} ({a.installed_by})' for a in present)}, which "
            f"cannot carry {', '.join(unfit)}: install {' or '.join(missing)}, or drop those fields",
        )
    return Choice(
        None,
        "NotServed",
        f"the cluster serves neither {' nor '.join(f'{a.kind} ({a.installed_by})' for a in APIS.values())}: "
        "install one of them",
    )


def _requested(api: JobApi, served: frozenset[str]) -> Choice:
    if api.backend in served:
        return Choice(
            api.backend, "Requested", f"spec.backend is {api.backend}; the cluster serves {api.kind}"
        )
    others = [name for name in APIS if name != api.backend and name in served]
    alternative = f" or set spec.backend to auto or {' or '.join(others)}" if others else ""
    return Choice(
        None,
        "NotServed",
        f"spec.backend is {api.backend}, but the cluster serves no {api.kind} ({api.api_version}): "
        f"install {api.installed_by}{alternative}",
    )


def _auto_message(chosen: JobApi, present: list[JobApi], spec_gaps: Mapping[str, tuple[str, ...]]) -> str:
    """Why auto took ``chosen``: what the cluster serves, and what it passed over."""
    ahead = list(APIS.values())[: list(APIS.values()).index(chosen)]
    if not ahead:
        others = [api.kind for api in present if api is not chosen]
        also = f" and {' and '.join(others)}; auto prefers {chosen.kind}" if others else ""
        return f"spec.backend is auto; the cluster serves {chosen.kind}{also}"
    missing = [api.kind for api in ahead if api not in present]
    unfit = "".join(
        f"; {api.kind} cannot carry {', '.join(spec_gaps[api.backend])}" for api in ahead if api in present
    )
    return (
        f"spec.backend is auto; the cluster serves {chosen.kind}"
        + (f" and no {' or '.join(missing)}" if missing else "")
        + unfit
    )


# Objects every backend's training may have beside its job, kind -> plural.
COMMON_COMPANIONS: Final[Mapping[str, str]] = {"ConfigMap": "configmaps"}


def render_job(
    training: GpuTraining, backend: str, *, default_image: str, reports: ReportEndpoint | None = None
) -> list[dict[str, Any]]:
    """The objects to create for a training on ``backend``, in creation order (the job last):
    with ``reports``, first the ConfigMap that carries the report endpoint's CA to its pods."""
    return render_objects(APIS[backend], training, default_image=default_image, reports=reports)


def render_objects(
    api: JobApi, training: GpuTraining, *, default_image: str, reports: ReportEndpoint | None = None
) -> list[dict[str, Any]]:
    """:func:`render_job` for a backend in hand."""
    ca = [report_ca_object(training, reports)] if reports is not None else []
    return ca + api.render(training, default_image=default_image, reports=reports)


def of_kind(kind: object) -> JobApi | None:
    """The backend whose job is of this kind (a job found before status named its backend)."""
    return next((api for api in APIS.values() if api.kind == kind), None)


def recorded(status: GpuTrainingStatus | None) -> JobApi | None:
    """The backend a training's status says it runs on. A status written before there were
    backends names a ``pytorchJob`` and nothing else: that one."""
    if status is None:
        return None
    if status.backend is not None:
        return APIS.get(status.backend)
    return PYTORCHJOB if status.pytorch_job is not None else None
